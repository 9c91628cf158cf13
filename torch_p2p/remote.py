"""RemoteTensor: a handle to (a view of) a tensor registered with another engine.

It holds metadata only: owner address, region id, per-rail keys, dtype, shape, strides and
offset. Basic indexing (ints, slices with positive steps, ``...``, ``None``) gives new views,
checked against the region's bounds; bytes and pickle round-trip it.
"""
from __future__ import annotations

import operator

import torch

from . import _C


class RemoteTensor:
    __slots__ = ("_v",)

    def __init__(self, view: _C.RemoteView):
        self._v = view

    # -- what it describes ---------------------------------------------------------------
    @property
    def shape(self) -> torch.Size:
        return torch.Size(self._v.shape)

    def size(self, dim: int | None = None):
        return self.shape if dim is None else self.shape[dim]

    def stride(self, dim: int | None = None):
        strides = tuple(self._v.strides)
        return strides if dim is None else strides[dim]

    def storage_offset(self) -> int:
        return self._v.offset

    @property
    def dtype(self) -> torch.dtype:
        return self._v.dtype

    @property
    def ndim(self) -> int:
        return len(self._v.shape)

    def dim(self) -> int:
        return self.ndim

    def numel(self) -> int:
        return self.shape.numel()

    def element_size(self) -> int:
        return self._v.element_size

    def __len__(self) -> int:
        if not self.ndim:
            raise TypeError("len() of a 0-d RemoteTensor")
        return self.shape[0]

    @property
    def owner(self) -> bytes:
        """The owning engine's address."""
        return self._v.owner

    @property
    def device(self) -> str:
        """Where the memory lives on the owner: "cpu" or "cuda:N"."""
        return self._v.device

    @property
    def region_id(self) -> int:
        return self._v.region_id

    @property
    def keys(self) -> list[int]:
        """One registration key per (piece, rail) of the owner's region."""
        return list(self._v.keys)

    @property
    def access(self) -> str:
        return {1: "r", 2: "w", 3: "rw"}.get(self._v.access, "")

    @property
    def staged(self) -> bool:
        """True when the owner's NICs cannot reach the memory and the owner copies through
        its staging slots (GPU memory without GPUDirect)."""
        return self._v.staged

    # -- serialization ---------------------------------------------------------------------
    def to_bytes(self) -> bytes:
        return self._v.to_bytes()

    @classmethod
    def from_bytes(cls, data: bytes) -> "RemoteTensor":
        """Parses bytes from to_bytes(); raises ValueError for anything else."""
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise TypeError(f"RemoteTensor.from_bytes takes bytes, not {type(data).__name__}")
        return cls(_C.RemoteView.from_bytes(bytes(data)))

    def __reduce__(self):
        return (RemoteTensor.from_bytes, (self.to_bytes(),))

    def __repr__(self) -> str:
        return (f"RemoteTensor(shape={tuple(self.shape)}, stride={self.stride()}, dtype={self.dtype}, "
                f"offset={self.storage_offset()}, region={self.region_id}, device={self.device!r}, "
                f"access={self.access!r})")

    # -- indexing --------------------------------------------------------------------------
    def __getitem__(self, index) -> "RemoteTensor":
        items = index if isinstance(index, tuple) else (index,)
        shape, strides = list(self._v.shape), list(self._v.strides)
        offset = self._v.offset
        specified = sum(1 for i in items if i is not None and i is not Ellipsis)
        if specified > len(shape):
            raise IndexError(f"too many indices for a RemoteTensor of dimension {len(shape)}")
        if sum(1 for i in items if i is Ellipsis) > 1:
            raise IndexError("an index can only have a single ellipsis ('...')")
        out_shape: list[int] = []
        out_strides: list[int] = []
        dim = 0
        for item in items:
            if item is None:
                out_shape.append(1)
                out_strides.append(1)
            elif item is Ellipsis:
                skip = len(shape) - specified
                out_shape += shape[dim:dim + skip]
                out_strides += strides[dim:dim + skip]
                dim += skip
            elif isinstance(item, slice):
                start, stop, step = item.indices(shape[dim]) if (item.step or 1) > 0 else (0, 0, 0)
                if step <= 0:
                    raise ValueError("RemoteTensor slices need a positive step")
                n = len(range(start, stop, step))
                offset += start * strides[dim]  # also for an empty slice, as torch does
                out_shape.append(n)
                stride = strides[dim] * step  # as torch has it
                if not -2 ** 63 <= stride < 2 ** 63:
                    if n > 1:
                        raise ValueError(f"slice step {step} makes the stride of dimension {dim} overflow")
                    stride = strides[dim]  # one element or none: the stride is never used
                out_strides.append(stride)
                dim += 1
            else:
                if isinstance(item, bool) or (isinstance(item, torch.Tensor) and item.dtype == torch.bool):
                    raise TypeError("RemoteTensor supports basic indexing only (no masks)")
                try:
                    i = operator.index(item)
                except TypeError:
                    raise TypeError(f"RemoteTensor supports basic indexing only: ints, slices, ... and "
                                    f"None, not {type(item).__name__}") from None
                size = shape[dim]
                if not -size <= i < size:
                    raise IndexError(f"index {i} is out of bounds for dimension {dim} with size {size}")
                offset += (i % size) * strides[dim]
                dim += 1
        out_shape += shape[dim:]
        out_strides += strides[dim:]
        return RemoteTensor(self._v.view(offset, out_shape, out_strides))
