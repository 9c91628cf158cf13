#!/bin/bash
# Session 28, call 2: every GPU test (system libfabric 1.17; peer on cuda:1 where there are two GPUs).
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
SECONDS=0
ls torch_p2p/_C*.so >/dev/null 2>&1 || bash .device/build.sh > /tmp/b.txt 2>&1 || { tail -30 /tmp/b.txt; exit 1; }
timeout -s KILL 500 python3 -m pytest -m cuda -p no:cacheprovider --timeout 100 --timeout-method thread -q -rs --durations 5 > $OUT/2-gpu-tests.txt 2>&1; tail -14 $OUT/2-gpu-tests.txt
pkill -9 -f multiprocessing
echo all done at $SECONDS s
