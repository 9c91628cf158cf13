#!/bin/bash
# Final tree (new) against a8a3c61 (old, this session's start), alternately; the new GPU test;
# the new tree's other rows (64 KiB pages, contiguous 64 MiB, latency).
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
timeout -s KILL 100 python3 -m pytest tests/test_ipc.py -m cuda -p no:cacheprovider --timeout 60 --timeout-method thread -q -rs -k "32_bits or in_flight" > $OUT/new-test.txt 2>&1; tail -3 $OUT/new-test.txt
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
B=benchmarks/bw.py; E="--device cuda:0 --peer-device cuda:0"
run() { name=$1; shift; timeout -s KILL 90 python3 $B $E "$@" --json /tmp/$name.json > $OUT/$name.txt 2>&1; grep -A12 "^op " $OUT/$name.txt; grep latency $OUT/$name.txt; pkill -9 -f multiprocessing; }
run bw-64k-64m --sizes 64K 64M --pages 1 256 --max-bytes 64M --window 8 --duration 0.5 --baseline memcpy
run lat --sizes 4K --pages 1 --layouts contiguous --window 1 --duration 1 --baseline none
echo all done at $SECONDS s
