# Runs bw.py (arguments as given) under torch.profiler (CUDA activity: every kernel and copy of
# this process, the worker's included) and prints, per kernel / copy name, the count and the
# median duration, start-to-start period and idle gap over the middle half of its run.
import runpy, statistics, sys
import torch
from torch.profiler import ProfilerActivity, profile

sys.argv = ["bw.py"] + sys.argv[1:]
sys.path.insert(0, "benchmarks")
with profile(activities=[ProfilerActivity.CUDA]) as p:
    try:
        runpy.run_path("benchmarks/bw.py", run_name="__main__")
    except SystemExit:
        pass
by = {}
for e in p.events():
    if e.device_type == torch.autograd.DeviceType.CUDA:
        by.setdefault(e.name, []).append((e.time_range.start, e.time_range.end))
import json
for arg in sys.argv:
    if arg.endswith(".json"):
        print("rows (op, pages, Gbps, timed calls):", [(r["op"], r["pages"], round(r["gbps"]), r["calls"]) for r in json.load(open(arg))])
for name, ev in sorted(by.items(), key=lambda kv: -len(kv[1])):
    ev.sort()
    if len(ev) < 20:
        continue
    mid = ev[len(ev) // 4: 3 * len(ev) // 4]
    dur = statistics.median(b - a for a, b in mid)
    period = statistics.median(mid[i + 1][0] - mid[i][0] for i in range(len(mid) - 1))
    gap = statistics.median(mid[i + 1][0] - mid[i][1] for i in range(len(mid) - 1))
    print(f"{len(ev):7d} x {name[:70]:70s} dur {dur:7.2f} us  period {period:7.2f}  gap {gap:7.2f}")
