"""The torch.distributed baseline: send/recv of one tensor of the call's bytes between the driver
(rank 0) and its peer (rank 1), "nccl" on GPUs, "gloo" on CPUs; for paged rows,
batch_isend_irecv of the call's pages in a random order, as a serving stack without this library
moves KV blocks, at most DIST_GROUP_OPS pages per group. In local mode the transports are pinned
to loopback sockets (dist_env), so NCCL runs its socket transport: the same road the engine's tcp
provider takes; with nvlink NCCL picks its own (NVLink P2P between GPUs of one host)."""
from __future__ import annotations

import datetime
import os
import time

import torch

from _timing import TIMEOUT_S, sync, timed

# NOTE: NCCL (2.2x, two H200) takes 0.33 s for one batch_isend_irecv group of 16,384 p2p
# operations of 32 KiB and does not finish one of 65,536 in 150 s; a call's pages go in groups
# of at most this many, one after the other.
DIST_GROUP_OPS = 4096

# NCCL held to its socket transport on loopback, the road the engine's tcp provider takes there;
# GLOO_SOCKET_IFNAME does the same for gloo.
LOOPBACK_ENV = {
    "NCCL_P2P_DISABLE": "1",
    "NCCL_SHM_DISABLE": "1",
    "NCCL_IB_DISABLE": "1",
    "NCCL_NET": "Socket",
    "NCCL_SOCKET_IFNAME": "lo",
    "GLOO_SOCKET_IFNAME": "lo",
}


def dist_unavailable(backend: str, device: torch.device, peer_device: str | None = None) -> str | None:
    """Why `backend` cannot run on `device` in this process (against a peer on `peer_device` of
    this host, where given), or None."""
    import torch.distributed as dist

    if not dist.is_available():
        return "torch was built without torch.distributed"
    if backend == "nccl":
        if device.type != "cuda" or not torch.cuda.is_available():
            return "nccl needs CUDA devices on both sides (use --device cuda:N)"
        if not dist.is_nccl_available():
            return "this torch has no NCCL"
        if peer_device == str(device):
            return "NCCL cannot pair two ranks on one GPU (give the peer another: --peer-device)"
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


def dist_init(backend: str, store, rank: int, device: torch.device, world_size: int = 2) -> None:
    """Joins the group (of the driver and its peer by default) once per process; later
    baselines reuse it."""
    import torch.distributed as dist

    if dist.is_initialized():
        return
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=TIMEOUT_S))


def dist_leave() -> None:
    """Destroys this process's group, if it joined one."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


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
    sync(device)


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
        sync(device)
        return time.perf_counter() - t

    return timed(batch, seconds, nbytes)
