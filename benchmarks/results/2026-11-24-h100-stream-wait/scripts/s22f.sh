#!/bin/bash
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
bash .device/build.sh || exit 1
timeout -s KILL 100 python3 -m pytest tests/test_cuda.py tests/test_ipc.py -m cuda -p no:cacheprovider --timeout 60 --timeout-method thread -k "stream" -v > $OUT/focus.txt 2>&1; grep -E "PASSED|FAILED|SKIPPED|ERROR|passed|failed|^E " $OUT/focus.txt | cut -c1-200 | tail -12
pkill -9 -f "multiprocessing" ; pkill -9 -f pytest
B=benchmarks/bw.py; D="--device cuda:0 --peer-device cuda:0"
run() { name=$1; shift; timeout -s KILL 90 python3 $B $D "$@" --json $OUT/$name.json > $OUT/$name.txt 2>&1; grep -A12 "^op " $OUT/$name.txt; pkill -9 -f multiprocessing; }
for r in 1 2; do
  run bw4k-$r --sizes 4K --pages 256 4096 --layouts paged --window 8 --duration 0.5 --baseline memcpy
  run bw4k-prep-$r --sizes 4K --pages 256 4096 --layouts paged --window 8 --duration 0.5 --baseline memcpy --prepared
done
run bw-64k-64m --sizes 64K 64M --pages 1 256 --max-bytes 64M --window 8 --duration 0.5 --baseline memcpy
run lat --sizes 4K --pages 1 --layouts contiguous --window 1 --duration 1 --baseline none
python3 -c "import json; [print(r['op'], 'p50', round(r.get('latency_p50_us',0),1), 'p99', round(r.get('latency_p99_us',0),1)) for r in json.load(open('$OUT/lat.json'))]"
