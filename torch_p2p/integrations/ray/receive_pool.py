"""ReceivePool: the host memory that fetches read into, kept registered and resident between
fetches.

A fetch hands its tensors to the user, so it needs new memory each time; from the allocator
that memory is untouched pages, and faulting them in costs about what the copy does (on two
cores, 64 MiB: 0.3 s of faults beside 0.3 s of copying). Objects of the sizes seen before (an
RL step's weights, again and again) are read instead into buffers that earlier fetches used:
a buffer goes back to the pool when the last tensor viewing it dies, stays registered with the
engine, and is taken by the next fetch of its size. The pool keeps at most ``idle_bytes`` of
buffers nobody uses (``TORCH_P2P_RAY_POOL_BYTES``, default 2 GiB; 0 keeps none), dropping
the least recently returned first.

Each fetch takes one buffer for all of its object's tensors; the user's tensors are views of a
lease on it (a ctypes array over the buffer's memory), whose finalizer gives the buffer back.
The engine reads into views of the buffer's own registered tensor, the same memory.
"""
from __future__ import annotations

import ctypes
import mmap
import os
import threading
import weakref
from dataclasses import dataclass

import torch

from ... import Engine, Region

_ALIGN = 64  # each tensor of a buffer starts on a cache line (and any dtype's alignment)


def size_class(nbytes: int) -> int:
    """The buffer size a fetch of `nbytes` takes: powers of two up to 2 MiB, then multiples of
    2 MiB, so that objects of about one size share buffers."""
    if nbytes <= 2 << 20:
        return max(4096, 1 << (nbytes - 1).bit_length())
    return -(-nbytes // (2 << 20)) * (2 << 20)


@dataclass(eq=False)
class _Buffer:
    memory: mmap.mmap
    tensor: torch.Tensor  # uint8 over all of `memory`, registered as `region`
    region: Region
    # A failed read may still be writing into it: deregistered (which waits for the read to
    # stop) instead of reused.
    spoiled: bool = False


class ReceivePool:
    def __init__(self, close_later, idle_bytes: int | None = None):
        """`close_later(fn)` runs fn off the caller's thread (deregistration may wait on peers)."""
        if idle_bytes is None:
            idle_bytes = int(os.environ.get("TORCH_P2P_RAY_POOL_BYTES", 2 << 30))
        self._close_later = close_later
        self._limit = idle_bytes
        self._lock = threading.Lock()
        self._idle: list[_Buffer] = []  # least recently returned first
        self._idle_bytes = 0
        self._leased: dict[int, _Buffer] = {}  # memory address -> buffer, while tensors view it

    def tensors(self, engine: Engine, meta: list) -> tuple[list[torch.Tensor], list[torch.Tensor], _Buffer | None]:
        """For Ray's (shape, dtype) list: the tensors to hand the user, the byte views the engine
        reads into (one per tensor with elements, in order; see registrations.byte_layout), and
        their buffer (to mark ``spoiled`` if the read fails)."""
        offsets, total = [], 0
        for shape, dtype in meta:
            offsets.append(total)
            total += -(-torch.Size(shape).numel() * dtype.itemsize // _ALIGN) * _ALIGN
        if total == 0:
            return [torch.empty(shape, dtype=dtype) for shape, dtype in meta], [], None
        buffer = self._take(engine, size_class(total))
        lease = (ctypes.c_uint8 * len(buffer.memory)).from_buffer(buffer.memory)
        weakref.finalize(lease, self._give_back, buffer).atexit = False
        leased = torch.frombuffer(lease, dtype=torch.uint8)
        tensors, local = [], []
        for (shape, dtype), offset in zip(meta, offsets):
            nbytes = torch.Size(shape).numel() * dtype.itemsize
            if nbytes == 0:
                tensors.append(torch.empty(shape, dtype=dtype))
                continue
            tensors.append(leased[offset:offset + nbytes].view(dtype).view(shape))
            local.append(buffer.tensor[offset:offset + nbytes].view([*shape, dtype.itemsize]))
        return tensors, local, buffer

    def counts(self) -> dict[str, int]:
        with self._lock:
            return {"pool_idle": len(self._idle), "pool_idle_bytes": self._idle_bytes,
                    "pool_leased": len(self._leased)}

    def region_of(self, t: torch.Tensor) -> Region | None:
        """The region of the leased buffer that `t`'s storage is (a received tensor), else None."""
        if t.device.type != "cpu":
            return None
        with self._lock:
            buffer = self._leased.get(t.untyped_storage().data_ptr())
            return buffer.region if buffer is not None else None

    def _take(self, engine: Engine, nbytes: int) -> _Buffer:
        with self._lock:
            for i, buffer in enumerate(self._idle):
                if len(buffer.memory) == nbytes and buffer.region.engine is engine:
                    del self._idle[i]
                    self._idle_bytes -= nbytes
                    self._leased[buffer.tensor.data_ptr()] = buffer
                    return buffer
        # New memory, faulted in here (MAP_POPULATE) rather than page by page under the copy.
        memory = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | mmap.MAP_POPULATE)
        tensor = torch.frombuffer(memory, dtype=torch.uint8)
        buffer = _Buffer(memory, tensor, engine.register(tensor))
        with self._lock:
            self._leased[tensor.data_ptr()] = buffer
        return buffer

    def _give_back(self, buffer: _Buffer) -> None:
        # Runs where the last tensor on the lease died (any thread): never blocks.
        with self._lock:
            del self._leased[buffer.tensor.data_ptr()]
            dropped = [buffer] if buffer.spoiled else []
            if not buffer.spoiled:
                self._idle.append(buffer)
                self._idle_bytes += len(buffer.memory)
            while self._idle_bytes > self._limit:
                gone = self._idle.pop(0)
                self._idle_bytes -= len(gone.memory)
                dropped.append(gone)
        for gone in dropped:
            self._close_later(gone.region.close)
