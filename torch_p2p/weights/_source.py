"""The part every source rank of torch_p2p.weights shares: SourceBase, under the leader
(_leader.py) and the other ranks (_follower.py)."""
from __future__ import annotations

import collections
import time

import torch

from ._actor import Actor
from ._memory import SourceViews, Staging, register_sources
from ._plan import Layout, make_plan
from ._push import Member, PushResult, Round
from ._relay import Fanout
from ..errors import P2PError


class SourceBase(Actor):
    """What every source rank does: plans per destination layout, writing its own chunks to
    the roots of the groups, adopting children of dropped members."""

    def __init__(self, engine, tensors: dict, layout: Layout, rank: int, world: int, settings):
        super().__init__(engine, f"torch_p2p-weights-source{rank}")
        self.tensors, self.layout, self.rank, self.world, self.settings = tensors, layout, rank, world, settings
        device = next(iter(tensors.values())).device if tensors else torch.device("cpu")
        self.regions = register_sources(engine, tensors.values())
        self.staging = Staging(engine, device, settings.staging_slots, settings.chunk_bytes)
        self.staging.on_free = self._pump_all
        self.views = SourceViews(tensors, self.staging)
        self.source_layouts: list = [None] * world
        self.source_layouts[rank] = layout
        self.plans: dict[str, object] = {}
        self.known: dict[int, Member] = {}
        self.queue: collections.deque[Round] = collections.deque()
        self.current: Round | None = None
        self.last_version = 0  # the last pushed, or the one before a failed last push
        self.last_done = 0
        self.early_drops: dict[int, list] = {}
        self.handlers.update(dropped=self.on_dropped, lacking=self.on_lacking)

    # -- actions (any thread) --------------------------------------------------------------------
    def push(self, version: int | None) -> torch.futures.Future:
        if version is not None and version <= self.last_version:
            raise ValueError(f"version {version} is not above the last pushed, {self.last_version}")
        self.last_version = version = self.last_version + 1 if version is None else int(version)
        event = None
        if self.views.stream is not None:
            event = torch.cuda.current_stream(self.staging.device).record_event()
        rnd = Round(version, event)
        self.call(self._enqueue, rnd)
        return rnd.future

    def failed(self, rnd: Round, error: Exception) -> None:
        """Fails a push. A push that failed may be pushed again, with its version: a trainer
        retries the step it lost. (Actor thread; push() reads last_version from any thread.)"""
        if self.last_version == rnd.version:
            self.last_version = rnd.version - 1
        rnd.future.set_exception(error)

    def close(self) -> None:
        self.stop()
        for rnd in [self.current, *self.queue]:
            if rnd is not None and not rnd.future.done():
                for f in rnd.fanouts:
                    f.close()
                rnd.future.set_exception(P2PError("the weight source was closed"))
        self.staging.close()
        for region in self.regions:
            region.close()

    # -- shared reactions --------------------------------------------------------------------------
    def plan(self, layout: Layout):
        if layout.key not in self.plans:
            self.plans[layout.key] = make_plan(self.source_layouts, layout, self.settings.chunk_bytes)
        return self.plans[layout.key]

    def start_fanouts(self, rnd: Round, groups: list[list[int]]) -> None:
        self.views.follow(rnd.event)
        for group in groups:
            own = {c.id: c for c in self.plan(self.known[group[0]].layout).of_source(self.rank)}
            if own:
                rnd.fanouts.append(Fanout(self, rnd.version, group, -1, self.settings.fanout, own, own, self.views,
                                          self.known, self.settings.window,
                                          lambda m, why, r=rnd: self.child_failed(r, m, why), self.progress))

    def _pump_all(self) -> None:
        if self.current is not None:
            for f in self.current.fanouts:
                f.pump()

    def on_dropped(self, sender, msg) -> None:
        rnd = self.current
        if rnd is not None and rnd.version == msg["v"]:
            for f in rnd.fanouts:
                f.dropped(int(msg["member"]))
            self.progress()
        elif msg["v"] > self.last_done:  # a push this rank has not started yet (push() not called)
            self.early_drops.setdefault(int(msg["v"]), []).append(int(msg["member"]))

    def on_lacking(self, sender, msg) -> None:
        rnd = self.current
        if rnd is not None and rnd.version == msg["v"]:
            for f in rnd.fanouts:
                f.lacking(int(msg["member"]), msg["chunks"])

    def child_failed(self, rnd: Round, member: int, reason: str) -> None:
        raise NotImplementedError

    def progress(self) -> None:
        """Something moved: the current push may be complete."""

    def result(self, rnd: Round, received: list, dropped: dict) -> PushResult:
        return PushResult(rnd.version, received, dropped, time.monotonic() - rnd.t0,
                          sum(f.sent_bytes for f in rnd.fanouts))

