#!/bin/bash
# Session 27, call 2: is the stream check slow because the caller's stream is the legacy
# default stream? CUDA alone (api6.cu), then the engine with calls on the default stream and
# on a stream of the caller's own, rounds alternating.
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
SECONDS=0
nvcc -O2 -o /tmp/api6 benchmarks/results/2026-11-24-h100-streams/scripts/api6.cu && /tmp/api6 | tee $OUT/1-api6.txt
bash .device/build.sh > /tmp/b.txt 2>&1 || { tail -30 /tmp/b.txt; exit 1; }
echo built at $SECONDS s
for r in 1 2 3; do
  for v in default side; do
    timeout -s KILL 60 python3 benchmarks/results/2026-11-24-h100-streams/scripts/gil.py "round $r" $v 2>&1 | grep -v Warn
    pkill -9 -f multiprocessing
  done
done | tee $OUT/2-streams.txt
echo all done at $SECONDS s
