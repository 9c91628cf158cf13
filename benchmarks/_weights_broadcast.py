"""The baseline of weights.py: one update as RL frameworks push it with torch.distributed, the
tensors packed into buckets broadcast one after the other, in a group of the source (rank 0) and
every destination."""
from __future__ import annotations

import os

import torch

from _dist import dist_env, dist_init


def buckets(tensors: list, elem: int, bucket_bytes: int) -> list[list[int]]:
    """Consecutive tensors packed into buckets of at most bucket_bytes (at `elem` bytes each)."""
    out, cur, size = [], [], 0
    for i, t in enumerate(tensors):
        n = t.numel() * elem
        if cur and size + n > bucket_bytes:
            out.append(cur)
            cur, size = [], 0
        cur.append(i)
        size += n
    return out + [cur] if cur else out


def broadcast_update(tensors: list, dtype, bucket_bytes: int, group, source: bool, buf: torch.Tensor) -> None:
    """One update as frameworks do it: pack a bucket, broadcast it, unpack it."""
    import torch.distributed as dist

    for idx in buckets(tensors, dtype.itemsize, bucket_bytes):
        if len(idx) == 1:  # alone in its bucket: broadcast as it is (converted first at the source)
            t = tensors[idx[0]]
            dist.broadcast(t.to(dtype) if source else t, 0, group=group)
            continue
        parts, at = [], 0
        for i in idx:
            n = tensors[i].numel()
            parts.append((i, buf[at:at + n]))
            at += n
        if source:
            for i, view in parts:
                view.copy_(tensors[i].reshape(-1))
        dist.broadcast(buf[:at], 0, group=group)
        if not source:
            for i, view in parts:
                tensors[i].view(-1).copy_(view)
    dist.barrier(group=group)
    if tensors[0].is_cuda:
        torch.cuda.synchronize(tensors[0].device)


def join_group(args, rank: int, device: str) -> None:
    """Joins the group of the source and all max(--dests) destinations."""
    import torch.distributed as dist

    dist_env(True, nvlink=not args.nccl_sockets)
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    world = max(args.dests) + 1
    dist_init(args.baseline, dist.FileStore(args.store, world), rank, torch.device(device), world)
