"""verl's ``torch_p2p`` checkpoint engine: trainer weights reach every rollout rank through
torch_p2p.weights.

verl's CheckpointEngineManager calls, on every update, prepare -> build_topology ->
init_process_group on all workers, then send_weights on the trainer ranks and receive_weights
on the rollout ranks, then finalize. The expensive things happen once instead:

- prepare opens the process's engines the first time and afterwards only returns their
  addresses; init_process_group records the topology; finalize keeps everything.
- The first send_weights fixes the model's tensors: each trainer rank copies its share
  (share.py) into buffers registered once, and starts a torch_p2p.weights source (rank 0
  leads; the others write their shares when it says go).
- A rollout rank the first time it receives learns the layout from the leader
  (rendezvous.py), allocates and registers one buffer per tensor, and joins: its plan is made
  then, once. Every rollout rank has the same layout, so they form one relay chain and the
  trainer ranks write each byte once.
- Each update is then one push; rollout ranks yield views of their buffers to verl's server
  adapter, which loads them into the model.

A replica added between updates joins at its first receive_weights without touching the
others. A replica removed between updates (verl's remove_replicas) leaves the leader's
membership at the next send_weights: the push neither writes to it nor waits for it; if it is
added again, it joins again. A dead trainer rank or relay fails the update within a bound (waiting.py).
A rollout rank dropped from a push (stalled past peer_timeout) joins again at its next
receive_weights, and the leader's next push waits for it unless its engine is gone. A step
that failed is pushed again with its version when verl retries it.
"""
from __future__ import annotations

import asyncio
import atexit
import hashlib
import logging
import time
import weakref
from typing import Any, AsyncGenerator

import torch
from verl.checkpoint_engine.base import CheckpointEngine, CheckpointEngineRegistry

import torch_p2p
import torch_p2p.weights as pw

from .rendezvous import LayoutService, encode, request_layout
from .share import TrainerShare
from .waiting import LIVENESS_S, SEND_TIMEOUT_S, check_alive, settled

log = logging.getLogger("torch_p2p.integrations.verl")

BACKEND = "torch_p2p"
# The update's global_steps travels with the weights, so a rollout rank checks that what it
# holds is the step it was asked to load (-1: the trainer gave none).
STEP = "__torch_p2p_verl_global_steps__"


def member_name(address: bytes) -> str:
    """How push results name a rollout rank: a digest of its data engine's address."""
    return "rollout-" + hashlib.sha1(address).hexdigest()[:12]


def _default_device() -> str:
    return f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu"


def _close_at_exit(ref: weakref.ref) -> None:
    engine = ref()
    if engine is not None:
        engine.close()


@CheckpointEngineRegistry.register(BACKEND)
class TorchP2PCheckpointEngine(CheckpointEngine):
    """One worker's side, trainer or rollout (the role comes with init_process_group).

    Args (``checkpoint_engine.engine_kwargs.torch_p2p``):
        device: where the share and receive buffers live, "cpu" or "cuda" (default: this
            process's GPU if it has one): one copy of the rank's share on a trainer rank, one
            copy of the model on a rollout rank.
        provider: the libfabric provider (None: automatic).
        chunk_bytes: the unit of a push (one notification per chunk and per relay hop).
        timeout: bounds one update (a push, and a rollout rank's wait for it).
        join_timeout: bounds the leader's wait for rollout ranks to join, and theirs for the
            layout.
    verl's bucket_size (update_weights_bucket_megabytes) is unused: nothing is bucketed.
    """

    def __init__(self, bucket_size: int = 0, is_master: bool = False, device: str | None = None,
                 provider: str | None = None, chunk_bytes: int = pw.CHUNK_BYTES, timeout: float = 600.0,
                 join_timeout: float = 120.0):
        if device is not None and torch.device(device).type not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda', not {device!r}")
        if int(chunk_bytes) < 64:
            raise ValueError(f"chunk_bytes must be at least 64, not {chunk_bytes!r}")
        self.is_master = bool(is_master)
        if device is None:
            device = _default_device()
        elif device == "cuda":
            device = f"cuda:{torch.cuda.current_device()}"  # an engine serves one GPU
        self.device = torch.device(device)
        self.provider = provider
        self.chunk_bytes = int(chunk_bytes)
        self.timeout = pw.positive_seconds(timeout, "timeout")
        self.join_timeout = pw.positive_seconds(join_timeout, "join_timeout")
        self.engine: torch_p2p.Engine | None = None
        self.service: LayoutService | None = None  # the leader's
        self.role: str | None = None
        self.rank = 0
        self.trainers: list[bytes] = []
        self.rollouts: list[bytes] = []
        self.service_address: bytes | None = None
        self.share: TrainerShare | None = None
        self.source: pw.WeightSource | None = None
        self.receiving: pw.ReceiveBuffers | None = None
        self.version = 0               # the last version pushed or received
        self.global_steps: int | None = None  # of the last update
        self.joins = 0                 # times this rollout rank joined the leader
        self.rejoining: set[bytes] = set()  # the leader's: rollout ranks dropped from a push
        self.rejoin: asyncio.Future | None = None  # a rollout rank's join after it was dropped

    # -- verl's topology calls ---------------------------------------------------------------------
    def prepare(self) -> dict[str, Any]:
        """Opens the engines the first time; returns their addresses (plain data for Ray)."""
        if self.engine is None:
            self.engine = torch_p2p.Engine(str(self.device), provider=self.provider)
            # verl never closes a checkpoint engine: its process's exit does (leaving the
            # leader's membership, stopping the threads) before the engines' own atexit.
            atexit.register(_close_at_exit, weakref.ref(self))
            if self.is_master:
                self.service = LayoutService(torch_p2p.Engine("cpu", provider=self.provider))
        return {"address": self.engine.address, "is_master": self.is_master,
                "service": self.service.address if self.service is not None else None}

    @classmethod
    def build_topology(cls, actor_wg_world_size: int, rollout_world_size: int, metadata: list[dict]):
        trainers, rollouts = metadata[:actor_wg_world_size], metadata[actor_wg_world_size:]
        if len(rollouts) != rollout_world_size:
            raise ValueError(f"expected {actor_wg_world_size} + {rollout_world_size} workers' metadata, "
                             f"got {len(metadata)}")
        if not trainers or not trainers[0]["is_master"] or any(m["is_master"] for m in metadata[1:]):
            raise ValueError("the trainer's rank 0, and only it, must be built with is_master=True")
        common = {"trainers": [m["address"] for m in trainers], "rollouts": [m["address"] for m in rollouts],
                  "service": trainers[0]["service"]}
        actor = {"role": ["trainer"] * len(trainers), "rank": list(range(len(trainers)))}
        rollout = {"role": ["rollout"] * len(rollouts), "rank": list(range(len(rollouts)))}
        for k, v in common.items():
            actor[k], rollout[k] = [v] * len(trainers), [v] * len(rollouts)
        return actor, rollout

    def init_process_group(self, role: str, rank: int, trainers: list, rollouts: list, service: bytes):
        """Records the topology. Joins happen at the first receive_weights (the layout is not
        known before the first send_weights); the trainer group must stay as it was."""
        trainers = [bytes(a) for a in trainers]
        if self.engine is None:
            raise RuntimeError("init_process_group before prepare")
        # A rollout rank's index moves when a replica before it is removed; a trainer rank's may not.
        same = role == self.role and trainers == self.trainers and (role == "rollout" or int(rank) == self.rank)
        if self.role is not None and not same:
            raise RuntimeError("the trainer group or this worker's role changed between updates; "
                               "the torch_p2p engine supports adding and removing rollout replicas only")
        self.role, self.rank, self.trainers = role, int(rank), trainers
        self.rollouts = [bytes(a) for a in rollouts]
        self.service_address = bytes(service)

    def finalize(self) -> None:
        """Nothing: the buffers, registrations, plan and membership serve the next update.
        close() releases them."""

    # -- trainer ranks -----------------------------------------------------------------------------
    @torch.no_grad()
    async def send_weights(self, weights, global_steps: int | None = None) -> dict:
        if self.role != "trainer":
            raise RuntimeError("send_weights on a worker that init_process_group made a rollout rank")
        share = self.share = self.share or TrainerShare(self.rank, len(self.trainers), self.device)
        first = not share.ready
        try:
            async for name, tensor in _items(weights):
                share.take(name, tensor)
            share.end()
        except BaseException:
            share.abandon()
            raise
        if self.rank == 0:
            step = share.owned.get(STEP)
            if step is None:
                step = share.owned[STEP] = torch.empty(1, dtype=torch.int64, device=self.device)
            step.fill_(-1 if global_steps is None else int(global_steps))
        if first:
            self._start_source(share)
        version = self.version + 1
        start = time.perf_counter()
        if self.rank == 0:
            self._remove_departed()
            await self._wait_for_joins()
        result = await settled(self.source.push(version), self.timeout + 5.0, f"pushing weights version {version}",
                               None if self.rank == 0 else self._leader_alive)
        self.version, self.global_steps = version, global_steps
        if self.rank == 0:
            self.service.version = version  # where a rollout rank joining later starts
        expected = {member_name(a) for a in self.rollouts}
        lost = {n: why for n, why in result.dropped.items() if n in expected}
        if lost and self.rank == 0:
            # A dropped rank may only have stalled: it joins again at its next receive_weights,
            # and the next push waits for that unless the rank is dead.
            dropped = {a for a in self.rollouts if member_name(a) in lost}
            self.service.forget(dropped)
            self.rejoining |= dropped
        if lost:
            raise RuntimeError(f"weights version {version} (global_steps {global_steps}): rollout ranks dropped "
                               f"during the push: {lost}")
        # verl merges the trainer ranks' dicts: per-rank keys keep each rank's bytes.
        return {"torch_p2p/update_s": time.perf_counter() - start,
                f"torch_p2p/bytes_sent/rank{self.rank}": result.bytes_sent}

    def _start_source(self, share: TrainerShare) -> None:
        shards = pw.whole(share.owned)
        leader = None if self.rank == 0 else self.trainers[0]
        self.source = pw.WeightSource(self.engine, shards, rank=self.rank, world=len(self.trainers), leader=leader,
                                      chunk_bytes=self.chunk_bytes, timeout=self.timeout,
                                      ready_timeout=min(30.0, self.timeout))
        if self.rank == 0:
            layout = share.layout().to_json() + pw.Layout.of({STEP: share.owned[STEP]}).to_json()
            self.service.publish(layout, self.engine.address)

    def _remove_departed(self) -> None:
        """Rollout ranks that joined and are no longer in the topology leave the membership."""
        gone = self.service.joined() - set(self.rollouts)
        if gone:
            self.source.remove(gone)
            self.service.forget(gone)

    async def _wait_for_joins(self) -> None:
        """Until every rollout rank of the topology has joined (a new one joins at its first
        receive_weights, which verl runs beside this call)."""
        deadline = time.monotonic() + self.join_timeout
        dead: set[bytes] = set()  # dropped from a push before, and not answering: the push goes without them
        while True:
            wanted = set(self.rollouts) - dead
            missing = await asyncio.to_thread(self.service.wait_joined, wanted,
                                              min(LIVENESS_S, max(0.0, deadline - time.monotonic())))
            self.rejoining -= wanted - missing
            if not missing:
                return
            if time.monotonic() >= deadline:
                raise torch_p2p.TimeoutError(f"{len(missing)} rollout ranks did not join within "
                                             f"{self.join_timeout:g} s: {sorted(map(member_name, missing))}")
            for address in missing & self.rejoining:
                try:
                    await check_alive(self.engine, {member_name(address): address})
                except torch_p2p.PeerError:
                    dead.add(address)

    async def _leader_alive(self) -> None:
        await check_alive(self.engine, {"the leading trainer rank": self.trainers[0]})

    # -- rollout ranks -----------------------------------------------------------------------------
    @torch.no_grad()
    async def receive_weights(self, global_steps: int | None = None) -> AsyncGenerator[tuple[str, torch.Tensor], None]:
        """Yields (name, tensor) for every tensor of the update: this rank's registered buffers,
        valid until the next update and read-only (the relay to the next rollout rank may
        still be reading them)."""
        if self.role != "rollout":
            raise RuntimeError("receive_weights on a worker that init_process_group made a trainer rank")
        if self.receiving is not None and not self.receiving.dest.joined:  # removed, and now added again
            self.receiving.close()
            self.receiving = None
        if self.rejoin is not None and not self.rejoin.done():
            await self.rejoin
        if self.receiving is None:
            await self._join()
        version = self.version + 1
        receiving = self.receiving
        try:
            got = await settled(receiving.dest.wait_for(version), self.timeout,
                                f"receiving weights version {version}", self._trainers_alive)
        except torch_p2p.PeerError:
            if receiving.dest.joined:
                raise
            # Dropped from a push while it was stopped, and told only once it ran again (perhaps
            # after this call began): the leader waits for this rank to join again before its
            # next push. One join, whichever call (an earlier one verl gave up on) learns it first.
            if self.receiving is receiving:
                receiving.close()
                self.receiving = None
                self.rejoin = asyncio.ensure_future(self._join())
            await self.rejoin
            version = self.version + 1
            got = await settled(self.receiving.dest.wait_for(version), self.timeout,
                                f"receiving weights version {version}", self._trainers_alive)
        if got != version:
            raise RuntimeError(f"waited for weights version {version}, but version {got} arrived: this rank "
                               f"missed an update")
        buffers = self.receiving.buffers
        step = int(buffers[STEP].item())
        if global_steps is not None and step != int(global_steps):
            raise RuntimeError(f"asked to load global_steps {global_steps}, but the weights that arrived are "
                               f"of global_steps {step}")
        self.version, self.global_steps = version, (None if step < 0 else step)
        for name, tensor in buffers.items():
            if name != STEP:
                yield name, tensor

    async def _join(self) -> None:
        answer = await request_layout(self.engine, self.service_address, self.join_timeout, self._trainers_alive)
        receiving = pw.ReceiveBuffers(pw.Layout.from_json(answer["tensors"]), bytes.fromhex(answer["leader"]),
                                      engine=self.engine, device=self.device, name=member_name(self.engine.address))
        try:
            await settled(receiving.join(), self.join_timeout, "joining the trainer's weight source",
                          self._trainers_alive)
            await settled(self.engine.send(self.service_address, encode("joined")), SEND_TIMEOUT_S,
                          "telling the trainer this rank joined")
        except BaseException:
            receiving.close()
            raise
        self.receiving, self.version = receiving, int(answer["version"])
        self.joins += 1

    async def _trainers_alive(self) -> None:
        await check_alive(self.engine, {f"trainer rank {r}": a for r, a in enumerate(self.trainers)})

    # -- teardown ----------------------------------------------------------------------------------
    def close(self) -> None:
        """Leaves or stops pushing, deregisters the buffers, closes the engines."""
        for part in (self.receiving, self.source, self.service):
            if part is not None:
                part.close()
        for engine in (self.engine, self.service.engine if self.service is not None else None):
            if engine is not None:
                engine.close()
        self.receiving = self.source = self.service = self.engine = None


async def _items(weights):
    """verl passes a generator or an async generator of (name, tensor)."""
    if hasattr(weights, "__aiter__"):
        async for item in weights:
            yield item
    else:
        for item in weights:
            yield item


