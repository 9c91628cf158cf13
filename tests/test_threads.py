"""Where an engine's threads may run: the progress thread on its core, everything it starts
(rail threads, the provider's own progress threads) elsewhere. Threads inherit their creator's
affinity, so without care they all end up sharing the worker's one core."""
import collections
import os

import pytest
import torch

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


def started_by(provider: str, **env) -> collections.Counter:
    """Names of the threads that two engines of `provider` (2 rails each) start and keep, with
    `env` set, once a write between them has run (the cma route starts its copy threads then)."""
    torch.ones(1 << 20).add_(1)  # torch's own worker threads exist from here on
    before = threads()
    with pytest.MonkeyPatch.context() as mp:
        for name, value in env.items():
            mp.setenv(name, value)
        with p2p.Engine("cpu", **engine_kwargs(provider, num_rails=2)) as a, \
                p2p.Engine("cpu", **engine_kwargs(provider, num_rails=2)) as b:
            src, dst = torch.ones(1 << 20), torch.zeros(1 << 20)
            a.register(src)
            p2p.wait(a.write_slices([src], [b.register(dst).remote]), 30)
            assert torch.equal(dst, src)
            return collections.Counter(name for key, name in threads().items() if key not in before)


def test_rail_threads_setting():
    """tcp posts from one thread per rail; TORCH_P2P_RAIL_THREADS=0 keeps posting on the worker."""
    assert started_by("tcp")["p2p-rail0"] == 2
    assert started_by("tcp", TORCH_P2P_RAIL_THREADS="0")["p2p-rail0"] == 0


def test_manual_progress_starts_no_progress_threads():
    """TORCH_P2P_PROGRESS=manual: the provider's progress threads (unnamed) and the rail threads
    are not started; the worker drives both."""
    auto, manual = started_by("tcp"), started_by("tcp", TORCH_P2P_PROGRESS="manual")
    assert manual["p2p-worker"] == 2 and not any(n.startswith("p2p-rail") for n in manual), manual
    assert manual["python"] < auto["python"], (auto, manual)


def test_cma_threads_setting():
    """TORCH_P2P_CMA_THREADS=n: n copy threads per engine on the cma route (0: the worker copies)."""
    none, three = started_by("cma", TORCH_P2P_CMA_THREADS="0"), started_by("cma", TORCH_P2P_CMA_THREADS="3")
    assert three["p2p-copy"] - none["p2p-copy"] == 2 * 3, (none, three)  # copies.cpp names its threads
