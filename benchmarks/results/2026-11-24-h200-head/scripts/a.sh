#!/bin/bash
# Session 28, call 1: issue 11's targets at HEAD, system libfabric 1.17, IPC route. The peer is
# cuda:1 where the machine has two GPUs, else cuda:0 (two processes on one GPU; then no NCCL row).
# Paged rows twice, plain and prepared alternating; contiguous 64 MiB; one 4 KiB write's latency
# (window 1); then the quick start's `python benchmarks/bw.py` with no arguments.
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
SECONDS=0
nvidia-smi --query-gpu=name --format=csv,noheader
bash .device/build.sh > /tmp/b.txt 2>&1 || { tail -30 /tmp/b.txt; exit 1; }
echo built in $SECONDS s
PEER=cuda:$(( $(nvidia-smi -L | wc -l) > 1 ? 1 : 0 ))
B=benchmarks/bw.py; E="--device cuda:0 --peer-device $PEER"
run() { name=$1; shift; timeout -s KILL 120 python3 $B $E "$@" --json $OUT/$name.json > /tmp/$name.txt 2>&1; echo "== $name"; grep -A10 "^op " /tmp/$name.txt | grep -v "^\["; grep "^latency\|rror" /tmp/$name.txt; pkill -9 -f multiprocessing; }
P="--sizes 4K 64K --pages 256 4096 --layouts paged --window 8 --duration 0.5"
{
for i in 1 2; do
  run 1-paged-$i $P --baseline memcpy
  run 1-prepared-$i $P --baseline memcpy --prepared
done
run 1-contiguous --sizes 64M --pages 1 --layouts contiguous --max-bytes 64M --window 8 --duration 0.5 --baseline memcpy
run 1-latency --sizes 4K --pages 1 --layouts contiguous --window 1 --duration 1 --baseline none
[ $PEER = cuda:1 ] && run 1-nccl $P --baseline nccl --nccl-nvlink
} 2>&1 | tee $OUT/1-targets.txt
echo targets done at $SECONDS s
timeout -s KILL 170 python3 $B > $OUT/1-bw-default.txt 2>&1; grep -v "^\[" $OUT/1-bw-default.txt | tail -40
pkill -9 -f multiprocessing
echo all done at $SECONDS s
