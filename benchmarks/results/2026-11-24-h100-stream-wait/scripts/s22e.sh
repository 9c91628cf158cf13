#!/bin/bash
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
bash .device/build.sh || exit 1
timeout -s KILL 150 python3 -m pytest tests/test_ipc.py tests/test_cuda.py -m cuda -p no:cacheprovider --timeout 60 --timeout-method thread -k "stream or follows or receiver" -v --durations 5 > $OUT/focus.txt 2>&1; grep -E "PASSED|FAILED|SKIPPED|ERROR|passed|failed" $OUT/focus.txt | cut -c1-150 | tail -20
pkill -9 -f "multiprocessing" ; pkill -9 -f pytest
timeout -s KILL 330 python3 -m pytest tests/test_ipc.py tests/test_cuda.py tests/test_kv.py tests/test_weights.py -m cuda -q -p no:cacheprovider --timeout 100 --timeout-method thread -k "not stream and not follows and not receiver" > $OUT/gputests.txt 2>&1; tail -3 $OUT/gputests.txt | cut -c1-300
