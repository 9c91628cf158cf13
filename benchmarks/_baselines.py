"""Baselines that bw.py measures beside the engine: same processes, same bytes, same run.

tcp:  plain TCP, one stream per rail, Python sockets: every stream moves its share of a
      call (call bytes / streams) with sendall() and recv_into() on preallocated buffers,
      one thread per stream (both calls release the GIL), for the row's duration.
dist: torch.distributed send/recv of one tensor of the call's bytes between the driver
      (rank 0) and its peer (rank 1): "nccl" on GPUs, "gloo" on CPUs; for paged rows, one
      batch_isend_irecv of the call's pages in a random order, as a serving stack without this
      library moves KV blocks. In local mode the transports are pinned to loopback sockets
      (dist_env), so NCCL runs its socket transport: the same road the engine's tcp provider
      takes; with nvlink NCCL picks its own (NVLink P2P between GPUs of one host).
memcpy: cudaMemcpyPeerAsync (torch's cross-device copy) of the call's bytes as one block
      between this process's GPU and the peer's, in the driver process alone: the copy
      engines' ceiling for the same-host IPC route.

Each baseline has two halves: the peer's (serve_*) runs in bw.py's peer process, the
driver's (measure_*) in the process that drives the engine and returns (bytes, seconds).
"""
from __future__ import annotations

import datetime
import os
import socket
import struct
import threading
import time

import torch

TIMEOUT_S = 120.0  # no socket or process-group wait lasts longer

# NCCL over its socket transport on loopback, as in notes/measured.md ("NCCL send/recv over
# sockets"); GLOO_SOCKET_IFNAME does the same for gloo.
LOOPBACK_ENV = {
    "NCCL_P2P_DISABLE": "1",
    "NCCL_SHM_DISABLE": "1",
    "NCCL_IB_DISABLE": "1",
    "NCCL_NET": "Socket",
    "NCCL_SOCKET_IFNAME": "lo",
    "GLOO_SOCKET_IFNAME": "lo",
}


def _threads(fn, items) -> list:
    """Runs fn(item) in one thread per item; returns the results, raises the first error."""
    results: list = [None] * len(items)
    errors: list[BaseException] = []

    def run(i):
        try:
            results[i] = fn(items[i])
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(items))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


def _send_for(sock: socket.socket, chunk: int, seconds: float) -> None:
    buf = memoryview(bytearray(chunk))
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        sock.sendall(buf)
    sock.shutdown(socket.SHUT_WR)


def _recv_all(sock: socket.socket, chunk: int) -> int:
    buf = memoryview(bytearray(chunk))
    total = 0
    while n := sock.recv_into(buf):
        total += n
    return total


# -- tcp ---------------------------------------------------------------------------------------
def tcp_listen(host: str) -> socket.socket:
    """A listening socket on `host` (the address the driver reached the peer on)."""
    s = socket.create_server((host, 0), backlog=64)
    s.settimeout(TIMEOUT_S)
    return s


def serve_tcp(listener: socket.socket, streams: int, chunk: int, send: bool, seconds: float) -> int:
    """The peer's half: accepts `streams` connections, then receives until the driver closes
    (replying with the byte count) or, if `send`, streams to the driver for `seconds`."""
    conns = []
    try:
        for _ in range(streams):
            conn, _ = listener.accept()
            conn.settimeout(TIMEOUT_S)
            conns.append(conn)

        def one(conn):
            if send:
                _send_for(conn, chunk, seconds)
                return 0
            n = _recv_all(conn, chunk)
            conn.sendall(struct.pack("!Q", n))
            return n

        return sum(_threads(one, conns))
    finally:
        for c in conns:
            c.close()


def measure_tcp(host: str, port: int, streams: int, chunk: int, send: bool, seconds: float):
    """The driver's half: (bytes that arrived, seconds from connecting until the last did)."""
    socks = [socket.create_connection((host, port), timeout=TIMEOUT_S) for _ in range(streams)]
    try:
        t0 = time.perf_counter()

        def one(sock):
            if not send:
                return _recv_all(sock, chunk)
            _send_for(sock, chunk, seconds)
            ack = b""
            while len(ack) < 8 and (part := sock.recv(8 - len(ack))):
                ack += part
            return struct.unpack("!Q", ack)[0]

        total = sum(_threads(one, socks))
        return total, time.perf_counter() - t0
    finally:
        for s in socks:
            s.close()


# -- torch.distributed ---------------------------------------------------------------------------
def dist_unavailable(backend: str, device: torch.device) -> str | None:
    """Why `backend` cannot run on `device` in this process, or None."""
    import torch.distributed as dist

    if not dist.is_available():
        return "torch was built without torch.distributed"
    if backend == "nccl":
        if device.type != "cuda" or not torch.cuda.is_available():
            return "nccl needs CUDA devices on both sides (use --device cuda:N)"
        if not dist.is_nccl_available():
            return "this torch has no NCCL"
    elif backend == "gloo":
        if device.type != "cpu":
            return "the gloo baseline runs on CPU tensors (use --device cpu)"
        if not dist.is_gloo_available():
            return "this torch has no gloo"
    else:
        return f"unknown backend {backend!r}"
    return None


def dist_env(loopback: bool, nvlink: bool = False) -> None:
    """Before the first process group: loopback sockets only (with nvlink: for the bootstrap
    only), unless the user set otherwise."""
    if loopback:
        for key, value in LOOPBACK_ENV.items():
            if not nvlink or key in ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME"):
                os.environ.setdefault(key, value)


def dist_init(backend: str, store, rank: int, device: torch.device) -> None:
    """Joins the two-process group once per process; later baselines reuse it."""
    import torch.distributed as dist

    if dist.is_initialized():
        return
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, store=store, rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=TIMEOUT_S))


def _dist_batch(tensor: torch.Tensor, n: int, rank: int, sender: int, pages: int = 1) -> None:
    import torch.distributed as dist

    if pages == 1:
        for _ in range(n):
            if rank == sender:
                dist.send(tensor, 1 - rank)
            else:
                dist.recv(tensor, 1 - rank)
        return
    views = tensor.view(pages, -1)
    order = torch.randperm(pages, generator=torch.Generator().manual_seed(rank)).tolist()
    op = dist.isend if rank == sender else dist.irecv
    for _ in range(n):
        for work in dist.batch_isend_irecv([dist.P2POp(op, views[i], 1 - rank) for i in order]):
            work.wait()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def serve_dist(nbytes: int, send: bool, device: torch.device, pages: int = 1) -> None:
    """The peer's half (rank 1): runs the batches rank 0 announces until it announces 0."""
    import torch.distributed as dist

    data = torch.empty(nbytes, dtype=torch.uint8, device=device)
    count = torch.zeros(1, dtype=torch.int64, device=device)
    while True:
        dist.recv(count, 0)
        n = int(count.item())
        if n == 0:
            break
        _dist_batch(data, n, 1, 1 if send else 0, pages)
    _sync(device)


def measure_dist(nbytes: int, send: bool, device: torch.device, seconds: float, pages: int = 1):
    """The driver's half (rank 0): one batch to warm up (and to create NCCL's p2p
    communicator), then batches of about 0.1 s until `seconds` have passed. Every batch is
    announced to the peer with a count, so both sides post matching operations."""
    import torch.distributed as dist

    data = torch.empty(nbytes, dtype=torch.uint8, device=device)
    count = torch.zeros(1, dtype=torch.int64, device=device)
    sender = 0 if send else 1

    def batch(n: int) -> float:
        t = time.perf_counter()
        count.fill_(n)
        dist.send(count, 1)
        if n:
            _dist_batch(data, n, 0, sender, pages)
        _sync(device)
        return time.perf_counter() - t

    return _timed(batch, seconds, nbytes)


def _timed(batch, seconds: float, nbytes: int):
    """Runs batch(n) (it returns its seconds) in batches of about 0.1 s until `seconds` have
    passed, after a warm-up of 2; batch(0) ends it. Returns (bytes, seconds) of the timed part."""
    per_call = batch(2) / 2
    moved, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        n = max(1, min(int(0.1 / max(per_call, 1e-6)), 1 << 16))
        per_call = batch(n) / n
        moved += n
    elapsed = time.perf_counter() - t0
    batch(0)
    return moved * nbytes, elapsed


def measure_memcpy(nbytes: int, send: bool, device: torch.device, peer: torch.device, seconds: float):
    """Copies of `nbytes` between `device` and `peer` (to the peer if `send`) in this process,
    one block per call on the copy engines."""
    here = torch.empty(nbytes, dtype=torch.uint8, device=device)
    there = torch.empty(nbytes, dtype=torch.uint8, device=peer)
    src, dst = (here, there) if send else (there, here)

    def batch(n: int) -> float:
        t = time.perf_counter()
        for _ in range(n):
            dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize(device)
        torch.cuda.synchronize(peer)
        return time.perf_counter() - t

    return _timed(batch, seconds, nbytes)
