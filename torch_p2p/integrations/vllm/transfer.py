"""What a TorchP2PConnector worker moves, free of vLLM so that it runs (and is tested) where
vLLM is not installed: a worker's KV caches registered once as a ``kv.KVCache`` (their layout:
cache_layout.py), served to decode workers over the side channel (side_channel.py), and the
decode side's pulls, each checked against the request's hold and followed by a release notice;
the prefill side keeps the blocks under a lease until the notices arrive (leases.py).

A decode worker keeps what it pulled only if the prefill side still held the blocks for its
request once the data had landed: it then reads the request's slot of the prefill worker's hold
table (holds.py) and compares it with the token the request's kv_transfer_params carry. It then
tells the prefill worker, in one message carrying how many decode workers read it, that it may
free the blocks.
"""
from __future__ import annotations

import json
import logging
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import wait as wait_for_jobs
from dataclasses import dataclass, field

import torch

from ... import Engine, _shared, kv, pages
from ...remote import RemoteTensor
from .cache_layout import CACHE_LAYOUTS, layer_order, layer_view, share_in_place
from .leases import Leases, release_notice
from .side_channel import SideChannel, fetch

_log = logging.getLogger("vllm.torch_p2p")  # the logger the connector's worker half uses
_CHECKS = 4096  # hold checks in flight at once (a slot each of a registered scratch tensor)


@dataclass
class Pulled:
    """One finished load: `error` is None when every block arrived."""
    request_id: str
    blocks: int
    bytes: int
    seconds: float  # the pull alone: issued to noticed done by poll()
    handshake_seconds: float  # 0 once the peer's handle is known
    error: BaseException | None = None
    check_seconds: float = 0.0  # the hold check's read(s), issued to done (inside `seconds`)


@dataclass(eq=False)
class _Load:
    """A request's pulls, one per prefill worker that holds some of our heads (the decode side)."""
    request_id: str
    remote_request_id: str
    readers: int
    sources: list[tuple[str, int]]
    remote_engine_id: str
    remote_tp: int | None
    hold: tuple[int, int] | None  # (slot, token) in the prefill workers' hold tables
    remote_blocks: list[int]
    local_blocks: list[int]
    start: float
    handshake: float = 0.0
    issued: float = 0.0
    peers: list["_Peer"] = field(default_factory=list)
    futures: list[torch.futures.Future] = field(default_factory=list)
    checks: list[int] = field(default_factory=list)  # scratch slots the hold checks read into
    check_seconds: float = 0.0  # the longest hold check's read

    def done(self) -> bool:
        return all(f.done() for f in self.futures)


@dataclass
class _Peer:
    """A prefill worker as its side channel describes it; `check`: the read of one slot of its
    hold table into one of our scratch slots, prepared once (run on the request's two)."""
    engine_id: str
    cache: kv.KVCacheHandle
    hold_table: RemoteTensor | None
    tp_size: int
    check: object = None


class StaleBlocks(RuntimeError):
    """The prefill side no longer held the blocks when a pull had read them (its lease ended,
    or it restarted): what was read is not the request's KV."""


def compat_differences(mine: dict, theirs: dict) -> list[str]:
    """The facts two engines must share (model, dtype, block size, ...) that differ, in words."""
    return [f"{k} {mine.get(k)!r} here, {theirs.get(k)!r} there" for k in sorted(set(mine) | set(theirs))
            if mine.get(k) != theirs.get(k)]


def _warn_if_untold(told: torch.futures.Future, request_id: str) -> None:
    try:
        told.value()
    except Exception as e:  # noqa: BLE001 - the blocks arrived; the prefill side's lease frees them
        _log.warning("TorchP2PConnector: telling the prefill side that request %s's blocks may be freed failed "
                     "(%s: %s): they are freed when its lease ends", request_id, type(e).__name__, e)


class KVTransfer:
    """One worker's caches and transfers.

    `caches`: layer name -> cache tensor ([blocks, heads, tokens, 2 x head dim]:
    cache_layout.py); `layout`: "cpu" or "cuda", a key of CACHE_LAYOUTS; `first_head`: the
    model's KV head this worker's caches start at (tensor parallelism). With `port`, a side
    channel at host:port serves the handle (the prefill side), and release notices arrive in
    the engine's inbox (give it an engine of its own). `hold_table`: the prefill side's hold
    table (holds.create), served read-only with the handle. `compat`: what a peer must share
    (model, dtype, block size, ...): a handshake with a peer whose facts differ fails, naming
    them. `tp_size`: this engine's tensor parallelism, which a load's `remote_tp` must name.
    `timeout` bounds a handshake and a pull; `lease`: the seconds blocks awaiting a pull are
    kept before they are freed anyway (the default of ``start_lease``). `share`: move host
    caches into shared memory, in place, before registering them, so that same-host peers map
    them and copy with memcpy instead of the kernel's cross-memory copy (the engine's cma
    route; the move copies the caches once and holds twice their memory meanwhile).
    """

    def __init__(self, caches: dict[str, torch.Tensor], layout: str, *, engine_id: str, first_head: int = 0,
                 host: str = "127.0.0.1", port: int | None = None, timeout: float = 10.0, lease: float = 30.0,
                 engine: Engine | None = None, share: bool = False, hold_table: torch.Tensor | None = None,
                 compat: dict | None = None, tp_size: int = 1):
        if not caches:
            raise ValueError("no KV caches to register")
        self.names = layer_order(caches)
        first = caches[self.names[0]]
        if share and first.device.type == "cpu":
            share_in_place(caches.values())
        self.engine = engine or Engine(str(first.device))
        self._own_engine = engine is None
        self.engine_id, self.timeout, self.compat = engine_id, timeout, dict(compat or {})
        self._regions = []
        self.cache = None
        try:
            self.cache = kv.KVCache(self.engine, [layer_view(caches[n], layout) for n in self.names],
                                    CACHE_LAYOUTS[layout], first_head=first_head)
            # Where hold checks land (host memory: read without a device sync), one int64 a check.
            self._scratch = torch.zeros(_CHECKS, 1, dtype=torch.int64)
            self._slots = self._scratch.numpy()  # the same memory, read and zeroed without a torch op
            # A check's page ids: its scratch slot (fixed) and the request's hold slot (set per check).
            self._check_ids = torch.arange(_CHECKS)
            self._hold_ids = torch.zeros(_CHECKS, dtype=torch.int64)
            self._hold_slots = self._hold_ids.numpy()  # set without a torch op, as _slots
            self._regions.append(self.engine.register(self._scratch))
            table = None
            if hold_table is not None:
                self._regions.append(self.engine.register(hold_table, "r"))
                table = _shared.b64(self._regions[-1].remote.to_bytes())
            self._block_bytes = self.cache.block_bytes
            served = json.dumps(dict(engine_id=engine_id, layers=self.names, compat=self.compat, tp_size=tp_size,
                                     hold_table=table, handle=_shared.b64(self.cache.handle.to_bytes()))).encode()
            try:
                self.side_channel = SideChannel(host, port, served) if port is not None else None
            except OSError as e:
                raise OSError(e.errno, f"TorchP2PConnector's side channel cannot listen on {host}:{port} "
                                       f"({e.strerror}): give each instance of a host its own side_channel_port") from e
        except BaseException:
            self._close_memory()
            raise
        self._peers: dict[tuple[str, int], _Peer] = {}
        self._pool = ThreadPoolExecutor(2, thread_name_prefix="torch_p2p-kv")
        self._releases: list = []  # the release notices' jobs on _pool: close() lets them go out
        self._handshakes: list = []  # loads waiting for a handshake on _pool: wait() waits for them too
        # Pulls in flight, checked by poll(): noticed on vLLM's thread, not by a callback, whose
        # thread would wait for the GIL (up to sys.getswitchinterval()) while vLLM's step runs.
        self._pulls: list[_Load] = []
        self._lock = threading.Lock()
        self._free_checks = list(range(_CHECKS))
        self._failed_early: queue.SimpleQueue[Pulled] = queue.SimpleQueue()
        self._leases = Leases(self.engine, lease) if port is not None else None  # the prefill side

    # -- decode side -----------------------------------------------------------------------------
    def load(self, request_id: str, remote_request_id: str, sources: list[tuple[str, int]], remote_engine_id: str,
             remote_blocks, local_blocks, *, readers: int = 1, hold: tuple[int, int] | None = None,
             remote_tp: int | None = None) -> None:
        """Pulls the prefill side's `remote_blocks` into `local_blocks` (the last
        len(local_blocks) of them: the first ones may be in our prefix cache) and tells it to
        free them. Reported by ``poll()``, failed or not, within `timeout` of a silent peer and
        at once of a dead local one.

        `sources`: the side channels (host, port) of the prefill workers that hold this
        worker's heads (one, or several where tensor parallelism differs: tp_mapping); each
        pull moves the heads both hold. `readers`: how many decode workers read each of them
        (their blocks are freed when all have). `hold`: the (slot, token) of the request's
        kv_transfer_params: once the data has landed, each prefill worker's hold table must
        still hold the token there, or the load fails with StaleBlocks. `remote_tp`: the
        prefill engine's tensor parallelism as the request names it."""
        remote_blocks, local_blocks = list(remote_blocks), list(local_blocks)
        if not sources:
            raise ValueError(f"request {request_id}: no prefill worker to pull from")
        load = _Load(request_id, remote_request_id, readers, [(h, int(p)) for h, p in sources], remote_engine_id,
                     remote_tp, None if hold is None else (int(hold[0]), int(hold[1])),
                     remote_blocks[max(0, len(remote_blocks) - len(local_blocks)):], local_blocks, time.perf_counter())
        known = [self._peers.get(where) for where in load.sources]
        if all(k is not None and k.engine_id == remote_engine_id for k in known):
            self._issue(load, known)  # on the caller's thread: no hop to another Python thread
        else:
            # A handshake leaves the model's step: a slow or dead prefill host delays only its requests.
            with self._lock:
                self._handshakes = [job for job in self._handshakes if not job.done()]
                self._handshakes.append(self._pool.submit(self._handshake_then_issue, load))

    def _handshake_then_issue(self, load: "_Load") -> None:
        try:
            peers = [self._handshake(where, load.remote_engine_id) for where in load.sources]
        except BaseException as e:  # reported as a failed load, never raised into vLLM's step
            self._failed_early.put(self._pulled(load, e))
            return
        load.handshake = time.perf_counter() - load.start
        self._issue(load, peers)

    def _issue(self, load: "_Load", peers: list[_Peer]) -> None:
        load.peers, load.issued = peers, time.perf_counter()
        try:
            for peer in peers:
                self._check_peer(peer, load)
            for peer in peers:
                data = self.cache.pull(peer.cache, load.remote_blocks, load.local_blocks, timeout=self.timeout)
                checked = load.hold is not None and load.local_blocks
                load.futures.append(self._then_check(load, peer, data) if checked else data)
        except BaseException as e:
            load.futures.append(_shared.failed(e))  # reported once the pulls issued before it are done
        with self._lock:
            self._pulls.append(load)

    def _check_peer(self, peer: _Peer, load: "_Load") -> None:
        """After the handshake (which names an incompatible peer first): can this load use it?"""
        if len(load.local_blocks) > len(load.remote_blocks):
            raise ValueError(f"request {load.request_id}: {len(load.local_blocks)} blocks to fill from "
                             f"{len(load.remote_blocks)} remote blocks")
        if load.remote_tp is not None and peer.tp_size != load.remote_tp:
            raise ValueError(f"request {load.request_id} names a prefill engine of tensor parallelism {load.remote_tp}; "
                             f"engine {peer.engine_id} runs {peer.tp_size}: nothing was read")
        if load.hold is not None and load.local_blocks:
            if peer.hold_table is None:
                raise ValueError(f"prefill engine {peer.engine_id} serves no hold table: what a pull reads could not "
                                 "be checked, so nothing was read")
            if not 0 <= load.hold[0] < peer.hold_table.shape[0]:
                raise ValueError(f"request {load.request_id}: hold slot {load.hold[0]} is outside engine "
                                 f"{peer.engine_id}'s table of {peer.hold_table.shape[0]}")

    def _then_check(self, load: "_Load", peer: _Peer, data: torch.futures.Future) -> torch.futures.Future:
        """`data`, then (issued once it has completed) the read of the request's hold slot."""
        with self._lock:
            if not self._free_checks:
                raise RuntimeError(f"more than {_CHECKS} loads in flight")
            i = self._free_checks.pop()
        load.checks.append(i)
        self._slots[i, 0] = 0
        self._hold_slots[i] = load.hold[0]

        def read():
            start = time.perf_counter()
            f = peer.check.run_pages(self._check_ids[i:i + 1], self._hold_ids[i:i + 1])
            f.add_done_callback(lambda _: setattr(load, "check_seconds",
                                                  max(load.check_seconds, time.perf_counter() - start)))
            return f
        out = torch.futures.Future()
        _shared.then(data, read, out)
        return out

    def _finish(self, load: "_Load") -> "Pulled":
        """A done load as a result; the prefill workers are told they may free the blocks on a
        thread of ours, off vLLM's step (a notice that fails leaves their blocks to the lease)."""
        try:
            for f in load.futures:
                f.value()
            self._check_hold(load)
        except BaseException as e:
            return self._pulled(load, e)
        self._releases = [job for job in self._releases if not job.done()]
        self._releases.append(self._pool.submit(self._release, load))
        return self._pulled(load, None)

    def _check_hold(self, load: "_Load") -> None:
        if not load.checks:
            return
        slot, token = load.hold
        for peer, i in zip(load.peers, load.checks):
            seen = int(self._slots[i, 0])
            if seen != token:
                raise StaleBlocks(f"request {load.request_id}: prefill engine {peer.engine_id} no longer held the "
                                  f"blocks once they were read (hold slot {slot} holds {seen}, not {token}: its lease "
                                  "ended or it restarted); what was read is discarded")

    def _release(self, load: "_Load") -> None:
        notice = release_notice(load.remote_request_id, load.readers)
        for peer in load.peers:
            try:
                told = self.engine.send(peer.cache.owner, notice, timeout=self.timeout)
            except Exception as e:  # noqa: BLE001 - reported below, like a notice that fails later
                told = _shared.failed(e)
            told.add_done_callback(lambda f, rid=load.request_id: _warn_if_untold(f, rid))

    def _pulled(self, load: "_Load", error: BaseException | None) -> "Pulled":
        with self._lock:
            self._free_checks.extend(load.checks)
            load.checks = []
        seconds = time.perf_counter() - load.issued if load.issued else 0.0
        return Pulled(load.request_id, len(load.local_blocks), len(load.local_blocks) * self._block_bytes,
                      seconds, load.handshake, error, load.check_seconds)

    def _handshake(self, where: tuple[str, int], remote_engine_id: str) -> _Peer:
        """The prefill worker at `where`, as its side channel describes it."""
        known = self._peers.get(where)
        if known is not None and known.engine_id == remote_engine_id:
            return known  # an earlier load's handshake finished meanwhile
        info = json.loads(fetch(*where, timeout=self.timeout))
        if info["engine_id"] != remote_engine_id:
            raise ValueError(f"{where[0]}:{where[1]} serves engine {info['engine_id']}, not {remote_engine_id}")
        if info["layers"] != self.names:
            raise ValueError(f"engine {remote_engine_id} has layers {info['layers']}, this one {self.names}")
        differ = compat_differences(self.compat, info.get("compat") or {})
        if differ:
            raise ValueError(f"prefill engine {remote_engine_id} at {where[0]}:{where[1]} is incompatible with this "
                             f"one: {'; '.join(differ)}. Nothing was read")
        table = info.get("hold_table")
        peer = _Peer(remote_engine_id, kv.KVCacheHandle.from_bytes(_shared.unb64(info["handle"])),
                     None if table is None else RemoteTensor.from_bytes(_shared.unb64(table)), int(info["tp_size"]))
        if peer.hold_table is not None:
            peer.check = self.engine.prepare_read([pages(self._scratch, [0])], [pages(peer.hold_table, [0])],
                                                  timeout=self.timeout)
        self._peers[where] = peer
        return peer

    def wait(self, seconds: float) -> None:
        """Waits until every load started so far (its handshake, then its pulls) is done, or
        `seconds` pass (for a caller with nothing else to do: poll() then reports them without
        another round)."""
        deadline = time.monotonic() + seconds
        with self._lock:
            handshakes = [job for job in self._handshakes if not job.done()]
        if handshakes:
            wait_for_jobs(handshakes, timeout=seconds)
        with self._lock:
            pending = [f for p in self._pulls for f in p.futures if not f.done()]
        # Woken by each completion: the caller sleeps without the GIL, which the engine's
        # completions need, and hears at once (a sleep-and-look loop added up to 0.4 ms a pull).
        _shared.wait_all(pending, max(0.0, deadline - time.monotonic()))

    # -- prefill side ----------------------------------------------------------------------------
    def start_lease(self, request_id: str, seconds: float | None = None) -> None:
        """Keeps a finished request's blocks until every decode worker that reads them has
        released them, or `seconds` (default: the object's `lease`) pass (leases.py)."""
        if self._leases is None:
            raise RuntimeError("a KVTransfer without a port serves no blocks: it keeps no leases")
        self._leases.start(request_id, seconds)

    # -- both ------------------------------------------------------------------------------------
    def poll(self) -> tuple[dict[str, bool], list[Pulled]]:
        """(requests whose blocks may be freed -> whether a pull released them (False: the lease
        ran out), loads finished since the last call)."""
        freed = self._leases.freed() if self._leases is not None else {}
        done, pending = [], []
        with self._lock:
            for p in self._pulls:
                (done if p.done() else pending).append(p)
            self._pulls = pending
        loaded = [self._finish(p) for p in done]
        while True:
            try:
                loaded.append(self._failed_early.get_nowait())
            except queue.Empty:
                return freed, loaded

    def close(self) -> None:
        if self.side_channel is not None:
            self.side_channel.close()
        wait_for_jobs(self._releases, timeout=self.timeout)
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self._leases is not None:
            self._leases.close()
        self._close_memory()

    def _close_memory(self) -> None:
        while self._regions:
            self._regions.pop().close()
        if self.cache is not None:
            self.cache.close()
        if self._own_engine:
            self.engine.close()
