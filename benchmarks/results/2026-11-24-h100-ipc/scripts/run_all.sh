#!/bin/bash
# One device call: build, GPU tests, the IPC route's bw.py rows (cuda:0 -> cuda:0 on one GPU).
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
bash .device/build.sh || exit 1
D="--device cuda:0 --peer-device ${PEER:-cuda:0}"
if [ -z "$NOTESTS" ]; then
  timeout 420 python3 -m pytest tests/test_ipc.py tests/test_cuda.py tests/test_kv.py tests/test_weights.py -m cuda -q -p no:cacheprovider > $OUT/gputests.txt 2>&1
  tail -4 $OUT/gputests.txt
fi
B=benchmarks/bw.py
for r in 1 2; do
  timeout 120 python3 $B $D --sizes 4K --pages 256 4096 --layouts paged --window 8 --duration 0.5 --baseline memcpy --json $OUT/bw4k-$r.json 2>/dev/null | tail -5
  timeout 120 python3 $B $D --sizes 4K --pages 256 4096 --layouts paged --window 8 --duration 0.5 --baseline memcpy --prepared --json $OUT/bw4k-prep-$r.json 2>/dev/null | tail -5
done
timeout 150 python3 $B $D --sizes 64K 64M --pages 1 256 --max-bytes 64M --window 8 --duration 0.5 --baseline memcpy --json $OUT/bw-64k-64m.json 2>/dev/null | tail -8
timeout 100 python3 $B $D --sizes 4K --pages 1 --layouts contiguous --window 1 --duration 1 --baseline none --json $OUT/lat.json 2>/dev/null | tail -3
python3 -c "import json; [print(r['op'], 'p50', round(r.get('latency_p50_us',0),1), 'p99', round(r.get('latency_p99_us',0),1)) for r in json.load(open('$OUT/lat.json'))]"
