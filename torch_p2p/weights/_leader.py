"""The leader of torch_p2p.weights (source rank 0), which keeps the membership and runs each
push; the other source ranks (_follower.py) write their chunks when it says go.

A push at the leader, advanced by one reaction per event:
  queued   -> waiting for the previous push to complete
  ready    -> `begin` sent to every member; each answers `ready` once it waits for the chunks
              (members that fail or do not answer within ready_timeout are dropped)
  moving   -> groups routed, sources writing, relays forwarding; `have` from each member
  finished -> every routed member has the version or was dropped, nothing in flight here
"""
from __future__ import annotations

import collections
import time

from . import _wire as wire
from ._plan import Layout, PlanError
from ._push import Member, Phase, Round
from ._source import SourceBase
from ..errors import PeerError
from ..remote import RemoteTensor

PING_S = 1.0  # how often the leader checks that the engines of a push's members are alive
# A member or source rank that answers no ping this long is stalled (stopped, starved): its
# engine may still take messages and writes without it (the kernel copies into a stopped
# process on one host), so only its answer shows that it runs.
SILENT_S = 10.0


class Leader(SourceBase):
    """Source rank 0: membership, the phases of each push, liveness of those it waits on."""

    def __init__(self, engine, tensors, layout, world, settings):
        super().__init__(engine, tensors, layout, 0, world, settings)
        self.members: dict[int, Member] = {}
        self.followers: dict[int, bytes] = {}
        self.told: dict[bytes, set] = collections.defaultdict(set)  # peer -> member ids it has
        self.pending_joins: list = []
        self.planning: set[int] = set()  # followers that have every source's layout
        self.next_id = 1
        self.untold: list = []  # dropped members not told yet: (when, until, wait, address, member, version, reason)
        self.retries: list = []  # (when, resend) of other notices a stalled peer has not taken
        self.heard: dict[bytes, float] = {}  # peer -> when it last answered a ping
        self.handlers.update(hello=self.on_hello, join=self.on_join, leave=self.on_leave, ready=self.on_ready,
                             have=self.on_have, drop=self.on_drop, pong=self.on_pong)

    @property
    def complete_sources(self) -> bool:
        return None not in self.source_layouts

    # -- membership --------------------------------------------------------------------------------
    def on_hello(self, sender, msg) -> None:
        rank = int(msg["rank"])
        if 0 < rank < self.world:
            self.source_layouts[rank] = Layout.from_json(msg["layout"])
            self.followers[rank] = sender
        if self.complete_sources:
            for join in self.pending_joins:
                self.on_join(*join)
            self.pending_joins.clear()
            self._next()

    def on_join(self, sender, msg) -> None:
        if not self.complete_sources:
            self.pending_joins.append((sender, msg))
            return
        layout = Layout.from_json(msg["layout"])
        try:
            self.plan(layout)
            if set(msg["remotes"]) != {n for n, spec in layout.specs.items() if spec.nbytes}:
                raise PlanError(["the destination's handles do not name its tensors"])
        except PlanError as e:
            self.send(sender, "refused", problems=e.problems)
            return
        for old in [m for m in self.members.values() if m.address == sender]:
            self.members.pop(old.id)  # the same engine joining again replaces itself
        mid, self.next_id = self.next_id, self.next_id + 1
        remotes = {n: RemoteTensor.from_bytes(b) for n, b in msg["remotes"].items()}
        member = Member(mid, msg.get("name") or f"destination-{mid}", sender, layout, remotes)
        self.members[mid] = self.known[mid] = member
        self.send(sender, "joined", lambda e: self.members.pop(mid, None), member=mid,
                  sources=[s.to_json() for s in self.source_layouts], chunk_bytes=self.settings.chunk_bytes)

    def on_leave(self, sender, msg) -> None:
        mid = int(msg["member"])
        self.members.pop(mid, None)
        rnd = self.current
        busy = rnd is not None and mid in rnd.members and mid not in rnd.dropped
        self.send(sender, "left", busy=busy)

    def remove(self, addresses: set) -> None:
        for m in [m for m in self.members.values() if m.address in addresses]:
            del self.members[m.id]
            self._tell_dropped(m.address, m.id, self.last_version, "removed by the source")

    def _tell_dropped(self, address: bytes, member: int, version: int, reason: str, wait: float = PING_S,
                      until: float | None = None) -> None:
        """Tells a member that it is out. One dropped because its engine stopped answering
        cannot be told then: the notice goes again, half as often each time, for as long as a
        push may take (`timeout`), so that a destination that was only stalled (or cut off)
        learns it is out once it runs again, instead of waiting as a member for versions that
        never come."""
        until = time.monotonic() + self.settings.timeout if until is None else until

        def failed(error) -> None:
            if (when := time.monotonic() + wait) < until:
                self.untold.append((when, until, 2 * wait, address, member, version, reason))

        self.send(address, "dropped", failed, v=version, member=member, reason=reason)

    # -- a push ------------------------------------------------------------------------------------
    def _enqueue(self, rnd: Round) -> None:
        self.queue.append(rnd)
        self._next()

    def _next(self) -> None:
        if self.current is not None or not self.queue or not self.complete_sources:
            return
        rnd = self.current = self.queue.popleft()
        rnd.phase, rnd.t0 = Phase.READY, time.monotonic()
        rnd.members = dict(self.members)
        rnd.deadline = rnd.t0 + self.settings.ready_timeout
        for m in rnd.members.values():
            self.send(m.address, "begin", lambda e, m=m: self._drop(rnd, m.id, f"{type(e).__name__}: {e}"),
                      v=rnd.version)
        self._maybe_route(rnd)

    def on_ready(self, sender, msg) -> None:
        rnd = self.current
        if rnd is not None and rnd.version == msg["v"] and int(msg["member"]) in rnd.members:
            rnd.ready.add(int(msg["member"]))
            self._maybe_route(rnd)

    def _maybe_route(self, rnd: Round) -> None:
        if rnd.phase is not Phase.READY or not set(rnd.members) <= rnd.ready | set(rnd.dropped):
            return
        rnd.phase = Phase.MOVING
        by_layout: dict[str, list[int]] = {}
        for mid in sorted(rnd.ready - set(rnd.dropped)):
            by_layout.setdefault(rnd.members[mid].layout.key, []).append(mid)
        groups = list(by_layout.values())
        fanout = self.settings.fanout
        for group in groups:
            for position, mid in enumerate(group):
                m = rnd.members[mid]
                rnd.routed.add(mid)
                self.send(m.address, "route", lambda e, mid=mid: self._drop(rnd, mid, f"{type(e).__name__}: {e}"),
                          v=rnd.version, group=group, position=position, fanout=fanout,
                          members=self._tell(m.address, group))
        for rank, address in self.followers.items():
            # Source layouts go once: a follower plans for each destination layout itself.
            sources = None if rank in self.planning else [s.to_json() for s in self.source_layouts]
            self.planning.add(rank)
            self.send(address, "go", lambda e, rank=rank: self._fail(rnd, rank, e), v=rnd.version, groups=groups,
                      fanout=fanout, sources=sources,
                      members=self._tell(address, [mid for g in groups for mid in g]))
        self.start_fanouts(rnd, groups)
        rnd.next_ping = time.monotonic() + PING_S
        for address in [rnd.members[mid].address for mid in rnd.routed] + list(self.followers.values()):
            self.heard[address] = time.monotonic()
        self.progress()

    def _tell(self, address: bytes, ids: list[int]) -> list:
        """The member infos `address` lacks among `ids` (handles travel once per peer)."""
        new = [i for i in ids if i not in self.told[address] and self.known[i].address != address]
        self.told[address].update(new)
        return [wire.member_info(self.known[i]) for i in new]

    def on_have(self, sender, msg) -> None:
        rnd = self.current
        if rnd is not None and rnd.version == msg["v"] and int(msg["member"]) in rnd.members:
            rnd.have.add(int(msg["member"]))  # a member with nothing to receive has it before routing
            self.progress()

    def on_pong(self, sender, msg) -> None:
        self.heard[sender] = time.monotonic()

    def on_drop(self, sender, msg) -> None:
        if self.current is not None and self.current.version == msg["v"]:
            self._drop(self.current, int(msg["member"]), str(msg["reason"]))

    def child_failed(self, rnd: Round, member: int, reason: str) -> None:
        self._drop(rnd, member, reason)

    def _drop(self, rnd: Round, mid: int, reason: str) -> None:
        """A member is out of this push (and of the membership): one event for every node."""
        if rnd is not self.current or mid not in rnd.members or mid in rnd.dropped:
            return
        rnd.dropped[mid] = reason
        if self.members.get(mid) is rnd.members[mid]:
            del self.members[mid]
        if rnd.phase is Phase.MOVING:
            notify = list(self.followers.values()) + [rnd.members[i].address for i in rnd.routed
                                                      if i not in rnd.dropped]
            for address in notify:
                self.send(address, "dropped", v=rnd.version, member=mid, reason=reason)
            for f in rnd.fanouts:
                f.dropped(mid)
        self._tell_dropped(rnd.members[mid].address, mid, rnd.version, reason)
        self._maybe_route(rnd)
        self.progress()

    def _fail(self, rnd: Round, rank: int, error) -> None:
        if rnd is not self.current:
            return
        for f in rnd.fanouts:
            f.close()
        error = PeerError(f"source rank {rank} cannot be reached: {error}")
        for other, address in self.followers.items():
            if other != rank:
                self.send(address, "failed", v=rnd.version, error=str(error))
        for mid in rnd.members:  # they stop waiting for it
            if mid not in rnd.dropped:
                self.send(rnd.members[mid].address, "failed", v=rnd.version, error=str(error))
        # The rank that could not be reached may only be stalled: told again, until it takes the
        # notice or a push's timeout passed, its push fails once it runs again instead of waiting.
        self._tell_failed(self.followers[rank], rnd.version, str(error), PING_S, time.monotonic() + self.settings.timeout)
        self.current = None
        self.failed(rnd, error)
        self._next()

    def _tell_failed(self, address: bytes, version: int, error: str, wait: float, until: float) -> None:
        def failed(_) -> None:
            if (when := time.monotonic() + wait) < until:
                self.retries.append((when, lambda: self._tell_failed(address, version, error, 2 * wait, until)))

        self.send(address, "failed", failed, v=version, error=error)

    def progress(self) -> None:
        rnd = self.current
        if (rnd is None or rnd.phase is not Phase.MOVING or not rnd.routed <= rnd.have | set(rnd.dropped)
                or not all(f.idle for f in rnd.fanouts)):
            return
        rnd.phase = Phase.FINISHED
        received = [rnd.members[i].name for i in sorted(rnd.have - set(rnd.dropped))]
        dropped = {rnd.members[i].name: why for i, why in rnd.dropped.items()}
        for address in self.followers.values():
            self.send(address, "done", v=rnd.version, received=received, dropped=dropped)
        self.current = None
        rnd.future.set_result(self.result(rnd, received, dropped))
        self._next()

    def tick(self) -> None:
        rnd, now = self.current, time.monotonic()
        due = [u for u in self.untold if u[0] <= now]
        if due:
            self.untold = [u for u in self.untold if u[0] > now]
            for _, until, wait, address, member, version, reason in due:
                self._tell_dropped(address, member, version, reason, wait, until)
        resend = [r for r in self.retries if r[0] <= now]
        if resend:
            self.retries = [r for r in self.retries if r[0] > now]
            for _, again in resend:
                again()
        if rnd is None:
            return
        if rnd.phase is Phase.READY and now > rnd.deadline:
            for mid in set(rnd.members) - rnd.ready:
                self._drop(rnd, mid, f"not ready within {self.settings.ready_timeout} s")
        elif rnd.phase is Phase.MOVING and now > rnd.t0 + self.settings.timeout:
            for mid in rnd.routed - rnd.have:
                self._drop(rnd, mid, f"the push took more than {self.settings.timeout} s")
        elif rnd.phase is Phase.MOVING and now > rnd.next_ping:
            # A member that dies after its last chunk arrived fails no write (yet its children
            # may still need chunks from it): ask every member's engine.
            rnd.next_ping = now + PING_S
            for mid in rnd.routed - set(rnd.dropped):
                address = rnd.members[mid].address
                if now - self.heard.get(address, now) > SILENT_S:
                    self._drop(rnd, mid, f"it answered no ping for {SILENT_S:g} s")
                else:
                    self.send(address, "ping", lambda e, mid=mid: self._drop(rnd, mid, f"{type(e).__name__}: {e}"))
            for rank, address in self.followers.items():
                if rnd is not self.current:
                    break
                if now - self.heard.get(address, now) > SILENT_S:
                    self._fail(rnd, rank, f"it answered no ping for {SILENT_S:g} s")
                else:
                    self.send(address, "ping", lambda e, rank=rank: self._fail(rnd, rank, e))

