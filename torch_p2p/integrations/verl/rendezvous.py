"""How rollout ranks learn the model's tensors and tell the trainer they have joined.

verl's topology calls (prepare, build_topology, init_process_group) run before the trainer has
seen a tensor: the layout exists only once the first send_weights has consumed its generator,
and a replica added later needs it too. The leading trainer rank therefore serves it on an
engine of its own (the weights layer owns its data engine's inbox):

    rollout rank -> leader's service   layout?   (the answer waits until the layout is known)
    service -> rollout rank            layout(tensors, leader, version)
    rollout rank -> leader's service   joined    (its WeightDestination has joined the leader)

The rollout rank receives the answer on its own data engine before it creates its
WeightDestination (its inbox is still free then). The leader pushes once every rollout rank
of the current topology has said `joined`, so none misses the version it waits for.
Messages are JSON, never pickle: the fabric does not authenticate senders.
"""
from __future__ import annotations

import json
import logging
import threading

import torch_p2p

from .waiting import SEND_TIMEOUT_S, settled

log = logging.getLogger("torch_p2p.integrations.verl")


def encode(kind: str, **fields) -> bytes:
    return json.dumps({"kind": kind, **fields}).encode()


def decode(payload: bytes) -> dict:
    try:
        msg = json.loads(payload)
    except (ValueError, UnicodeDecodeError):
        return {}
    return msg if isinstance(msg, dict) else {}




class LayoutService:
    """The leader's side: answers layout requests and collects joins, on its own thread over
    its own engine. `publish` and `joined` may be called from any thread."""

    def __init__(self, engine: torch_p2p.Engine):
        self.engine = engine
        self._lock = threading.Condition()
        self._layout: list | None = None
        self._leader = ""
        self.version = 0  # the last version pushed, set by the leader after each push
        self._waiting: list[bytes] = []
        self._joined: set[bytes] = set()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="torch_p2p-verl-layout", daemon=True)
        self._thread.start()

    @property
    def address(self) -> bytes:
        return self.engine.address

    def publish(self, layout: list, leader: bytes) -> None:
        """The tensors and the leader's data address: what a joining rollout rank needs (with
        `version`, the last version pushed). Answers the requests that waited for them."""
        with self._lock:
            self._layout, self._leader = layout, leader.hex()
            waiting, self._waiting = self._waiting, []
        for address in waiting:
            self._send(address, self._answer())

    def _answer(self) -> bytes | None:
        if self._layout is None:
            return None
        return encode("layout", tensors=self._layout, leader=self._leader, version=self.version)

    def joined(self) -> set[bytes]:
        """The data addresses of the rollout ranks that have joined."""
        with self._lock:
            return set(self._joined)

    def wait_joined(self, addresses: set[bytes], timeout: float) -> set[bytes]:
        """Waits until every one of `addresses` has joined (at most `timeout` seconds, or until
        close()); returns those that have not."""
        with self._lock:
            self._lock.wait_for(lambda: addresses <= self._joined or self._stopping, timeout)
            return addresses - self._joined

    def forget(self, addresses: set[bytes]) -> None:
        """Rollout ranks that left the topology: one added again must join again."""
        with self._lock:
            self._joined -= addresses

    def close(self) -> None:
        with self._lock:
            self._stopping = True
            self._lock.notify_all()
        self._thread.join(5.0)

    def _run(self) -> None:
        while not self._stopping:
            try:
                sender, payload = self.engine.recv(timeout=0.5).wait()
            except torch_p2p.TimeoutError:
                continue
            except torch_p2p.P2PError:
                return  # the engine closed
            kind = decode(payload).get("kind")
            if kind == "layout?":
                with self._lock:
                    answer = self._answer()
                    if answer is None:
                        self._waiting.append(sender)
                if answer is not None:
                    self._send(sender, answer)
            elif kind == "joined":
                with self._lock:
                    self._joined.add(sender)
                    self._lock.notify_all()

    def _send(self, address: bytes, payload: bytes) -> None:
        # A requester that died meanwhile must not stop the service: its failure is only logged.
        try:
            torch_p2p.wait(self.engine.send(address, payload), SEND_TIMEOUT_S)
        except torch_p2p.P2PError as e:
            log.warning("torch_p2p verl engine: a rollout rank asked for the layout and left: %s", e)


async def request_layout(engine: torch_p2p.Engine, service: bytes, timeout: float, alive) -> dict:
    """Asks the leader's service for the layout; returns the answer (tensors, leader, version).
    Runs before the caller's WeightDestination exists (the answer comes to its inbox).
    `alive()` (async) raises if the trainer is gone while the answer is awaited."""
    await settled(engine.send(service, encode("layout?")), SEND_TIMEOUT_S, "asking the trainer for the layout")
    while True:
        recv = engine.recv(timeout=timeout)
        try:
            sender, payload = await settled(recv, timeout + 1.0, "waiting for the model's layout from the trainer",
                                            alive)
        except BaseException:
            engine.cancel(recv)  # a later message must not vanish into an abandoned receive
            raise
        msg = decode(payload)
        if sender == service and msg.get("kind") == "layout":
            return msg
        log.warning("torch_p2p verl engine: ignoring a message before joining (kind %r)", msg.get("kind"))
