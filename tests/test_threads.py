"""Where an engine's threads may run: the progress thread on its core, everything it starts
(rail threads, the provider's own progress threads) elsewhere. Threads inherit their creator's
affinity, so without care they all end up sharing the worker's one core."""
import os

import pytest

import torch_p2p as p2p
from conftest import engine_kwargs


def threads() -> dict[tuple[int, int], str]:
    """Live threads by (tid, start time): a tid alone may be reused by a new thread."""
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = f.read().strip()
            with open(f"/proc/self/task/{tid}/stat") as f:
                start = int(f.read().rsplit(")", 1)[1].split()[19])
        except OSError:
            continue  # the thread ended
        out[(int(tid), start)] = name
    return out


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs")
def test_only_the_worker_is_pinned():
    core = min(os.sched_getaffinity(0))
    before = threads()
    with p2p.Engine("cpu", num_rails=3, cpus=[core], **engine_kwargs("tcp")):
        started = {tid: name for (tid, start), name in threads().items() if (tid, start) not in before}
        affinity = {tid: os.sched_getaffinity(tid) for tid in started}
    workers = [tid for tid, name in started.items() if name == "p2p-worker"]
    rails = [tid for tid, name in started.items() if name.startswith("p2p-rail")]
    assert len(workers) == 1 and affinity[workers[0]] == {core}
    assert len(rails) == 3  # tcp: one rail thread per rail
    others = [tid for tid in started if tid not in workers]
    assert others and all(affinity[tid] != {core} for tid in others), \
        {started[t]: sorted(affinity[t]) for t in others}
