#!/bin/bash
# Final tree: GPU tests, and the rows that go through the copy engines alone (64 MiB) and the kernel.
export PYTHONUNBUFFERED=1
SECONDS=0
bash .device/build.sh > /tmp/b.txt 2>&1 || { tail -30 /tmp/b.txt; exit 1; }
echo built in $SECONDS s
export PYTHONPATH=$PWD
timeout -s KILL 330 python3 -m pytest tests/test_ipc.py tests/test_cuda.py tests/test_kv.py tests/test_weights.py -m cuda -p no:cacheprovider --timeout 100 --timeout-method thread -q -rs > $OUT/gputests.txt 2>&1; tail -3 $OUT/gputests.txt
pkill -9 -f multiprocessing
echo tests done at $SECONDS s
B=benchmarks/bw.py; E="--device cuda:0 --peer-device cuda:0"
run() { name=$1; shift; timeout -s KILL 90 python3 $B $E "$@" --json $OUT/$name.json > $OUT/$name.txt 2>&1; grep -A12 "^op " $OUT/$name.txt; pkill -9 -f multiprocessing; }
run bw-64m --sizes 64M 16M --pages 1 --layouts contiguous --max-bytes 64M --window 8 --duration 0.5 --baseline memcpy
run bw-4k --sizes 4K --pages 256 --layouts paged --window 8 --duration 0.5 --baseline memcpy --prepared
echo all done at $SECONDS s
