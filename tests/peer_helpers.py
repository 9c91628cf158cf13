"""Helpers for the peer, failure, security, fuzz and soak tests.

  - handles with fields changed (`tampered`), written by the engine's own encoders
    (torch_p2p._C._encode_remote) so that every CRC is right and the engine's local checks pass;
  - waiting on futures, stopping and resuming processes;
  - steps that run inside Peer children (tests/peer.py): each takes `state` first and reports
    facts (counts, exception names, times) for the test to check; those that start and close
    engines and registered tensors are tests/helpers.py's, imported here.

Times that cross processes are time.monotonic(): one clock for every process of the machine.
"""
from __future__ import annotations

import ctypes
import os
import signal
import socket
import threading
import time
import zlib

import torch

import torch_p2p as p2p
from conftest import engine_kwargs
from helpers import close_engine, close_region, fetch, put, start_engine, target  # noqa: F401 - steps for Peer children
from peer import shm_endpoint_files
from torch_p2p import _C

# -- forged handles ----------------------------------------------------------------------------

READ, WRITE = 1, 2  # access bits (csrc/core/address.h)


def tampered(remote: p2p.RemoteTensor, **changes) -> p2p.RemoteTensor:
    """A copy of `remote` with region fields (access, nbytes, entries, ...) or view fields
    (shape, strides, offset, dtype) changed and every CRC recomputed; the names are those of
    _C._decode_remote."""
    fields = _C._decode_remote(remote.to_bytes())
    for key, value in changes.items():
        where = fields if key in fields else fields["region"]
        if key not in where:
            raise KeyError(key)
        where[key] = value
    return p2p.RemoteTensor.from_bytes(_C._encode_remote(fields))


# -- misc --------------------------------------------------------------------------------------

def free_port() -> int:
    """A loopback TCP port that nobody listens on right now."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def outcomes(futures, timeout: float) -> list:
    """Waits for every future (up to `timeout` in all); returns each one's exception, None if
    it succeeded, or "pending" if it is not done at the deadline."""
    deadline = time.monotonic() + timeout
    for fut in futures:
        try:
            p2p.wait(fut, max(0.0, deadline - time.monotonic()))
        except Exception:  # noqa: BLE001 - read below
            pass
    return [_exception(f) if f.done() else "pending" for f in futures]


def wait_all(futures, timeout: float) -> list:
    """outcomes(), where a future still pending at the deadline raises AssertionError."""
    out = outcomes(futures, timeout)
    if any(x == "pending" for x in out if isinstance(x, str)):
        raise AssertionError(f"a future is still pending after {timeout} s")
    return out


def _exception(fut):
    try:
        fut.value()
    except Exception as exc:  # noqa: BLE001
        return exc
    return None


def _name(exc) -> str | None:
    return exc if isinstance(exc, str) or exc is None else type(exc).__name__


def pattern(seed: int, nbytes: int) -> torch.Tensor:
    """Deterministic pseudo-random bytes (both processes can regenerate them)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)


def round_trips(state, remote_bytes: bytes, seed: int, rows: int, row: int) -> list:
    """In the initiator: writes into a [rows, row] byte region of the owner and reads back, a
    small run, the whole region and every other row as pages; returns the cases whose bytes
    came back wrong. The region ends up as after_round_trips(seed, rows, row)."""
    e = state["engine"]
    remote = p2p.RemoteTensor.from_bytes(remote_bytes).view(rows, row)
    src = pattern(seed, rows * row).view(rows, row)
    back = torch.zeros_like(src)
    state["regions"] = [e.register(src), e.register(back)]
    wrong = []
    p2p.wait(e.write_slices([src[1, 100:1100]], [remote[1, 100:1100]]), 30)
    p2p.wait(e.read_slices([back[1, 100:1100]], [remote[1, 100:1100]]), 30)
    if not torch.equal(back[1, 100:1100], src[1, 100:1100]):
        wrong.append("small")
    p2p.wait(e.write_slices(src, remote), 60)
    p2p.wait(e.read_slices(back.zero_(), remote), 60)
    if not torch.equal(back, src):
        wrong.append("contiguous")
    mine, theirs = _round_trip_pages(rows)
    p2p.wait(e.write_slices([p2p.pages(src, mine)], [p2p.pages(remote, theirs)]), 60)
    p2p.wait(e.read_slices([p2p.pages(back.zero_(), mine)], [p2p.pages(remote, theirs)]), 60)
    if not torch.equal(back[mine], src[mine]):
        wrong.append("paged")
    return wrong


def after_round_trips(seed: int, rows: int, row: int) -> torch.Tensor:
    """The owner's region after round_trips(.., seed, rows, row), flat."""
    src = pattern(seed, rows * row).view(rows, row)
    out = src.clone()
    mine, theirs = _round_trip_pages(rows)
    out[theirs] = src[mine]
    return out.view(-1)


def _round_trip_pages(rows: int) -> tuple[list, list]:
    mine = list(range(0, rows, 2))
    return mine, [rows - 1 - i for i in mine]


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

def forbid_ptrace(state) -> None:
    """Makes this process one that others may not copy from or into without CAP_SYS_PTRACE
    (not dumpable), as a hardened service may be."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(4, 0, 0, 0, 0) != 0:  # PR_SET_DUMPABLE, 0
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_DUMPABLE)")


def drop_ptrace_capability(state) -> None:
    """Drops CAP_SYS_PTRACE from this thread and the threads it starts later (a root process
    otherwise copies any process's memory)."""
    class Header(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

    class Data(ctypes.Structure):
        _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]

    libc = ctypes.CDLL(None, use_errno=True)
    header, data = Header(0x20080522, 0), (Data * 2)()  # _LINUX_CAPABILITY_VERSION_3
    if libc.capget(ctypes.byref(header), data) != 0:
        raise OSError(ctypes.get_errno(), "capget")
    data[0].effective &= ~(1 << 19)  # CAP_SYS_PTRACE
    data[0].permitted &= ~(1 << 19)
    if libc.capset(ctypes.byref(header), data) != 0:
        raise OSError(ctypes.get_errno(), "capset")


class _Iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def ptrace_errno(state, pid: int) -> int:
    """What the OS answers this process's process_vm_readv of one byte of process `pid`: EPERM
    where it has no ptrace access to it, EFAULT where it has (address 1 is never mapped)."""
    libc = ctypes.CDLL(None, use_errno=True)
    byte = ctypes.create_string_buffer(1)
    local, remote = _Iovec(ctypes.addressof(byte), 1), _Iovec(1, 1)
    if libc.process_vm_readv(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0) == 1:
        return 0
    return ctypes.get_errno()


def file_target(state, name: str, path: str, nbytes: int, fill: int, replace: bool = False) -> bytes:
    """A tensor mapped by torch.from_file(path, shared=True) (which closes the file), filled with
    `fill` and registered; with `replace`, `path` names another file (of other bytes) by then."""
    t = torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)
    t.fill_(fill)
    if replace:
        os.unlink(path)
        with open(path, "wb") as f:
            f.write(bytes([fill ^ 0xFF]) * nbytes)
    state[name] = t
    state[f"{name}.region"] = state["engine"].register(t)
    return state[f"{name}.region"].remote.to_bytes()


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


def checksum(state, name: str, start: int = 0, stop: int | None = None) -> int:
    t = state[name]
    return zlib.crc32(t.view(torch.uint8).numpy()[start:stop].tobytes())


def disconnect(state, address: bytes, timeout: float = 10) -> None:
    p2p.wait(state["engine"].disconnect(address), timeout)


def send_numbered(state, address: bytes, n: int, tag: bytes = b"", timeout: float = 60) -> list:
    """Sends n messages tag + b"<i>"; returns each one's exception type name, "pending", or
    None if it was delivered."""
    e = state["engine"]
    futs = [e.send(address, tag + str(i).encode()) for i in range(n)]
    return [_name(x) for x in outcomes(futs, timeout)]


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


def await_notification(state, tag: int, timeout: float = 60) -> None:
    """Calls notification(tag) and returns: the waiter is in place before anything that the
    parent does next (check_notification collects it)."""
    state["notification"] = state["engine"].notification(tag, timeout=timeout)


def check_notification(state, name: str, seed: int, timeout: float = 60) -> dict:
    """Waits for await_notification's future and checks, right then, that `name` holds
    pattern(seed)."""
    p2p.wait(state.pop("notification"), timeout)
    got = state[name].view(torch.uint8).reshape(-1)
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
    them back, until a round reads back other bytes. Returns the rounds that read back what
    they wrote, and the number of the first that did not (None: none)."""
    e = state["engine"]
    remote = p2p.RemoteTensor.from_bytes(remote_bytes)[slot * nbytes:(slot + 1) * nbytes]
    if name not in state:
        state[name] = torch.zeros(2 * nbytes, dtype=torch.uint8)
        state[name + ".region"] = e.register(state[name])
    src, dst = state[name][:nbytes], state[name][nbytes:]
    rounds = 0
    end = time.monotonic() + seconds
    g = torch.Generator().manual_seed(slot)
    while time.monotonic() < end:
        src.copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g))
        dst.zero_()
        p2p.wait(e.write_slices(src, [remote]), 30)
        p2p.wait(e.read_slices(dst, [remote]), 30)
        if not torch.equal(src, dst):
            return {"rounds": rounds, "mismatch": rounds}
        rounds += 1
    return {"rounds": rounds, "mismatch": None}


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
    return _exception(fut) is not None


class stopped:
    """with stopped(pid): the process is SIGSTOPped inside the block, and resumed at its end
    or after `limit` seconds, whichever comes first, so that nothing waits on it forever."""

    def __init__(self, pid: int, limit: float = 30):
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


# -- steps of the failure tests, run inside the child that hosts the engine under test ----------
# NOTE: an engine whose shm peer was killed can spin forever inside libfabric (see
# test_failures.py); the engine under test then lives in a child that the parent can kill.

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
    return {"errors": [_name(x) for x in errors],
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
