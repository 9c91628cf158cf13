#!/bin/bash
# Kernel timeline of steady 256 x 4 KiB writes (torch.profiler in the initiator): is the GPU the bound?
export PYTHONUNBUFFERED=1
bash .device/build.sh || exit 1
export PYTHONPATH=$PWD
D="--device cuda:0 --peer-device cuda:0 --sizes 4K --layouts paged --ops write --baseline memcpy --duration 0.3"
for args in "--pages 256 --window 8" "--pages 256 --window 8 --prepared" "--pages 256 --window 1" "--pages 4096 --window 8"; do
  echo "== $args"
  timeout -s KILL 90 python3 .device/kprof.py $D $args --json /tmp/k.json 2>/tmp/kerr.txt | grep -v "^ *$" | tail -12
  python3 -c "import json;print([(r['pages'],round(r['gbps']),round(r['baseline_gbps'])) for r in json.load(open('/tmp/k.json'))])"
  pkill -9 -f multiprocessing
done 2>&1 | tee $OUT/kprof.txt
