#!/bin/bash
# Session 25, call 6: the final tree (an event record that fails leaves the batch to the stream
# query): build, the IPC GPU tests, one 4 KiB run.
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
SECONDS=0
bash .device/build.sh > /tmp/b.txt 2>&1 || { tail -30 /tmp/b.txt; exit 1; }
echo built in $SECONDS s
timeout -s KILL 200 python3 -m pytest tests/test_ipc.py -m cuda -p no:cacheprovider --timeout 100 --timeout-method thread -q -rs 2>&1 | tail -2 | tee $OUT/1-ipc-tests.txt
pkill -9 -f multiprocessing
timeout -s KILL 120 python3 benchmarks/bw.py --device cuda:0 --peer-device cuda:0 --sizes 4K --pages 256 4096 --layouts paged --window 8 --duration 0.5 --baseline memcpy --json $OUT/2-bw4k.json 2>&1 | grep -A5 "^op "
pkill -9 -f multiprocessing
echo all done at $SECONDS s
