#!/bin/bash
# The IPC batch hazard: the tree with shared launches (batched.tar) against the current one, on
# the new test; then the current tree's GPU tests and 4 KiB rows.
export PYTHONUNBUFFERED=1
mkdir -p /tmp/batched && tar -xf .device/batched.tar -C /tmp/batched && cp -r .device /tmp/batched/ && rm -f /tmp/batched/.device/*.tar
cp tests/test_ipc.py /tmp/batched/tests/
dpkg -x .device/libfabric-dev_*.deb /tmp/lf && mkdir -p /tmp/lf/usr/lib64 &&
  ln -sf "$(ls /usr/lib/x86_64-linux-gnu/libfabric.so.1* | head -1)" /tmp/lf/usr/lib64/libfabric.so
(MAX_JOBS=8 bash .device/build.sh > /tmp/new.log 2>&1; echo current built: $?) &
(cd /tmp/batched && BUILD_LOG=/tmp/bbuild.log MAX_JOBS=8 bash .device/build.sh > /tmp/bb.log 2>&1; echo batched built: $?) &
wait
T=test_ipc_a_call_after_a_stream_wait_for_an_earlier_one
echo "== batched tree"; (cd /tmp/batched && PYTHONPATH=/tmp/batched timeout 200 python3 -m pytest tests/test_ipc.py -m cuda -k $T -q -p no:cacheprovider -x 2>&1 | tail -4)
echo "== current tree"; PYTHONPATH=$PWD timeout 200 python3 -m pytest tests/test_ipc.py -m cuda -k $T -q -p no:cacheprovider 2>&1 | tail -2
PYTHONPATH=$PWD timeout 400 python3 -m pytest tests/test_ipc.py tests/test_cuda.py tests/test_kv.py tests/test_weights.py -m cuda -q -p no:cacheprovider > $OUT/gputests.txt 2>&1; tail -2 $OUT/gputests.txt
for r in 1 2; do PYTHONPATH=$PWD timeout 120 python3 benchmarks/bw.py --device cuda:0 --peer-device cuda:0 --sizes 4K --pages 256 4096 --layouts paged --window 8 --duration 0.5 --baseline memcpy --json $OUT/bw4k-$r.json 2>/dev/null | tail -4; done
