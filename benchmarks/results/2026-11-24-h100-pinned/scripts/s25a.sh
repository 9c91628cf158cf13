#!/bin/bash
# Session 25, call 1: which idle streams are slow to query on a busy GPU; the engine's calls from
# the default stream against a side stream.
export PYTHONUNBUFFERED=1
SECONDS=0
nvcc -std=c++17 -O2 -arch=sm_90 .device/api4.cu -o /tmp/api4 -lcuda && timeout -s KILL 60 /tmp/api4 2>&1 | tee $OUT/1-api4.txt
bash .device/build.sh > /tmp/b.txt 2>&1 || { tail -30 /tmp/b.txt; exit 1; }
echo built in $SECONDS s
export PYTHONPATH=$PWD
timeout -s KILL 120 python3 .device/side.py 2>&1 | tee $OUT/2-side.txt
pkill -9 -f multiprocessing
echo all done at $SECONDS s
