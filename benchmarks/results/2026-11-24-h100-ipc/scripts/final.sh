#!/bin/bash
# The final tree: the stream-wait test, the GPU tests, the 4 KiB rows and the 4 KiB latency.
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
bash .device/build.sh || exit 1
T=test_ipc_a_call_after_a_stream_wait_for_an_earlier_one
timeout -s KILL 120 python3 -m pytest tests/test_ipc.py -m cuda -k $T -q -p no:cacheprovider > $OUT/stream-wait-test.txt 2>&1; tail -1 $OUT/stream-wait-test.txt
timeout -s KILL 400 python3 -m pytest tests/test_ipc.py tests/test_cuda.py tests/test_kv.py tests/test_weights.py -m cuda -q -p no:cacheprovider > $OUT/gputests.txt 2>&1; tail -1 $OUT/gputests.txt
for r in 1 2; do timeout -s KILL 120 python3 benchmarks/bw.py --device cuda:0 --peer-device cuda:0 --sizes 4K --pages 256 4096 --layouts paged --window 8 --duration 0.5 --baseline memcpy --json $OUT/bw4k-$r.json > $OUT/bw4k-$r.txt 2>/dev/null; tail -4 $OUT/bw4k-$r.txt; done
timeout -s KILL 60 python3 benchmarks/bw.py --device cuda:0 --peer-device cuda:0 --sizes 4K --pages 1 --layouts contiguous --window 1 --duration 1 --baseline none --json $OUT/lat.json > /dev/null 2>&1
python3 -c "import json; [print(r['op'], 'p50', round(r['latency_p50_us'],1), 'p99', round(r['latency_p99_us'],1)) for r in json.load(open('$OUT/lat.json'))]"
