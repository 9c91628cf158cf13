#!/bin/bash
# Review: the batch state is cleared after every flush (failure included); the guard check shared in the tests.
export PYTHONUNBUFFERED=1
SECONDS=0
bash .device/build.sh > /tmp/b.txt 2>&1 || { tail -30 /tmp/b.txt; exit 1; }
echo built in $SECONDS s
export PYTHONPATH=$PWD
timeout -s KILL 300 python3 -m pytest tests/test_ipc.py -m cuda -p no:cacheprovider --timeout 100 --timeout-method thread -q -rs 2>&1 | tail -3
pkill -9 -f multiprocessing
timeout -s KILL 90 python3 benchmarks/bw.py --device cuda:0 --peer-device cuda:0 --sizes 4K --pages 256 4096 --layouts paged --window 8 --duration 0.5 --baseline memcpy --prepared 2>&1 | grep -A5 "^op "
pkill -9 -f multiprocessing
echo all done at $SECONDS s
