#!/bin/bash
# Session 25, call 5 (nvidia-h200, one GPU): HEAD's IPC GPU tests, then bw.py's IPC rows.
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
SECONDS=0
nvidia-smi --query-gpu=name --format=csv,noheader; lscpu | grep -E "Model name|^CPU\(s\)"
bash .device/build.sh > /tmp/b.txt 2>&1 || { tail -30 /tmp/b.txt; exit 1; }
echo built in $SECONDS s
timeout -s KILL 200 python3 -m pytest tests/test_ipc.py -m cuda -p no:cacheprovider --timeout 100 --timeout-method thread -q -rs 2>&1 | tail -2 | tee $OUT/1-ipc-tests.txt
pkill -9 -f multiprocessing
B=benchmarks/bw.py; E="--device cuda:0 --peer-device cuda:0"
run() { name=$1; shift; timeout -s KILL 120 python3 $B $E "$@" --json $OUT/$name.json > /tmp/$name.txt 2>&1; grep -A8 "^op " /tmp/$name.txt; pkill -9 -f multiprocessing; }
run 2-bw4k --sizes 4K --pages 256 4096 --layouts paged --window 8 --duration 0.5 --baseline memcpy
run 3-bw4k-prep --sizes 4K --pages 256 4096 --layouts paged --window 8 --duration 0.5 --baseline memcpy --prepared
run 4-bw64k-64m --sizes 64K 64M --pages 1 256 --layouts paged contiguous --window 8 --duration 0.5 --baseline memcpy --max-bytes 64M
run 5-lat --sizes 4K --pages 1 --layouts contiguous --window 1 --duration 1 --baseline none
python3 -c "import json; [print(r['op'], 'p50', round(r['latency_p50_us'],1), 'p99', round(r['latency_p99_us'],1)) for r in json.load(open('$OUT/5-lat.json'))]"
echo all done at $SECONDS s
