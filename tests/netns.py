"""Two hosts on one machine: network namespaces joined by a veth pair, and the steps that run
inside Peer children placed in them (tests/peer.py).

Traffic goes only between the two namespaces' own addresses (ADDRESSES). Creating namespaces
needs root and iproute2; `hosts()` skips the test otherwise, and always deletes what it made.
"""
from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import subprocess
import time
from dataclasses import dataclass

import pytest
import torch

import torch_p2p as p2p
from conftest import PEER_TIMEOUT

ADDRESSES = ("10.77.0.1", "10.77.0.2")
CLONE_NEWNET = 0x40000000


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


@dataclass
class Hosts:
    namespaces: tuple[str, str]
    interfaces: tuple[str, str]

    def link(self, i: int, up: bool) -> None:
        """Takes host i's end of the veth down or up: a cut cable, as each host sees it."""
        _ip("-n", self.namespaces[i], "link", "set", self.interfaces[i], "up" if up else "down")

    def throttle(self, i: int, rate: str) -> None:
        """Limits what host i sends to `rate` (tc's token bucket), so that calls stay in flight."""
        _ip_tc = ["tc", "-n", self.namespaces[i], "qdisc", "add", "dev", self.interfaces[i], "root", "tbf",
                  "rate", rate, "burst", "256kb", "latency", "400ms"]
        subprocess.run(_ip_tc, check=True, capture_output=True, timeout=30)


@contextlib.contextmanager
def hosts():
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("two hosts on one machine need root and iproute2 (network namespaces)")
    tag = f"p2p{os.getpid() % 100000}"
    h = Hosts((f"{tag}a", f"{tag}b"), (f"{tag}a0", f"{tag}b0"))
    try:
        for ns in h.namespaces:
            _ip("netns", "add", ns)
        _ip("link", "add", h.interfaces[0], "type", "veth", "peer", "name", h.interfaces[1])
        for i in (0, 1):
            _ip("link", "set", h.interfaces[i], "netns", h.namespaces[i])
            _ip("-n", h.namespaces[i], "addr", "add", f"{ADDRESSES[i]}/24", "dev", h.interfaces[i])
            h.link(i, True)
        yield h
    finally:
        for ns in h.namespaces:  # deleting a namespace deletes its end of the veth, and so the pair
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)


# -- steps inside a Peer child -----------------------------------------------------------------

def enter(state, namespace: str, interface: str, **engine_options) -> bytes:
    """Moves the child into `namespace` and starts its engine there on the tcp provider, the
    fabric carrying everything (no same-host route); returns its address."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/var/run/netns/{namespace}", os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), "setns")
    finally:
        os.close(fd)
    options = dict(provider="tcp", domains=[interface], cma=False, ipc=False, peer_timeout=PEER_TIMEOUT)
    state["engine"] = p2p.Engine("cpu", **{**options, **engine_options})
    return state["engine"].address


def region(state, name: str, nbytes: int, fill: int) -> bytes:
    t = torch.full((nbytes,), fill, dtype=torch.uint8)
    state[name] = t
    state[f"{name}/region"] = state["engine"].register(t)
    return state[f"{name}/region"].remote.to_bytes()


def fill(state, name: str, value: int) -> None:
    state[name].fill_(value)


def counts(state, name: str, values: list) -> list:
    t = state[name]
    return [int((t == v).sum()) for v in values]


def slices_all(state, name: str, calls: int, value: int) -> list:
    """For each of `calls` equal slices of `name` (start_calls'), whether every byte is `value`."""
    t = state[name]
    step = t.numel() // calls
    return [bool((t[i * step:(i + 1) * step] == value).all()) for i in range(calls)]


def snapshot(state, name: str) -> None:
    state[f"{name}/snapshot"] = state[name].clone()


def changed_since_snapshot(state, name: str) -> int:
    return int((state[name] != state[f"{name}/snapshot"]).sum())


def start_calls(state, kind: str, name: str, remote_blob: bytes, calls: int, connect: bool = True) -> None:
    """`calls` writes (or reads) of equal slices of tensor `name` to (from) the same slices of the
    remote region, all in flight at once (with `connect`, once its owner has answered)."""
    remote = p2p.RemoteTensor.from_bytes(remote_blob)
    t, e = state[name], state["engine"]
    if connect:
        p2p.wait(e.connect(remote.owner), 30)
    step = t.numel() // calls
    call = e.write_slices if kind == "write" else e.read_slices
    state["calls"] = [call([t[i * step:(i + 1) * step]], [remote[i * step:(i + 1) * step]]) for i in range(calls)]
    state["calls/start"] = time.monotonic()


def outcomes(state, timeout: float) -> list:
    """Each call's (error type or None, seconds from start_calls to its end, message), in order,
    polled every 5 ms; "pending" for a call not done by `timeout`."""
    futures, start = state["calls"], state["calls/start"]
    ended = [None] * len(futures)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not all(ended):
        for i, f in enumerate(futures):
            if ended[i] is None and f.done():
                ended[i] = time.monotonic() - start
        time.sleep(0.005)
    out = []
    for f, t in zip(futures, ended):
        if t is None:
            out.append(("pending", None, ""))
            continue
        try:
            f.value()
            out.append((None, t, ""))
        except Exception as exc:  # noqa: BLE001 - the type is the result
            cause = exc.__cause__ or exc
            out.append((type(cause).__name__, t, str(cause)[:300]))
    return out


def write_once(state, name: str, remote_blob: bytes, timeout: float) -> None:
    remote = p2p.RemoteTensor.from_bytes(remote_blob)
    p2p.wait(state["engine"].write_slices([state[name]], [remote]), timeout)
