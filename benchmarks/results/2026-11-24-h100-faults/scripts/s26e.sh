#!/bin/bash
# Session 26, call 6: stream_wait's index finds the call (a GPU-side wait, not a host wait), and
# the IPC GPU tests on the final tree.
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
SECONDS=0
bash .device/build.sh > /tmp/b.txt 2>&1 || { tail -30 /tmp/b.txt; exit 1; }
echo built in $SECONDS s
timeout -s KILL 300 python3 -m pytest tests/test_ipc.py -m cuda -p no:cacheprovider --timeout 100 --timeout-method thread -q -rs 2>&1 | tail -15 > $OUT/6-ipc-tests.txt
tail -3 $OUT/6-ipc-tests.txt
pkill -9 -f multiprocessing
echo all done at $SECONDS s
# A variant whose find() never finds its call: the new test should fail (host wait).
python3 - <<'PY'
p = "csrc/engine/futures.h"
s = open(p).read()
old = "    auto it = ids_.find(future.get());\n    if (it == ids_.end()) return false;"
assert old in s
open(p, "w").write(s.replace(old, "    auto it = ids_.find(future.get());\n    if (true) return false;  // variant: never found"))
PY
bash .device/build.sh > /tmp/b.txt 2>&1 || { tail -30 /tmp/b.txt; exit 1; }
echo variant built at $SECONDS s
timeout -s KILL 100 python3 -m pytest tests/test_ipc.py::test_ipc_stream_wait_waits_on_the_gpu_not_the_host -p no:cacheprovider --timeout 60 --timeout-method thread -q -rs 2>&1 | tail -6 > $OUT/6-never-found-variant.txt
tail -3 $OUT/6-never-found-variant.txt
pkill -9 -f multiprocessing
echo all done at $SECONDS s
