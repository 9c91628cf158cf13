#!/bin/bash
# Three trees built side by side: old (a8a3c61), mid (shared launches), new (+ dispatcher spin);
# the IPC GPU tests on new, then bw.py 256/4096 x 4 KiB alternately, two rounds.
export PYTHONUNBUFFERED=1
dpkg -x .device/libfabric-dev_*.deb /tmp/lf && mkdir -p /tmp/lf/usr/lib64 &&
  ln -sf "$(ls /usr/lib/x86_64-linux-gnu/libfabric.so.1* | head -1)" /tmp/lf/usr/lib64/libfabric.so
for t in old mid; do
  mkdir -p /tmp/$t && tar -xf .device/$t.tar -C /tmp/$t && mkdir -p /tmp/$t/.device && cp .device/build.sh .device/*.deb /tmp/$t/.device/
done
SECONDS=0
(MAX_JOBS=6 bash .device/build.sh > /tmp/new.log 2>&1; echo new built: $?) &
(cd /tmp/old && BUILD_LOG=/tmp/oldbuild.log MAX_JOBS=5 bash .device/build.sh > /tmp/oldb.log 2>&1; echo old built: $?) &
(cd /tmp/mid && BUILD_LOG=/tmp/midbuild.log MAX_JOBS=5 bash .device/build.sh > /tmp/midb.log 2>&1; echo mid built: $?) &
wait
echo built in $SECONDS s
export PYTHONPATH=$PWD
timeout -s KILL 170 python3 -m pytest tests/test_ipc.py -m cuda -p no:cacheprovider --timeout 60 --timeout-method thread -q -rs > $OUT/ipc-tests.txt 2>&1; tail -3 $OUT/ipc-tests.txt
pkill -9 -f multiprocessing
echo tests done at $SECONDS s
D="--device cuda:0 --peer-device cuda:0 --sizes 4K --pages 256 4096 --layouts paged --window 8 --duration 0.5 --baseline memcpy"
for r in 1 2; do
  for tree in old mid new; do
    dir=$PWD; [ $tree != new ] && dir=/tmp/$tree
    for prep in "" --prepared; do
      (cd $dir && PYTHONPATH=$dir timeout -s KILL 60 python3 benchmarks/bw.py $D $prep --json /tmp/ab-$tree${prep:+-prep}-$r.json > /tmp/ab.txt 2>&1)
      pkill -9 -f multiprocessing
      python3 - "$tree${prep:+-prep} run $r" /tmp/ab-$tree${prep:+-prep}-$r.json <<'PY'
import json, sys
rows = json.load(open(sys.argv[2]))
print(sys.argv[1], " ".join(f"{r['op'][0]}{r['pages']}={r['gbps']:.0f}/{r['baseline_gbps']:.0f}" for r in rows))
PY
    done
  done
  echo round $r done at $SECONDS s
done 2>&1 | tee $OUT/ab.txt
cd /tmp && tar -cf $OUT/ab-json.tar ab-*.json
