"""TrainerShare: a trainer rank's share of the weights, the registered copies it sends from.

verl hands a checkpoint engine a new generator of (name, tensor) every update, and the tensors
it yields may be temporaries (FSDP's full_tensor()) or views of a buffer reused for the next
tensor (Megatron's per-tensor gathers). torch_p2p.weights moves registered memory, registered
once. So each rank copies the tensors it owns into buffers of its own, allocated and
registered at the first update and refilled at every later one: the cost is one copy of the
rank's share (the model's bytes / trainer ranks) on the staging device and one device copy of
it per update; no registration after the first.

Every trainer rank sees the same sequence of tensors (verl's generators yield full tensors on
each rank), so each assigns ownership the same way without talking: a tensor goes to the rank
with the fewest bytes so far (ties to the lowest rank), which balances the ranks' shares to
within one tensor while the generator streams.
"""
from __future__ import annotations

import torch

from torch_p2p.weights import Layout, dtype_name


class TrainerShare:
    """The copies one trainer rank sends from. `specs` (name, dtype, shape) lists every tensor
    of the model in generator order; `owned` maps the names this rank sends to its buffers.
    Not thread-safe: the engine's caller fills it."""

    def __init__(self, rank: int, world: int, device: torch.device):
        if not 0 <= rank < world:
            raise ValueError(f"rank {rank} is not in a world of {world}")
        self.rank, self.world, self.device = rank, world, torch.device(device)
        self.specs: list[tuple[str, torch.dtype, tuple]] = []
        self.owned: dict[str, torch.Tensor] = {}
        self._owner: list[int] = []
        self._load = [0] * world  # bytes assigned to each rank
        self._names: set[str] = set()
        self._fixed = False
        self._next = 0  # index of the next tensor of the update under way

    @property
    def ready(self) -> bool:
        """Whether the first update has fixed the tensors."""
        return self._fixed

    def take(self, name: str, t: torch.Tensor) -> None:
        """One tensor of the update, in the generator's order: copied if this rank owns it."""
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name!r}: the weights generator yielded a {type(t).__name__}, not a tensor")
        with torch.no_grad():
            if self._fixed:
                self._again(name, t)
            else:
                self._first(name, t)
        self._next += 1

    def end(self) -> None:
        """The update's last tensor was taken."""
        count, self._next = self._next, 0
        if not self._fixed:
            if not self.specs:
                raise ValueError("the weights generator yielded no tensors")
            self._fixed = True
        elif count != len(self.specs):
            raise ValueError(f"this update yielded {count} tensors, the first update {len(self.specs)}")

    def abandon(self) -> None:
        """The update failed part way: a first update starts over at the next one."""
        self._next = 0
        if not self._fixed:
            self.specs, self.owned, self._owner, self._load, self._names = [], {}, [], [0] * self.world, set()

    def _first(self, name: str, t: torch.Tensor) -> None:
        if name in self._names:
            raise ValueError(f"the weights generator yielded {name!r} twice")
        owner = min(range(self.world), key=lambda r: (self._load[r], r))
        self._load[owner] += t.numel() * t.element_size()
        self.specs.append((name, t.dtype, tuple(t.shape)))
        self._owner.append(owner)
        self._names.add(name)
        if owner == self.rank:
            buf = torch.empty(t.shape, dtype=t.dtype, device=self.device)
            buf.copy_(t.detach())
            self.owned[name] = buf

    def _again(self, name: str, t: torch.Tensor) -> None:
        i = self._next
        if i >= len(self.specs) or (name, t.dtype, tuple(t.shape)) != self.specs[i]:
            seen = f"{name!r} {dtype_name(t.dtype)} {list(t.shape)}"
            want = ("nothing" if i >= len(self.specs) else
                    f"{self.specs[i][0]!r} {dtype_name(self.specs[i][1])} {list(self.specs[i][2])}")
            raise ValueError(f"tensor {i} of this update is {seen}, the first update's was {want}: "
                             f"the model's tensors must not change between updates")
        if self._owner[i] == self.rank:
            self.owned[name].copy_(t.detach())

    def layout(self) -> Layout:
        """The whole model, every tensor whole (what a rollout rank allocates)."""
        return Layout.of({name: torch.empty(shape, dtype=dtype, device="meta") for name, dtype, shape in self.specs})
