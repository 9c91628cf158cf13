"""Baselines that bw.py measures beside the engine: same processes, same bytes, same run.

tcp:  plain TCP, one stream per rail, Python sockets: every stream moves its share of a
      call (call bytes / streams) with sendall() and recv_into() on preallocated buffers,
      one thread per stream (both calls release the GIL), for the row's duration.
dist: torch.distributed send/recv of one tensor of the call's bytes between the driver
      (rank 0) and its peer (rank 1): "nccl" on GPUs, "gloo" on CPUs; for paged rows,
      batch_isend_irecv of the call's pages in a random order, as a serving stack without this
      library moves KV blocks, at most DIST_GROUP_OPS (4096) pages per group: NCCL does not
      finish one group of 65,536 p2p operations (one of 16,384 takes a third of a second). In local mode the transports are pinned to loopback sockets
      (dist_env), so NCCL runs its socket transport: the same road the engine's tcp provider
      takes; with nvlink NCCL picks its own (NVLink P2P between GPUs of one host).
memcpy: cudaMemcpyPeerAsync (torch's cross-device copy) of the call's bytes as one block
      between this process's GPU and the peer's, in the driver process alone: the copy
      engines' ceiling for the same-host IPC route. On host memory, one memcpy per page of the
      row's pages in the row's orders, one thread of the driver process: one core's ceiling
      for the same-host cma route.
nixl, nixl-libfabric, mooncake: the peer libraries users compare this one with, through their
      Python APIs, moving the same pages between the same buffers: one descriptor per page
      (source and destination pages in the row's orders), one request (a NIXL transfer, a
      Mooncake batch) per call. NIXL: an agent with the UCX backend and num_threads=4, as
      vLLM's NixlConnector makes it, or its LIBFABRIC backend (libfabric 1.21 or newer);
      DRAM or VRAM descriptors after the tensors' device. Mooncake Transfer Engine:
      P2PHANDSHAKE, the tcp transport for host memory, nvlink_intra for GPU memory, per-peer
      TCP queues raised to their maximum so that a batch of thousands of pages is not
      refused. A library that is missing or cannot run here is skipped with its reason.

Each baseline has two halves: the peer's (serve_*) runs in bw.py's peer process, the
driver's (measure_*) in the process that drives the engine and returns (bytes, seconds).
"""
from __future__ import annotations

import collections
import contextlib
import datetime
import os
import socket
import statistics
import struct
import threading
import time

import torch

TIMEOUT_S = 120.0  # no socket or process-group wait lasts longer
# NOTE: NCCL (2.2x, two H200) takes 0.33 s for one batch_isend_irecv group of 16,384 p2p
# operations of 32 KiB and does not finish one of 65,536 in 150 s; a call's pages go in groups
# of at most this many, one after the other.
DIST_GROUP_OPS = 4096

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


def _dist_batch(tensor: torch.Tensor, n: int, rank: int, sender: int, pages: int, group_ops: int) -> None:
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
    groups = [order[at:at + group_ops] for at in range(0, pages, group_ops)]
    for _ in range(n):
        for group in groups:
            for work in dist.batch_isend_irecv([dist.P2POp(op, views[i], 1 - rank) for i in group]):
                work.wait()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def serve_dist(nbytes: int, send: bool, device: torch.device, pages: int = 1,
               group_ops: int = DIST_GROUP_OPS) -> None:
    """The peer's half (rank 1): runs the batches rank 0 announces until it announces 0."""
    import torch.distributed as dist

    data = torch.empty(nbytes, dtype=torch.uint8, device=device)
    count = torch.zeros(1, dtype=torch.int64, device=device)
    while True:
        dist.recv(count, 0)
        n = int(count.item())
        if n == 0:
            break
        _dist_batch(data, n, 1, 1 if send else 0, pages, group_ops)
    _sync(device)


def measure_dist(nbytes: int, send: bool, device: torch.device, seconds: float, pages: int = 1,
                 group_ops: int = DIST_GROUP_OPS):
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
            _dist_batch(data, n, 0, sender, pages, group_ops)
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


def measure_host_memcpy(buf: torch.Tensor, mine: list, theirs: list, seconds: float):
    """The call's pages copied between `buf` and a second buffer like it in this process, one
    memcpy per page on one thread (_C._copy_rows), mine -> theirs."""
    from torch_p2p import _C

    rows = buf.reshape(buf.shape[0], -1)
    other = torch.empty_like(rows)

    def batch(n: int) -> float:
        t = time.perf_counter()
        for _ in range(n):
            _C._copy_rows(other, theirs, rows, mine)
        return time.perf_counter() - t

    return _timed(batch, seconds, len(mine) * rows[0].numel() * rows.element_size())


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


def measure_page_kernel(page_bytes: int, mine: list, theirs: list, send: bool, device: torch.device,
                        peer: torch.device, seconds: float):
    """The call's pages moved by one plain copy kernel per call (Triton; one program per page),
    between a buffer on `device` and one on `peer` in this process through peer
    access, mine -> theirs (theirs -> mine if not `send`): what a paged call of the IPC route
    could reach if it cost nothing but its kernel."""
    kernel = _page_kernel()
    words = page_bytes // 8
    if kernel is None or page_bytes % 8:
        raise BaselineUnavailable("the page-kernel baseline needs Triton and pages of a multiple of 8 bytes")
    here = torch.zeros(len(mine), words, dtype=torch.int64, device=device)
    there = torch.zeros(len(theirs), words, dtype=torch.int64, device=peer)
    there.copy_(here.to(peer))  # peer access, as torch enables it for its own copies
    src, dst = (here, there) if send else (there, here)
    src_ids = torch.tensor(mine if send else theirs, dtype=torch.int64, device=src.device)
    dst_ids = torch.tensor(theirs if send else mine, dtype=torch.int64, device=src.device)
    block = min(1024, 1 << (words - 1).bit_length())

    def batch(n: int) -> float:
        t = time.perf_counter()
        with torch.cuda.device(src.device):
            for _ in range(n):
                kernel[(len(mine),)](src, dst, src_ids, dst_ids, words, BLOCK=block)
        _sync(device)
        _sync(peer)
        return time.perf_counter() - t

    try:
        return _timed(batch, seconds, len(mine) * page_bytes)
    except Exception as e:  # noqa: BLE001 - Triton's compile or launch refused: say why, skip
        raise BaselineUnavailable(f"the page kernel did not run: {type(e).__name__}: {e}") from None


class BaselineUnavailable(RuntimeError):
    """A baseline that cannot run here (a missing package): skipped with this reason."""


_PAGE_KERNEL: list = []


def _page_kernel():
    """The Triton page-copy kernel, compiled at first use; None without Triton."""
    if not _PAGE_KERNEL:
        try:
            import triton
            import triton.language as tl
        except ImportError:
            _PAGE_KERNEL.append(None)
            return None

        @triton.jit
        def copy_pages(src, dst, src_ids, dst_ids, words, BLOCK: tl.constexpr):
            k = tl.program_id(0)
            s = src + tl.load(src_ids + k) * words
            d = dst + tl.load(dst_ids + k) * words
            for off in range(0, words, BLOCK):
                o = off + tl.arange(0, BLOCK)
                m = o < words
                tl.store(d + o, tl.load(s + o, mask=m), mask=m)

        _PAGE_KERNEL.append(copy_pages)
    return _PAGE_KERNEL[0]


# -- peer libraries: NIXL and Mooncake Transfer Engine ----------------------------------------------
PEER_LIBRARIES = ("nixl", "nixl-libfabric", "mooncake")
NIXL_LIBFABRIC_MIN = (1, 21)  # NIXL's src/plugins/libfabric/README.md
# Mooncake's tcp transport refuses a batch beyond 1024 queued slices per peer by default
# (a 4096-page call fails with "TCP lane queue-full"); 65535 is the most it accepts.
MOONCAKE_ENV = {
    "MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER": "65535",
    "MC_TCP_MAX_PENDING_ADMISSIONS_PER_PEER": "65535",
    "MC_LOG_LEVEL": "ERROR",
}
NIXL_ENV = {"NIXL_LOG_LEVEL": "WARN"}  # no INFO line per agent and backend


class PeerLibraryError(RuntimeError):
    """A peer library refused or failed a step; the message is one line, fit for a skip notice."""


def peer_library_unavailable(name: str, device: torch.device) -> str | None:
    """Why the peer library `name` cannot run on `device` in this process, or None."""
    package, extra = ("mooncake-transfer-engine", "mooncake") if name == "mooncake" else ("nixl", "nixl")
    for key, value in (MOONCAKE_ENV if name == "mooncake" else NIXL_ENV).items():
        os.environ.setdefault(key, value)  # before the first import: read when the library loads
    try:
        if name == "mooncake":
            import mooncake.engine as module
        else:
            import nixl._api as module  # noqa: F401
    except Exception as e:  # noqa: BLE001 - ImportError, or a wheel built for another CUDA
        first = (str(e).splitlines() or [""])[0]
        return f"{package} cannot be imported ({type(e).__name__}: {first}); pip install 'torch_p2p[{extra}]'"
    if name == "nixl-libfabric":
        from torch_p2p import _C

        version = _C.libfabric_version()
        if version < NIXL_LIBFABRIC_MIN:
            return (f"libfabric {version[0]}.{version[1]} is installed; NIXL's LIBFABRIC backend needs "
                    f"{NIXL_LIBFABRIC_MIN[0]}.{NIXL_LIBFABRIC_MIN[1]} or newer")
    if name == "mooncake" and device.type == "cuda" and not getattr(module, "SUPPORT_INTRA_NVLINK", False):
        return "this Mooncake wheel has no nvlink_intra transport for GPU memory (install a CUDA wheel)"
    return None


def open_peer_library(name: str, device: torch.device, host: str) -> "PeerLibrary":
    """This process's side of `name`, reachable at `host`; raises PeerLibraryError."""
    if why := peer_library_unavailable(name, device):
        raise PeerLibraryError(why)
    with library_errors():
        return (Mooncake if name == "mooncake" else Nixl)(name, device, host)


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


class Nixl(PeerLibrary):
    def __init__(self, name: str, device: torch.device, host: str):
        super().__init__(name, device, host)
        from nixl._api import nixl_agent, nixl_agent_config

        backend = "LIBFABRIC" if name == "nixl-libfabric" else "UCX"
        # NOTE: vLLM's NixlConnector gives UCX num_threads=4 (its default) and other backends none.
        config = nixl_agent_config(backends=[backend], num_threads=4 if backend == "UCX" else 0)
        self.agent = nixl_agent(f"{name}-{os.getpid()}", config)
        if backend not in self.agent.backends:
            raise PeerLibraryError(f"NIXL has no usable {backend} plugin here")
        self.backend, self.what = backend, f"NIXL {backend}"
        self.mem = "VRAM" if device.type == "cuda" else "DRAM"
        self.dev = (device.index or 0) if device.type == "cuda" else 0
        self.registered: list = []
        self.requests: list = []
        self.peer: dict | None = None

    def register(self, tensors):
        self.registered.append(self.agent.register_memory(tensors, backends=[self.backend]))

    def address(self):
        return {"metadata": self.agent.get_agent_metadata(), "mem": self.mem, "dev": self.dev}

    def connect(self, peer):
        self.peer = dict(peer, name=self.agent.add_remote_agent(peer["metadata"]))

    def request(self, read, local, remote):
        agent, peer = self.agent, self.peer
        handle = agent.initialize_xfer(
            "READ" if read else "WRITE",
            agent.get_xfer_descs([(a, n, self.dev) for a, n in local], self.mem),
            agent.get_xfer_descs([(a, n, peer["dev"]) for a, n in remote], peer["mem"]),
            peer["name"], backends=[self.backend])
        self.requests.append(handle)
        return _NixlRequest(agent, handle)

    def release(self):
        for handle in self.requests:
            handle.release()
        for descs in self.registered:
            self.agent.deregister_memory(descs, backends=[self.backend])
        if self.peer:
            self.agent.remove_remote_agent(self.peer["name"])
        self.requests, self.registered, self.peer = [], [], None


class _NixlRequest(Request):
    def __init__(self, agent, handle):
        self.agent, self.handle = agent, handle

    def post(self):
        if self.agent.transfer(self.handle) == "ERR":
            raise PeerLibraryError("NIXL refused to post the transfer")

    def wait(self):
        while (state := self.agent.check_xfer_state(self.handle)) == "PROC":
            pass
        if state != "DONE":
            raise PeerLibraryError(f"NIXL transfer ended in state {state}")


class Mooncake(PeerLibrary):
    def __init__(self, name: str, device: torch.device, host: str):
        super().__init__(name, device, host)
        protocol = "tcp"
        if device.type == "cuda":
            protocol = "nvlink_intra"
            os.environ.setdefault("MC_INTRA_NVLINK", "true")
            torch.cuda.set_device(device)
        from mooncake.engine import TransferEngine

        self.engine = TransferEngine()
        if self.engine.initialize(host, "P2PHANDSHAKE", protocol, "") != 0:
            raise PeerLibraryError(f"Mooncake TransferEngine.initialize({host!r}, P2PHANDSHAKE, {protocol}) failed")
        self.what = f"Mooncake {protocol}"
        self.registered: list[int] = []
        self.session: str | None = None

    def register(self, tensors):
        location = f"cuda:{self.device.index or 0}" if self.device.type == "cuda" else "*"
        for base, size in dict.fromkeys(_allocation(t) for t in tensors):
            if self.engine.register_memory(base, size, location) != 0:
                raise PeerLibraryError(f"Mooncake register_memory of {size} bytes at {location} failed")
            self.registered.append(base)

    def address(self):
        return {"session": f"{self.host}:{self.engine.get_rpc_port()}"}

    def connect(self, peer):
        self.session = peer["session"]

    def request(self, read, local, remote):
        return _MooncakeRequest(self.engine, self.session, read, local, remote)

    def release(self):
        for base in self.registered:
            self.engine.unregister_memory(base)
        self.registered, self.session = [], None


def _allocation(tensor: torch.Tensor) -> tuple[int, int]:
    """(base, bytes) to register for `tensor`: on GPUs the whole cudaMalloc block holding it,
    since nvlink_intra shares memory with cudaIpcGetMemHandle, which maps from a block's start."""
    ptr = tensor.data_ptr()
    if tensor.is_cuda:
        for seg in torch.cuda.memory_snapshot():
            if seg["address"] <= ptr < seg["address"] + seg["total_size"]:
                return seg["address"], seg["total_size"]
    return ptr, tensor.nbytes


class _MooncakeRequest(Request):
    def __init__(self, engine, session, read, local, remote):
        self.engine, self.session = engine, session
        self.post_batch = engine.batch_transfer_async_read if read else engine.batch_transfer_async_write
        self.args = ([a for a, _ in local], [a for a, _ in remote], [n for _, n in local])
        self.batch = 0

    def post(self):
        self.batch = self.post_batch(self.session, *self.args)
        if not self.batch:
            raise PeerLibraryError(f"Mooncake refused a batch of {len(self.args[0])} descriptors")

    def wait(self):
        if self.engine.get_batch_transfer_status([self.batch]) != 0:
            raise PeerLibraryError(f"Mooncake batch of {len(self.args[0])} descriptors failed")


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

    return _timed(batch, seconds, nbytes)


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
