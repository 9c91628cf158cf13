"""Steps of the failure tests, run inside the child that hosts the engine under test (a Peer,
tests/peer.py): an engine whose shm peer was killed can spin forever inside libfabric (see
test_dead_peers.py), so the engine under test lives in a child that the parent can kill. Each
step takes `state` first and reports facts (exception names, counts, times) for the test.

Times that cross processes are time.monotonic(): one clock for every process of the machine.
"""
from __future__ import annotations

import os
import threading
import time

import torch

import torch_p2p as p2p
from conftest import engine_kwargs
from peer import shm_endpoint_files
from peer_helpers import error_name, exception_of, outcomes, pattern, taken_by_worker


class Stream:
    """Keeps `depth` writes of `src` to `remote` outstanding until one fails or stop() is
    called; records when each future completed (time.monotonic())."""

    def __init__(self, engine, src, remote, depth=8):
        self.engine, self.src, self.remote = engine, src, remote
        self.futures, self.done_at = [], {}
        self.failed, self._stop = threading.Event(), threading.Event()
        self._slots = threading.Semaphore(depth)
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        while not self._stop.is_set() and not self.failed.is_set():
            if not self._slots.acquire(timeout=0.1):
                continue
            fut = self.engine.write_slices(self.src, [self.remote])
            i = len(self.futures)
            self.futures.append(fut)
            fut.add_done_callback(lambda f, i=i: self._done(i, f))

    def _done(self, i, fut):
        self.done_at[i] = time.monotonic()
        if failed(fut):
            self.failed.set()
        self._slots.release()

    def completed_ok(self) -> int:
        return sum(1 for i, f in enumerate(list(self.futures)) if i in self.done_at and not failed(f))

    def stop(self):
        self._stop.set()
        self.thread.join(10)


def failed(fut) -> bool:
    """True if a done future holds an exception."""
    return exception_of(fut) is not None


def local(state, name: str, nbytes: int, seed: int | None = None) -> None:
    """Registers a local tensor `name`: zeros, or pattern(seed)."""
    state[name] = torch.zeros(nbytes, dtype=torch.uint8) if seed is None else pattern(seed, nbytes)
    state[name + ".region"] = state["engine"].register(state[name])


def write(state, name: str, remote_bytes: bytes, timeout: float = 10) -> None:
    p2p.wait(state["engine"].write_slices(state[name], [p2p.RemoteTensor.from_bytes(remote_bytes)]), timeout)


def write_read_back(state, src: str, out: str, remote_bytes: bytes, timeout: float) -> bool:
    """Adds 1 to every byte of `src`, writes it to the remote, reads it back into `out`;
    returns whether `out` then equals `src`."""
    e, remote = state["engine"], p2p.RemoteTensor.from_bytes(remote_bytes)
    state[src].add_(1)
    state[out].zero_()
    p2p.wait(e.write_slices(state[src], [remote]), timeout)
    p2p.wait(e.read_slices(state[out], [remote]), timeout)
    return bool(torch.equal(state[out], state[src]))


def route_to(state, remote_bytes: bytes) -> str:
    return state["engine"].route(p2p.RemoteTensor.from_bytes(remote_bytes))


def issue(state, ops: list) -> float:
    """Starts operations without waiting for them: ("write" | "read", local name, remote
    bytes), ("send", address, payload) or ("connect", address). Their futures join those that
    settle() waits for. Returns when the first was issued."""
    e, issued = state["engine"], state.setdefault("issued", [])
    start = time.monotonic()
    for op, *args in ops:
        if op in ("write", "read"):
            name, remote_bytes = args
            move = e.write_slices if op == "write" else e.read_slices
            issued.append(move(state[name], [p2p.RemoteTensor.from_bytes(remote_bytes)]))
        else:
            issued.append(getattr(e, op)(*args))
    return start


def taken(state) -> None:
    """Returns once the engine's worker has taken every operation issued so far (taken_by_worker)."""
    taken_by_worker(state["engine"])


def start_stream(state, name: str, remote_bytes: bytes) -> None:
    """Starts a Stream of writes of `name` to the remote."""
    state["stream"] = Stream(state["engine"], state[name], p2p.RemoteTensor.from_bytes(remote_bytes))


def stream_going(state, writes: int, timeout: float = 20) -> int:
    """Waits (up to `timeout`) until `writes` writes of the stream succeeded; returns how many did."""
    stream, deadline = state["stream"], time.monotonic() + timeout
    while stream.completed_ok() < writes and time.monotonic() < deadline:
        time.sleep(0.02)
    return stream.completed_ok()


def mark_in_flight(state) -> int:
    """Notes the stream's writes in flight now (settle() says whether they ended); returns how many."""
    state["marked"] = [f for f in list(state["stream"].futures) if not f.done()]
    return len(state["marked"])


def worker_stalls(state, address: bytes) -> bool:
    """Sends a small probe to `address` (settle() waits for it too) and tells whether our
    worker then stalls: a recv(timeout=0.1), which completes only while the worker runs, is
    still pending 1 s later."""
    e = state["engine"]
    state.setdefault("issued", []).append(e.send(address, b"probe"))
    tick = e.recv(timeout=0.1)
    end = time.monotonic() + 1.0
    while not tick.done() and time.monotonic() < end:
        time.sleep(0.01)
    return not tick.done()


def settle(state, timeout: float) -> dict:
    """Waits (up to `timeout` in all) for the stream's writes started so far and every issued
    operation, then stops the stream and forgets them. Returns each one's exception type name
    ("pending" if not done, None if it succeeded), their distinct messages, whether the marked
    writes ended, and when the last one ended (time.monotonic())."""
    stream = state.pop("stream", None)
    futures = (list(stream.futures) if stream else []) + state.pop("issued", [])
    errors = outcomes(futures, timeout)
    ended = time.monotonic()
    if stream:
        stream.stop()
        ended = max([ended] + list(stream.done_at.values()))
    return {"errors": [error_name(x) for x in errors],
            "messages": sorted({str(x) for x in errors if x and not isinstance(x, str)})[:3],
            "marked_done": all(f.done() for f in state.pop("marked", [])),
            "ended": ended}


def start_churn(state) -> None:
    """A thread registers tensors and deregisters them until stop_churn()."""
    e = state["engine"]
    state["churn"] = churn = {"count": 0, "stop": threading.Event()}

    def run():
        while not churn["stop"].is_set():
            e.register(torch.zeros(1024)).close(timeout=5)
            churn["count"] += 1

    churn["thread"] = threading.Thread(target=run, daemon=True)
    churn["thread"].start()


def stop_churn(state) -> int:
    """Stops the thread of start_churn(); returns how many tensors it registered."""
    churn = state.pop("churn")
    churn["stop"].set()
    churn["thread"].join(30)
    return churn["count"]


def writes_to_self(state, seconds: float) -> int:
    """For `seconds`, writes into the engine's own region; returns how many writes were done."""
    e = state["engine"]
    src, dst = torch.ones(4096, dtype=torch.uint8), torch.zeros(4096, dtype=torch.uint8)
    regions = [e.register(src), e.register(dst)]
    writes, deadline = 0, time.monotonic() + seconds
    try:
        while time.monotonic() < deadline:
            p2p.wait(e.write_slices(src, [regions[1].remote]), 10)
            writes += 1
    finally:
        for r in regions:
            r.close(timeout=5)
    return writes


def closed_engine_address(state, provider: str) -> bytes:
    """The address of an engine that this process opened and closed."""
    gone = p2p.Engine("cpu", **engine_kwargs(provider))
    address = gone.address
    gone.close()
    return address


def close_two_at_once(state, provider: str, rounds: int) -> int:
    """Two engines of this process, each with writes, reads and messages to the other in
    flight, closed at the same time from two threads, `rounds` times. Returns how many of
    their futures were still pending afterwards (a crash ends the process)."""
    pending = 0
    for _ in range(rounds):
        a, b = (p2p.Engine("cpu", **engine_kwargs(provider, peer_timeout=2)) for _ in range(2))
        ra, rb = (e.register(torch.zeros(1 << 20, dtype=torch.uint8)).remote for e in (a, b))
        sa, sb = torch.ones(4096, dtype=torch.uint8), torch.ones(4096, dtype=torch.uint8)
        a.register(sa)
        b.register(sb)
        p2p.wait(a.connect(b.address), 10)
        p2p.wait(b.connect(a.address), 10)
        futures = [a.write_slices(sa, [rb[:4096]]) for _ in range(100)] + \
            [b.read_slices(sb, [ra[:4096]]) for _ in range(100)] + \
            [a.send(b.address, b"a") for _ in range(20)] + [b.send(a.address, b"b") for _ in range(20)]
        closing = threading.Thread(target=b.close)
        closing.start()
        a.close()
        closing.join()
        pending += outcomes(futures, 0).count("pending")
    return pending


def own_shm_files(state) -> list[int]:
    """How many shm endpoint files of this process exist: with two shm engines open, once the
    first has closed, once both have."""
    def count():
        return len(shm_endpoint_files(os.getpid()))

    a, b = (p2p.Engine("cpu", **engine_kwargs("shm")) for _ in range(2))
    counts = [count()]
    b.close()
    counts.append(count())
    a.close()
    return counts + [count()]
