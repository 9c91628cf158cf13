"""What torch_p2p's modules share: tensors grouped by storage (the engine registers a storage
once), bytes inside JSON handles and messages (base64), futures chained or joined
(``Future.then`` would wrap an error in a RuntimeError), and whether a process is alive."""
from __future__ import annotations

import base64
import math
import os
import threading
import time

import torch

from . import _C
from .errors import TimeoutError


def by_storage(items) -> dict[tuple, list]:
    """(key, tensor) pairs grouped by the storage their tensor views, in first-seen order."""
    groups: dict[tuple, list] = {}
    for key, t in items:
        groups.setdefault((str(t.device), t.untyped_storage().data_ptr()), []).append((key, t))
    return groups


def process_alive(pid: int) -> bool:
    """Whether process `pid` exists on this host (one of another user counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def unb64(text) -> bytes:
    return base64.b64decode(text)


def done() -> torch.futures.Future:
    f = torch.futures.Future()
    f.set_result(None)
    return f


def failed(error: BaseException) -> torch.futures.Future:
    f = torch.futures.Future()
    f.set_exception(error)
    return f


def then(first: torch.futures.Future, start, out: torch.futures.Future) -> None:
    """Once `first` succeeds, starts the operation start() returns and completes `out` with
    it; the first failure (or start()'s exception) fails `out`."""

    def finish(f):
        try:
            f.wait()
        except BaseException as e:  # noqa: BLE001 - the caller's future carries it
            out.set_exception(e)
        else:
            out.set_result(None)

    def second(f):
        try:
            f.wait()
            start().add_done_callback(finish)
        except BaseException as e:  # noqa: BLE001
            out.set_exception(e)

    first.add_done_callback(second)


def all_of(futures: list) -> torch.futures.Future:
    """Completes when every future has: with None, or the first error as it is."""
    out = torch.futures.Future()
    if not futures:
        out.set_result(None)
        return out
    lock, left, errors = threading.Lock(), [len(futures)], []

    def one(f):
        try:
            f.wait()
        except BaseException as e:  # noqa: BLE001 - reported through `out`
            errors.append(e)
        with lock:
            left[0] -= 1
            last = left[0] == 0
        if last:
            if errors:
                out.set_exception(errors[0])
            else:
                out.set_result(None)

    for f in futures:
        f.add_done_callback(one)
    return out


def positive(value, what: str = "timeout") -> float:
    """`value` as a float number of seconds; ValueError naming `what` unless it is a positive
    number."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{what} must be positive (a number of seconds), not {value!r}")
    return float(value)


def wait_all(futures, timeout: float | None = None) -> bool:
    """Whether every one of `futures` (torch futures) completed, well or not, within `timeout`
    seconds (None: no limit). Waits without the GIL: spinning first on an engine that spins,
    then on a condition variable that the future's completion sets (no Python callback, so no
    thread takes the GIL to wake the waiter); Ctrl-C ends it."""
    deadline = None if timeout is None else time.monotonic() + timeout
    for f in futures:
        left = math.inf if deadline is None else deadline - time.monotonic()
        if not _C._wait_done(f, getattr(f, "_spin_us", 0), left):
            return False
    return True


def wait(future, timeout: float | None = None):
    """future.wait() with a timeout: raises TimeoutError if it is not done in time (waits as
    wait_all does)."""
    if not isinstance(future, torch._C.Future):  # what then() and collect_all() return too
        raise TypeError(f"wait() takes a torch.futures.Future, not {type(future).__name__}")
    if not wait_all([future], timeout):
        raise TimeoutError(f"the operation did not complete within {timeout} s")
    return future.wait()
