#!/bin/bash
# Session 26, call 3: the tree (one driver-entry helper, CUDA 12.0-12.4 branch; an event that
# cannot be recorded leaves the batch to the stream): build, every GPU test, 4 KiB rows.
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
SECONDS=0
bash .device/build.sh > /tmp/b.txt 2>&1 || { tail -30 /tmp/b.txt; exit 1; }
echo built in $SECONDS s
timeout -s KILL 380 python3 -m pytest tests/test_ipc.py tests/test_cuda.py tests/test_kv.py tests/test_weights.py -m cuda -p no:cacheprovider --timeout 100 --timeout-method thread -q -rs 2>&1 | tail -15 > $OUT/3-gpu-tests.txt
tail -3 $OUT/3-gpu-tests.txt
pkill -9 -f multiprocessing
echo tests done at $SECONDS s
timeout -s KILL 100 python3 benchmarks/bw.py --device cuda:0 --peer-device cuda:0 --sizes 4K --pages 256 4096 --layouts paged --window 8 --duration 0.5 --baseline memcpy --json $OUT/3-bw4k.json 2>&1 | grep -A6 "^op "
pkill -9 -f multiprocessing
echo all done at $SECONDS s
