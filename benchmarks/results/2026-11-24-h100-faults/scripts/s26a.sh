#!/bin/bash
# Session 26, call 2: the event-record test on the code before e1867b2 (expected to fail),
# then on the tree, then every GPU test on the tree.
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
SECONDS=0
T=tests/test_ipc.py::test_ipc_batch_without_its_event_completes_after_its_copy
cp csrc/ipc/cuda_memory.cpp /tmp/new_cuda_memory.cpp
cp .device/old26/cuda_memory.cpp csrc/ipc/cuda_memory.cpp
bash .device/build.sh > /tmp/b.txt 2>&1 || { tail -30 /tmp/b.txt; exit 1; }
echo old built in $SECONDS s
timeout -s KILL 120 python3 -m pytest $T -p no:cacheprovider --timeout 60 --timeout-method thread -q -rs 2>&1 | tail -25 > $OUT/1-old-code-event-test.txt
tail -4 $OUT/1-old-code-event-test.txt
pkill -9 -f multiprocessing
cp /tmp/new_cuda_memory.cpp csrc/ipc/cuda_memory.cpp; touch csrc/ipc/cuda_memory.cpp
bash .device/build.sh > /tmp/b.txt 2>&1 || { tail -30 /tmp/b.txt; exit 1; }
echo new built at $SECONDS s
timeout -s KILL 120 python3 -m pytest $T -p no:cacheprovider --timeout 60 --timeout-method thread -q -rs -s 2>&1 | tail -25 > $OUT/2-new-code-event-test.txt
tail -3 $OUT/2-new-code-event-test.txt
pkill -9 -f multiprocessing
timeout -s KILL 330 python3 -m pytest tests/test_ipc.py tests/test_cuda.py tests/test_kv.py tests/test_weights.py -m cuda -p no:cacheprovider --timeout 100 --timeout-method thread -q -rs 2>&1 | tail -15 > $OUT/3-gpu-tests.txt
tail -3 $OUT/3-gpu-tests.txt
pkill -9 -f multiprocessing
echo all done at $SECONDS s
