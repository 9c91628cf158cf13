#!/bin/bash
# Page kernel with per-turn pair reads: kernel timeline (and kernels per call), then the GPU tests.
export PYTHONUNBUFFERED=1
SECONDS=0
bash .device/build.sh > /tmp/b.txt 2>&1 || { tail -30 /tmp/b.txt; exit 1; }
echo built in $SECONDS s
export PYTHONPATH=$PWD
K="--device cuda:0 --peer-device cuda:0 --sizes 4K --layouts paged --ops write --baseline memcpy --duration 0.3"
for args in "--pages 256 --window 8" "--pages 4096 --window 8" "--pages 256 --window 32 --prepared" "--pages 16 --window 32"; do
  echo "== $args"
  timeout -s KILL 60 python3 .device/kprof.py $K $args --json /tmp/k.json 2>/tmp/kerr.txt | grep -v "^ *$" | grep " x \|latency\|rows"
  pkill -9 -f multiprocessing
done 2>&1 | tee $OUT/kprof.txt
echo kprof done at $SECONDS s
timeout -s KILL 330 python3 -m pytest tests/test_ipc.py tests/test_cuda.py tests/test_kv.py tests/test_weights.py -m cuda -p no:cacheprovider --timeout 100 --timeout-method thread -q -rs > $OUT/gputests.txt 2>&1; tail -12 $OUT/gputests.txt
echo tests done at $SECONDS s
