#!/bin/bash
# Session 27, call 6: same pages over shm with CUDA (libfabric 2.6, the route a CUDA libfabric
# gives without the IPC route: TORCH_P2P_IPC=0) and over the IPC route, one H100, same machine.
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
SECONDS=0
[ -f /tmp/lfcuda/lib/libfabric.so.1 ] || { echo no CUDA libfabric on this machine; exit 1; }
ls torch_p2p/_C*.so >/dev/null 2>&1 || bash .device/build.sh > /tmp/b.txt 2>&1 || { tail -30 /tmp/b.txt; exit 1; }
A="--device cuda:0 --peer-device cuda:0 --provider shm --sizes 4K 64K --pages 256 --layouts paged --window 8 --duration 0.5 --baseline memcpy"
for ipc in 0 1; do
  TORCH_P2P_IPC=$ipc LD_LIBRARY_PATH=/tmp/lfcuda/lib timeout -s KILL 200 python3 benchmarks/bw.py $A --json $OUT/bw-shm-ipc$ipc.json 2>&1 | grep -vE "^\[" | tail -12
  pkill -9 -f multiprocessing
done | tee $OUT/3-shm-vs-ipc.txt
echo at $SECONDS s
