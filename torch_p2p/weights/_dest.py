"""The destinations of torch_p2p.weights: join the leader, receive each version's chunks,
forward them to their relay children, and announce the version once every byte is here.

A version at a destination: `begin` posts a wait per chunk (arrivals are counted, so chunks
may come first), `ready` goes back (after apply() of the previous version when double
buffered), `route` names the relay group and starts forwarding, and the last arrival makes
the version current: `have` to the leader, then waiters and callbacks.
"""
from __future__ import annotations

import torch

from . import _wire as wire
from ._actor import Actor, error_of, log
from ._memory import TargetViews, register_targets
from ._plan import Layout, PlanError, make_plan
from ._relay import Fanout
from ._push import Member
from ..errors import PeerError

# How long a destination absorbs a second arrival of a chunk it asked an adopting parent for
# (the dropped parent's write may still land, with the same bytes).
ABSORB_S = 30.0


class Incoming:
    """One version arriving here."""

    def __init__(self, version: int):
        self.version = version
        self.waits: dict[int, torch.futures.Future] = {}
        self.arrived: set[int] = set()
        self.fanout: Fanout | None = None
        self.asked: set[int] = set()  # chunks named to an adopting parent
        self.complete = False

    def abandon(self, engine) -> None:
        for fut in self.waits.values():
            if not fut.done():
                engine.cancel(fut)
        if self.fanout is not None:
            self.fanout.close()


class Receiver(Actor):
    """A destination: its registered shards, its plan, the version arriving and its relaying.
    Owned by its actor thread; WeightDestination calls in through call()."""

    def __init__(self, engine, live: dict[str, torch.Tensor], layout: Layout, leader: bytes, name: str | None,
                 double_buffer: bool, window: int):
        super().__init__(engine, f"torch_p2p-weights-{name or 'destination'}")
        self.live, self.layout, self.leader, self.name, self.window = live, layout, leader, name, window
        self.double_buffer = double_buffer
        # Double buffering receives into private copies; apply() copies them into `live`.
        self.targets = {n: torch.empty_like(t) for n, t in live.items()} if double_buffer else live
        self.regions, self.remotes = register_targets(engine, self.targets)
        self.views = TargetViews(self.targets)
        self.member: int | None = None
        self.chunks: dict = {}
        self.known: dict[int, Member] = {}
        self.version: int | None = None
        self.applied: int | None = None
        self.incoming: Incoming | None = None
        self.pending_ready: int | None = None
        self.joined: torch.futures.Future | None = None
        self.leaving: torch.futures.Future | None = None
        self.leave_when_idle = False
        self.waiters: list = []
        self.callbacks: list = []
        self.handlers.update(joined=self.on_joined, refused=self.on_refused, left=self.on_left, begin=self.on_begin,
                             route=self.on_route, dropped=self.on_dropped, want=self.on_want, lacking=self.on_lacking,
                             failed=self.on_failed, ping=lambda sender, msg: self.send(sender, "pong"))

    # -- actions (run on the actor's thread through call()) ---------------------------------------------
    def join(self, fut) -> None:
        self.joined = fut
        remotes = {n: r.to_bytes() for n, r in self.remotes.items()}
        self.send(self.leader, "join", self._join_failed, name=self.name, layout=self.layout.to_json(), remotes=remotes)

    def wait_for(self, version: int, fut) -> None:
        if self.version is not None and self.version >= version:
            fut.set_result(self.version)
        else:
            self.waiters.append((version, fut))

    def applied_version(self, version: int) -> None:
        self.applied = version
        if self.pending_ready is not None:
            self._ready(self.pending_ready)

    def leave(self, fut) -> None:
        self.leaving = fut
        if self.member is None:
            self._finish_leave()
        else:
            self.send(self.leader, "leave", lambda e: self._finish_leave(), member=self.member)

    # -- reactions ---------------------------------------------------------------------------------
    def _join_failed(self, error) -> None:
        if self.joined is not None and not self.joined.done():
            self.joined.set_exception(error)

    def on_joined(self, sender, msg) -> None:
        sources = [Layout.from_json(s) for s in msg["sources"]]
        plan = make_plan(sources, self.layout, int(msg["chunk_bytes"]))
        self.chunks = {c.id: c for c in plan.chunks}
        self.member = int(msg["member"])
        if self.joined is not None and not self.joined.done():
            self.joined.set_result(plan)

    def on_refused(self, sender, msg) -> None:
        self._join_failed(PlanError([str(p) for p in msg["problems"]]))

    def on_left(self, sender, msg) -> None:
        if msg["busy"]:
            self.leave_when_idle = True  # the push under way counts on us as a relay
            self.progress()
        else:
            self._finish_leave()

    def on_begin(self, sender, msg) -> None:
        if self.member is None:
            return
        if self.incoming is not None and not self.incoming.complete:
            self.incoming.abandon(self.engine)  # the leader moved on: that version will not come
        inc = self.incoming = Incoming(int(msg["v"]))
        for cid in self.chunks:
            fut = inc.waits[cid] = self.engine.notification(wire.tag(inc.version, cid))
            self.on_done(fut, self._arrived, inc, cid)
        if self.double_buffer and self.version is not None and self.applied != self.version:
            self.pending_ready = inc.version  # the back buffer still holds an unapplied version
        else:
            self._ready(inc.version)
        if self.version is not None and self.version >= inc.version:
            self.version = inc.version - 1  # the version of a failed push again: its bytes are replaced
        if not self.chunks:
            self._complete(inc)

    def _ready(self, version: int) -> None:
        self.pending_ready = None
        self.send(self.leader, "ready", v=version, member=self.member)

    def on_route(self, sender, msg) -> None:
        inc = self.incoming
        if inc is None or inc.version != msg["v"]:
            return
        for info in msg["members"]:
            m = Member.from_info(info)
            self.known[m.id] = m
        group = [int(i) for i in msg["group"]]
        inc.fanout = Fanout(self, inc.version, group, int(msg["position"]), int(msg["fanout"]), self.chunks,
                            inc.arrived, self.views, self.known, self.window, self._child_failed, self.progress)

    def _child_failed(self, member: int, reason: str) -> None:
        self.send(self.leader, "drop", v=self.incoming.version, member=member, reason=reason)

    def _arrived(self, fut, inc: Incoming, cid: int) -> None:
        if inc is not self.incoming or error_of(fut) is not None:
            return  # abandoned, or cancelled
        inc.arrived.add(cid)
        if inc.fanout is not None:
            inc.fanout.arrived(cid)
        if len(inc.arrived) == len(self.chunks):
            self._complete(inc)

    def _complete(self, inc: Incoming) -> None:
        inc.complete = True
        self.version = inc.version
        self.send(self.leader, "have", v=inc.version, member=self.member)
        for cid in inc.asked:
            self.engine.notification(wire.tag(inc.version, cid), timeout=ABSORB_S)
        due = [(v, f) for v, f in self.waiters if v <= inc.version]
        self.waiters = [(v, f) for v, f in self.waiters if v > inc.version]
        for _, fut in due:
            fut.set_result(inc.version)
        for callback in list(self.callbacks):
            try:
                callback(inc.version)
            except Exception:  # noqa: BLE001 - the user's callback must not stop the destination
                log.exception("torch_p2p.weights: an on_version callback failed")
        self.progress()

    def on_dropped(self, sender, msg) -> None:
        inc = self.incoming
        if int(msg["member"]) == self.member:
            log.warning("torch_p2p.weights: %s was dropped from version %s: %s", self.name, msg["v"], msg["reason"])
            if inc is not None:
                inc.abandon(self.engine)
            self.member = self.incoming = None
            # No version comes to a destination that is out: its waiters learn it now.
            waiters, self.waiters = self.waiters, []
            for _, fut in waiters:
                fut.set_exception(PeerError(f"{self.name or 'this destination'} was dropped from version {msg['v']}: "
                                            f"{msg['reason']}"))
            if self.leaving is not None:
                self._finish_leave()
        elif inc is not None and inc.version == msg["v"] and inc.fanout is not None:
            inc.fanout.dropped(int(msg["member"]))

    def on_failed(self, sender, msg) -> None:
        """The push of a version failed at the sources: it will not come (it may be pushed again)."""
        version, inc = int(msg["v"]), self.incoming
        if inc is not None and inc.version == version and not inc.complete:
            inc.abandon(self.engine)
            self.incoming = None
        failed = [(v, f) for v, f in self.waiters if v <= version]
        self.waiters = [(v, f) for v, f in self.waiters if v > version]
        for _, fut in failed:
            fut.set_exception(PeerError(f"the push of version {version} failed: {msg['error']}"))

    def on_want(self, sender, msg) -> None:
        inc = self.incoming
        if inc is None or inc.version != msg["v"]:
            return
        lacking = sorted(set(self.chunks) - inc.arrived)
        inc.asked.update(lacking)
        self.send(sender, "lacking", v=inc.version, member=self.member, chunks=lacking)

    def on_lacking(self, sender, msg) -> None:
        inc = self.incoming
        if inc is not None and inc.version == msg["v"] and inc.fanout is not None:
            inc.fanout.lacking(int(msg["member"]), msg["chunks"])

    def progress(self) -> None:
        inc = self.incoming
        if self.leave_when_idle and (inc is None or inc.complete and (inc.fanout is None or inc.fanout.idle)):
            self._finish_leave()

    def _finish_leave(self) -> None:
        if self.incoming is not None:
            self.incoming.abandon(self.engine)
        self.member = self.incoming = None
        self.leave_when_idle = False
        if self.leaving is not None and not self.leaving.done():
            self.leaving.set_result(self.version)
