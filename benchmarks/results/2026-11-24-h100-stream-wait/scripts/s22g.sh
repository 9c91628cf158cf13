#!/bin/bash
# HEAD (old) against the working tree (new: no event for an idle stream), built side by side, run alternately.
export PYTHONUNBUFFERED=1
mkdir -p /tmp/old && tar -xf .device/old.tar -C /tmp/old && cp -r .device /tmp/old/ && rm -f /tmp/old/.device/old.tar
dpkg -x .device/libfabric-dev_*.deb /tmp/lf && mkdir -p /tmp/lf/usr/lib64 &&
  ln -sf "$(ls /usr/lib/x86_64-linux-gnu/libfabric.so.1* | head -1)" /tmp/lf/usr/lib64/libfabric.so
(MAX_JOBS=8 bash .device/build.sh > /tmp/new.log 2>&1; echo new built: $?) &
(cd /tmp/old && BUILD_LOG=/tmp/oldbuild.log MAX_JOBS=8 bash .device/build.sh > /tmp/oldb.log 2>&1; echo old built: $?) &
wait
export PYTHONPATH=$PWD
timeout -s KILL 100 python3 -m pytest tests/test_cuda.py tests/test_ipc.py -m cuda -p no:cacheprovider --timeout 60 --timeout-method thread -k "stream or follows or receiver" -q > $OUT/focus.txt 2>&1; tail -1 $OUT/focus.txt
pkill -9 -f multiprocessing
D="--device cuda:0 --peer-device cuda:0 --sizes 4K --pages 256 4096 --layouts paged --window 8 --duration 0.5 --baseline memcpy"
for r in 1 2; do
  for tree in old new; do
    dir=$PWD; [ $tree = old ] && dir=/tmp/old
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
done
