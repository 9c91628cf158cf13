#!/bin/bash
# Old (the session's start, 7156bef) against new, built side by side on one machine, run alternately.
export PYTHONUNBUFFERED=1
mkdir -p /tmp/old && tar -xf .device/old.tar -C /tmp/old && cp -r .device /tmp/old/ && rm -f /tmp/old/.device/old.tar
dpkg -x .device/libfabric-dev_*.deb /tmp/lf && mkdir -p /tmp/lf/usr/lib64 &&
  ln -sf "$(ls /usr/lib/x86_64-linux-gnu/libfabric.so.1* | head -1)" /tmp/lf/usr/lib64/libfabric.so
(MAX_JOBS=8 bash .device/build.sh > /tmp/new.log 2>&1; echo new built: $?; tail -5 /tmp/new.log) &
(cd /tmp/old && BUILD_LOG=/tmp/oldbuild.log MAX_JOBS=8 bash .device/build.sh > /tmp/oldb.log 2>&1; echo old built: $?; tail -5 /tmp/oldb.log /tmp/oldbuild.log) &
wait
D="--device cuda:0 --peer-device cuda:0 --sizes 4K --pages 256 4096 --layouts paged --window 8 --duration 0.5 --baseline memcpy"
for r in 1 2; do
  for tree in old new; do
    dir=$PWD; [ $tree = old ] && dir=/tmp/old
    for prep in "" --prepared; do
      echo "== $tree $prep run $r"
      (cd $dir && PYTHONPATH=$dir timeout 120 python3 benchmarks/bw.py $D $prep --json $OUT/ab-$tree${prep:+-prep}-$r.json 2>/dev/null | tail -4)
    done
  done
done
