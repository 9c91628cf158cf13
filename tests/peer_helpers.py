"""Helpers for the peer, failure, security, fuzz and soak tests.

  - handles with fields changed (`tampered`), written by the engine's own encoders
    (torch_p2p._C._encode_remote) so that every CRC is right and the engine's local checks pass;
  - functions that run inside Peer children (tests/peer.py): each takes `state` first.
"""
from __future__ import annotations

import os
import signal
import socket
import time
import zlib

import torch

import torch_p2p as p2p
from conftest import engine_kwargs
from torch_p2p import _C

# -- forged handles ----------------------------------------------------------------------------

READ, WRITE = 1, 2  # access bits (csrc/engine/address.h)


def tampered(remote: p2p.RemoteTensor, **changes) -> p2p.RemoteTensor:
    """A copy of `remote` with region fields (access, nbytes, entries, ...) or view fields
    (shape, strides, offset, dtype) changed and every CRC recomputed; the names are those of
    _C._decode_remote."""
    fields = _C._decode_remote(remote.to_bytes())
    for key, value in changes.items():
        target = fields if key in fields else fields["region"]
        if key not in target:
            raise KeyError(key)
        target[key] = value
    return p2p.RemoteTensor.from_bytes(_C._encode_remote(fields))


# -- misc --------------------------------------------------------------------------------------

def free_port() -> int:
    """A loopback TCP port that nobody listens on right now."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_all(futures, timeout: float) -> list:
    """Waits for every future (up to `timeout` in all); returns each one's exception or None.
    A future still pending at the deadline makes this raise AssertionError."""
    deadline = time.monotonic() + timeout
    out = []
    for fut in futures:
        try:
            p2p.wait(fut, max(0.0, deadline - time.monotonic()))
            out.append(None)
        except p2p.TimeoutError as exc:
            if not fut.done():
                raise AssertionError(f"a future is still pending after {timeout} s") from exc
            out.append(exc)
        except Exception as exc:  # noqa: BLE001 - returned to the test
            out.append(exc)
    return out


def pattern(seed: int, nbytes: int) -> torch.Tensor:
    """Deterministic pseudo-random bytes (both processes can regenerate them)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)


def stop(pid: int) -> None:
    """SIGSTOP: the peer keeps its sockets and memory but makes no progress. Returns once it
    has stopped: kill() returns before that, and a write posted in between could still be
    taken (seen: test_engine_usable_after_peer_died_mid_transfer, a "doomed" write that
    succeeded, about 1 run in 6)."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        if all(_task_state(pid, task) in ("T", "t", None) for task in os.listdir(f"/proc/{pid}/task")):
            return
        time.sleep(0.001)
    raise TimeoutError(f"process {pid} did not stop within 5 s of SIGSTOP")


def _task_state(pid: int, task: str) -> str | None:
    try:
        with open(f"/proc/{pid}/task/{task}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:  # the thread exited
        return None


def resume(pid: int) -> None:
    os.kill(pid, signal.SIGCONT)


def native_threads() -> int:
    return len(os.listdir("/proc/self/task"))


# -- functions that run in Peer children ------------------------------------------------------

def start_engine(state, provider: str, **kwargs) -> bytes:
    state["engine"] = p2p.Engine("cpu", **engine_kwargs(provider, **kwargs))
    return state["engine"].address


def guarded_target(state, name: str, nbytes: int, guard: int = 4096, access: str = "rw",
                   fill: int = 0xAB, guard_fill: int = 0x5A) -> bytes:
    """Registers `nbytes` in the middle of a larger buffer; the `guard` bytes on each side are
    never registered, so no peer may ever change them. Returns the RemoteTensor bytes."""
    buf = bytearray([guard_fill]) * (2 * guard + nbytes)
    buf[guard:guard + nbytes] = bytes([fill]) * nbytes
    t = torch.frombuffer(buf, dtype=torch.uint8, offset=guard, count=nbytes)
    assert t.untyped_storage().nbytes() == nbytes and t.data_ptr() == _address_of(buf) + guard
    state[name + ".buf"] = buf
    state[name] = t
    state[name + ".region"] = state["engine"].register(t, access=access)
    return state[name + ".region"].remote.to_bytes()


def _address_of(buf: bytearray) -> int:
    import ctypes
    return ctypes.addressof(ctypes.c_char.from_buffer(buf))


def buffer_bytes(state, name: str) -> bytes:
    return bytes(state[name + ".buf"])


def target(state, name: str, nbytes: int, fill: int = 0, access: str = "rw") -> bytes:
    t = torch.full((nbytes,), fill, dtype=torch.uint8)
    state[name] = t
    state[name + ".region"] = state["engine"].register(t, access=access)
    return state[name + ".region"].remote.to_bytes()


def checksum(state, name: str, start: int = 0, stop: int | None = None) -> int:
    t = state[name]
    return zlib.crc32(t.view(torch.uint8).numpy()[start:stop].tobytes())


def close_region(state, name: str) -> None:
    state[name + ".region"].close()


def close_engine(state) -> None:
    state.pop("engine").close()


def disconnect(state, address: bytes, timeout: float = 10) -> None:
    p2p.wait(state["engine"].disconnect(address), timeout)


def connect(state, address: bytes, timeout: float = 10) -> None:
    p2p.wait(state["engine"].connect(address), timeout)


def send_numbered(state, address: bytes, n: int, tag: bytes = b"", timeout: float = 60) -> None:
    """Sends n messages tag + b"<i>", waiting for all of them."""
    e = state["engine"]
    futs = [e.send(address, tag + str(i).encode()) for i in range(n)]
    errors = wait_all(futs, timeout)
    assert errors == [None] * n, [x for x in errors if x][:3]


def send(state, address: bytes, payload: bytes, timeout: float = 60) -> None:
    p2p.wait(state["engine"].send(address, payload), timeout)


def send_result(state, address: bytes, payload: bytes, timeout: float = 30) -> str | None:
    """Sends and returns the exception type name, or None on success."""
    try:
        p2p.wait(state["engine"].send(address, payload), timeout)
        return None
    except p2p.P2PError as exc:
        return f"{type(exc).__name__}: {exc}"


def recv(state, timeout: float = 30):
    return p2p.wait(state["engine"].recv(timeout=timeout), timeout + 10)


def recv_result(state, timeout: float):
    """(address, payload), or the exception type name."""
    try:
        return p2p.wait(state["engine"].recv(timeout=timeout), timeout + 10)
    except p2p.P2PError as exc:
        return type(exc).__name__


def recv_many(state, n: int, timeout: float = 60) -> list:
    e = state["engine"]
    futs = [e.recv(timeout=timeout) for _ in range(n)]
    out = []
    for f in futs:
        out.append(p2p.wait(f, timeout + 10))
    return out


def expect_notification(state, tag: int, name: str, seed: int, timeout: float = 60) -> dict:
    """Waits for notification(tag) and checks, right then, that `name` holds pattern(seed)."""
    e = state["engine"]
    fut = e.notification(tag, timeout=timeout)
    state["notify.ready"] = True
    p2p.wait(fut, timeout + 10)
    t = state[name]
    got = t.view(torch.uint8).reshape(-1)
    expected = pattern(seed, got.numel())
    return {"equal": bool(torch.equal(got, expected)),
            "mismatched_bytes": int((got != expected).sum())}


def notifications(state, tags: list, timeout: float = 30) -> list:
    """Calls notification() for each tag first, then waits for all; returns outcomes."""
    e = state["engine"]
    futs = [e.notification(t, timeout=timeout) for t in tags]
    out = []
    for f in futs:
        try:
            p2p.wait(f, timeout + 10)
            out.append(None)
        except p2p.P2PError as exc:
            out.append(type(exc).__name__)
    return out


def write_loop(state, name: str, remote_bytes: bytes, seconds: float, nbytes: int, slot: int) -> dict:
    """For `seconds`, writes fresh random bytes into slot `slot` of a remote region and reads
    them back, verifying each round. Returns counts; raises on the first mismatch."""
    e = state["engine"]
    remote = p2p.RemoteTensor.from_bytes(remote_bytes)[slot * nbytes:(slot + 1) * nbytes]
    if name not in state:
        state[name] = torch.zeros(2 * nbytes, dtype=torch.uint8)
        state[name + ".region"] = e.register(state[name])
    src, dst = state[name][:nbytes], state[name][nbytes:]
    rounds, errors = 0, []
    end = time.monotonic() + seconds
    g = torch.Generator().manual_seed(slot)
    while time.monotonic() < end:
        src.copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g))
        dst.zero_()
        p2p.wait(e.write_slices(src, [remote]), 30)
        p2p.wait(e.read_slices(dst, [remote]), 30)
        if not torch.equal(src, dst):
            raise AssertionError(f"round {rounds}: read back differs from what was written")
        rounds += 1
    return {"rounds": rounds, "errors": errors}


def engine_address(state) -> bytes:
    return state["engine"].address


class Stream:
    """Keeps `depth` writes of `src` to `remote` outstanding until one fails or stop() is
    called; records when each future completed (time.monotonic())."""

    def __init__(self, engine, src, remote, depth=8):
        import threading
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
    try:
        fut.value()
        return False
    except Exception:  # noqa: BLE001
        return True


class stopped:
    """with stopped(pid): the process is SIGSTOPped inside the block, and resumed at its end
    or after `limit` seconds, whichever comes first, so that nothing waits on it forever."""

    def __init__(self, pid: int, limit: float = 30):
        import threading
        self.pid = pid
        self.timer = threading.Timer(limit, self._resume)
        self.timer.daemon = True

    def _resume(self):
        try:
            resume(self.pid)
        except ProcessLookupError:
            pass

    def __enter__(self):
        stop(self.pid)
        self.timer.start()
        return self

    def __exit__(self, *exc):
        self.timer.cancel()
        self._resume()


# -- loops that a host child runs in the background, for join/leave tests ------------------------

def _loop(state, key, remote, nbytes, seed):
    e = state["engine"]
    src = torch.zeros(nbytes, dtype=torch.uint8)
    dst = torch.zeros(nbytes, dtype=torch.uint8)
    regions = [e.register(src), e.register(dst)]
    g = torch.Generator().manual_seed(seed)
    info = state["loops"][key]
    try:
        while not info["stop"].is_set():
            src.copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g))
            dst.zero_()
            try:
                p2p.wait(e.write_slices(src, [remote]), 20)
                p2p.wait(e.read_slices(dst, [remote]), 20)
            except Exception as exc:  # noqa: BLE001 - reported to the parent
                info["error"] = f"{type(exc).__name__}: {exc}"
                return
            if not torch.equal(src, dst):
                info["error"] = "AssertionError: read back differs from what was written"
                return
            info["rounds"] += 1
    finally:
        for r in regions:
            try:
                r.close(timeout=5)
            except Exception:  # noqa: BLE001 - the engine may be wedged; the parent sees the error
                pass


def start_loop(state, key: str, remote_bytes: bytes, nbytes: int, seed: int) -> None:
    """Starts a background loop: write fresh bytes to the remote, read them back, verify."""
    import threading
    remote = p2p.RemoteTensor.from_bytes(remote_bytes)
    state.setdefault("loops", {})[key] = info = {"stop": threading.Event(), "rounds": 0, "error": None}
    info["thread"] = threading.Thread(target=_loop, args=(state, key, remote, nbytes, seed), daemon=True)
    info["thread"].start()


def loop_status(state) -> dict:
    return {k: {"rounds": v["rounds"], "error": v["error"], "alive": v["thread"].is_alive()}
            for k, v in state.get("loops", {}).items()}


def stop_loops(state, keys, timeout: float = 30) -> dict:
    """Stops the loops, waiting `timeout` in all; a loop still running shows as alive."""
    deadline = time.monotonic() + timeout
    for k in keys:
        state["loops"][k]["stop"].set()
    for k in keys:
        state["loops"][k]["thread"].join(max(0.0, deadline - time.monotonic()))
    return loop_status(state)


def wait_loop_ended(state, key: str, timeout: float) -> dict:
    state["loops"][key]["thread"].join(timeout)
    return loop_status(state)


def register_churn_beside_writes(state, seconds: float) -> dict:
    """For `seconds`, a thread registers tensors and deregisters them while this one writes
    into the engine's own region. Returns how many of each were done."""
    import threading
    e = state["engine"]
    src, dst = torch.ones(4096, dtype=torch.uint8), torch.zeros(4096, dtype=torch.uint8)
    regions = [e.register(src), e.register(dst)]
    counts = {"churned": 0, "writes": 0}
    stop = threading.Event()

    def churn():
        while not stop.is_set():
            e.register(torch.zeros(1024)).close(timeout=5)
            counts["churned"] += 1

    thread = threading.Thread(target=churn, daemon=True)
    thread.start()
    deadline = time.monotonic() + seconds
    try:
        while time.monotonic() < deadline:
            p2p.wait(e.write_slices(src, [regions[1].remote]), 10)
            counts["writes"] += 1
    finally:
        stop.set()
        thread.join(30)
        for r in regions:
            r.close(timeout=5)
    return counts


# -- failure scenarios, run inside a host child --------------------------------------------------
# NOTE: an engine whose shm peer was killed can spin forever inside libfabric (see
# test_failures.py); the engine under test then lives in a child that the parent can kill.

def dead_peer_scenario(state, b_pid: int, rb_bytes: bytes, b_address: bytes, budget: float) -> dict:
    """Streams writes to b, kills it mid-stream, then starts a read and a send to it too.
    Returns what happened to every future; raises if one is still pending after `budget`."""
    e = state["engine"]
    rb = p2p.RemoteTensor.from_bytes(rb_bytes)
    src = torch.randint(0, 256, (rb.numel(),), dtype=torch.uint8)
    out = torch.zeros(rb.numel(), dtype=torch.uint8)
    state["src"], state["out"] = e.register(src), e.register(out)
    stream = Stream(e, src, rb)
    deadline = time.monotonic() + 20
    while stream.completed_ok() < 3 and time.monotonic() < deadline:
        time.sleep(0.02)
    started = stream.completed_ok()
    in_flight = [f for f in list(stream.futures) if not f.done()]
    os.kill(b_pid, signal.SIGKILL)
    killed = time.monotonic()
    late = [e.read_slices(out, [rb]), e.send(b_address, b"x" * 100000)]
    errors = wait_all(list(stream.futures) + late, budget)
    stream.stop()
    return {
        "started": started,
        "in_flight": len(in_flight),
        "in_flight_done": all(f.done() for f in in_flight),
        "errors": [type(x).__name__ if x else None for x in errors],
        "messages": sorted({str(x) for x in errors if x})[:3],
        "latest": max(list(stream.done_at.values()) + [time.monotonic()]) - killed,
    }


def usable_after_death_scenario(state, b_pid: int, rb_bytes: bytes, rc_bytes: bytes, d_address: bytes,
                                budget: float) -> dict:
    """b dies with writes in flight (stopped first, so they surely are); then c and a new
    peer d must still work. Returns what failed where."""
    e = state["engine"]
    rb, rc = p2p.RemoteTensor.from_bytes(rb_bytes), p2p.RemoteTensor.from_bytes(rc_bytes)
    src = torch.randint(0, 256, (rb.numel(),), dtype=torch.uint8)
    out = torch.zeros(rb.numel(), dtype=torch.uint8)
    state["src"], state["out"] = e.register(src), e.register(out)
    p2p.wait(e.write_slices(src, [rb]), 10)
    p2p.wait(e.write_slices(src, [rc]), 10)
    stop(b_pid)
    doomed = [e.write_slices(src, [rb]) for _ in range(4)]
    time.sleep(0.3)
    os.kill(b_pid, signal.SIGKILL)
    result = {"doomed": [type(x).__name__ if x else None for x in wait_all(doomed, budget)]}
    step = "start"
    try:
        for _ in range(3):
            step = "w"
            src.add_(1)
            out.zero_()
            p2p.wait(e.write_slices(src, [rc]), budget)
            step = "r"
            p2p.wait(e.read_slices(out, [rc]), budget)
            assert torch.equal(out, src), "read back differs"
        step = "send"
        p2p.wait(e.send(d_address, b"welcome"), budget)
        result["after"] = None
    except Exception as exc:  # noqa: BLE001 - reported to the parent
        incarnations = {name: f"{_C._decode_address(a)['incarnation']:016x}" for name, a in
                        (("b", rb.owner), ("c", rc.owner), ("d", d_address))}
        result["after"] = f"{type(exc).__name__} in step {step!r} (peers {incarnations}): {exc}"
    return result


def idle_death_scenario(state, b_pid: int, rb_bytes: bytes, b_address: bytes, budget: float) -> dict:
    e = state["engine"]
    rb = p2p.RemoteTensor.from_bytes(rb_bytes)
    buf = torch.zeros(rb.numel(), dtype=torch.uint8)
    state["buf"] = e.register(buf)
    p2p.wait(e.write_slices(buf, [rb]), 10)
    os.kill(b_pid, signal.SIGKILL)
    time.sleep(0.2)
    start = time.monotonic()
    first = wait_all([e.write_slices(buf, [rb]), e.read_slices(buf, [rb]), e.send(b_address, b"?")], budget)
    first_took = time.monotonic() - start
    start = time.monotonic()
    second = wait_all([e.connect(b_address)], budget)
    return {"first": [type(x).__name__ if x else None for x in first], "first_took": first_took,
            "connect": [type(x).__name__ if x else None for x in second],
            "connect_took": time.monotonic() - start}


def locked_death_scenario(state, b_pid: int, rb_bytes: bytes, b_address: bytes, budget: float,
                          tries: int = 40) -> dict:
    """Kills b at a moment when it surely holds the lock of its shm region: b is stopped
    (SIGSTOP) at random points of a stream of writes until a small send to it blocks our
    worker (then b is stopped inside its lock), and killed there. Returns whether that state
    was reached and how the futures to b ended (None: still pending after `budget`)."""
    e = state["engine"]
    rb = p2p.RemoteTensor.from_bytes(rb_bytes)
    src = torch.randint(0, 256, (rb.numel(),), dtype=torch.uint8)
    state["src"] = e.register(src)
    stream = Stream(e, src, rb)
    deadline = time.monotonic() + 20
    while stream.completed_ok() < 3 and time.monotonic() < deadline:
        time.sleep(0.02)
    caught, probes = False, []
    for attempt in range(tries):
        stop(b_pid)
        time.sleep(0.02)
        probes.append(e.send(b_address, b"probe"))
        tick = e.recv(timeout=0.1)  # completes (TimeoutError) only while our worker runs
        end = time.monotonic() + 1.0
        while not tick.done() and time.monotonic() < end:
            time.sleep(0.01)
        if not tick.done():
            caught = True
            break
        resume(b_pid)
        time.sleep(0.03)
    os.kill(b_pid, signal.SIGKILL)
    killed = time.monotonic()
    futures = list(stream.futures) + probes
    end = killed + budget
    while time.monotonic() < end and not all(f.done() for f in futures):
        time.sleep(0.05)
    stream._stop.set()
    return {"caught": caught, "attempts": attempt + 1,
            "pending": sum(1 for f in futures if not f.done()),
            "errors": sorted({type(_exception(f)).__name__ for f in futures if f.done() and failed(f)}),
            "took": time.monotonic() - killed}


def _exception(fut):
    try:
        fut.value()
    except Exception as exc:  # noqa: BLE001
        return exc
    return None


def connect_to_closed_sibling(state, provider: str, peer_timeout: float) -> str | None:
    """With an engine open, opens and closes a second one in this process, then connects the
    first to the second's address."""
    with p2p.Engine("cpu", **engine_kwargs(provider, peer_timeout=peer_timeout)) as e:
        gone = p2p.Engine("cpu", **engine_kwargs(provider))
        address = gone.address
        gone.close()
        err = wait_all([e.connect(address)], peer_timeout + 5)[0]
    return type(err).__name__ if err else None
