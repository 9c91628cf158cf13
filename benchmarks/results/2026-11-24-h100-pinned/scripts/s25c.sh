#!/bin/bash
# Session 25, call 4: A/B of the worker's command check (P2P_AB_LOCK=1: the lock every turn, as
# before; unset: an atomic flag first), three rounds alternating; then the IPC GPU tests.
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
SECONDS=0
bash .device/build.sh > /tmp/b.txt 2>&1 || { tail -30 /tmp/b.txt; exit 1; }
echo built in $SECONDS s
for r in 1 2 3; do
  P2P_AB_LOCK=1 timeout -s KILL 60 python3 .device/evab.py "round $r lock-every-turn" 2>&1 | grep -v Warn | tee -a $OUT/1-ab.txt
  pkill -9 -f multiprocessing
  timeout -s KILL 60 python3 .device/evab.py "round $r flag-first     " 2>&1 | grep -v Warn | tee -a $OUT/1-ab.txt
  pkill -9 -f multiprocessing
done
echo ab done at $SECONDS s
timeout -s KILL 200 python3 -m pytest tests/test_ipc.py -m cuda -p no:cacheprovider --timeout 100 --timeout-method thread -q -rs 2>&1 | tail -3 | tee $OUT/2-ipc-tests.txt
pkill -9 -f multiprocessing
echo all done at $SECONDS s
