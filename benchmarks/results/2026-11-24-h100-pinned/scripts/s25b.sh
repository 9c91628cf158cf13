#!/bin/bash
# Session 25, call 2: the new pinned-memory test against the old IPC code (must fail), then the
# new code: that test, the IPC tests and every GPU test.
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
SECONDS=0
cp -r .device/old/csrc/. csrc/
bash .device/build.sh > /tmp/b.txt 2>&1 || { tail -30 /tmp/b.txt; exit 1; }
echo old built in $SECONDS s
timeout -s KILL 200 python3 -m pytest tests/test_ipc.py -k pinned -m cuda -p no:cacheprovider --timeout 150 --timeout-method thread -q -rs 2>&1 | tail -15 | tee $OUT/1-old-pinned-test.txt
pkill -9 -f multiprocessing
cp -r .device/new/csrc/. csrc/
bash .device/build.sh > /tmp/b.txt 2>&1 || { tail -30 /tmp/b.txt; exit 1; }
echo new built at $SECONDS s
timeout -s KILL 120 python3 -m pytest tests/test_ipc.py -k pinned -m cuda -p no:cacheprovider --timeout 100 --timeout-method thread -q -rs 2>&1 | tail -15 | tee $OUT/2-new-pinned-test.txt
pkill -9 -f multiprocessing
timeout -s KILL 200 python3 -m pytest tests/test_ipc.py -m cuda -p no:cacheprovider --timeout 100 --timeout-method thread -q -rs 2>&1 | tail -5 | tee $OUT/3-ipc-tests.txt
pkill -9 -f multiprocessing
echo all done at $SECONDS s
