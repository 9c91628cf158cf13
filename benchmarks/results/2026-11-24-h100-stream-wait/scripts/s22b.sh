#!/bin/bash
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
bash .device/build.sh || exit 1
T=test_ipc_a_call_after_a_stream_wait_for_an_earlier_one
sed -i 's/            earlier = a.write_slices(\[src\[0\]\]/            print("iteration", i, file=sys.stderr, flush=True)\n            earlier = a.write_slices([src[0]]/' tests/test_ipc.py
grep -q "^import sys" tests/test_ipc.py || sed -i '1i import sys' tests/test_ipc.py
for mode in LAZY EAGER; do
CUDA_MODULE_LOADING=$mode timeout -s KILL 60 python3 -m pytest tests/test_ipc.py -m cuda -k $T -q -s -p no:cacheprovider --timeout 30 --timeout-method thread > $OUT/sw-$mode.txt 2>&1; echo $mode; grep iteration $OUT/sw-$mode.txt | tail -1; tail -1 $OUT/sw-$mode.txt
pkill -9 -f "multiprocessing" ; pkill -9 -f pytest
done
