"""What a TorchP2PConnector worker moves, free of vLLM so that it runs (and is tested) where
vLLM is not installed: a worker's KV caches registered once as a ``kv.KVCache``, the side
channel that hands their handle to decode workers, the decode side's pulls (each telling the
prefill side it may free the blocks) and the prefill side's leases on blocks awaiting a pull.

vLLM gives each attention layer's cache as a tensor of logical shape [blocks, kv heads,
tokens, 2 x head dim] (any strides). ``LAYOUTS`` names where K and V sit inside it: the CPU
backend reads each head's block as all K rows then all V rows, CUDA backends keep a token's K
and V side by side.

Request ids become notification tags through CRC-32: both sides compute the tag from the
prefill side's request id, so nothing but the ids crosses between them.
"""
from __future__ import annotations

import base64
import json
import logging
import queue
import re
import socket
import struct
import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import wait as wait_for_jobs
from dataclasses import dataclass, field

import torch

from ... import Engine, _shared, kv

LAYOUTS = {"cpu": "blocks heads kv tokens dim", "cuda": "blocks heads tokens kv dim"}
_HEADER = struct.Struct("!I")
_log = logging.getLogger("vllm.torch_p2p")  # the logger the connector's worker half uses
_MAX_INFO = 1 << 24


def layer_view(cache: torch.Tensor, layout: str) -> torch.Tensor:
    """`cache` ([blocks, heads, tokens, 2 x dim]) with K and V as an axis of its own, as
    LAYOUTS[layout] names the axes."""
    if cache.dim() != 4 or cache.shape[-1] % 2:
        raise ValueError(f"expected a KV cache of shape [blocks, heads, tokens, 2 x head dim], "
                         f"got {tuple(cache.shape)}")
    blocks, heads, tokens, both = cache.shape
    if layout == "cpu":
        return cache.view(blocks, heads, 2, tokens, both // 2)
    if layout == "cuda":
        return cache.unflatten(-1, (2, both // 2))
    raise ValueError(f"unknown layout {layout!r}: use one of {sorted(LAYOUTS)}")


def share_in_place(tensors) -> None:
    """Moves the tensors' storages into shared memory; every view of them (the model's own)
    follows, as ``Tensor.share_memory_()`` swaps a storage's memory in place."""
    for t in tensors:
        try:
            t.share_memory_()  # a storage already shared is left as it is
        except (RuntimeError, OSError) as e:
            raise RuntimeError(f"moving the KV cache ({t.untyped_storage().nbytes()} bytes) into shared memory "
                               f"failed ({e}): make /dev/shm larger, or turn share_cpu_cache off "
                               "(transfers then take the kernel's cross-memory copy)") from e


def layer_order(names) -> list[str]:
    """Layer names in model order (layers.10 after layers.2), the order both sides pair."""
    return sorted(names, key=lambda n: [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", n)])


def tag(request_id: str, readers: int = 1) -> int:
    """The notification a pull sends when `readers` decode workers read the same prefill
    worker's blocks (tensor parallelism larger on the decode side): it frees them after all."""
    return zlib.crc32(request_id.encode() if readers == 1 else f"{request_id}/{readers}".encode())


def expand_blocks(ids, per_block: int) -> list[int]:
    """Scheduler block ids as the cache tensor's blocks, where a kernel block is smaller than
    the scheduler's (`per_block` kernel blocks each)."""
    return [b * per_block + i for b in ids for i in range(per_block)]


@dataclass
class Pulled:
    """One finished load: `error` is None when every block arrived."""
    request_id: str
    blocks: int
    bytes: int
    seconds: float  # the pull alone: issued to noticed done by poll()
    handshake_seconds: float  # 0 once the peer's handle is known
    error: BaseException | None = None


@dataclass(eq=False)
class _Load:
    """A request's pulls, one per prefill worker that holds some of our heads (the decode side)."""
    request_id: str
    notify: int
    sources: list[tuple[str, int]]
    remote_engine_id: str
    remote_blocks: list[int]
    local_blocks: list[int]
    start: float
    handshake: float = 0.0
    issued: float = 0.0
    peers: list[kv.KVCacheHandle] = field(default_factory=list)
    futures: list[torch.futures.Future] = field(default_factory=list)

    def done(self) -> bool:
        return all(f.done() for f in self.futures)


def _first_of(groups: list[list], engine: Engine) -> torch.futures.Future:
    """Completes when every future of one of `groups` (of `engine`'s futures) has succeeded,
    cancelling the others' then, or fails with the last error once each group has failed."""
    out, left, lock = torch.futures.Future(), [len(groups)], threading.Lock()

    def one(group, f):
        with lock:
            left[0] -= 1
            if out.done():
                return
            try:
                f.value()
            except BaseException as e:  # noqa: BLE001 - the caller's future carries it
                if left[0] == 0:
                    out.set_exception(e)
                return
            out.set_result(None)
        for other in groups:
            for g in other:
                if other is not group and not g.done():
                    engine.cancel(g)

    for group in groups:
        joined = _shared.all_of(group)
        joined.add_done_callback(lambda f, group=group: one(group, f))
    return out


def _warn_if_untold(told: torch.futures.Future, request_id: str) -> None:
    try:
        told.value()
    except Exception as e:  # noqa: BLE001 - the blocks arrived; the prefill side's lease frees them
        _log.warning("TorchP2PConnector: telling the prefill side that request %s's blocks may be freed failed "
                     "(%s: %s): they are freed when its lease ends", request_id, type(e).__name__, e)


class SideChannel:
    """A TCP listener that hands `info` (bytes) to whoever connects, then closes: one
    round trip, no state between connections."""

    def __init__(self, host: str, port: int, info: bytes):
        self._info = _HEADER.pack(len(info)) + info
        self._sock = socket.create_server((host, port))
        self._sock.settimeout(0.2)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="torch_p2p-side-channel", daemon=True)
        self._thread.start()

    @property
    def port(self) -> int:
        return self._sock.getsockname()[1]

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except (socket.timeout, OSError):
                continue
            with conn:
                try:
                    conn.settimeout(5)
                    conn.sendall(self._info)
                except OSError:
                    pass  # the asker went away; it will ask again

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self._sock.close()


def fetch(host: str, port: int, timeout: float) -> bytes:
    """What a SideChannel at host:port serves; OSError (refused, reset, timeout) otherwise."""
    with socket.create_connection((host, port), timeout=timeout) as s:
        s.settimeout(timeout)
        size = _HEADER.unpack(_read(s, _HEADER.size))[0]
        if size > _MAX_INFO:
            raise ValueError(f"side channel at {host}:{port} announced {size} bytes: not a torch_p2p peer")
        return _read(s, size)


def _read(s: socket.socket, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        chunk = s.recv(n - len(out))
        if not chunk:
            raise ConnectionError(f"side channel closed after {len(out)} of {n} bytes")
        out += chunk
    return bytes(out)


class KVTransfer:
    """One worker's caches and transfers.

    `caches`: layer name -> cache tensor (see the module's docstring); `layout`: "cpu" or
    "cuda"; `first_head`: the model's KV head this worker's caches start at (tensor
    parallelism). With `port`, a side channel at host:port serves the handle (the prefill
    side). `timeout` bounds a handshake and a pull; `lease` is how long blocks awaiting a pull
    are held before they are freed anyway. `share`: move host caches into shared memory, in
    place, before registering them, so that same-host peers map them and copy with memcpy
    instead of the kernel's cross-memory copy (the engine's cma route; the move copies the
    caches once and holds twice their memory meanwhile).
    """

    def __init__(self, caches: dict[str, torch.Tensor], layout: str, *, engine_id: str, first_head: int = 0,
                 host: str = "127.0.0.1", port: int | None = None, timeout: float = 10.0, lease: float = 30.0,
                 engine: Engine | None = None, share: bool = False):
        if not caches:
            raise ValueError("no KV caches to register")
        self.names = layer_order(caches)
        first = caches[self.names[0]]
        if share and first.device.type == "cpu":
            share_in_place(caches.values())
        self.engine = engine or Engine(str(first.device))
        self._own_engine = engine is None
        self.cache = kv.KVCache(self.engine, [layer_view(caches[n], layout) for n in self.names], LAYOUTS[layout],
                                first_head=first_head)
        self.engine_id, self.timeout, self.lease = engine_id, timeout, lease
        self.info = json.dumps(dict(engine_id=engine_id, layers=self.names,
                                    handle=base64.b64encode(self.cache.handle.to_bytes()).decode())).encode()
        try:
            self.side_channel = SideChannel(host, port, self.info) if port is not None else None
        except OSError as e:
            self.cache.close()
            if self._own_engine:
                self.engine.close()
            raise OSError(e.errno, f"TorchP2PConnector's side channel cannot listen on {host}:{port} "
                                   f"({e.strerror}): give each instance of a host its own side_channel_port") from e
        self._peers: dict[tuple[str, int], tuple[str, kv.KVCacheHandle]] = {}
        self._pool = ThreadPoolExecutor(2, thread_name_prefix="torch_p2p-kv")
        self._releases: list = []  # the free notices' jobs on _pool: close() lets them go out
        # Pulls in flight, checked by poll(): noticed on vLLM's thread, not by a callback, whose
        # thread would wait for the GIL (up to sys.getswitchinterval()) while vLLM's step runs.
        self._pulls: list[_Load] = []
        self._lock = threading.Lock()
        self._failed_early: queue.SimpleQueue[Pulled] = queue.SimpleQueue()
        self._leases: dict[str, torch.futures.Future] = {}
        self._lease_lock = threading.Lock()

    # -- decode side -----------------------------------------------------------------------------
    def load(self, request_id: str, remote_request_id: str, sources: list[tuple[str, int]], remote_engine_id: str,
             remote_blocks, local_blocks, *, readers: int = 1) -> None:
        """Pulls the prefill side's `remote_blocks` into `local_blocks` (the last
        len(local_blocks) of them: the first ones may be in our prefix cache) and tells it to
        free them. Reported by ``poll()``, failed or not, within `timeout` of a silent peer and
        at once of a dead local one.

        `sources`: the side channels (host, port) of the prefill workers that hold this
        worker's heads (one, or several where tensor parallelism differs: tp_mapping); each
        pull moves the heads both hold. `readers`: how many decode workers read each of them
        (their blocks are freed when all have)."""
        remote_blocks, local_blocks = list(remote_blocks), list(local_blocks)
        if len(local_blocks) > len(remote_blocks):
            raise ValueError(f"request {request_id}: {len(local_blocks)} blocks to fill from "
                             f"{len(remote_blocks)} remote blocks")
        if not sources:
            raise ValueError(f"request {request_id}: no prefill worker to pull from")
        load = _Load(request_id, tag(remote_request_id, readers), [(h, int(p)) for h, p in sources], remote_engine_id,
                     remote_blocks[len(remote_blocks) - len(local_blocks):], local_blocks, time.perf_counter())
        known = [self._peers.get(where) for where in load.sources]
        if all(k is not None and k[0] == remote_engine_id for k in known):
            self._issue(load, [k[1] for k in known])  # on the caller's thread: no hop to another Python thread
        else:
            # A handshake leaves the model's step: a slow or dead prefill host delays only its requests.
            self._pool.submit(self._handshake_then_issue, load)

    def _handshake_then_issue(self, load: "_Load") -> None:
        try:
            peers = [self._handshake(where, load.remote_engine_id) for where in load.sources]
        except BaseException as e:  # reported as a failed load, never raised into vLLM's step
            self._failed_early.put(self._pulled(load, e))
            return
        load.handshake = time.perf_counter() - load.start
        self._issue(load, peers)

    def _issue(self, load: "_Load", peers: list[kv.KVCacheHandle]) -> None:
        load.peers, load.issued = peers, time.perf_counter()
        try:
            for peer in peers:
                load.futures.append(self.cache.pull(peer, load.remote_blocks, load.local_blocks, timeout=self.timeout))
        except BaseException as e:
            load.futures.append(_shared.failed(e))  # reported once the pulls issued before it are done
        with self._lock:
            self._pulls.append(load)

    def _finish(self, load: "_Load") -> "Pulled":
        """A done load as a result; the prefill workers are told they may free the blocks on a
        thread of ours, off vLLM's step (a notice that fails leaves their blocks to the lease)."""
        try:
            for f in load.futures:
                f.value()
        except BaseException as e:
            return self._pulled(load, e)
        self._releases = [job for job in self._releases if not job.done()]
        self._releases.append(self._pool.submit(self._release, load))
        return self._pulled(load, None)

    def _release(self, load: "_Load") -> None:
        for peer in load.peers:
            try:
                told = self.cache.pull(peer, [], [], notify=load.notify, timeout=self.timeout)
            except Exception as e:  # noqa: BLE001 - reported below, like a notice that fails later
                told = _shared.failed(e)
            told.add_done_callback(lambda f, rid=load.request_id: _warn_if_untold(f, rid))

    def _pulled(self, load: "_Load", error: BaseException | None) -> "Pulled":
        seconds = time.perf_counter() - load.issued if load.issued else 0.0
        return Pulled(load.request_id, len(load.local_blocks), len(load.local_blocks) * self.cache.block_bytes,
                      seconds, load.handshake, error)

    def _handshake(self, where: tuple[str, int], remote_engine_id: str) -> kv.KVCacheHandle:
        """The handle of the engine at `where`, fetched from its side channel."""
        known = self._peers.get(where)
        if known is not None and known[0] == remote_engine_id:
            return known[1]  # an earlier load's handshake finished meanwhile
        info = json.loads(fetch(*where, timeout=self.timeout))
        if info["engine_id"] != remote_engine_id:
            raise ValueError(f"{where[0]}:{where[1]} serves engine {info['engine_id']}, not {remote_engine_id}")
        if info["layers"] != self.names:
            raise ValueError(f"engine {remote_engine_id} has layers {info['layers']}, this one {self.names}")
        peer = kv.KVCacheHandle.from_bytes(base64.b64decode(info["handle"]))
        self._peers[where] = (remote_engine_id, peer)
        return peer

    def wait(self, seconds: float) -> None:
        """Waits until every pull issued so far is done, or `seconds` pass (for a caller with
        nothing else to do: poll() then reports them without another round)."""
        with self._lock:
            pending = [f for p in self._pulls for f in p.futures if not f.done()]
        if not pending:
            return
        # Woken by the last completion: the caller sleeps without the GIL, which the engine's
        # completions need, and hears at once (a sleep-and-look loop added up to 0.4 ms a pull).
        done = threading.Event()
        _shared.all_of(pending).add_done_callback(lambda _: done.set())
        done.wait(seconds)

    # -- prefill side ----------------------------------------------------------------------------
    def hold(self, request_id: str, lease: float | None = None) -> None:
        """Holds a finished request's blocks until the decode workers' pulls say they are done
        with them, or `lease` (default: the object's) passes. How many decode workers read them
        is up to the decode engine's tensor parallelism: one waiter per count this worker's
        heads allow (a reader takes at least one), the first to complete wins."""
        lease = self.lease if lease is None else lease
        heads = self.cache.heads[1] - self.cache.heads[0] if self.cache.heads else 1
        groups = [[self.engine.notification(tag(request_id, k), timeout=lease) for _ in range(k)]
                  for k in range(1, heads + 1) if heads % k == 0]
        with self._lease_lock:
            self._leases[request_id] = _first_of(groups, self.engine)

    # -- both ------------------------------------------------------------------------------------
    def poll(self) -> tuple[dict[str, bool], list[Pulled]]:
        """(requests whose blocks may be freed -> whether a pull released them (False: the lease
        ran out), loads finished since the last call)."""
        freed = {}
        with self._lease_lock:
            for rid, fut in list(self._leases.items()):
                if fut.done():
                    del self._leases[rid]
                    try:
                        fut.value()
                        freed[rid] = True
                    except Exception:
                        freed[rid] = False
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
        self.cache.close()
        if self._own_engine:
            self.engine.close()
