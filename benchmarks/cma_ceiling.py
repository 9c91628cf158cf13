"""cma_ceiling.py: what the kernel's cross-memory attach moves between two processes, without
the engine: the ceiling of the cma route (csrc/routes/host_cma/).

    python benchmarks/cma_ceiling.py
    python benchmarks/cma_ceiling.py --sizes 4K 64K --pages 256 --threads 1 2 4 8 --seconds 0.5

A child process holds a buffer of 2 x `pages` pages; this process copies `pages` random pages of
its own buffer to random pages of the child's (write, process_vm_writev) or back (read,
process_vm_readv), one system call per call as the route makes them (one iovec per page), from
1 or more threads at once. Each call is checked to move every byte. Rows: GB/s over all threads,
and microseconds per call on one thread.
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import random
import sys
import threading
import time

import torch

try:
    from torch_p2p import _C
except ImportError:  # run from a checkout without installing: use the in-place build
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from torch_p2p import _C
from _processes import exit_on_sigterm, reap, spawn
from _table import parse_size


def hold(nbytes: int, queue, done) -> None:
    """The child: a buffer the parent copies into and out of, until told to stop."""
    buf = torch.ones(nbytes, dtype=torch.uint8)
    queue.put((os.getpid(), buf.data_ptr()))
    done.wait()


def rate(pid: int, calls: list, write: bool, threads: int, seconds: float) -> tuple[float, float]:
    """(GB/s over all threads, us per call on one thread) of `threads` threads copying `calls`."""
    counts = [0] * threads

    def work(k: int) -> None:
        t0, i = time.perf_counter(), 0
        while time.perf_counter() - t0 < seconds:
            error = _C._cma_copy(pid, calls[i % len(calls)], write)
            if error:
                raise OSError(error, os.strerror(error))
            i += 1
        counts[k] = i

    workers = [threading.Thread(target=work, args=(k,)) for k in range(threads)]
    t0 = time.perf_counter()
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    elapsed = time.perf_counter() - t0
    n = sum(counts)
    moved = n * sum(length for _, _, length in calls[0])
    return moved / elapsed / 1e9, elapsed / max(n, 1) * threads * 1e6


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", nargs="+", type=parse_size, default=[4 << 10, 64 << 10], metavar="SIZE")
    ap.add_argument("--pages", type=int, default=256, help="pages per call (default 256)")
    ap.add_argument("--threads", nargs="+", type=int, default=[1, 2, 4, 8], metavar="N")
    ap.add_argument("--seconds", type=float, default=0.5, help="per row (default 0.5)")
    args = ap.parse_args(argv)
    ctx = mp.get_context("spawn")
    print(f"# process_vm_writev / readv, {args.pages} random pages a call, {os.cpu_count()} cores")
    print(f"{'op':5}  {'page':>6}  {'threads':>7}  {'GB/s':>7}  {'us/call':>8}")
    for size in args.sizes:
        queue, done = ctx.Queue(), ctx.Event()
        child = spawn(hold, (2 * args.pages * size, queue, done), "cma-holder")
        try:
            pid, remote = queue.get(timeout=60)
            local = torch.ones(2 * args.pages * size, dtype=torch.uint8)
            rng = random.Random(size)
            calls = []
            for _ in range(16):
                mine = rng.sample(range(2 * args.pages), args.pages)
                theirs = rng.sample(range(2 * args.pages), args.pages)
                calls.append([(local.data_ptr() + m * size, remote + t * size, size) for m, t in zip(mine, theirs)])
            for write in (True, False):
                for threads in args.threads:
                    gbs, us = rate(pid, calls, write, threads, args.seconds)
                    print(f"{'write' if write else 'read':5}  {size >> 10:4}KiB  {threads:7}  {gbs:7.2f}  {us:8.1f}", flush=True)
        finally:
            done.set()
            reap([child], 10)
    return 0


if __name__ == "__main__":
    exit_on_sigterm()
    sys.exit(main())
