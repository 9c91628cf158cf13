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
import queue
import re
import socket
import struct
import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from ... import Engine, kv

LAYOUTS = {"cpu": "blocks heads kv tokens dim", "cuda": "blocks heads tokens kv dim"}
_HEADER = struct.Struct("!I")
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


def layer_order(names) -> list[str]:
    """Layer names in model order (layers.10 after layers.2), the order both sides pair."""
    return sorted(names, key=lambda n: [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", n)])


def tag(request_id: str) -> int:
    return zlib.crc32(request_id.encode())


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
    seconds: float  # the pull alone
    handshake_seconds: float  # 0 once the peer's handle is known
    error: BaseException | None = None


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
    are held before they are freed anyway.
    """

    def __init__(self, caches: dict[str, torch.Tensor], layout: str, *, engine_id: str, first_head: int = 0,
                 host: str = "127.0.0.1", port: int | None = None, timeout: float = 10.0, lease: float = 30.0,
                 engine: Engine | None = None):
        if not caches:
            raise ValueError("no KV caches to register")
        self.names = layer_order(caches)
        first = caches[self.names[0]]
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
        # Handshakes leave the model's step: a slow or dead prefill host delays only its requests.
        self._pool = ThreadPoolExecutor(2, thread_name_prefix="torch_p2p-load")
        self._loaded: queue.SimpleQueue[Pulled] = queue.SimpleQueue()
        self._leases: dict[str, torch.futures.Future] = {}
        self._lease_lock = threading.Lock()

    # -- decode side -----------------------------------------------------------------------------
    def load(self, request_id: str, remote_request_id: str, host: str, port: int, remote_engine_id: str,
             remote_blocks, local_blocks) -> None:
        """Pulls the prefill side's `remote_blocks` into `local_blocks` (the last
        len(local_blocks) of them: the first ones may be in our prefix cache) and tells it to
        free them. Reported by ``poll()``, failed or not, within `timeout` of a silent peer and
        at once of a dead local one."""
        remote_blocks, local_blocks = list(remote_blocks), list(local_blocks)
        if len(local_blocks) > len(remote_blocks):
            raise ValueError(f"request {request_id}: {len(local_blocks)} blocks to fill from "
                             f"{len(remote_blocks)} remote blocks")
        remote_blocks = remote_blocks[len(remote_blocks) - len(local_blocks):]
        self._pool.submit(self._load, request_id, tag(remote_request_id), (host, int(port)), remote_engine_id,
                          remote_blocks, local_blocks)

    def _load(self, request_id, notify, where, remote_engine_id, remote_blocks, local_blocks) -> None:
        start = time.perf_counter()
        nbytes = len(local_blocks) * self.cache.block_bytes
        try:
            peer, fetched = self._handshake(where, remote_engine_id)
            handshake = time.perf_counter() - start if fetched else 0.0
            begun = time.perf_counter()
            fut = self.cache.pull(peer, remote_blocks, local_blocks, timeout=self.timeout)
        except BaseException as e:  # reported as a failed load, never raised into vLLM's step
            self._loaded.put(Pulled(request_id, len(local_blocks), nbytes, 0.0, time.perf_counter() - start, e))
            return

        def done(f):
            err = None
            try:
                f.value()
                # The blocks are here: tell the prefill side without waiting for it to hear (a
                # notice that fails leaves its blocks to the lease).
                self.cache.pull(peer, [], [], notify=notify, timeout=self.timeout)
            except BaseException as e:
                err = e
            self._loaded.put(Pulled(request_id, len(local_blocks), nbytes, time.perf_counter() - begun, handshake, err))
        fut.add_done_callback(done)

    def _handshake(self, where: tuple[str, int], remote_engine_id: str) -> tuple[kv.KVCacheHandle, bool]:
        """The handle of the engine at `where`, and whether it was fetched now."""
        known = self._peers.get(where)
        if known is not None and known[0] == remote_engine_id:
            return known[1], False
        info = json.loads(fetch(*where, timeout=self.timeout))
        if info["engine_id"] != remote_engine_id:
            raise ValueError(f"{where[0]}:{where[1]} serves engine {info['engine_id']}, not {remote_engine_id}")
        if info["layers"] != self.names:
            raise ValueError(f"engine {remote_engine_id} has layers {info['layers']}, this one {self.names}")
        peer = kv.KVCacheHandle.from_bytes(base64.b64decode(info["handle"]))
        self._peers[where] = (remote_engine_id, peer)
        return peer, True

    # -- prefill side ----------------------------------------------------------------------------
    def hold(self, request_id: str, lease: float | None = None) -> None:
        """Holds a finished request's blocks until a decode worker's pull says it is done with
        them, or `lease` (default: the object's) passes."""
        fut = self.cache.notification(tag(request_id), timeout=self.lease if lease is None else lease)
        with self._lease_lock:
            self._leases[request_id] = fut

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
        loaded = []
        while True:
            try:
                loaded.append(self._loaded.get_nowait())
            except queue.Empty:
                return freed, loaded

    def close(self) -> None:
        if self.side_channel is not None:
            self.side_channel.close()
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.cache.close()
        if self._own_engine:
            self.engine.close()
