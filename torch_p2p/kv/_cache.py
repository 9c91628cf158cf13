"""KVCache, its handle and its streamed pushes (the package's docstring says how they move)."""
from __future__ import annotations

import json
import operator
import threading

import torch

from .. import _C, _shared
from .._shared import b64, unb64
from ..engine import Engine, Region, pages
from ..remote import RemoteTensor
from . import _layout as lay

MAX_PREPARED = 64  # prepared calls kept per peer (one per direction, layer selection and timeout)

_MAGIC, _VERSION = b"P2PKV", 1


class _Side:
    """What a cache and a handle describe alike: per layer its stores, as (label, tensor or
    RemoteTensor) with the axes `axes` (see _layout)."""

    def _describe(self, layout: str, axes: tuple, layers: list, first_head: int | None, what: str) -> None:
        facts = lay.describe(axes, layers, what)
        if first_head is not None and facts["heads"] is None:
            raise ValueError(f"{what} has no heads axis, so no first head")
        if first_head is not None and first_head < 0:
            raise ValueError(f"{what}: first_head must be >= 0, not {first_head}")
        self.layout, self.axes, self.layers, self.dtype = layout, axes, layers, facts["dtype"]
        self.num_layers, self.num_blocks = len(layers), facts["num_blocks"]
        self.block_size, self.head_dim = facts["block_size"], facts["head_dim"]
        start = first_head or 0
        self.heads = None if facts["heads"] is None else (start, start + facts["heads"])

    @property
    def block_bytes(self) -> int:
        """Bytes of one block over all layers and stores."""
        return sum(x.numel() * x.element_size() for layer in self.layers for _, x in layer) // self.num_blocks


class KVCacheHandle(_Side):
    """What a peer needs to move blocks of a KVCache: its owner's address, layout, dtype and
    RemoteTensors (metadata and keys, no data). ``KVCache.handle`` makes it; ``to_bytes()`` /
    ``from_bytes()`` / pickle carry it, once per pair of engines, not per request."""

    def __init__(self, layout: str, axes: tuple, first_head: int | None, bases: list, refs: list,
                 mailbox: RemoteTensor):
        self._bases, self._refs, self._first_head, self.mailbox = bases, refs, first_head, mailbox
        self.owner = mailbox.owner
        if any(b.owner != self.owner for b in bases):
            raise ValueError("a KV cache handle names RemoteTensors of several engines")
        self._describe(layout, axes, lay.derive(bases, refs), first_head, "the peer's cache")

    def to_bytes(self) -> bytes:
        header = dict(layout=self.layout, axes=" ".join(self.axes), first_head=self._first_head, refs=self._refs,
                      bases=[b64(b.to_bytes()) for b in self._bases], mailbox=b64(self.mailbox.to_bytes()))
        return _MAGIC + bytes([_VERSION]) + json.dumps(header, separators=(",", ":")).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> "KVCacheHandle":
        """Parses to_bytes(); anything else raises ValueError."""
        data = bytes(data)
        if not data.startswith(_MAGIC) or len(data) <= len(_MAGIC):
            raise ValueError("not a KV cache handle")
        if data[len(_MAGIC)] != _VERSION:
            raise ValueError(f"KV cache handle version {data[len(_MAGIC)]}; this torch_p2p reads {_VERSION}")
        try:
            h = json.loads(data[len(_MAGIC) + 1:])
            bases = [RemoteTensor.from_bytes(unb64(b)) for b in h["bases"]]
            refs = [[(str(label), int(b), int(k)) for label, b, k in layer] for layer in h["refs"]]
            if not refs or any(not 0 <= b < len(bases) for layer in refs for _, b, _ in layer):
                raise ValueError("no layers, or a store names a missing RemoteTensor")
            first_head = None if h["first_head"] is None else int(h["first_head"])
            return cls(str(h["layout"]), lay.parse_layout(h["axes"]), first_head, bases, refs,
                       RemoteTensor.from_bytes(unb64(h["mailbox"])))
        except (KeyError, TypeError, IndexError, ValueError, json.JSONDecodeError) as e:
            raise ValueError(f"bad KV cache handle: {e}") from None

    def __reduce__(self):
        return (KVCacheHandle.from_bytes, (self.to_bytes(),))

    def __repr__(self):
        return (f"KVCacheHandle({self.layout!r}, {self.num_layers} layers, {self.num_blocks} blocks of "
                f"{self.block_size}, heads {self.heads}, {self.dtype}, {self.mailbox.device})")


class KVCache(_Side):
    """A paged KV cache registered with `engine`.

    `layers`: one tensor per layer, a (K, V) pair of tensors per layer (layouts without "kv"),
    or one stacked tensor (a "layers" axis, else a leading one). `layout`: a key of LAYOUTS or
    an axes string. `block_size`: tokens per block of a token-granular layout (SGLang's page
    size); tokens after the last whole block are out of reach. `first_head`: the first of the
    model's KV heads that this cache holds (tensor parallelism), default 0. `access`: what peers
    may do with the blocks ("rw", "r", "w").

    Tensors that share a storage (views of one buffer) must be evenly spaced views of one
    shape: the storage is registered once, as one stacked view.
    """

    def __init__(self, engine: Engine, layers, layout: str = "flash_attn", *, block_size: int | None = None,
                 first_head: int | None = None, access: str = "rw"):
        stores, axes = lay.normalize(layers, lay.parse_layout(layout), block_size)
        bases, refs = lay.stack_by_storage(stores)
        self.engine = engine
        self._regions: list[Region] = []
        self._plans: dict[int, tuple] = {}
        self._lock = threading.Lock()
        self._describe(layout, axes, lay.derive(bases, refs), first_head, "the cache")
        try:
            for base in bases:
                self._regions.append(engine.register(base, access))
            # Where pullers write one element with notify= to say they are done with our blocks.
            self._mailbox = torch.zeros(1, dtype=torch.int64, device=engine.device)
            self._regions.append(engine.register(self._mailbox))
        except BaseException:
            self.close()
            raise
        self.handle = KVCacheHandle(layout, axes, first_head, [r.remote for r in self._regions[:-1]], refs,
                                    self._regions[-1].remote)

    # -- moving blocks ---------------------------------------------------------------------------
    def push(self, peer: KVCacheHandle, src_blocks, dst_blocks, *, layers=None, notify: int | None = None,
             timeout: float | None = None) -> torch.futures.Future:
        """Writes this cache's blocks `src_blocks[i]` into the peer's blocks `dst_blocks[i]`, of
        every layer or of those in `layers`, as one engine call. The future completes when every
        byte is in the peer's memory (the source blocks may be reused then); with `notify` the
        peer's ``notification(notify)`` completes too. CUDA sources are read after the work
        queued so far on the current stream."""
        src = lay.block_ids(src_blocks, self.num_blocks, "source")
        dst = lay.block_ids(dst_blocks, self._checked(peer).num_blocks, "destination", unique=True)
        return self._move(True, peer, src, dst, self._layer_list(layers), notify, timeout)

    def pull(self, peer: KVCacheHandle, src_blocks, dst_blocks, *, layers=None, notify: int | None = None,
             timeout: float | None = None) -> torch.futures.Future:
        """Reads the peer's blocks `src_blocks[i]` into this cache's blocks `dst_blocks[i]`, as one
        engine call. With `notify`, the peer's ``notification(notify)`` then completes (it may free
        its blocks) and the future completes after that."""
        src = lay.block_ids(src_blocks, self._checked(peer).num_blocks, "source")
        dst = lay.block_ids(dst_blocks, self.num_blocks, "destination", unique=True)
        return self._move(False, peer, dst, src, self._layer_list(layers), notify, timeout)

    def stream(self, peer: KVCacheHandle, src_blocks, dst_blocks, *, notify: int | None = None,
               timeout: float | None = None) -> "PushStream":
        """A push issued a layer at a time: ``stream.push(i)`` right after layer i's forward, on
        the stream that computed it, so the transfer overlaps the rest of the prefill."""
        return PushStream(self, peer, src_blocks, dst_blocks, notify, timeout)

    def notification(self, tag: int, count: int = 1, *, timeout: float | None = None) -> torch.futures.Future:
        """Completes when `count` calls with ``notify=tag`` have finished here: pushes into this
        cache (a streamed push of n layers is n calls), or pulls of its blocks (the puller is done
        reading them). Not bound to one peer: give a timeout to hear of a sender that died."""
        if count < 1:
            raise ValueError(f"count must be at least 1, not {count}")
        return _shared.all_of([self.engine.notification(tag, timeout=timeout) for _ in range(count)])

    def _move(self, write, peer, local_ids, remote_ids, layers, notify, timeout):
        if len(local_ids) != len(remote_ids):
            src, dst = (local_ids, remote_ids) if write else (remote_ids, local_ids)
            raise ValueError(f"{len(src)} source blocks but {len(dst)} destination blocks")
        plan, calls = self._entry(peer)
        fut = None
        if len(local_ids) and layers:
            ids = {False: (local_ids, remote_ids)}
            if plan[0][0][3]:
                # A kvflat store's pages: K of block b is page b, its V page num_blocks + b.
                ids[True] = _C.stacked_ids(local_ids, self.num_blocks), _C.stacked_ids(remote_ids, peer.num_blocks)

            def entries():
                local, remote = [], []
                for layer in layers:
                    for x, rx, dim, is_flat in plan[layer]:
                        local.append(pages(x, ids[is_flat][0], dim))
                        remote.append(pages(rx, ids[is_flat][1], dim))
                return local, remote

            # The first request to this peer over these layers is prepared once; the next ones
            # run it on their own blocks (one list of ids that every layer shares), sparing the
            # parse of an entry per layer on each request's critical path.
            key = (write, tuple(layers), timeout)
            call = calls.get(key, False)
            if call is False:
                call = (self.engine.prepare_write if write else self.engine.prepare_read)(*entries(), timeout=timeout)
                if len(calls) >= MAX_PREPARED:
                    calls.clear()
                call = calls[key] = call if call.takes_pages else None  # None: mixed layouts, parsed each time
            if call is not None:
                fut = call.run_pages(*ids[plan[layers[0]][0][3]], notify=notify if write else None)
            elif write:
                fut = self.engine.write_slices(*entries(), notify=notify, timeout=timeout)
            else:
                fut = self.engine.read_slices(*entries(), timeout=timeout)
        if write:
            return fut if fut is not None else self._tell(peer, notify, timeout)  # none: a notification is owed
        read = fut if fut is not None else _shared.done()
        if notify is None:
            return read
        out = torch.futures.Future()
        _shared.then(read, lambda: self._tell(peer, notify, timeout), out)
        return out

    def _tell(self, peer, notify, timeout):
        if notify is None:
            return _shared.done()
        return self.engine.write_slices([self._mailbox], [peer.mailbox], notify=notify, timeout=timeout)

    # -- pairing with a peer ---------------------------------------------------------------------
    def _checked(self, peer) -> KVCacheHandle:
        if not isinstance(peer, KVCacheHandle):
            raise TypeError(f"the peer is a KVCacheHandle, not {type(peer).__name__}")
        return peer

    def _plan(self, peer: KVCacheHandle) -> list:
        """Per layer, the (local view, remote view, block dim, kvflat) that pair this cache with
        `peer`'s; computed once per handle object."""
        return self._entry(peer)[0]

    def _entry(self, peer: KVCacheHandle) -> tuple[list, dict]:
        """The plan for `peer`, and its prepared calls by (write, layers, timeout)."""
        with self._lock:
            known = self._plans.get(id(self._checked(peer)))
            if known and known[0] is peer:
                return known[1:]
        lay.check_compatible(self, peer)
        plan = [lay.pair(self, peer, i) for i in range(self.num_layers)]
        with self._lock:
            self._plans[id(peer)] = (peer, plan, {})  # holding the handle keeps its id from being reused
            return self._plans[id(peer)][1:]

    def _layer_list(self, layers) -> list[int]:
        if layers is None:
            return list(range(self.num_layers))
        out = [operator.index(layers)] if isinstance(layers, int) else [operator.index(i) for i in layers]
        for i in out:
            if not 0 <= i < self.num_layers:
                raise IndexError(f"layer {i} is out of range for a cache of {self.num_layers} layers")
        if len(set(out)) != len(out):
            raise ValueError(f"a layer is named twice in {out}")
        return out

    # -- life cycle ------------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self.engine.device

    def close(self) -> None:
        """Deregisters the cache's storages (after local transfers that use them)."""
        with self._lock:
            self._plans.clear()  # and the prepared calls, which name the regions
        while self._regions:
            self._regions.pop().close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        return (f"KVCache({self.layout!r}, {self.num_layers} layers, {self.num_blocks} blocks of "
                f"{self.block_size}, heads {self.heads}, {self.dtype}, {self.device})")


class PushStream:
    """One request's push issued a layer (or a few) at a time; made by ``KVCache.stream``. Each
    ``push`` is one engine call carrying the stream's notify tag, so the receiver waits for
    ``notification(tag, count=calls)``: ``num_layers`` when every layer goes alone."""

    def __init__(self, cache: KVCache, peer: KVCacheHandle, src_blocks, dst_blocks, notify, timeout):
        self.src = lay.block_ids(src_blocks, cache.num_blocks, "source")
        self.dst = lay.block_ids(dst_blocks, cache._checked(peer).num_blocks, "destination", unique=True)
        if len(self.src) != len(self.dst):
            raise ValueError(f"{len(self.src)} source blocks but {len(self.dst)} destination blocks")
        cache._plan(peer)  # a layout mismatch raises now, not at the first layer
        self.cache, self.peer, self.notify, self.timeout = cache, peer, notify, timeout
        self.pushed: set[int] = set()
        self.futures: list[torch.futures.Future] = []

    @property
    def calls(self) -> int:
        return len(self.futures)

    def push(self, layers) -> torch.futures.Future:
        """Pushes these layers (an index or several) as one call."""
        layers = self.cache._layer_list(layers)
        again = self.pushed.intersection(layers)
        if again:
            raise ValueError(f"layers {sorted(again)} were pushed already")
        fut = self.cache._move(True, self.peer, self.src, self.dst, layers, self.notify, self.timeout)
        self.pushed.update(layers)
        self.futures.append(fut)
        return fut

    def future(self) -> torch.futures.Future:
        """Completes when every push so far has (with the first error, if any)."""
        return _shared.all_of(self.futures)
