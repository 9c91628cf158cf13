#!/bin/bash
# The same A/B as s23e (final tree against a8a3c61) on the nvidia-h200 kind, without the other rows.
export PYTHONUNBUFFERED=1
dpkg -x .device/libfabric-dev_*.deb /tmp/lf && mkdir -p /tmp/lf/usr/lib64 &&
  ln -sf "$(ls /usr/lib/x86_64-linux-gnu/libfabric.so.1* | head -1)" /tmp/lf/usr/lib64/libfabric.so
mkdir -p /tmp/old && tar -xf .device/old.tar -C /tmp/old && mkdir -p /tmp/old/.device && cp .device/build.sh .device/*.deb /tmp/old/.device/
SECONDS=0
(MAX_JOBS=8 bash .device/build.sh > /tmp/new.log 2>&1; echo new built: $?) &
(cd /tmp/old && BUILD_LOG=/tmp/oldbuild.log MAX_JOBS=8 bash .device/build.sh > /tmp/oldb.log 2>&1; echo old built: $?) &
wait
echo built in $SECONDS s
export PYTHONPATH=$PWD
pkill -9 -f multiprocessing
D="--device cuda:0 --peer-device cuda:0 --sizes 4K --pages 256 4096 --layouts paged --window 8 --duration 0.5 --baseline memcpy"
for r in 1 2; do
  for tree in old new; do
    dir=$PWD; [ $tree != new ] && dir=/tmp/$tree
    for prep in "" --prepared; do
      (cd $dir && PYTHONPATH=$dir timeout -s KILL 60 python3 benchmarks/bw.py $D $prep --json $OUT/ab-$tree${prep:+-prep}-$r.json > /tmp/ab.txt 2>&1)
      pkill -9 -f multiprocessing
      python3 - "$tree${prep:+-prep} run $r" $OUT/ab-$tree${prep:+-prep}-$r.json <<'PY'
import json, sys
rows = json.load(open(sys.argv[2]))
print(sys.argv[1], " ".join(f"{r['op'][0]}{r['pages']}={r['gbps']:.0f}/{r['baseline_gbps']:.0f}" for r in rows))
PY
    done
  done
  echo round $r done at $SECONDS s
done 2>&1 | tee $OUT/ab.txt
echo all done at $SECONDS s
