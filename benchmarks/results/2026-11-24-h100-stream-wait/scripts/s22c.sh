#!/bin/bash
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
bash .device/build.sh || exit 1
T=test_ipc_a_call_after_a_stream_wait_for_an_earlier_one
timeout -s KILL 90 python3 -m pytest tests/test_ipc.py -m cuda -k $T -q -p no:cacheprovider --timeout 60 --timeout-method thread > $OUT/stream-wait.txt 2>&1; tail -2 $OUT/stream-wait.txt | cut -c1-300
pkill -9 -f "multiprocessing" ; pkill -9 -f pytest
timeout -s KILL 400 python3 -m pytest tests/test_ipc.py tests/test_cuda.py tests/test_kv.py tests/test_weights.py -m cuda -q -p no:cacheprovider --timeout 120 --timeout-method thread > $OUT/gputests.txt 2>&1; tail -3 $OUT/gputests.txt | cut -c1-300
