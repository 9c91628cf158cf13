#!/bin/bash
# perf (Debian's, carried with its libraries) over bw.py's 256 x 4 KiB rows, plain and prepared.
export PYTHONUNBUFFERED=1
SECONDS=0
bash .device/build.sh > /tmp/b.txt 2>&1 || { tail -30 /tmp/b.txt; exit 1; }
echo built in $SECONDS s
export PYTHONPATH=$PWD
P=".device/perf/perf"; export LD_LIBRARY_PATH=$PWD/.device/perf/lib
cat /proc/sys/kernel/perf_event_paranoid; $P stat -e cpu-clock,task-clock true 2>&1 | tail -6
B=benchmarks/bw.py; E="--device cuda:0 --peer-device cuda:0 --sizes 4K --pages 256 --layouts paged --window 8 --ops write --baseline none"
for mode in plain prepared; do
  extra=""; [ $mode = prepared ] && extra="--prepared"
  PYTHONPERFSUPPORT=1 timeout -s KILL 120 $P record -e cpu-clock -F 20000 -g -o /tmp/$mode.data -- python3 $B $E --duration 4 $extra > $OUT/$mode-run.txt 2>&1
  grep -A3 "^op " $OUT/$mode-run.txt; tail -3 $OUT/$mode-run.txt
  pkill -9 -f multiprocessing
  $P report -i /tmp/$mode.data --no-children --sort pid,comm --stdio -g none 2>/dev/null | grep -v "^#" | grep -v "^$" | head -30 > $OUT/$mode-threads.txt
  cat $OUT/$mode-threads.txt | head -14
  $P report -i /tmp/$mode.data --no-children --sort pid,comm,dso,sym --percent-limit 0.3 --stdio -g none 2>/dev/null | grep -v "^#" | grep -v "^$" | head -150 > $OUT/$mode-syms.txt
  $P report -i /tmp/$mode.data --children --sort pid,comm,sym --percent-limit 2 --stdio -g none 2>/dev/null | grep -v "^#" | grep -v "^$" | head -150 > $OUT/$mode-children.txt
done
echo all done at $SECONDS s
