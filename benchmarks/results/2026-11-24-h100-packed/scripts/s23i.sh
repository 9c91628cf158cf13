#!/bin/bash
# Review change (one pass over a list's ids): the IPC GPU tests and one 256 x 4 KiB row.
export PYTHONUNBUFFERED=1
SECONDS=0
bash .device/build.sh > /tmp/b.txt 2>&1 || { tail -30 /tmp/b.txt; exit 1; }
export PYTHONPATH=$PWD
timeout -s KILL 150 python3 -m pytest tests/test_ipc.py -m cuda -p no:cacheprovider --timeout 60 --timeout-method thread -q -rs > $OUT/ipc-tests.txt 2>&1; tail -2 $OUT/ipc-tests.txt
pkill -9 -f multiprocessing
timeout -s KILL 60 python3 benchmarks/bw.py --device cuda:0 --peer-device cuda:0 --sizes 4K --pages 256 --layouts paged --window 8 --duration 0.5 --baseline memcpy --prepared --json $OUT/bw.json > $OUT/bw.txt 2>&1; grep -A3 "^op " $OUT/bw.txt
echo done at $SECONDS s
