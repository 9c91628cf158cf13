"""TorchP2PTransport: Ray's TensorTransportManager over torch_p2p's engine.

Ray makes one instance per process and calls it:
- on the owner, right after a ``tensor_transport="TORCH_P2P"`` method returns:
  ``extract_tensor_transport_metadata`` registers the tensors' storages and returns their
  RemoteTensor handles (each names the owner's engine address; the metadata is what Ray ships
  to receivers); ``garbage_collect`` lets the registrations go once the ObjectRef is out of
  scope;
- on the receiver (an actor, or the driver's ``ray.get``): ``fetch_multiple_tensors`` takes
  host tensors from the receive pool (registered already), or allocates GPU tensors (or takes
  the target buffers) and registers them, and reads the owner's bytes with one
  ``read_slices`` per device; ``wait_fetch_complete`` waits for it; ``abort_transport``
  cancels it.
The engine picks the route per owner: cma or CUDA IPC on one host, the fabric across hosts.
Every wait is bounded: a read fails after Ray's RDT fetch timeout at most, and sooner (the
engine's peer_timeout, or at once on the cma route) when the owner dies.
"""
from __future__ import annotations

import collections
import os
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import ray
from ray.experimental.rdt.tensor_transport_manager import (CommunicatorMetadata, FetchRequest,
                                                           TensorTransportManager, TensorTransportMetadata)

from ... import Engine, RemoteTensor, errors, wait
from . import NAME
from .receive_pool import ReceivePool
from .registrations import Registrations, local_bytes, remote_bytes

# Ray's RDT fetch timeout (its ray_constants.RDT_FETCH_FAIL_TIMEOUT_SECONDS, read from the same
# variable with the same default): every read is bounded by it.
FETCH_TIMEOUT_S = int(os.environ.get("RAY_rdt_fetch_fail_timeout_milliseconds", 60000)) / 1000

# Aborts that came before their fetch started, remembered so that the fetch fails; bounded,
# since an abort may also come after a fetch that already ended.
_EARLY_ABORTS = 1024


@dataclass(eq=False)
class TorchP2PTransportMetadata(TensorTransportMetadata):
    """Ray's shapes and dtypes, plus one handle per tensor: the tensor's bytes in the owner's
    registered storage (None for a tensor without elements)."""

    handles: list[Optional[RemoteTensor]] = field(default_factory=list)


@dataclass(eq=False)
class TorchP2PFetchRequest(FetchRequest):
    """A fetch in flight: its reads (one per local device) and the registrations of the
    buffers they fill. ``close()`` cancels what is still running and releases them; it runs
    once, from ``wait_fetch_complete`` or when Ray drops the request unwaited."""

    reads: list = field(default_factory=list)  # (engine, future)
    aborted: bool = False
    keys: list = field(default_factory=list)
    buffer: Any = None  # the pool's buffer the reads fill, if they fill one
    transport: Any = None

    def close(self, cancel: bool) -> None:
        transport, self.transport = self.transport, None
        if transport is None:
            return
        if cancel:
            if self.buffer is not None:
                self.buffer.spoiled = True
            for engine, future in self.reads:
                if not future.done():
                    engine.cancel(future)
        transport._forget(self)

    def __del__(self):
        self.close(cancel=True)


def _has_torch_p2p(actor_self) -> bool:
    """Runs in the actor: whether torch_p2p's extension loads there."""
    try:
        import torch_p2p._C  # noqa: F401
    except ImportError:
        return False
    return True


class TorchP2PTransport(TensorTransportManager):
    def __init__(self):
        self._registrations = Registrations(lent=lambda t: self._pool.region_of(t))
        self._pool = ReceivePool(self._registrations.close_later)
        # Reentrant: a request dropped unwaited closes itself from __del__, whichever thread
        # the collector runs on, perhaps one holding the lock.
        self._lock = threading.RLock()
        self._owned: dict[str, list] = {}  # object id -> the storages its tensors hold
        self._fetches: dict[str, list[TorchP2PFetchRequest]] = {}
        self._aborted: collections.OrderedDict = collections.OrderedDict()
        # Handles compare by actor id; weak, so that the cache keeps no actor alive.
        self._actors_with_transport: weakref.WeakSet = weakref.WeakSet()

    def tensor_transport_backend(self) -> str:
        return NAME

    @staticmethod
    def is_one_sided() -> bool:
        return True

    @staticmethod
    def can_abort_transport() -> bool:
        return True

    def actor_has_tensor_transport(self, actor: "ray.actor.ActorHandle") -> bool:
        # Ray asks before every call of a TORCH_P2P method; the answer does not change.
        if actor in self._actors_with_transport:
            return True
        call = actor.__ray_call__.options(concurrency_group="_ray_system").remote(_has_torch_p2p)
        if not ray.get(call, timeout=FETCH_TIMEOUT_S):
            return False
        self._actors_with_transport.add(actor)
        return True

    def get_communicator_metadata(self, src_actor, dst_actor, backend=None) -> CommunicatorMetadata:
        return CommunicatorMetadata()  # the handles say everything a reader needs

    # -- owner -------------------------------------------------------------------------------
    def extract_tensor_transport_metadata(self, obj_id: str, rdt_object: list) -> TorchP2PTransportMetadata:
        kinds = {t.device.type for t in rdt_object}
        if len(kinds) > 1:
            raise ValueError(f"the tensors of one TORCH_P2P object must be on one kind of device, not {sorted(kinds)}")
        # Readers on the CUDA IPC route copy without this process's streams: what the method
        # queued must be done first.
        for device in {t.device for t in rdt_object if t.is_cuda}:
            torch.cuda.current_stream(device).synchronize()
        keys, handles = [], []
        try:
            for t in rdt_object:
                if t.numel() == 0:
                    handles.append(None)
                    continue
                key, region = self._registrations.acquire(t)
                keys.append(key)
                handles.append(remote_bytes(region, t))
        except BaseException:
            self._registrations.release(keys)
            raise
        with self._lock:
            # Ray describes an object again when a retried task finds it stored already.
            previous = self._owned.pop(obj_id, [])
            self._owned[obj_id] = keys
        self._registrations.release(previous)
        return TorchP2PTransportMetadata(tensor_meta=[(t.shape, t.dtype) for t in rdt_object],
                                tensor_device=kinds.pop() if kinds else None, handles=handles)

    def garbage_collect(self, obj_id: str, tensor_transport_meta, tensors: list) -> None:
        with self._lock:
            keys = self._owned.pop(obj_id, [])
        self._registrations.release(keys)

    # -- receiver ----------------------------------------------------------------------------
    def fetch_multiple_tensors(self, obj_id: str, tensor_transport_metadata: TorchP2PTransportMetadata,
                               communicator_metadata, target_buffers=None) -> TorchP2PFetchRequest:
        meta = tensor_transport_metadata
        if not isinstance(meta, TorchP2PTransportMetadata):
            raise TypeError(f"TORCH_P2P cannot read an object described by {type(meta).__name__}")
        # Host memory comes from the pool (registered and resident already); target buffers
        # and GPU memory (the caching allocator's, resident too) are registered for the read.
        by_device: dict[torch.device, tuple[list, list]] = {}  # local views, handles
        pooled = not target_buffers and meta.tensor_device == "cpu"
        if target_buffers:
            tensors = list(target_buffers)
        elif pooled:
            cpu = torch.device("cpu")
            tensors, local, buffer = self._pool.tensors(self._registrations.engine(cpu), meta.tensor_meta)
            if local:
                by_device[cpu] = (local, [h for h in meta.handles if h is not None])
        else:
            tensors = [torch.empty(shape, dtype=dtype, device=meta.tensor_device) for shape, dtype in meta.tensor_meta]
        request = TorchP2PFetchRequest(obj_id=obj_id, tensors=tensors, buffer=buffer if pooled else None)
        with self._lock:
            if self._aborted.pop(obj_id, None) is not None:
                raise _transfer_error(obj_id, "it was aborted before it started")
            self._fetches.setdefault(obj_id, []).append(request)
        request.transport = self
        try:
            for t, handle in zip(tensors, meta.handles):
                if handle is None or pooled:
                    continue
                key, region = self._registrations.acquire(t)
                request.keys.append(key)
                local, remote = by_device.setdefault(t.device, ([], []))
                local.append(local_bytes(region, t))
                remote.append(handle)
            for device, (local, remote) in by_device.items():
                engine = self._registrations.engine(device)
                future = engine.read_slices(local, remote, timeout=FETCH_TIMEOUT_S)
                with self._lock:
                    request.reads.append((engine, future))
                    aborted = request.aborted
                if aborted:  # abort_transport came while the reads were starting
                    engine.cancel(future)
        except BaseException as e:
            request.close(cancel=True)
            raise _transfer_error(obj_id, f"it could not start: {e!r}") from e
        return request

    def wait_fetch_complete(self, fetch_request: TorchP2PFetchRequest, timeout: float = -1) -> list:
        request = fetch_request
        try:
            for _, future in request.reads:
                # A read ends on its own within Ray's fetch timeout; `timeout` is the caller's.
                wait(future, None if timeout < 0 else timeout)
        except errors.TimeoutError as e:
            request.close(cancel=True)
            if any(not f.done() for _, f in request.reads):
                raise TimeoutError(f"TORCH_P2P: object {request.obj_id} did not arrive within {timeout} s") from e
            raise _transfer_error(request.obj_id, repr(e)) from e
        except BaseException as e:
            request.close(cancel=True)
            raise _transfer_error(request.obj_id, repr(e)) from e
        request.close(cancel=False)
        return request.tensors

    def recv_multiple_tensors(self, obj_id: str, tensor_transport_metadata, communicator_metadata,
                              target_buffers=None) -> list:
        request = self.fetch_multiple_tensors(obj_id, tensor_transport_metadata, communicator_metadata,
                                              target_buffers)
        return self.wait_fetch_complete(request)

    def send_multiple_tensors(self, tensors, tensor_transport_metadata, communicator_metadata):
        raise NotImplementedError("TORCH_P2P is one-sided: the receiver reads, the owner sends nothing")

    def abort_transport(self, obj_id: str, communicator_metadata) -> None:
        with self._lock:
            requests = self._fetches.get(obj_id, ())
            if not requests:
                self._aborted[obj_id] = True
                while len(self._aborted) > _EARLY_ABORTS:
                    self._aborted.popitem(last=False)
            for request in requests:
                request.aborted = True
            reads = [read for request in requests for read in request.reads]
        for engine, future in reads:
            engine.cancel(future)

    # -- bookkeeping -------------------------------------------------------------------------
    def engine(self, device) -> "Engine":
        """This process's engine for `device`, made on first use (its address, its routes)."""
        return self._registrations.engine(torch.device(device))

    def counts(self) -> dict[str, int]:
        """What this process holds now: storages and engine regions registered, objects owned,
        fetches in flight (tests check that none of them grows)."""
        with self._lock:
            owned, fetches = len(self._owned), sum(len(r) for r in self._fetches.values())
        return dict(self._registrations.counts(), **self._pool.counts(), objects=owned, fetches=fetches)

    def _forget(self, request: TorchP2PFetchRequest) -> None:
        with self._lock:
            requests = self._fetches.get(request.obj_id, [])
            if request in requests:
                requests.remove(request)
            if not requests:
                self._fetches.pop(request.obj_id, None)
        self._registrations.release(request.keys)


def _transfer_error(obj_id: str, why: str) -> Exception:
    from ray.exceptions import RayDirectTransportError

    return RayDirectTransportError(f"TORCH_P2P: the transfer of object {obj_id} failed: {why}. The owner "
                                   "may have died during the transfer.")
