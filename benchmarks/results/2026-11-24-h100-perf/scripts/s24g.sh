#!/bin/bash
# Does the calling thread's core matter (SMT sibling of the worker or not)?
export PYTHONUNBUFFERED=1
SECONDS=0
lscpu | grep -E "^CPU\(s\)|Thread|Core|Socket|NUMA|Model name"
bash .device/build.sh > /tmp/b.txt 2>&1 || { tail -30 /tmp/b.txt; exit 1; }
echo built in $SECONDS s
export PYTHONPATH=$PWD
timeout -s KILL 150 python3 .device/pin.py 2>&1 | grep -v Warning
pkill -9 -f multiprocessing
echo all done at $SECONDS s
