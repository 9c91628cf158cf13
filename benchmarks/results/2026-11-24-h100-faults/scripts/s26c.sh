#!/bin/bash
# Session 26, call 4: driver_function's CUDA 12.0-12.4 branch (cudaGetDriverEntryPoint),
# forced on the CUDA 13 toolkit here (it still has the call, deprecated): build, IPC GPU tests.
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
SECONDS=0
sed -i 's/^#if CUDART_VERSION >= 12050$/#if 0  \/\/ forced: the 12.0-12.4 branch/' csrc/cuda/device.cpp
grep -n "forced" csrc/cuda/device.cpp
bash .device/build.sh > /tmp/b.txt 2>&1 || { tail -30 /tmp/b.txt; exit 1; }
grep -c "deprecated" /tmp/b.txt
echo built in $SECONDS s
timeout -s KILL 250 python3 -m pytest tests/test_ipc.py tests/test_cuda.py -m cuda -p no:cacheprovider --timeout 100 --timeout-method thread -q -rs 2>&1 | tail -8 > $OUT/4-entry-point-branch-tests.txt
tail -3 $OUT/4-entry-point-branch-tests.txt
pkill -9 -f multiprocessing
git checkout csrc/cuda/device.cpp 2>/dev/null
echo all done at $SECONDS s
