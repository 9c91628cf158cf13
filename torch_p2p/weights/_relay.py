"""Relay trees of torch_p2p.weights and the sending half of every node in them.

Destinations with equal layouts form a group, ordered by the leader. Position i's parent is
(i - 1) // fanout; the sources are the parent of position 0 (fanout 1 is a chain). A node that
has a chunk writes it to its children with the chunk's notification tag, so a child forwards
chunk k while chunks k + 1... are still on their way to it.

Repair: when a member drops out, every node of the push learns it from the leader (one event
for all) and recomputes its children, adopting the dropped one's; it asks each adopted child
which chunks it lacks (a chunk that was in flight from the dropped node may still land, with
the same bytes) and writes those.
"""
from __future__ import annotations

import collections

from . import _wire as wire
from ._actor import error_of
from ._memory import remote_views
from ..errors import P2PError


def children(position: int, size: int, fanout: int) -> list[int]:
    """Positions whose parent is `position` (-1: the sources) in a group of `size`."""
    if position < 0:
        return [0] if size else []
    first = position * fanout + 1
    return list(range(first, min(size, first + fanout)))


def live_children(position: int, size: int, fanout: int, dead: set[int]) -> list[int]:
    """The children of `position` once every dead node's children are its parent's."""
    out: list[int] = []
    for c in children(position, size, fanout):
        out.extend(live_children(c, size, fanout, dead) if c in dead else [c])
    return out


class _Child:
    __slots__ = ("member", "wants", "todo", "inflight", "failed")

    def __init__(self, member: int, wants):
        self.member = member
        self.failed = False          # reported to the leader; waiting for its verdict
        self.wants = wants           # chunk ids still to write; None until it said what it lacks
        self.todo = collections.deque()  # wanted ids available here, in order
        self.inflight: list = []


class Fanout:
    """Writes one version's chunks to this node's children in one group. Owned by the actor.

    `chunks`: id -> Chunk this node sends (a source: its own; a relay: all). `have`: ids
    available now (a relay adds arrivals with arrived()). `views`: local views of a chunk
    (SourceViews or TargetViews). `remotes`: member id -> Member (address, RemoteTensors).
    `on_failed(member, reason)`: a write to a child failed (it is reported to the leader).
    `on_progress()`: a write completed or a child changed: the owner may be done."""

    def __init__(self, actor, version: int, group: list[int], position: int, fanout: int, chunks: dict,
                 have, views, remotes: dict, window: int, on_failed, on_progress):
        self.actor, self.version, self.group, self.position = actor, version, group, position
        self.fanout, self.chunks, self.views, self.remotes = fanout, chunks, views, remotes
        self.window, self.on_failed, self.on_progress = window, on_failed, on_progress
        self.have = set(have)
        self.order = sorted(chunks)
        self.dead: set[int] = set()
        self.kids: dict[int, _Child] = {}
        self.sent_bytes = 0
        self.closed = False
        self._remote_cache: dict[tuple, list] = {}
        for p in live_children(position, len(group), fanout, self.dead):
            self._add(p, set(chunks))
        self.pump()

    @property
    def idle(self) -> bool:
        """Nothing in flight and nothing owed to a live child."""
        return all(not k.inflight and k.wants is not None and not k.wants for k in self.kids.values())

    def arrived(self, chunk_id: int) -> None:
        self.have.add(chunk_id)
        for kid in self.kids.values():
            if kid.wants and chunk_id in kid.wants:
                kid.todo.append(chunk_id)
        self.pump()

    def dropped(self, member: int) -> None:
        """`member` is out of this push: adopt its children (asking what they lack)."""
        if member not in self.group:
            return
        position = self.group.index(member)
        self.dead.add(position)
        kid = self.kids.pop(position, None)
        if kid:
            for fut in kid.inflight:
                self.actor.engine.cancel(fut)
        for p in live_children(self.position, len(self.group), self.fanout, self.dead):
            if p not in self.kids:
                self._add(p, None)
                self.actor.send(self._address(p), "want", lambda e, p=p: self._failed(p, e), v=self.version)

    def lacking(self, member: int, ids: list) -> None:
        """An adopted child's answer: the chunks it still needs."""
        if member not in self.group or (kid := self.kids.get(self.group.index(member))) is None:
            return
        if kid.wants is None:
            kid.wants = set(int(i) for i in ids) & set(self.chunks)
            kid.todo.extend(i for i in self.order if i in kid.wants and i in self.have)
        self.pump()
        self.on_progress()

    def close(self) -> None:
        """Cancels what is in flight (a destination leaving, a push abandoned)."""
        self.closed = True
        for kid in self.kids.values():
            for fut in kid.inflight:
                self.actor.engine.cancel(fut)

    def pump(self) -> None:
        """Starts writes up to `window` per child."""
        for position, kid in list(self.kids.items()):
            while not self.closed and not kid.failed and kid.todo and len(kid.inflight) < self.window:
                chunk = self.chunks[kid.todo[0]]
                got = self.views.local(chunk)
                if got is None:
                    return  # every staging slot is busy: a completion pumps again
                views, release = got
                kid.todo.popleft()
                try:
                    with self.views.context():
                        fut = self.actor.engine.write_slices(views, self._remote(kid.member, chunk),
                                                             notify=wire.tag(self.version, chunk.id))
                except P2PError as e:
                    release()
                    self._failed(position, e)
                    break
                kid.inflight.append(fut)
                self.actor.on_done(fut, self._written, position, kid, chunk, release)

    def _written(self, fut, position: int, kid: _Child, chunk, release) -> None:
        release()
        kid.inflight.remove(fut)
        if (e := error_of(fut)) is not None:
            if self.kids.get(position) is kid:
                self._failed(position, e)
        else:
            self.sent_bytes += chunk.nbytes
            if kid.wants is not None:
                kid.wants.discard(chunk.id)
        self.pump()
        self.on_progress()

    def _failed(self, position: int, error) -> None:
        kid = self.kids.get(position)
        if kid is None or kid.failed:
            return
        kid.failed = True
        kid.todo.clear()
        self.on_failed(self.group[position], f"{type(error).__name__}: {error}")

    def _add(self, position: int, wants) -> None:
        # Contacted on purpose first: an engine that saw this child's engine fail (a stall past
        # peer_timeout) fails every later write to it until it is contacted again, yet the leader
        # counts the child in (it joined again since). Its writes wait for the answer; a child
        # that is gone fails them as before.
        try:
            self.actor.engine.connect(self._address(position))
        except P2PError:
            pass  # the engine is closing: the writes fail too
        kid = _Child(self.group[position], wants)
        if wants is not None:
            kid.todo.extend(i for i in self.order if i in self.have)
        self.kids[position] = kid

    def _address(self, position: int) -> bytes:
        return self.remotes[self.group[position]].address

    def _remote(self, member: int, chunk) -> list:
        key = (member, chunk.id)
        if key not in self._remote_cache:
            self._remote_cache[key] = remote_views(self.remotes[member].remotes, chunk)
        return self._remote_cache[key]
