"""Helpers for the peer, failure, security, fuzz and soak tests.

  - handles with fields changed (`tampered`), written by the engine's own encoders
    (torch_p2p._C._encode_remote) so that every CRC is right and the engine's local checks pass;
  - waiting on futures, stopping and resuming processes;
  - steps that run inside Peer children (tests/peer.py): each takes `state` first and reports
    facts (counts, exception names, times) for the test to check; those that start and close
    engines and registered tensors are tests/helpers.py's, imported here; those of a child
    hosting the engine under a failure test are tests/host_steps.py's.

Times that cross processes are time.monotonic(): one clock for every process of the machine.
"""
from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time
import zlib

import torch

import torch_p2p as p2p
from helpers import close_engine, close_region, fetch, put, start_engine, target  # noqa: F401 - steps for Peer children
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

def outcomes(futures, timeout: float) -> list:
    """Waits for every future (up to `timeout` in all); returns each one's exception, None if
    it succeeded, or "pending" if it is not done at the deadline."""
    deadline = time.monotonic() + timeout
    for fut in futures:
        try:
            p2p.wait(fut, max(0.0, deadline - time.monotonic()))
        except Exception:  # noqa: BLE001 - read below
            pass
    return [exception_of(f) if f.done() else "pending" for f in futures]


def wait_all(futures, timeout: float) -> list:
    """outcomes(), where a future still pending at the deadline raises AssertionError."""
    out = outcomes(futures, timeout)
    if any(x == "pending" for x in out if isinstance(x, str)):
        raise AssertionError(f"a future is still pending after {timeout} s")
    return out


def errors_by_type(errors) -> dict:
    """How many of `errors` (outcomes() or their error_name()s) are of each kind; "ok": none."""
    out = {}
    for e in errors:
        name = error_name(e) or "ok"
        out[name] = out.get(name, 0) + 1
    return out


FENCE_TAG = 0xFE11CE  # a notification tag that no test sends


def taken_by_worker(engine, timeout: float = 10) -> None:
    """Returns once `engine`'s worker has taken every call submitted before this one (started
    its transfers, sent its messages, begun its connects): it takes calls in order, and a
    notification wait queued after them times out only on a later turn of its loop."""
    (outcome,) = outcomes([engine.notification(FENCE_TAG, timeout=0.05)], timeout)
    assert isinstance(outcome, p2p.TimeoutError), f"the worker took no calls for {timeout} s ({outcome})"


def waiting(thread: threading.Thread) -> bool:
    """Whether `thread` is inside torch_p2p's wait (blocked in it, or about to be)."""
    frame = sys._current_frames().get(thread.ident)
    code = frame.f_code if frame is not None else None
    return code is not None and code.co_name == "wait_all" and code.co_filename.endswith("_shared.py")


def exception_of(fut):
    """The exception a done future holds; None if it succeeded."""
    try:
        fut.value()
    except Exception as exc:  # noqa: BLE001
        return exc
    return None


def error_name(exc) -> str | None:
    """An outcome as outcomes() gives it, by name: the exception's type, None or "pending"."""
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
        if stopped_now(pid):
            return
        time.sleep(0.001)
    raise TimeoutError(f"process {pid} did not stop within 5 s of SIGSTOP")


def stopped_now(pid: int) -> bool:
    """Whether every thread of process `pid` is stopped (SIGSTOP, by us or by itself)."""
    return all(_task_state(pid, task) in ("T", "t", None) for task in os.listdir(f"/proc/{pid}/task"))


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
    return [error_name(x) for x in outcomes(futs, timeout)]


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
