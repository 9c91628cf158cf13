#!/bin/bash
# Launch deferral while the last launch runs (P2P_DEFER=1) against launching every turn; P2P_EV=2 (no stream check) for scale.
export PYTHONUNBUFFERED=1
SECONDS=0
bash .device/build.sh > /tmp/b.txt 2>&1 || { tail -30 /tmp/b.txt; exit 1; }
echo built in $SECONDS s
export PYTHONPATH=$PWD
for round in 1 2; do for v in "0 0" "0 1" "2 1"; do set -- $v
  P2P_EV=$1 P2P_DEFER=$2 timeout -s KILL 60 python3 .device/evab.py "ev=$1 defer=$2" 2>&1 | grep "^ev="; pkill -9 -f multiprocessing
done; done
timeout -s KILL 200 python3 -m pytest tests/test_ipc.py -m cuda -p no:cacheprovider --timeout 60 --timeout-method thread -q -x 2>&1 | tail -2
P2P_DEFER=1 timeout -s KILL 200 python3 -m pytest tests/test_ipc.py -m cuda -p no:cacheprovider --timeout 60 --timeout-method thread -q -x 2>&1 | tail -2
echo all done at $SECONDS s
