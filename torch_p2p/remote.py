"""RemoteTensor: a handle to (a view of) a tensor registered with another engine.

It holds metadata only: owner address, region id, per-rail keys, dtype, shape, strides and
offset. Basic indexing (ints, slices with positive steps, ``...``, ``None``) gives new views,
checked against the region's bounds, and ``view(shape)`` reshapes as torch does; bytes and pickle
round-trip it.
"""
from __future__ import annotations

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

    # -- views ---------------------------------------------------------------------------
    def __getitem__(self, index) -> "RemoteTensor":
        """Basic indexing (ints, slices with positive steps, ``...``, ``None``) as torch does
        it; made natively: a view costs well under a microsecond."""
        return _index(self, index)

    def as_strided(self, size, stride, storage_offset: int = 0) -> "RemoteTensor":
        """A view of this tensor's region with the given shape, strides and offset (in
        elements of this dtype from the region's start), as ``torch.Tensor.as_strided``;
        ValueError where it reaches outside the region."""
        return RemoteTensor(self._v.view(int(storage_offset), [int(s) for s in size], [int(s) for s in stride]))

    def view(self, *shape) -> "RemoteTensor":
        """The same elements in another shape, by ``torch.Tensor.view``'s rules (one -1 is
        inferred; the strides must allow it without a copy; ValueError otherwise)."""
        return _view(self, *shape)


_index, _view = _C.remote_index, _C.remote_view
