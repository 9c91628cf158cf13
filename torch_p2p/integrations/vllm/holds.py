"""The prefill side's hold tables: what lets a decode worker tell, after its pull, whether the
blocks it read were still held for its request (free of vLLM).

A hold is a slot of the table and a token never used before, given to a finished prefill
request whose blocks wait for a decode engine's pull. The scheduler, the one process that
decides when blocks are freed, writes the token into the slot before the request's
kv_transfer_params leave the engine, and writes 0 there before it frees the blocks (vLLM calls
``update_connector_output`` before it frees the blocks its workers report done). Each worker
maps the table (a file in /dev/shm named by its side-channel port and its process id) and
registers it read-only: a decode worker reads the slot after its data read completed and keeps
the data only if the slot still holds the token. docs/vllm.md says why that holds on every route.
"""
from __future__ import annotations

import contextlib
import os
import secrets

import torch

from ..._shared import process_alive

_DIR = "/dev/shm"


def table_path(port: int, pid: int | None = None) -> str:
    """The hold table made by process `pid` (default: this one) for the prefill worker whose
    side channel listens on `port` (a port serves one instance of a host at a time)."""
    return os.path.join(_DIR, f"torch_p2p-holds-{os.getuid()}-{port}-{os.getpid() if pid is None else pid}")


def _tables() -> list[tuple[int, int, str]]:
    """(port, pid, path) of this user's hold tables on this host."""
    prefix = f"torch_p2p-holds-{os.getuid()}-"
    found = []
    with contextlib.suppress(FileNotFoundError):
        for name in os.listdir(_DIR):
            port, _, pid = name[len(prefix):].partition("-")
            if name.startswith(prefix) and port.isdigit() and pid.isdigit():
                found.append((int(port), int(pid), os.path.join(_DIR, name)))
    return found


def create(port: int, slots: int) -> torch.Tensor:
    """A fresh table of `slots` zeroed slots ([slots, 1] int64, shared with the scheduler): a
    table left on this port by an earlier instance is replaced, never reused, so the tokens it
    gave out match nothing here; tables of processes that are gone (killed before they could
    remove theirs) are removed too."""
    for other_port, pid, path in _tables():
        if other_port == port or not process_alive(pid):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
    table = torch.from_file(table_path(port), shared=True, size=slots, dtype=torch.int64)
    table.zero_()
    return table.view(slots, 1)


def find(port: int) -> str:
    """The path of the live table of `port`'s prefill worker."""
    live = [path for p, pid, path in _tables() if p == port and process_alive(pid)]
    if not live:
        raise FileNotFoundError(f"no hold table of port {port} in {_DIR}")
    return max(live, key=os.path.getmtime)


def remove(port: int) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(table_path(port))


class HoldTables:
    """The scheduler's side: the tables of an engine's workers (one per tensor-parallel rank,
    all written alike), their free slots, and the holds given out."""

    def __init__(self, ports: list[int]):
        self.ports = ports
        self._tables: list[torch.Tensor] | None = None
        self._free: list[int] = []
        self._slot: dict[str, int] = {}  # request id -> its slot
        # Tokens start at a random 62-bit value: those of an earlier instance match nothing.
        self._next = secrets.randbits(62) | 1

    def _open(self) -> list[torch.Tensor]:
        # The workers made their tables when they registered their caches, before vLLM made
        # the scheduler; opened at the first hold.
        if self._tables is None:
            tables = []
            for port in self.ports:
                try:
                    path = find(port)
                    size = os.path.getsize(path) // 8
                except OSError as e:
                    raise RuntimeError(f"{e}: the prefill worker of port {port} runs on another host or did not "
                                       "start") from None
                tables.append(torch.from_file(path, shared=True, size=size, dtype=torch.int64))
            self._tables = tables
            self._free = list(range(min(t.numel() for t in tables) - 1, -1, -1))
        return self._tables

    def begin(self, request_id: str) -> tuple[int, int] | None:
        """The (slot, token) of a new hold for `request_id`, written into every worker's
        table; None when every slot is taken (the request then offers no remote decode)."""
        tables = self._open()
        if not self._free:
            return None
        slot, token = self._free.pop(), self._next
        self._next += 1
        for t in tables:
            t[slot] = token
        self._slot[request_id] = slot
        return slot, token

    def end(self, request_id: str) -> None:
        """Ends the request's hold: after this, a decode worker that reads its slot fails its
        load. Called before vLLM frees the request's blocks."""
        slot = self._slot.pop(request_id, None)
        if slot is None:
            return
        for t in self._tables:
            t[slot] = 0
        self._free.append(slot)

    @property
    def active(self) -> int:
        """How many holds are given out and not ended."""
        return len(self._slot)
