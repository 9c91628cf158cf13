#!/bin/bash
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
nvidia-smi --query-gpu=name --format=csv,noheader > $OUT/gpu.txt
bash .device/build.sh || exit 1
T=test_ipc_a_call_after_a_stream_wait_for_an_earlier_one
timeout -s KILL 120 python3 -m pytest tests/test_ipc.py -m cuda -k $T -q -p no:cacheprovider --timeout 60 --timeout-method thread > $OUT/stream-wait.txt 2>&1; tail -3 $OUT/stream-wait.txt | cut -c1-300
pkill -9 -f "multiprocessing" ; pkill -9 -f pytest
timeout -s KILL 300 python3 -m pytest tests/test_ipc.py tests/test_cuda.py tests/test_kv.py tests/test_weights.py -m cuda -q -p no:cacheprovider --timeout 120 --timeout-method thread > $OUT/gputests.txt 2>&1; tail -3 $OUT/gputests.txt | cut -c1-300
pkill -9 -f "multiprocessing" ; pkill -9 -f pytest
for i in 1 2; do
timeout -s KILL 60 python3 benchmarks/bw.py --device cuda:0 --peer-device cuda:0 --sizes 4K --pages 256 4096 --layouts paged --window 8 --duration 0.5 --baseline memcpy --json $OUT/bw4k-$i.json > $OUT/bw4k-$i.txt 2>&1; tail -8 $OUT/bw4k-$i.txt
pkill -9 -f "multiprocessing"
done
