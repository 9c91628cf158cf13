#!/bin/bash
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
bash .device/build.sh || exit 1
T=test_ipc_a_call_after_a_stream_wait_for_an_earlier_one
timeout -s KILL 330 python3 -m pytest tests/test_ipc.py tests/test_cuda.py tests/test_kv.py tests/test_weights.py -m cuda -k "not $T" -q -p no:cacheprovider > $OUT/gputests.txt 2>&1; tail -1 $OUT/gputests.txt
pkill -9 -f "multiprocessing" ; pkill -9 -f pytest
timeout -s KILL 90 python3 -m pytest tests/test_ipc.py -m cuda -k $T -q -p no:cacheprovider --timeout 45 --timeout-method thread > $OUT/stream-wait.txt 2>&1; tail -60 $OUT/stream-wait.txt | cut -c1-200
