"""Bounded waits inside verl's coroutines: a torch future awaited without blocking the event
loop (verl's workers are async Ray actors), with a deadline and a liveness check of the peers
the wait depends on, so that a dead trainer or relay fails the update instead of hanging it."""
from __future__ import annotations

import asyncio

import torch

import torch_p2p

LIVENESS_S = 1.0  # how often a waiter checks that the peers it depends on are alive
SEND_TIMEOUT_S = 30.0  # bounds a control message to a peer that stopped answering
# A message nobody handles: the weights layer drops kinds it does not know, so sending it to a
# trainer rank's data engine tests only that the engine is alive.
PING = b'{"kind": "torch_p2p-verl-ping"}'


async def settled(fut: torch.futures.Future, timeout: float, what: str, alive=None):
    """The future's value, raising its exception; torch_p2p.TimeoutError naming `what` after
    `timeout` seconds; `alive()` (async, raising if a peer is gone) runs every LIVENESS_S."""
    loop = asyncio.get_running_loop()
    done = asyncio.Event()

    def wake(_):
        try:
            loop.call_soon_threadsafe(done.set)
        except RuntimeError:
            pass  # the loop closed: nobody waits any more

    fut.add_done_callback(wake)
    deadline = loop.time() + timeout
    while not fut.done():
        left = deadline - loop.time()
        if left <= 0:
            raise torch_p2p.TimeoutError(f"{what}: not done within {timeout:g} s")
        try:
            await asyncio.wait_for(done.wait(), min(left, LIVENESS_S))
        except asyncio.TimeoutError:
            if alive is not None:
                await alive()
    return fut.value()


async def check_alive(engine: torch_p2p.Engine, peers: dict[str, bytes]) -> None:
    """Raises torch_p2p.PeerError naming the first of `peers` (what -> address) whose engine
    does not take a message (dead, closed, or silent for the engine's peer_timeout)."""
    sends = {what: engine.send(address, PING) for what, address in peers.items()}
    for what, fut in sends.items():
        try:
            await settled(fut, SEND_TIMEOUT_S, f"checking that {what} is alive")
        except torch_p2p.P2PError as e:
            raise torch_p2p.PeerError(f"{what} is gone: {e}") from e
