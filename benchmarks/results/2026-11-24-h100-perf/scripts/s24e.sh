#!/bin/bash
# perf of the submitting thread only, by library and by symbol, with (ev=0) and without (ev=2) the stream check.
export PYTHONUNBUFFERED=1
SECONDS=0
bash .device/build.sh > /tmp/b.txt 2>&1 || { tail -30 /tmp/b.txt; exit 1; }
echo built in $SECONDS s
export PYTHONPATH=$PWD
P=$PWD/.device/perf/perf; export LD_LIBRARY_PATH=$PWD/.device/perf/lib
for ev in 0 2; do
  P2P_EV=$ev PYTHONPERFSUPPORT=1 timeout -s KILL 120 python3 .device/pprof.py $P $OUT > $OUT/run-ev$ev.txt 2>&1; cat $OUT/run-ev$ev.txt | grep -v route
  pkill -9 -f multiprocessing
  main=$(grep -o "main tid [0-9]*" $OUT/run-ev$ev.txt | awk '{print $3}')
  D=/tmp/plain.data
  { echo "== main thread by dso (relative)"; $P report -i $D --tid=$main --percentage relative --no-children --sort dso --stdio -g none 2>/dev/null | grep -E "^ +[0-9]" | head -20
    echo "== main thread by sym (relative)"; $P report -i $D --tid=$main --percentage relative --no-children --sort dso,sym --stdio -g none --percent-limit 0.4 2>/dev/null | grep -E "^ +[0-9]" | head -90
    echo "== main thread, callers into the kernel"; $P report -i $D --tid=$main --percentage relative --children --sort sym --stdio -g none --percent-limit 1 2>/dev/null | grep -E "^ +[0-9]" | grep -E "\[k\]|futex|sched|syscall|Future|wait|GIL|gil|take_gil|drop_gil" | head -30
  } > $OUT/ev$ev-main.txt
  head -14 $OUT/ev$ev-main.txt
done
echo all done at $SECONDS s
