#!/bin/bash
# HEAD (7b34725 + results only): the GPU tests, then the 4 KiB rows and latency.
export PYTHONUNBUFFERED=1
SECONDS=0
bash .device/build.sh > /tmp/b.txt 2>&1 || { tail -30 /tmp/b.txt; exit 1; }
echo built in $SECONDS s
export PYTHONPATH=$PWD
timeout -s KILL 360 python3 -m pytest tests/test_ipc.py tests/test_cuda.py tests/test_kv.py tests/test_weights.py -m cuda -p no:cacheprovider --timeout 100 --timeout-method thread -q -rs > $OUT/gputests.txt 2>&1; tail -4 $OUT/gputests.txt
pkill -9 -f multiprocessing
B=benchmarks/bw.py; E="--device cuda:0 --peer-device cuda:0"
run() { name=$1; shift; timeout -s KILL 100 python3 $B $E "$@" --json $OUT/$name.json > $OUT/$name.txt 2>&1; grep -A8 "^op " $OUT/$name.txt; pkill -9 -f multiprocessing; }
run bw4k --sizes 4K --pages 256 4096 --layouts paged --window 8 --duration 0.5 --baseline memcpy
run bw4k-prep --sizes 4K --pages 256 4096 --layouts paged --window 8 --duration 0.5 --baseline memcpy --prepared
run lat --sizes 4K --pages 1 --layouts contiguous --window 1 --duration 1 --baseline none
echo all done at $SECONDS s
