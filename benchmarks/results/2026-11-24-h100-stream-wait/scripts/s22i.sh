#!/bin/bash
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
nvidia-smi --query-gpu=name --format=csv,noheader; nproc
bash .device/build.sh || exit 1
B=benchmarks/bw.py; D="--device cuda:0 --peer-device cuda:0"
run() { name=$1; shift; timeout -s KILL 90 python3 $B $D "$@" --json $OUT/$name.json > $OUT/$name.txt 2>&1; grep -A6 "^op " $OUT/$name.txt; pkill -9 -f multiprocessing; }
for r in 1 2; do
  run h200-bw4k-$r --sizes 4K --pages 256 4096 --layouts paged --window 8 --duration 0.5 --baseline memcpy
  run h200-bw4k-prep-$r --sizes 4K --pages 256 4096 --layouts paged --window 8 --duration 0.5 --baseline memcpy --prepared
done
