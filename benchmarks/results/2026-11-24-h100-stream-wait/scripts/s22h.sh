#!/bin/bash
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
bash .device/build.sh || exit 1
timeout -s KILL 480 python3 -m pytest tests/test_ipc.py tests/test_cuda.py tests/test_kv.py tests/test_weights.py -m cuda -q -p no:cacheprovider --timeout 100 --timeout-method thread -rs > $OUT/gputests-final.txt 2>&1; tail -12 $OUT/gputests-final.txt | cut -c1-250
