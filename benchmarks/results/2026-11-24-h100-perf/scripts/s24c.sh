#!/bin/bash
# The stream check's cost: P2P_EV=0 query (current), 1 always record, 2 neither (measurement only).
export PYTHONUNBUFFERED=1
SECONDS=0
bash .device/build.sh > /tmp/b.txt 2>&1 || { tail -30 /tmp/b.txt; exit 1; }
echo built in $SECONDS s
export PYTHONPATH=$PWD
for round in 1 2 3; do for ev in 0 1 2; do
  P2P_EV=$ev timeout -s KILL 60 python3 .device/evab.py "ev=$ev" 2>&1 | grep "^ev="; pkill -9 -f multiprocessing
done; done
echo all done at $SECONDS s
