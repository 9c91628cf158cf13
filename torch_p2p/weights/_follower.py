"""The source ranks of torch_p2p.weights other than the leader (_leader.py)."""
from __future__ import annotations

import time

from . import _wire as wire
from ._plan import Layout
from ._push import Member, Phase, Round
from ._source import SourceBase
from ..errors import PeerError


class Follower(SourceBase):
    """Source rank > 0: introduces its layout to the leader, then writes its chunks of each
    push once both the user (push) and the leader (go) have started it."""

    def __init__(self, engine, tensors, layout, rank, world, leader: bytes, settings):
        super().__init__(engine, tensors, layout, rank, world, settings)
        self.leader = leader
        self.go: dict[int, dict] = {}
        self.failed_early: dict[int, str] = {}  # pushes the leader failed before this rank started them
        self.handlers.update(go=self.on_go, done=self.on_done_msg, failed=self.on_failed,
                             ping=lambda sender, msg: self.send(sender, "pong"))

    def start(self) -> None:
        super().start()
        hello = wire.encode("hello", rank=self.rank, layout=self.layout.to_json())
        self.engine.send(self.leader, hello).wait()  # fails with PeerError if the leader cannot be reached

    def _enqueue(self, rnd: Round) -> None:
        self.queue.append(rnd)
        self._next()

    def on_go(self, sender, msg) -> None:
        self.go[int(msg["v"])] = msg
        self._next()

    def _next(self) -> None:
        while self.current is None and self.queue and self.queue[0].version in self.failed_early:
            rnd = self.queue.popleft()
            self.failed(rnd, PeerError(self.failed_early.pop(rnd.version)))
        if self.current is not None or not self.queue or self.queue[0].version not in self.go:
            return
        rnd = self.current = self.queue.popleft()
        msg = self.go.pop(rnd.version)
        rnd.phase, rnd.t0 = Phase.MOVING, time.monotonic()
        if msg["sources"] is not None:
            self.source_layouts = [Layout.from_json(s) for s in msg["sources"]]
        for info in msg["members"]:
            member = Member.from_info(info)
            self.known[member.id] = member
        self.settings.fanout = int(msg["fanout"])
        self.start_fanouts(rnd, [[int(i) for i in g] for g in msg["groups"]])
        for member in self.early_drops.pop(rnd.version, []):
            for f in rnd.fanouts:
                f.dropped(member)

    def on_done_msg(self, sender, msg) -> None:
        rnd = self.current
        if rnd is not None and rnd.version == msg["v"]:
            rnd.outcome = msg
            self.progress()

    def on_failed(self, sender, msg) -> None:
        rnd, version = self.current, int(msg["v"])
        if rnd is not None and rnd.version == version:
            for f in rnd.fanouts:
                f.close()
            self.current = None
            self.failed(rnd, PeerError(str(msg["error"])))
        elif version > self.last_done:  # not started here yet: it fails when push() comes
            self.go.pop(version, None)
            self.early_drops.pop(version, None)
            self.failed_early[version] = str(msg["error"])
        self._next()

    def child_failed(self, rnd: Round, member: int, reason: str) -> None:
        self.send(self.leader, "drop", v=rnd.version, member=member, reason=reason)

    def progress(self) -> None:
        rnd = self.current
        if rnd is None or rnd.outcome is None or not all(f.idle or f.closed for f in rnd.fanouts):
            return
        for f in rnd.fanouts:
            f.close()
        self.current, self.last_done = None, rnd.version
        rnd.future.set_result(self.result(rnd, list(rnd.outcome["received"]), dict(rnd.outcome["dropped"])))
        self._next()
