#!/bin/bash
# Session 27, call 1: does the dispatcher's turn at the GIL (popping futures completed in C++)
# slow the calling thread? One build with the P2P_SKIPDONE variant; rounds alternate.
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
SECONDS=0
patch -p1 < benchmarks/results/2026-11-24-h100-streams/scripts/skipdone.patch
bash .device/build.sh > /tmp/b.txt 2>&1 || { tail -30 /tmp/b.txt; exit 1; }
echo built in $SECONDS s
for r in 1 2 3; do
  for v in 0 1; do
    P2P_SKIPDONE=$v timeout -s KILL 60 python3 benchmarks/results/2026-11-24-h100-streams/scripts/gil.py "round $r skipdone=$v" 2>&1 | grep -v Warn
    pkill -9 -f multiprocessing
  done
done | tee $OUT/1-gil.txt
for v in 0 1; do
  for prep in "" --prepared; do
    P2P_SKIPDONE=$v timeout -s KILL 90 python3 benchmarks/bw.py --device cuda:0 --peer-device cuda:0 --sizes 4K --pages 256 --layouts paged --window 8 --duration 1 --baseline none $prep --json $OUT/bw-skip$v$prep.json 2>&1 | grep -E "x256" | tail -2
    pkill -9 -f multiprocessing
  done
done | tee $OUT/2-bw.txt
echo all done at $SECONDS s
