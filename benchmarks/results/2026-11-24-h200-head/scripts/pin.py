"""bw.py with its calling thread pinned to one core that no engine claimed (PIN_CALLER=1), or as
is (PIN_CALLER=0): does the calling thread's placement set the cost of a small call? Run from
the repository root with bw.py's arguments."""
import os
import runpy
import sys
import threading

sys.path.insert(0, "benchmarks")  # bw.py imports _baselines from beside it

import torch_p2p as p2p

_init = p2p.Engine.__init__


def _claimed() -> set[int]:
    with open("/proc/net/unix") as f:
        return {int(line.split("/cpu/")[1]) for line in f if "@torch_p2p/cpu/" in line}


def init(self, *args, **kwargs):
    _init(self, *args, **kwargs)
    if os.environ.get("PIN_CALLER") == "1" and threading.current_thread() is threading.main_thread():
        free = sorted(set(os.sched_getaffinity(0)) - _claimed() - {0})
        os.sched_setaffinity(0, {free[-1]})  # 0: this thread only
        print(f"caller pinned to cpu {free[-1]}; claimed {sorted(_claimed())}", file=sys.stderr, flush=True)


p2p.Engine.__init__ = init
sys.argv = ["benchmarks/bw.py"] + sys.argv[1:]
runpy.run_path("benchmarks/bw.py", run_name="__main__")
