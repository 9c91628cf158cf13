"""The peer libraries users compare this one with (NIXL, Mooncake Transfer Engine), through
their Python APIs, as baselines: the same pages between the same buffers, one descriptor per page
(source and destination pages in the row's orders), one request (a NIXL transfer, a Mooncake
batch) per call. This module holds what every library shares: the interface each implements
(_nixl.py, _mooncake.py), its errors, and the timed loops over its requests. A library that is
missing or cannot run here is skipped with its reason.

Each baseline has two halves: the peer registers its buffer and says where it is; the driver
opens the same library, connects and measures (bytes, seconds)."""
from __future__ import annotations

import collections
import contextlib
import importlib
import os
import socket
import statistics
import time

import torch

from _timing import timed

PEER_LIBRARIES = ("nixl", "nixl-libfabric", "mooncake")


class PeerLibraryError(RuntimeError):
    """A peer library refused or failed a step; the message is one line, fit for a skip notice."""


def _library(name: str) -> type:
    """The class that speaks peer library `name` (imported here: its module imports this one)."""
    if name == "mooncake":
        from _mooncake import Mooncake
        return Mooncake
    from _nixl import Nixl
    return Nixl


def peer_library_unavailable(name: str, device: torch.device) -> str | None:
    """Why the peer library `name` cannot run on `device` in this process, or None."""
    return _library(name).unavailable(name, device)


def open_peer_library(name: str, device: torch.device, host: str) -> "PeerLibrary":
    """This process's side of `name`, reachable at `host`; raises PeerLibraryError."""
    if why := peer_library_unavailable(name, device):
        raise PeerLibraryError(why)
    with library_errors():
        return _library(name)(name, device, host)


def load(module: str, package: str, extra: str, env: dict) -> tuple:
    """(the peer library's `module`, None), or (None, the one-line reason why it cannot be
    imported, naming the extra that installs `package`). `env` is set first, where the user has
    not: the library reads it when it loads."""
    for key, value in env.items():
        os.environ.setdefault(key, value)
    try:
        return importlib.import_module(module), None
    except Exception as e:  # noqa: BLE001 - ImportError, or a wheel built for another CUDA
        first = (str(e).splitlines() or [""])[0]
        return None, f"{package} cannot be imported ({type(e).__name__}: {first}); pip install 'torch_p2p[{extra}]'"


@contextlib.contextmanager
def library_errors():
    """Turns what a peer library raises (each has its own types) into a one-line PeerLibraryError."""
    try:
        yield
    except PeerLibraryError:
        raise
    except Exception as e:  # noqa: BLE001
        raise PeerLibraryError(f"{type(e).__name__}: {(str(e).splitlines() or [''])[0]}") from None


def local_address(peer_host: str) -> str:
    """The address of this host that `peer_host` reaches it on (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((socket.gethostbyname(peer_host), 9))
        return s.getsockname()[0]


def page_descs(address: int, page_bytes: int, order: list[int]) -> list[tuple[int, int]]:
    """(address, bytes) of pages `order` of a buffer of pages at `address`, in that order."""
    return [(address + i * page_bytes, page_bytes) for i in order]


class PeerLibrary:
    """One process's side of a peer library: registered tensors, the peer it talks to, and
    requests that move lists of (address, bytes) descriptors between them. Used from one thread."""

    @staticmethod
    def unavailable(name: str, device: torch.device) -> str | None:
        """Why the library cannot run on `device` in this process, or None (its module loaded,
        through load())."""
        raise NotImplementedError

    def __init__(self, name: str, device: torch.device, host: str):
        self.name, self.device, self.host = name, device, host
        self.what = name  # the backend or transport, for the progress line

    def register(self, tensors: list[torch.Tensor]) -> None:
        raise NotImplementedError

    def address(self) -> dict:
        """What the other side's connect() needs; JSON values and bytes."""
        raise NotImplementedError

    def connect(self, peer: dict) -> None:
        raise NotImplementedError

    def request(self, read: bool, local: list[tuple[int, int]], remote: list[tuple[int, int]]) -> "Request":
        """A request that moves remote[i] into local[i] (read) or local[i] into remote[i]."""
        raise NotImplementedError

    def release(self) -> None:
        """Deregisters everything registered and forgets the peer (before the tensors go)."""
        raise NotImplementedError


class Request:
    """One call of a peer library: post() starts it, wait() returns once it is done (raising
    PeerLibraryError on failure); posted again only after wait()."""

    def post(self) -> None:
        raise NotImplementedError

    def wait(self) -> None:
        raise NotImplementedError


def measure_peer_library(lib: PeerLibrary, read: bool, local, remote, window: int, seconds: float):
    """The driver's half: calls of `local` <-> `remote` descriptors, `window` in flight, in
    batches until `seconds` have passed (after a warm-up); (bytes, seconds) as the others."""
    requests = [lib.request(read, local, remote) for _ in range(window)]
    nbytes = sum(n for _, n in local)

    def batch(n: int) -> float:
        t = time.perf_counter()
        inflight: collections.deque = collections.deque()
        for i in range(n):
            req = requests[i % window]
            if len(inflight) == window:  # the oldest is the one posted next
                inflight.popleft().wait()
            req.post()
            inflight.append(req)
        while inflight:
            inflight.popleft().wait()
        return time.perf_counter() - t

    return timed(batch, seconds, nbytes)


def median_request_seconds(request: Request, repeat: int) -> float:
    """Median seconds of one request to completion over `repeat`, after a warm-up."""
    times = []
    for i in range(repeat + 1):
        t = time.perf_counter()
        request.post()
        request.wait()
        if i:
            times.append(time.perf_counter() - t)
    return statistics.median(times)
