#!/bin/bash
# Session 26, call 7 (review): record() through cuda::record_event, the preloaded-peer tests
# through shared helpers: build, the IPC GPU tests.
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
SECONDS=0
bash .device/build.sh > /tmp/b.txt 2>&1 || { tail -30 /tmp/b.txt; exit 1; }
echo built in $SECONDS s
timeout -s KILL 300 python3 -m pytest tests/test_ipc.py -m cuda -p no:cacheprovider --timeout 100 --timeout-method thread -q -rs 2>&1 | tail -15 > $OUT/7-review-ipc-tests.txt
tail -3 $OUT/7-review-ipc-tests.txt
pkill -9 -f multiprocessing
echo all done at $SECONDS s
