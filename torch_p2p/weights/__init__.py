"""Weight updates from trainers to inference replicas (RL post-training).

    import torch_p2p.weights as pw

    # trainer rank 0 (the leader; ranks > 0 pass rank=, world=, leader=)
    source = pw.WeightSource(engine, pw.whole(model.state_dict()))
    fut = source.push()            # -> Future[PushResult]; returns at once
    ...                            # forward/backward may run; do not modify the weights
    fut.wait()                     # every destination present at the call has the version
    optimizer.step()

    # each inference rank
    dest = pw.WeightDestination(engine, {name: pw.Shard(t, shape, offset), ...}, leader_address)
    dest.join().wait()             # refused with PlanError if the tensors cannot be matched
    dest.wait_for(1).wait()        # version 1 is here, every byte of it

Both sides describe their tensors by name: the global shape and the slice held (`Shard`).
From the descriptions each destination gets a plan, once: which source rank's slice lands
where, cut into chunks; a push moves views, never gathering a tensor. Destinations with equal
layouts form relay trees (a chain by default): the source writes each chunk once, and a
destination forwards chunk k while later chunks still arrive. See the README section
"Weight updates (torch_p2p.weights)" for the protocol, the guarantees and the costs.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Mapping

import torch

from .._shared import positive as positive_seconds
from .._shared import wait
from ..engine import Engine
from ._dest import Receiver
from ._plan import Layout, Plan, PlanError, TensorSpec, dtype_name, make_plan, parse_dtype
from ._follower import Follower
from ._leader import Leader
from ._push import PushResult

__all__ = ["Shard", "whole", "split", "plan", "Plan", "PlanError", "Layout", "WeightSource", "WeightDestination",
           "ReceiveBuffers", "PushResult", "dtype_name", "parse_dtype", "positive_seconds", "CHUNK_BYTES", "WINDOW",
           "FANOUT", "STAGING_SLOTS"]

# Defaults; benchmarks/weights.py measures them (--chunk, --window, --fanout).
CHUNK_BYTES = 64 << 20
WINDOW = 2           # chunks in flight to each child: keeps arrivals in order, so relays start early
FANOUT = 1           # children per relay node: a chain
STAGING_SLOTS = 2    # dtype conversion: one slot converting while the other is written


class Shard:
    """The part of a named tensor one process holds: `tensor` is the slice of the global tensor
    of shape `shape` (default: the tensor's own) that starts at `offset` (default: 0s)."""

    __slots__ = ("tensor", "shape", "offset")

    def __init__(self, tensor: torch.Tensor, shape=None, offset=None):
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"a Shard holds a tensor, not {type(tensor).__name__}")
        if tensor.layout != torch.strided or tensor.is_quantized:
            # The wire carries a strided tensor's bytes: not a sparse tensor's indices, nor a
            # quantized tensor's scale and zero point.
            kind = "quantized" if tensor.is_quantized else str(tensor.layout).removeprefix("torch.")
            raise TypeError(f"the weights layer moves dense tensors, not a {kind} tensor: convert it "
                            f"(.dequantize(), .to_dense()) or send its parts as tensors of their own")
        self.tensor = tensor
        self.shape = tuple(int(s) for s in (tensor.shape if shape is None else shape))
        self.offset = tuple(int(o) for o in (offset if offset is not None else [0] * len(self.shape)))
        if not len(self.shape) == len(self.offset) == tensor.dim():
            raise ValueError(f"shape {list(self.shape)} and offset {list(self.offset)} must have one entry per "
                             f"dimension of the tensor ({tensor.dim()})")
        for o, n, g in zip(self.offset, tensor.shape, self.shape):
            if o < 0 or o + n > g:
                raise ValueError(f"a tensor of shape {list(tensor.shape)} at offset {list(self.offset)} does not "
                                 f"fit in the global shape {list(self.shape)}")

    @property
    def box(self) -> tuple:
        return tuple((o, o + n) for o, n in zip(self.offset, self.tensor.shape))

    def spec(self) -> TensorSpec:
        return TensorSpec(self.shape, self.box, self.tensor.dtype)

    def __repr__(self):
        return f"Shard({list(self.tensor.shape)} {self.tensor.dtype} at {list(self.offset)} of {list(self.shape)})"


def whole(tensors: Mapping[str, torch.Tensor]) -> dict[str, Shard]:
    """Every tensor held whole (e.g. a model's state_dict())."""
    return {name: Shard(t) for name, t in tensors.items()}


def split(tensor: torch.Tensor, dim: int, rank: int, parts: int) -> Shard:
    """The `rank`-th of `parts` slices of a whole tensor along `dim` (torch.tensor_split's
    sizes), as a Shard viewing `tensor`: a TP shard (dim 0: column-parallel weights, dim 1:
    row-parallel ones) or an FSDP dim-0 shard. Clone the view to own the memory."""
    dim = dim % tensor.dim()
    view = torch.tensor_split(tensor, parts, dim)[rank]
    offset = [0] * tensor.dim()
    offset[dim] = sum(p.shape[dim] for p in torch.tensor_split(tensor, parts, dim)[:rank])
    return Shard(view, tensor.shape, offset)


def _layout(shards: Mapping[str, Shard]) -> Layout:
    for name, s in shards.items():
        if not isinstance(s, Shard):
            raise TypeError(f"{name!r}: expected a Shard (pw.Shard, pw.whole), not {type(s).__name__}")
    return Layout({name: s.spec() for name, s in shards.items()})


def plan(sources: list[Mapping[str, Shard]], dest: Mapping[str, Shard], chunk_bytes: int = CHUNK_BYTES) -> Plan:
    """The plan a push follows (sources by rank): `plan.chunks`, each of Pieces (name, source
    box, destination box). Raises PlanError listing every unmatched name or shape and every
    incompletely covered slice. Source names the destination lacks are in `plan.unused`."""
    return make_plan([_layout(s) for s in sources], _layout(dest), chunk_bytes)


@dataclasses.dataclass
class _Settings:
    chunk_bytes: int
    window: int
    fanout: int
    staging_slots: int
    ready_timeout: float
    timeout: float


class WeightSource:
    """One trainer rank's side. Rank 0 is the leader: destinations join it, and it runs every
    push; ranks > 0 name it with `leader` (its engine's address) and call push() with it.

    Args:
        engine: a torch_p2p.Engine whose messages and notification tags are this object's.
        shards: name -> Shard, registered once (each storage); the memory stays registered.
        chunk_bytes: the unit written with one notification, and a staging slot's size.
        window: chunks in flight to each child. fanout: children per relay node (1: chain).
        staging_slots: slots of chunk_bytes for dtype conversion (allocated on first use).
        ready_timeout: a destination that does not answer `begin` in this time is dropped.
        timeout: destinations that have not received a push in this time are dropped.
    """

    def __init__(self, engine, shards: Mapping[str, Shard], *, rank: int = 0, world: int = 1,
                 leader: bytes | None = None, chunk_bytes: int = CHUNK_BYTES, window: int = WINDOW,
                 fanout: int = FANOUT, staging_slots: int = STAGING_SLOTS, ready_timeout: float = 30.0,
                 timeout: float = 600.0):
        if not 0 <= rank < world or (rank > 0) != (leader is not None):
            raise ValueError("rank 0 is the leader (no `leader`); ranks 1..world-1 need the leader's address")
        if min(window, fanout, staging_slots) < 1:
            raise ValueError("window, fanout and staging_slots must be at least 1")
        settings = _Settings(int(chunk_bytes), int(window), int(fanout), int(staging_slots), float(ready_timeout),
                             float(timeout))
        if settings.chunk_bytes < 64:
            raise ValueError(f"chunk_bytes must be at least 64, not {chunk_bytes}")
        tensors = {name: s.tensor for name, s in shards.items()}
        spec = _layout(shards)
        self._impl = (Leader(engine, tensors, spec, world, settings) if rank == 0 else
                      Follower(engine, tensors, spec, rank, world, bytes(leader), settings))
        try:
            self._impl.start()
        except BaseException:  # a follower whose leader cannot be reached: undo the registrations
            self._impl.close()
            raise

    @property
    def address(self) -> bytes:
        """The leader's address: what destinations (and source ranks > 0) need."""
        return self._impl.engine.address if self._impl.rank == 0 else self._impl.leader

    @property
    def version(self) -> int:
        """The last version pushed (0 before the first)."""
        return self._impl.last_version

    def push(self, version: int | None = None) -> torch.futures.Future:
        """Starts pushing the shards as `version` (default: the last + 1) to every destination
        that has joined; returns at once. The Future's PushResult names who received it and
        who was dropped. Until it completes the source tensors must not be modified: the push
        reads them from its start until its end (a dropped relay's children may be refilled
        from here). A push called while one is in flight queues behind it (call order); on
        CUDA it follows the work queued on the current stream before the call. The version of a
        push that failed may be pushed again."""
        return self._impl.push(version)

    def remove(self, addresses) -> None:
        """Leader only: the destinations on these engines leave the membership before the next
        push (one under way keeps them). Each is told, as a dropped destination is: it receives
        no more versions until it joins again."""
        if self._impl.rank != 0:
            raise ValueError("only the leader (rank 0) keeps the membership")
        self._impl.call(self._impl.remove, {bytes(a) for a in addresses})

    def close(self) -> None:
        """Fails pushes not yet complete and deregisters the memory (the engine stays open)."""
        self._impl.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class WeightDestination:
    """One inference rank's side: joins the leader, receives each version into its shards and
    relays it to destinations of the same layout.

    Args:
        engine: a torch_p2p.Engine whose messages and notification tags are this object's.
        shards: name -> Shard (the model's tensors, or its TP slices); registered once.
        leader: the leader source's address (WeightSource.address).
        name: how push results name this destination.
        double_buffer: receive into a private copy of the shards (as much memory again), so
            the shards keep serving the old version until apply(); a next version is not
            accepted before apply() of the previous one.
        window: chunks in flight to each relay child.
    """

    def __init__(self, engine, shards: Mapping[str, Shard], leader: bytes, *, name: str | None = None,
                 double_buffer: bool = False, window: int = WINDOW):
        self._impl = Receiver(engine, {n: s.tensor for n, s in shards.items()}, _layout(shards), bytes(leader),
                              name, double_buffer, int(window))
        self._impl.start()

    def join(self) -> torch.futures.Future:
        """Asks the leader in; completes with this destination's Plan, or fails with PlanError
        (nothing moves). The destination gets the next push that starts after it joined.
        A destination that left, or was dropped, may join again."""
        fut = torch.futures.Future()
        self._impl.call(self._impl.join, fut)
        return fut

    @property
    def version(self) -> int | None:
        """The last version whose every byte arrived (None before the first)."""
        return self._impl.version

    @property
    def joined(self) -> bool:
        """Whether the leader counts this destination in: False before join() completes, after
        leave(), and once dropped or removed."""
        return self._impl.member is not None

    def wait_for(self, version: int) -> torch.futures.Future:
        """Completes (with the version) once `version` or a later one has fully arrived; fails
        with PeerError if the source drops this destination or that version's push fails first."""
        fut = torch.futures.Future()
        self._impl.call(self._impl.wait_for, int(version), fut)
        return fut

    def on_version(self, callback: Callable[[int], None]) -> None:
        """callback(version) after each version's last byte; runs on this destination's thread
        and must not block (relaying waits for it)."""
        self._impl.callbacks.append(callback)

    @property
    def progress(self) -> tuple:
        """(version arriving or None, chunks arrived, chunks in all)."""
        inc = self._impl.incoming
        return (None, 0, len(self._impl.chunks)) if inc is None else (inc.version, len(inc.arrived),
                                                                      len(self._impl.chunks))

    def apply(self) -> int | None:
        """Double buffering: copies the last version into the shards (on CUDA on the current
        stream, synchronized: the next version may overwrite the private copy right after).
        Returns the version the shards now hold."""
        impl = self._impl
        if not impl.double_buffer:
            raise ValueError("apply() is for double-buffered destinations")
        version = impl.version
        if version is not None and version != impl.applied:
            with torch.no_grad():
                for name, t in impl.live.items():
                    t.copy_(impl.targets[name])
            devices = {t.device for t in impl.live.values() if t.device.type == "cuda"}
            for d in devices:
                torch.cuda.current_stream(d).synchronize()
            impl.call(impl.applied_version, version)
        return version

    def leave(self) -> torch.futures.Future:
        """Leaves the leader's membership at once; a push under way that counts on this
        destination (as a relay) is finished first. Completes with the last version held."""
        fut = torch.futures.Future()
        self._impl.call(self._impl.leave, fut)
        return fut

    def close(self, timeout: float = 10.0) -> None:
        """Leaves (waiting up to `timeout`), stops the thread and deregisters the memory."""
        try:
            wait(self.leave(), timeout)
        except Exception:  # noqa: BLE001 - closing goes on: the leader drops us at its next push
            pass
        self._impl.stop()
        for region in self._impl.regions:
            region.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class ReceiveBuffers:
    """A receiving rank's bring-up in one object: one buffer per tensor of a whole-tensor
    `layout` (what the trainer sends, e.g. ``Layout.from_json`` of its ``Layout.of(tensors)
    .to_json()``), allocated on `device`, registered with `engine` (or an engine of its own,
    opened on `device` with `provider`), and the WeightDestination over them. Pushes land in
    `buffers`; the caller joins with ``join()`` and loads from the buffers once
    ``version_ready`` says a version is whole.

    `floating_dtype`: floating tensors are received in it (the source converts on the way),
    other tensors in the layout's dtype. Not thread-safe: one owner thread."""

    def __init__(self, layout: Layout, leader: bytes, *, engine=None, device="cpu", provider: str | None = None,
                 name: str | None = None, floating_dtype: torch.dtype | None = None):
        if not layout.whole():
            raise ValueError("ReceiveBuffers takes a layout of whole tensors")
        self.buffers = {
            n: torch.empty(s.shape, device=device,
                           dtype=floating_dtype if floating_dtype is not None and s.dtype.is_floating_point else s.dtype)
            for n, s in layout.specs.items()}
        self._own_engine = engine is None
        self.engine = Engine(str(device), provider=provider) if engine is None else engine
        try:
            self.dest = WeightDestination(self.engine, whole(self.buffers), leader, name=name)
        except BaseException:
            if self._own_engine:
                self.engine.close()
            raise

    def join(self) -> torch.futures.Future:
        return self.dest.join()

    def version_ready(self, version: int, timeout: float) -> None:
        """Returns once `version` has wholly arrived and the buffers hold it with no later push
        arriving (waiting up to `timeout`: TimeoutError); RuntimeError if they hold another."""
        got = wait(self.dest.wait_for(version), positive_seconds(timeout))
        arriving, _, _ = self.dest.progress  # the version of the last push that began here
        if got != version or arriving != version:
            raise RuntimeError(f"asked to load version {version}, but the receive buffers hold version {got} and "
                               f"version {arriving} is arriving (None: this rank was dropped from the push group): "
                               f"the trainer pushes only after an update ends")

    def close(self) -> None:
        """Stops receiving and deregisters the buffers. With an engine of its own, that engine
        closes first, deregistering the buffers at once: a destination closed first waits for
        its leader's answer to the leave and its release of the buffers, which a dead leader
        never gives (the engine's peer_timeout); a live leader hears of the close."""
        if self._own_engine:
            self.engine.close()
            self.dest.close(timeout=0)  # stops its thread; the closed engine sends nothing
        else:
            self.dest.close()

