"""The storages a process has registered for the TORCH_P2P transport, counted by their users,
and the engines they are registered with (one per device, made on first use).

A storage may back tensors of several RDT objects (views of one weight matrix returned again
and again), and the engine registers a storage once (it refuses an overlapping one): so a
storage is registered on its first use and deregistered after its last user lets it go. It is
registered as one flat byte tensor over the whole storage, so that any tensor on it, of any
dtype, shape and strides, is a byte view of that one region (``byte_layout``).

Deregistration tells the peers that know the region and may wait for their answer, so it runs
on a thread of its own: a fetch returns its tensors without waiting for it, and Ray's thread
that frees objects is never held by a slow peer. A storage used again before its region is
gone keeps the region (or, once the deregistration has begun, waits for it to end).

Thread model: Ray calls the transport from the actor's main thread (a task's return value),
its ``_ray_system`` thread (fetches) and its core worker's thread (freeing objects); one lock
guards the table and is held across a registration, so that one storage is never registered
twice.
"""
from __future__ import annotations

import logging
import queue
import threading
from dataclasses import dataclass

import torch

from ... import Engine, Region, RemoteTensor

log = logging.getLogger("torch_p2p")


def byte_layout(t: torch.Tensor) -> tuple[int, list[int], list[int]]:
    """(offset, shape, strides) of `t`'s bytes in its storage, as a uint8 view with one more
    dimension (the bytes of an element): any dtype becomes the same kind of view."""
    e = t.element_size()
    return t.storage_offset() * e, [*t.shape, e], [s * e for s in t.stride()] + [1]


def remote_bytes(region: Region, t: torch.Tensor) -> RemoteTensor:
    """The handle a peer reads `t` through: its bytes in `region` (its storage's region)."""
    offset, shape, strides = byte_layout(t)
    return region.remote.as_strided(shape, strides, offset)


def local_bytes(region: Region, t: torch.Tensor) -> torch.Tensor:
    """`t`'s bytes as a view of `region`'s flat tensor: what a read into `t` fills."""
    offset, shape, strides = byte_layout(t)
    return region.tensor.as_strided(shape, strides, offset)


@dataclass(eq=False)
class _Entry:
    region: Region
    users: int = 0
    closing: bool = False
    lent: bool = False  # another part's region (a receive buffer): never deregistered here


class Registrations:
    def __init__(self, lent=lambda t: None):
        """`lent(t)`: the region that already holds `t`'s storage, registered by another part
        of the transport (the receive pool's buffer a fetch read `t` into), else None; a
        relay that returns a tensor it received hands out views of that region."""
        self._lent = lent
        # Reentrant: a fetch request dropped unwaited releases its storages from __del__,
        # whichever thread the collector runs on, perhaps one holding the lock.
        self._lock = threading.RLock()
        self._closed = threading.Condition(self._lock)
        self._engines: dict[str, Engine] = {}
        self._table: dict[tuple[str, int], _Entry] = {}  # (device, storage address) -> entry
        self._later: queue.SimpleQueue = queue.SimpleQueue()  # deregistrations, run by _closer
        self._closer: threading.Thread | None = None

    def engine(self, device: torch.device) -> Engine:
        """This process's engine for `device`, made on first use."""
        with self._lock:
            name = str(device)
            engine = self._engines.get(name)
            if engine is None:
                engine = self._engines[name] = Engine(device)
            return engine

    def acquire(self, t: torch.Tensor) -> tuple[tuple[str, int], Region]:
        """Registers `t`'s storage unless it is already, and counts one more user of it."""
        if t.layout is not torch.strided or t.is_quantized:
            raise ValueError(f"TORCH_P2P moves dense (strided) tensors, not {t.layout} ones")
        key = (str(t.device), t.untyped_storage().data_ptr())
        with self._lock:
            entry = self._table.get(key)
            if entry is not None and entry.closing:
                engine = self.engine(t.device)
                if not self._closed.wait_for(lambda: self._table.get(key) is not entry, timeout=engine.timeout):
                    raise TimeoutError(f"TORCH_P2P: the storage's old registration did not close in {engine.timeout} s")
                entry = self._table.get(key)
            if entry is None:
                region = self._lent(t)
                if region is not None:
                    entry = self._table[key] = _Entry(region, lent=True)
                else:
                    flat = torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())
                    entry = self._table[key] = _Entry(self.engine(t.device).register(flat))
            entry.users += 1
            return key, entry.region

    def release(self, keys) -> None:
        """One user fewer of each storage; after the last one, its region is deregistered."""
        with self._lock:
            for key in keys:
                entry = self._table.get(key)
                if entry is None:
                    continue
                entry.users -= 1
                if entry.users == 0 and entry.lent:
                    del self._table[key]  # its owner deregisters it
                elif entry.users == 0:
                    self.close_later(lambda key=key, entry=entry: self._close_unused(key, entry))

    def close_later(self, close) -> None:
        """Runs close() on this object's deregistration thread, after what came before it."""
        with self._lock:
            self._later.put(close)
            if self._closer is None:
                self._closer = threading.Thread(target=self._close, name="torch_p2p-ray-deregister", daemon=True)
                self._closer.start()

    def counts(self) -> dict[str, int]:
        """What is registered now: storages in the table, regions the engines hold."""
        with self._lock:
            return {"storages": len(self._table),
                    "engine_regions": sum(e.num_regions for e in self._engines.values())}

    def _close(self) -> None:
        while True:
            close = self._later.get()
            try:
                close()
            except Exception as e:  # noqa: BLE001 - nobody waits for this thread: say it
                log.warning("TORCH_P2P: deregistering a storage failed: %r", e)

    def _close_unused(self, key, entry: _Entry) -> None:
        with self._lock:
            if entry.users or entry.closing or self._table.get(key) is not entry:
                return  # used again meanwhile
            entry.closing = True
        try:
            entry.region.close()
        finally:
            with self._lock:
                if self._table.get(key) is entry:
                    del self._table[key]
                self._closed.notify_all()
