"""Engine: one progress thread (one GPU, or the host) moving tensors to and from peers.

Thread model: the C++ worker owns the NICs and never takes the GIL. It hands results to a
Python dispatcher thread (one per engine), which completes the torch futures; callbacks
attached with ``Future.then`` run there, so they must not block on this engine.
"""
from __future__ import annotations

import atexit
import logging
import threading
import weakref
from collections.abc import Sequence

import torch

from . import _C, errors, topology
from ._shared import positive, then as _then
from .remote import RemoteTensor

log = logging.getLogger("torch_p2p")

# The settings table's defaults (csrc/core/config.h), for the signature below.
_DEFAULTS = {key: default for key, _, default in _C.settings()}

_live: "weakref.WeakSet[Engine]" = weakref.WeakSet()

_new_future = torch._C.Future.__new__  # the native call sets it up (a future of Python objects, no devices)


class _SpinningFuture(torch.futures.Future):
    """The futures of an engine whose worker is pinned (busy-polls its core): wait() first
    spins without the GIL (up to the engine's completion_spin_us) for the completion, which a
    small call's comes within, and only then sleeps; a sleeping waiter's wake-up costs about as
    much as the call."""

    _spin_us = 0

    def wait(self):
        _C._wait_done(self, self._spin_us, 0.0)
        return super().wait()


def _parse_device(device) -> torch.device:
    dev = torch.device(device)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {device!r} requested but CUDA is not available")
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        if not _C.with_cuda:
            raise ValueError("torch_p2p was built without CUDA; reinstall it with CUDA available")
    elif dev.type != "cpu":
        raise ValueError(f"device must be 'cpu' or 'cuda[:N]', not {device!r}")
    return dev


class Pages:
    """Pages of a tensor or RemoteTensor: ``x.select(dim, i)`` for each ``i`` in ``ids``, in that
    order, without a Python view per page. Made by ``p2p.pages()``; pairs with a Pages of the
    same count and page shape on the other side of ``write_slices`` / ``read_slices``."""

    __slots__ = ("base", "ids", "dim")

    def __init__(self, base, ids, dim: int = 0):
        if not isinstance(base, (torch.Tensor, RemoteTensor)):
            raise TypeError(f"pages() takes a tensor or a RemoteTensor, not {type(base).__name__}")
        # A KV block table is usually an int64 CPU tensor already: take it as it is (a
        # conversion costs a microsecond per call, and a call may hold one entry per layer).
        if not (isinstance(ids, torch.Tensor) and ids.dtype is torch.int64 and ids.is_cpu):
            ids = torch.as_tensor(ids, dtype=torch.int64, device="cpu")
        if ids.dim() != 1:
            raise ValueError(f"page ids must be one-dimensional, not of shape {tuple(ids.shape)}")
        ndim = base.dim()
        if not -ndim <= dim < ndim:
            raise IndexError(f"page dimension {dim} is out of range for a tensor of dimension {ndim}")
        self.base, self.ids, self.dim = base, ids if ids.is_contiguous() else ids.contiguous(), dim % ndim

    def __len__(self) -> int:
        return len(self.ids)

    def __repr__(self):
        return f"Pages({len(self.ids)} pages of dim {self.dim} of {type(self.base).__name__} {tuple(self.base.shape)})"


def pages(base, ids, dim: int = 0) -> Pages:
    """``base.select(dim, i)`` for each ``i`` in ``ids`` (a sequence or an integer tensor), as one
    entry of ``write_slices`` / ``read_slices``. Thousands of random pages (KV-cache blocks)
    cost one call and no Python object per page; consecutive ids merge into one run."""
    return _C._pages(base, ids, dim)  # Pages(base, ids, dim), made natively where no check fails


# write_slices' arguments are taken apart natively (a small call's cost is mostly per call):
# the native side needs the classes it takes apart.
_C._set_classes(Pages, RemoteTensor, Sequence)


class PreparedCall:
    """A write_slices / read_slices call checked once (``Engine.prepare_write`` /
    ``prepare_read``). ``run()`` starts it again and returns its future; like the call itself,
    a run follows the work queued so far on the current CUDA stream, and its views must not
    change until its future completes. A run fails with ClosedError once a local region that
    it uses is deregistered, and like any call when the peer's region is gone."""

    __slots__ = ("engine", "_native")

    def __init__(self, engine: "Engine", native):
        self.engine, self._native = engine, native

    def run(self) -> torch.futures.Future:
        return self.engine._call(self.engine._c.run, self._native)

    @property
    def takes_pages(self) -> bool:
        """Whether run_pages() may give this call other page ids."""
        return self._native.takes_pages

    def run_pages(self, local_ids: torch.Tensor, remote_ids: torch.Tensor, *,
                  notify: int | None = None) -> torch.futures.Future:
        """Runs the call on other pages: for a call whose page entries are all ``p2p.pages`` of
        dense pages sharing one list of ids (a KV cache's layers: ``pages(layer, ids)`` for
        each layer, the same ids tensors), those ids replaced by `local_ids` and `remote_ids`
        (1-d int64 CPU tensors of one length, any length), checked as a call checks them. With
        `notify`, that tag in place of the prepared one. Raises ValueError for a call of
        another shape."""
        return self.engine._call(self.engine._c.run_pages, self._native, local_ids, remote_ids, notify)


class Region:
    """A registered storage. ``remote`` is the handle to give peers; ``close()`` deregisters."""

    def __init__(self, engine: "Engine", rid: int, tensor: torch.Tensor, remote: RemoteTensor):
        self.engine = engine
        self.id = rid
        self.tensor = tensor
        self.remote = remote
        self.closed = False

    def close(self, timeout: float | None = None) -> None:
        """Deregisters, first waiting (up to `timeout`, default the engine's) for local
        operations that use the region; peers can no longer reach it afterwards."""
        self.engine.deregister(self, timeout=timeout)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        return f"Region(id={self.id}, nbytes={self.tensor.untyped_storage().nbytes()}, closed={self.closed})"


class Engine:
    """Moves tensor data between registered memory of this process and its peers.

    Args:
        device: "cpu" or "cuda:N": the GPU whose NICs, NUMA-local core and memory it serves.
        provider: libfabric provider: "efa", "verbs", "tcp", "shm", a full stack such as
            "tcp;ofi_rxm", or None for the best available (efa, verbs, then tcp).
            ``TORCH_P2P_PROVIDER`` overrides None.

    An argument left as None takes its ``TORCH_P2P_*`` variable, else the provider's default,
    else the table's: ``_C.settings()`` lists every setting, its variable and its default
    (csrc/core/config.h). Tuning settings without an argument (max_chunk_bytes, tx_depth,
    spin_us, ...) come from their variables only.
        num_rails: NICs (libfabric domains) to stripe over; by default every NIC that belongs
            to the device (PCIe proximity), and on tcp ``topology.default_tcp_rails()`` (one
            per 4 cores, up to 8) when that is more. More rails than NICs open several
            domains on one NIC. ``TORCH_P2P_NUM_RAILS`` sets it too.
        domains: use exactly these libfabric domains (e.g. ["lo"]); ``TORCH_P2P_DOMAINS``.
        cpus: cores for the progress thread (``TORCH_P2P_CPUS``); by default a core on the
            GPU's NUMA node, and no pinning for host engines.
        ipc: same-host peers move CUDA memory by CUDA IPC, without the fabric (CUDA engines;
            default on; ``TORCH_P2P_IPC=0`` turns it off). See ``route()``.
        cma: same-host peers move host memory with cross-memory attach (process_vm_writev /
            readv), without the fabric (default on; ``TORCH_P2P_CMA=0`` turns it off); a peer's
            tensor in shared memory (``share_memory_()`` before ``register``) is mapped and
            copied with memcpy instead (``TORCH_P2P_CMA_MAP=0`` turns that off). See
            ``route()`` and docs/routes.md, "Same-host host memory (the cma route)".
        data_path: None (auto), "direct" (GPUDirect RDMA; error if the provider has no FI_HMEM)
            or "staged" (through pinned host slots, also for host memory).
        timeout: default deadline of one operation, seconds.
        peer_timeout: a peer that something waits on and that stays silent this long is dead:
            its futures fail with PeerError.
        staging_bytes / staging_slot_bytes: size of the pinned staging pool and of one slot
            (the staged path's memory bound; half the slots serve peers' requests; 64 MiB and
            4 MiB, ``TORCH_P2P_STAGING_BYTES`` / ``TORCH_P2P_STAGING_SLOT_BYTES``).
        port: first port of the rails' endpoints on IP providers (rail i uses port + i);
            None lets the system choose.
    """

    def __init__(self, device="cpu", provider: str | None = None, num_rails: int | None = None, *,
                 domains: list[str] | None = None, cpus: list[int] | None = None,
                 data_path: str | None = None, timeout: float = float(_DEFAULTS["timeout"]),
                 peer_timeout: float = float(_DEFAULTS["peer_timeout"]), staging_bytes: int | None = None,
                 staging_slot_bytes: int | None = None, port: int | None = None,
                 ipc: bool | None = None, cma: bool | None = None):
        if data_path not in (None, "direct", "staged"):
            raise ValueError(f"data_path must be None, 'direct' or 'staged', not {data_path!r}")
        self.device = _parse_device(device)
        cuda = self.device.type == "cuda"
        setup = _C.Setup(dict(
            provider=provider or None,
            cuda_device=self.device.index if cuda else -1,
            port=port or 0,
            data_path=data_path,
            timeout=float(timeout),
            peer_timeout=float(peer_timeout),
            staging_bytes=staging_bytes,
            staging_slot_bytes=staging_slot_bytes,
            ipc=ipc,
            cma=cma,
        ))
        nics = [topology.Nic(n["domain"], n["pci"], n["speed_bps"]) for n in setup.nics]
        self.plan = topology.plan(nics, str(self.device), num_rails, domains=domains, cpus=cpus,
                                  min_rails=topology.default_tcp_rails()
                                  if _C.provider_profile(setup.provider)["rails_from_cores"] else 1,
                                  claim=topology.claim_core)
        setup.place([nic.domain for nic in self.plan.rails], -1 if self.plan.cpu is None else self.plan.cpu,
                    list(self.plan.node_cpus))
        self.timeout = setup.setting("timeout")
        try:
            self._c = _C.Engine(setup)
        except BaseException:
            self.plan.release()
            raise
        self._closed = False
        self._regions: dict[int, Region] = {}
        spin_us = self._c.completion_spin_us
        self._future_type = (type("Future", (_SpinningFuture,), {"_spin_us": spin_us, "__module__": __name__})
                             if spin_us else torch.futures.Future)
        self._warm_buffers: dict[torch.dtype, torch.Tensor] = {}  # warm()'s scratch, by dtype
        why = ("provider has FI_HMEM (GPUDirect RDMA)" if self._c.data_path == "direct"
               else "requested" if data_path == "staged" else "provider has no FI_HMEM")
        log.info("engine on %s: %s, data path %s (%s); %s", self.device, self._c.provider,
                 self._c.data_path if cuda or data_path else "direct (host memory)", why, self.plan.reason)
        # The dispatcher holds the native engine, not self, so that an unreferenced Engine is
        # collected (and closed) like any object. The futures in flight are in the native
        # engine's table, which names each operation's id.
        self._dispatcher = threading.Thread(target=_dispatch, args=(self._c,),
                                            name="torch_p2p-dispatch", daemon=True)
        self._dispatcher.start()
        _live.add(self)

    # -- facts -------------------------------------------------------------------------------
    @property
    def address(self) -> bytes:
        """Opaque bytes a peer needs to reach this engine; share them any way you like."""
        return self._c.address

    @property
    def provider(self) -> str:
        return self._c.provider

    @property
    def data_path(self) -> str:
        """How GPU memory moves: "direct" (NIC reads and writes it) or "staged" (pinned slots)."""
        return self._c.data_path

    @property
    def rails(self) -> list[dict]:
        return self._c.rails

    @property
    def num_regions(self) -> int:
        """How many regions this engine has registered and not yet deregistered."""
        return len(self._regions)

    @property
    def closed(self) -> bool:
        return self._closed

    def route(self, peer) -> str:
        """How this engine's transfers of its device's memory reach `peer` (an engine address or
        a RemoteTensor): "ipc" (same host, CUDA IPC: one copy over NVLink or PCIe), "cma" (same
        host, host memory: the kernel copies between the processes, or memcpy where the peer's
        tensor is in shared memory), "direct" (the NIC reads and writes the memory) or
        "staged" (pinned host slots). For a RemoteTensor the IPC route is
        tried (its storage mapped) before the answer."""
        self._check_open()
        if isinstance(peer, RemoteTensor):
            return self._c.route(peer.owner, peer._v)
        return self._c.route(_address(peer), None)

    # -- memory ------------------------------------------------------------------------------
    def register(self, tensor: torch.Tensor, access: str = "rw") -> Region:
        """Registers the tensor's whole storage on every rail. `access` is what peers may do:
        "rw", "r" (read only) or "w" (write only); providers enforce it."""
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"register() takes a tensor, not {type(tensor).__name__}")
        self._check_open()
        rid, view = self._c.register(tensor, access, self.timeout)
        region = Region(self, rid, tensor, RemoteTensor(view))
        self._regions[rid] = region
        return region

    def deregister(self, region: Region, timeout: float | None = None) -> None:
        """See Region.close(). After a TimeoutError the region stays closed to new operations
        (``region.closed``) and close() may be called again."""
        if self._closed or region.id not in self._regions:
            region.closed = True
            return
        region.closed = True
        self._c.deregister(region.id, self.timeout if timeout is None else float(timeout))
        self._regions.pop(region.id, None)

    # -- transfers ---------------------------------------------------------------------------
    def write_slices(self, src_views, dst, *, notify: int | None = None,
                     timeout: float | None = None) -> torch.futures.Future:
        """Writes local views into remote memory.

        `src_views`: a tensor or a sequence of views of tensors registered with this engine.
        `dst`: a sequence of RemoteTensors, one per view with the same shape and dtype; or one
        RemoteTensor of a remote tensor laid out like the local registered one ("mirror":
        each view lands at the same element positions it has locally).
        `notify`: a 32-bit tag; the peer's ``notification(tag)`` completes once all bytes of
        this call are in its memory.
        The future completes when every byte is in the destination memory. CUDA sources are
        read after the work queued so far on the current stream.
        """
        return self._call(self._c.submit, True, src_views, dst, notify, timeout)

    def read_slices(self, dst_views, src, *, timeout: float | None = None) -> torch.futures.Future:
        """Reads remote memory into local views (RDMA READ); pairing as in write_slices."""
        return self._call(self._c.submit, False, dst_views, src, None, timeout)

    def prepare_write(self, src_views, dst, *, notify: int | None = None,
                      timeout: float | None = None) -> "PreparedCall":
        """write_slices' checks and decomposition, done once: each ``run()`` of the result then
        moves what ``write_slices(src_views, dst, ...)`` would, without doing them again. For
        the same buffers moved again and again (weights, pipeline stages, benchmarks). Page ids
        are copied here: changing them later changes nothing."""
        return PreparedCall(self, self._c.prepare(True, src_views, dst, notify, timeout))

    def prepare_read(self, dst_views, src, *, timeout: float | None = None) -> "PreparedCall":
        """read_slices done once, run many times: see prepare_write."""
        return PreparedCall(self, self._c.prepare(False, dst_views, src, None, timeout))

    # -- peers and messages --------------------------------------------------------------------
    def connect(self, address: bytes) -> torch.futures.Future:
        """Introduces this engine to a peer; completes when the peer answered. Optional:
        using a RemoteTensor of an unknown owner connects implicitly. A peer whose engine
        closed is not contacted again: this fails at once with ``PeerError``."""
        return self._call(self._c.connect, _address(address))

    def warm(self, peer, *, timeout: float | None = None) -> torch.futures.Future:
        """Makes the first transfer to a peer cost what the next ones do, off the request path.
        `peer` is an engine address or a RemoteTensor. With an address: connects (the peer's
        introduction and keys). With a RemoteTensor of access "r" or "rw": also reads a few bytes
        of its storage over every pair of rails, which opens the provider's connections and, on
        the CUDA IPC route, maps the storage; then reads them once more, so that the last thing
        both engines did is what later calls do. The scratch memory it reads into (one small
        tensor per dtype) stays registered until the engine closes."""
        self._check_open()
        if not isinstance(peer, RemoteTensor):
            return self.connect(peer)
        if "r" not in peer.access:
            return self.connect(peer.owner)
        elem = peer.element_size()
        per_piece = max(1, 64 // elem)
        total = peer._v.nbytes // elem
        pieces = max(1, min(len(self.plan.rails) * peer._v.rails, total // per_piece))
        spacing = total // pieces // per_piece * per_piece
        remotes = [RemoteTensor(peer._v.view(k * spacing, [min(per_piece, total)], [1])) for k in range(pieces)]
        scratch = self._warm_buffers.get(peer.dtype)
        if scratch is None or scratch.numel() < pieces * per_piece:
            scratch = torch.empty(pieces, per_piece, dtype=peer.dtype, device=self.device)
            self.register(scratch)
            self._warm_buffers[peer.dtype] = scratch  # the old one stays registered, unused
        views = [scratch[k, :remotes[k].numel()] for k in range(pieces)]
        # NOTE: the first read does what only a first transfer does (the peer's introduction,
        # the cma route's ask, the IPC mapping); a second one, once that is over, leaves both
        # engines having just moved bytes the way later calls do. On two cores the first 4 KiB
        # write after warm() then took 1.5 x a steady one on the cma route, 2.7 x with one
        # read (benchmarks/bw.py --first-contact).
        done = torch.futures.Future()
        _then(self.read_slices(views, remotes, timeout=timeout),
              lambda: self.read_slices(views, remotes, timeout=timeout), done)
        return done

    def disconnect(self, address: bytes) -> torch.futures.Future:
        """Leaves a peer cleanly: operations in flight to it finish, then it is told goodbye."""
        return self._call(self._c.disconnect, _address(address))

    def send(self, address: bytes, payload: bytes, *, timeout: float | None = None) -> torch.futures.Future:
        """Sends a message (any size up to 1 GiB); per-peer order is kept. The future completes
        once the peer's engine has the message (it answers), so a message that a restarted
        peer's new process drops fails with ``PeerError`` instead of passing as sent."""
        if not isinstance(payload, (bytes, bytearray, memoryview)):
            raise TypeError(f"payload must be bytes, not {type(payload).__name__}")
        return self._call(self._c.send, _address(address), bytes(payload), _worker_timeout(timeout))

    def recv(self, *, timeout: float | None = None) -> torch.futures.Future:
        """The next message from any peer, as (sender address, payload). Without a timeout it
        waits until a message arrives, ``cancel()`` or ``close()``."""
        return self._call(self._c.recv, _worker_timeout(timeout))

    def notification(self, tag: int, *, timeout: float | None = None) -> torch.futures.Future:
        """Completes when a peer's ``write_slices(..., notify=tag)`` has all its bytes here
        (or fails with the sender's error). Arrivals are counted: each call consumes one."""
        if not 0 <= int(tag) < 1 << 32:
            raise ValueError(f"tag must be a 32-bit unsigned integer, not {tag}")
        return self._call(self._c.notification, int(tag), _worker_timeout(timeout))

    def cancel(self, future: torch.futures.Future) -> None:
        """Fails a pending recv, notification or transfer with CancelledError."""
        if not isinstance(future, torch._C.Future):
            raise TypeError(f"cancel takes a torch.futures.Future, not {type(future).__name__}")
        self._c.cancel(future)

    def stream_wait(self, future: torch.futures.Future, stream: torch.cuda.Stream | None = None) -> None:
        """Makes `stream` (default: current) follow `future`, so that kernels queued after this
        call see the arrived data. A call of this engine on the IPC route is followed on the
        GPU (an event after its copy; this returns once the copy is queued); anything else is
        waited for here, on the host (the GIL released), since a stream held until the host
        releases it can hold up what would release it. If the future fails the stream is
        released too: check the future."""
        if self.device.type != "cuda":
            raise ValueError("stream_wait needs a CUDA engine")
        if not isinstance(future, torch._C.Future):
            raise TypeError(f"stream_wait takes a torch.futures.Future, not {type(future).__name__}")
        stream = stream or torch.cuda.current_stream(self.device)
        self._c.stream_wait(stream.cuda_stream, future)

    # -- life cycle ----------------------------------------------------------------------------
    def close(self) -> None:
        """Fails whatever is in flight with ClosedError, says goodbye to peers, stops the
        threads and deregisters everything. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._c.close()
        self.plan.release()
        if threading.current_thread() is not self._dispatcher:
            self._dispatcher.join(timeout=30)
        for fut in self._c.take_futures():
            if not fut.done():
                fut.set_exception(errors.ClosedError("the engine was closed"))
        for region in self._regions.values():
            region.closed = True
        self._regions.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    def __repr__(self):
        return (f"Engine(device={str(self.device)!r}, provider={self.provider!r}, rails={len(self.plan.rails)}, "
                f"data_path={self.data_path!r}, closed={self._closed})")

    # -- helpers -------------------------------------------------------------------------------
    def _check_open(self):
        if self._closed:
            raise errors.ClosedError("the engine is closed")

    def _call(self, start, *args) -> torch.futures.Future:
        """Starts the operation that completes a new future: ``start(future, *args)``, which
        takes the future into the native engine's table (or raises, keeping nothing)."""
        if self._closed:
            raise errors.ClosedError("the engine is closed")
        fut = _new_future(self._future_type)  # torch.futures.Future() without __init__: start() sets it up
        start(fut, *args)
        return fut


def _address(address) -> bytes:
    if not isinstance(address, (bytes, bytearray)):
        raise TypeError(f"an engine address is bytes, not {type(address).__name__}")
    return bytes(address)


def _dispatch(native) -> None:
    """Completes futures with what the worker reports, until the engine is closed and drained.
    Successes without a result are completed natively; poll() hands over the rest."""
    while True:
        batch = native.poll(100)
        for fut, kind, message, payload, address in batch:
            if fut.done():
                continue
            try:
                if kind == 0:
                    fut.set_result(None if address is None else (address, payload))
                else:
                    fut.set_exception(errors.from_kind(kind, message))
            except Exception:  # noqa: BLE001 - one bad completion must not end the others
                log.exception("torch_p2p: completing a future failed")
        if not batch and native.drained():
            return


@atexit.register
def _close_all():
    for engine in list(_live):
        try:
            engine.close()
        except Exception:
            pass


def _worker_timeout(timeout) -> float:
    """A timeout as the worker takes it; None is 0: the engine's default for transfers and
    messages, no deadline for recv() and notification()."""
    return 0.0 if timeout is None else positive(timeout)
