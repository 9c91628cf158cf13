#!/bin/bash
# Session 27, call 3: the caller's stream point, query (P2P_POINT=q, the previous tree) against
# an event on streams other than the legacy default (the new tree), calls on the default stream
# and on a stream of the caller's own; rounds alternate.
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
SECONDS=0
patch -p1 < benchmarks/results/2026-11-24-h100-streams/scripts/stream-point.patch
bash .device/build.sh > /tmp/b.txt 2>&1 || { tail -30 /tmp/b.txt; exit 1; }
echo built at $SECONDS s
for r in 1 2 3; do
  for p in q e; do
    for v in default side; do
      P2P_POINT=$p timeout -s KILL 60 python3 benchmarks/results/2026-11-24-h100-streams/scripts/gil.py "round $r point=$p" $v 2>&1 | grep -v Warn
      pkill -9 -f multiprocessing
    done
  done
done | tee $OUT/1-point.txt
echo all done at $SECONDS s
