#!/bin/bash
# Session 28, call 3: 256 x 4 KiB with the calling thread pinned to a free core or not,
# three rounds alternating, plain and prepared; two processes on one GPU.
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
SECONDS=0
ls torch_p2p/_C*.so >/dev/null 2>&1 || bash .device/build.sh > /tmp/b.txt 2>&1 || { tail -30 /tmp/b.txt; exit 1; }
S=benchmarks/results/2026-11-24-h200-head/scripts/pin.py
A="--device cuda:0 --peer-device cuda:0 --sizes 4K --pages 256 --layouts paged --window 8 --duration 0.5 --baseline memcpy"
for r in 1 2 3; do for pin in 0 1; do for prep in "" --prepared; do
  name=3-pin$pin$prep-$r
  PIN_CALLER=$pin timeout -s KILL 60 python3 $S $A $prep --json $OUT/$name.json > /tmp/$name.txt 2>&1
  echo "== $name"; grep "pinned" /tmp/$name.txt; grep -A2 "^op " /tmp/$name.txt | grep -v "^\["; grep -i "error" /tmp/$name.txt
  pkill -9 -f multiprocessing
done; done; done 2>&1 | tee $OUT/3-pin.txt
echo all done at $SECONDS s
