#!/bin/bash
# Session 25, call 7: the review's mend (flush and mark share one event-record helper): build, IPC GPU tests.
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
SECONDS=0
bash .device/build.sh > /tmp/b.txt 2>&1 || { tail -30 /tmp/b.txt; exit 1; }
echo built in $SECONDS s
timeout -s KILL 240 python3 -m pytest tests/test_ipc.py -m cuda -p no:cacheprovider --timeout 100 --timeout-method thread -q -rs 2>&1 | tail -2 | tee $OUT/ipc-tests.txt
pkill -9 -f multiprocessing
echo all done at $SECONDS s
