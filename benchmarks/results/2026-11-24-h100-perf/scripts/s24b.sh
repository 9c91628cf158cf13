#!/bin/bash
# perf over steady 256 x 4 KiB IPC calls only (pprof.py attaches it mid-run).
export PYTHONUNBUFFERED=1
SECONDS=0
bash .device/build.sh > /tmp/b.txt 2>&1 || { tail -30 /tmp/b.txt; exit 1; }
echo built in $SECONDS s
export PYTHONPATH=$PWD
P=$PWD/.device/perf/perf; export LD_LIBRARY_PATH=$PWD/.device/perf/lib
PYTHONPERFSUPPORT=1 timeout -s KILL 120 python3 .device/pprof.py $P $OUT | tee $OUT/run.txt
pkill -9 -f multiprocessing
main=$(grep -o "main tid [0-9]*" $OUT/run.txt | awk '{print $3}')
for mode in plain prepared; do
  D=/tmp/$mode.data
  { echo "== threads"; $P report -i $D --no-children --sort pid,comm --stdio -g none 2>/dev/null | grep -E "^ +[0-9]" | head -12
    echo "== main thread, children"; $P report -i $D --tid=$main --children --sort sym --stdio -g none --percent-limit 1.5 2>/dev/null | grep -E "^ +[0-9]" | head -70
    echo "== main thread, self"; $P report -i $D --tid=$main --no-children --sort dso,sym --stdio -g none --percent-limit 0.7 2>/dev/null | grep -E "^ +[0-9]" | head -50
  } > $OUT/$mode-main.txt
  { echo "== worker, children"; $P report -i $D --comm=p2p-worker --children --sort sym --stdio -g none --percent-limit 1.5 2>/dev/null | grep -E "^ +[0-9]" | head -60
    echo "== worker, self"; $P report -i $D --comm=p2p-worker --no-children --sort dso,sym --stdio -g none --percent-limit 0.7 2>/dev/null | grep -E "^ +[0-9]" | head -50
    echo "== others, self"; $P report -i $D --comm=python3 --no-children --sort pid,dso,sym --stdio -g none --percent-limit 0.5 2>/dev/null | grep -E "^ +[0-9]" | grep -v " $main:" | head -40
  } > $OUT/$mode-worker.txt
  head -8 $OUT/$mode-main.txt
done
echo all done at $SECONDS s
