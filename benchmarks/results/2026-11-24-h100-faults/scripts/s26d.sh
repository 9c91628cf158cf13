#!/bin/bash
# Session 26, call 5: a failed stream event must not leave CUDA's last error behind. The new
# test on the previous device.cpp (expected to fail), then every GPU test on the tree.
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
SECONDS=0
T=tests/test_ipc.py::test_ipc_failed_stream_event_raises_and_leaves_no_cuda_error
cp csrc/cuda/device.cpp /tmp/new_device.cpp
cp .device/old26/device.cpp csrc/cuda/device.cpp
bash .device/build.sh > /tmp/b.txt 2>&1 || { tail -30 /tmp/b.txt; exit 1; }
echo old built in $SECONDS s
timeout -s KILL 100 python3 -m pytest $T -p no:cacheprovider --timeout 60 --timeout-method thread -q -rs 2>&1 | tail -25 > $OUT/5-old-code-last-error-test.txt
tail -4 $OUT/5-old-code-last-error-test.txt
pkill -9 -f multiprocessing
cp /tmp/new_device.cpp csrc/cuda/device.cpp; touch csrc/cuda/device.cpp
bash .device/build.sh > /tmp/b.txt 2>&1 || { tail -30 /tmp/b.txt; exit 1; }
echo new built at $SECONDS s
timeout -s KILL 400 python3 -m pytest tests/test_ipc.py tests/test_cuda.py tests/test_kv.py tests/test_weights.py -m cuda -p no:cacheprovider --timeout 100 --timeout-method thread -q -rs 2>&1 | tail -15 > $OUT/5-gpu-tests.txt
tail -3 $OUT/5-gpu-tests.txt
pkill -9 -f multiprocessing
echo all done at $SECONDS s
