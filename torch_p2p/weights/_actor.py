"""The thread model of torch_p2p.weights: one thread per role owns all of its state.

Engine messages, future completions and calls from the user's threads arrive on the role's
queue as events and run one at a time on its thread ("reactions"), so nothing is shared with
the engine's dispatcher thread (whose callbacks only enqueue) and no state needs a lock.
"""
from __future__ import annotations

import logging
import queue
import threading
import time

from . import _wire as wire
from ..errors import P2PError

log = logging.getLogger("torch_p2p.weights")


def error_of(fut):
    """The exception a completed torch future failed with, or None."""
    try:
        fut.value()
    except Exception as e:  # noqa: BLE001 - returned, not raised
        return e
    return None


class Actor:
    """Runs `handlers[kind](sender, msg)` for each engine message and `tick()` every TICK_S."""

    TICK_S = 0.25

    def __init__(self, engine, name: str):
        self.engine = engine
        self.handlers: dict = {}
        self._events: queue.SimpleQueue = queue.SimpleQueue()
        self._recv = None
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        self._listen()
        self._thread.start()

    def stop(self) -> None:
        """Stops the thread after the event it is running; callable from any thread."""
        self._stopping = True
        if self._recv is not None:
            self.engine.cancel(self._recv)
        self._events.put((None, ()))
        if threading.current_thread() is not self._thread and self._thread.is_alive():
            self._thread.join(30)

    def call(self, fn, *args) -> None:
        """Runs fn(*args) on the actor's thread."""
        self._events.put((fn, args))

    def on_done(self, fut, fn, *args) -> None:
        """Runs fn(fut, *args) on the actor's thread once `fut` completes."""
        fut.add_done_callback(lambda f: self._events.put((fn, (f, *args))))

    def send(self, address: bytes, kind: str, on_error=None, **fields) -> None:
        """Sends a message; on_error(exception) runs on the actor's thread if it cannot be
        delivered (the peer is dead, left or closed)."""
        try:
            fut = self.engine.send(address, wire.encode(kind, **fields))
        except P2PError as e:
            if on_error:
                on_error(e)
            return
        if on_error:
            self.on_done(fut, lambda f: (e := error_of(f)) and on_error(e))

    def tick(self) -> None:
        """Timers: deadlines, liveness checks."""

    def _listen(self) -> None:
        try:
            self._recv = self.engine.recv()
        except P2PError:
            return
        self.on_done(self._recv, self._received)

    def _received(self, fut) -> None:
        try:
            sender, payload = fut.value()
        except P2PError:
            return  # cancelled or closed: the actor is stopping
        self._listen()
        try:
            msg = wire.decode(payload)
        except ValueError as e:
            log.warning("dropping a message from a peer: %s", e)
            return
        handler = self.handlers.get(msg.pop("kind"))
        if handler is None:
            return  # another role's message, or a late one
        handler(sender, msg)

    def _run(self) -> None:
        next_tick = time.monotonic() + self.TICK_S
        while not self._stopping:
            try:
                fn, args = self._events.get(timeout=max(0.0, next_tick - time.monotonic()))
            except queue.Empty:
                fn = None
            if fn is not None and not self._stopping:
                try:
                    fn(*args)
                except Exception:  # noqa: BLE001 - one bad event (a peer's message) must not end the role
                    log.exception("torch_p2p.weights: handling an event failed")
            if time.monotonic() >= next_tick:
                next_tick = time.monotonic() + self.TICK_S
                try:
                    self.tick()
                except Exception:  # noqa: BLE001
                    log.exception("torch_p2p.weights: a timer failed")
