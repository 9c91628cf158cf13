"""What a push is made of, at every node of torch_p2p.weights: the destinations it goes to
(Member, as the wire carries them), its phases at a source rank (Phase, Round) and how it ended
(PushResult)."""
from __future__ import annotations

import dataclasses
import enum

import torch

from ._plan import Layout
from ._relay import Fanout
from ..remote import RemoteTensor


@dataclasses.dataclass
class Member:
    """A destination as sources see it."""
    id: int
    name: str
    address: bytes
    layout: Layout
    remotes: dict

    @classmethod
    def from_info(cls, info: dict) -> "Member":
        remotes = {str(n): RemoteTensor.from_bytes(b) for n, b in info["remotes"].items()}
        return cls(int(info["id"]), str(info["name"]), bytes(info["address"]), Layout.from_json(info["layout"]),
                   remotes)


@dataclasses.dataclass
class PushResult:
    """How a push ended: who holds `version` now, who was dropped and why."""
    version: int
    received: list
    dropped: dict
    seconds: float
    bytes_sent: int  # by this source rank


class Phase(enum.Enum):
    QUEUED = "queued"
    READY = "ready"
    MOVING = "moving"
    FINISHED = "finished"


class Round:
    """One push as a source sees it."""

    def __init__(self, version: int, event):
        self.version, self.event = version, event
        self.future = torch.futures.Future()
        self.phase = Phase.QUEUED
        self.t0 = 0.0
        self.members: dict[int, Member] = {}
        self.ready: set[int] = set()
        self.routed: set[int] = set()
        self.have: set[int] = set()
        self.dropped: dict[int, str] = {}
        self.fanouts: list[Fanout] = []
        self.deadline = self.next_ping = 0.0
        self.outcome = None  # a follower's result from the leader

