"""Registered memory of torch_p2p.weights: sources' storages, destinations' tensors and their
RemoteTensors, the staging slots of dtype conversion, and the views each chunk moves."""
from __future__ import annotations

import contextlib

import torch

from .._shared import by_storage
from ..remote import RemoteTensor
from ._plan import ALIGN, Chunk


def _whole_storage(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(0, dtype=dtype, device=t.device).set_(t.untyped_storage())


def _empty(t: torch.Tensor) -> bool:
    """An empty tensor (or an empty TP shard) has nothing to move: its storage, possibly of no
    bytes at all, is never registered, and no chunk refers to it."""
    return t.numel() == 0


def register_sources(engine, tensors) -> list:
    """Registers each storage holding a source tensor once (local views need no handle)."""
    groups = by_storage((None, t) for t in tensors if not _empty(t))
    return [engine.register(_whole_storage(group[0][1], torch.uint8), access="r") for group in groups.values()]


def register_targets(engine, tensors: dict[str, torch.Tensor]) -> tuple[list, dict[str, RemoteTensor]]:
    """Registers the storages of destination tensors for remote writes; returns the regions and
    a RemoteTensor per name laid out exactly like its tensor.

    A storage can be registered once, and a RemoteTensor only indexed (not re-strided), so a
    storage that holds several tensors (fused weights, one flat buffer) is registered through
    an "anchor": its elements as an overlapping view of shape (n_0, ..., n_k) and strides
    (1, ..., 1), from which any view with positive strides is a slice with steps."""
    regions, remotes = [], {}
    for members in by_storage((name, t) for name, t in tensors.items() if not _empty(t)).values():
        group = dict(members)
        views = {(t.storage_offset(), tuple(t.shape), t.stride(), t.dtype) for t in group.values()}
        if len(views) == 1:
            region = engine.register(next(iter(group.values())), access="w")
            remotes.update({name: region.remote for name in group})
        else:
            region, anchored = _register_anchor(engine, group)
            remotes.update(anchored)
        regions.append(region)
    return regions, remotes


def _register_anchor(engine, group: dict[str, torch.Tensor]):
    dtypes = {t.dtype for t in group.values()}
    if len(dtypes) > 1:
        raise ValueError(f"destination tensors {sorted(group)} share a storage but not a dtype: give each "
                         f"dtype its own storage")
    dtype = dtypes.pop()
    flat = _whole_storage(next(iter(group.values())), dtype)
    ndim = max(1, max(t.dim() for t in group.values()))
    # How far each tensor reaches along each anchor dimension (dimensions aligned on the right;
    # leading ones it lacks are indexed with integers, reaching 0).
    extents = {}
    for name, t in group.items():
        if any(s < 1 and n > 1 for s, n in zip(t.stride(), t.shape)):
            raise ValueError(f"destination tensor {name!r} has a stride below 1 (expanded or flipped)")
        extents[name] = [0] * (ndim - t.dim()) + [max(0, (n - 1) * s) for n, s in zip(t.shape, t.stride())]
    reach = [0] + [max(e[j] for e in extents.values()) for j in range(1, ndim)]
    reach[0] = flat.numel() - 1 - sum(reach)  # the anchor may not reach past the storage (torch checks)
    if any(e[0] > reach[0] for e in extents.values()):
        raise ValueError(f"destination tensors {sorted(group)} share a storage in a way the weights layer "
                         f"cannot address (give them storages of their own)")
    region = engine.register(flat.as_strided([r + 1 for r in reach], [1] * ndim, 0), access="w")
    remotes = {}
    for name, t in group.items():
        # The storage offset, spread over the dimensions' slack (it fits: the tensor does).
        left, index = t.storage_offset(), []
        first = ndim - t.dim()
        for j in range(ndim):
            start = min(left, reach[j] - extents[name][j])
            left -= start
            if j < first:
                index.append(start)
            else:
                step = max(1, t.stride(j - first))
                index.append(slice(start, start + extents[name][j] + 1, step))
        remotes[name] = region.remote[tuple(index)]
    return region, remotes


def _index(box) -> tuple:
    return tuple(slice(s, e) for s, e in box)


class Staging:
    """Fixed slots of the source's device memory, registered once, into which dtype conversion
    writes; a slot is busy from its conversion until its write completes. Allocated on first
    use: a source that converts nothing holds none."""

    def __init__(self, engine, device: torch.device, slots: int, slot_bytes: int):
        self.engine, self.device, self.count, self.slot_bytes = engine, device, slots, slot_bytes
        self.buffer = None
        self.region = None
        self.free: list[int] = []
        self.on_free = _nothing  # slots are shared by every group: all their senders may go on

    def acquire(self):
        if self.buffer is None:
            self.buffer = torch.empty(self.count, self.slot_bytes, dtype=torch.uint8, device=self.device)
            self.region = self.engine.register(self.buffer, access="r")
            self.free = list(range(self.count))
        return self.free.pop() if self.free else None

    def release(self, slot: int) -> None:
        self.free.append(slot)
        self.on_free()

    def close(self) -> None:
        if self.region is not None:
            self.region.close()
        self.buffer = self.region = None


class SourceViews:
    """Local views of a source's chunks: its own tensors' slices, or converted copies in a
    staging slot. On CUDA, conversions and writes run on a side stream that waits for the
    work the trainer queued before push()."""

    def __init__(self, tensors: dict[str, torch.Tensor], staging: Staging):
        self.tensors, self.staging = tensors, staging
        self.stream = torch.cuda.Stream(staging.device) if staging.device.type == "cuda" else None
        self._direct: dict[int, list] = {}

    def context(self):
        return torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()

    def follow(self, event) -> None:
        """Later conversions and writes run after `event` (recorded at push())."""
        if self.stream is not None and event is not None:
            self.stream.wait_event(event)

    def local(self, chunk: Chunk):
        """(views, release) for a write of `chunk`, or None while every staging slot is busy."""
        if not chunk.staged_bytes:
            key = id(chunk)  # plans live as long as the source: their chunks' ids are stable
            if key not in self._direct:
                self._direct[key] = [self.tensors[p.name][_index(p.src)] for p in chunk.pieces]
            return self._direct[key], _nothing
        slot = self.staging.acquire()
        if slot is None:
            return None
        buf, offset, views = self.staging.buffer[slot], 0, []
        with self.context():
            for p in chunk.pieces:
                src = self.tensors[p.name][_index(p.src)]
                if not p.convert:
                    views.append(src)
                    continue
                dst = buf[offset:offset + p.nbytes].view(p.dtype).view(src.shape)
                dst.copy_(src)
                views.append(dst)
                offset += -(-p.nbytes // ALIGN) * ALIGN
        return views, lambda: self.staging.release(slot)


class TargetViews:
    """Local views of a destination's chunks (what a relay forwards): its own tensors' slices.
    On CUDA forwards are issued on a stream of their own: the bytes came from a peer, so they
    wait for nothing, and a write follows its current stream's queued work (on the legacy
    default stream: every kernel the server has queued)."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        self.tensors = tensors
        self._cache: dict[int, list] = {}
        devices = {t.device for t in tensors.values() if t.device.type == "cuda"}
        self.stream = torch.cuda.Stream(devices.pop()) if devices else None

    def context(self):
        return torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()

    def local(self, chunk: Chunk):
        if chunk.id not in self._cache:  # one plan per destination: ids are unique
            self._cache[chunk.id] = [self.tensors[p.name][_index(p.dst)] for p in chunk.pieces]
        return self._cache[chunk.id], _nothing


def remote_views(remotes: dict[str, RemoteTensor], chunk: Chunk) -> list:
    return [remotes[p.name][_index(p.dst)] for p in chunk.pieces]


def _nothing() -> None:
    pass
