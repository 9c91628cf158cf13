"""Native part of torch_p2p (csrc/bindings/). Use the Python API (torch_p2p.Engine,
torch_p2p.RemoteTensor); these names may change."""
from typing import Any

import torch

with_cuda: bool
error_kinds: dict[int, str]  # csrc/common/error.h's kinds: number -> exception name

def libfabric_version() -> tuple[int, int]:
    """(major, minor) of the libfabric loaded at run time."""

def list_nics(provider: str, want_hmem: bool) -> tuple[str, bool, list[dict[str, Any]]]:
    """(resolved provider, FI_HMEM granted, [{domain, fabric, pci, speed_bps}])."""

def provider_limits(provider: str) -> dict[str, Any]:
    """What a provider grants the engine's query: its limits, modes and NICs (torch_p2p.doctor)."""

def provider_profile(provider: str) -> dict[str, Any]:
    """What the engine does differently on a provider (csrc/fabric/profile.h): name, default_rank,
    remote, rdma, dmabuf, auto_progress, rails_from_cores, max_chunk, unchecked_fast_rma, cuda_ipc_rma,
    own_endpoint_names, peers_must_release, target_progress, known_problem. An unknown provider: name "", no quirks."""

def registration(provider: str, hmem: bool, dmabuf: bool, memory: str) -> tuple[str, str]:
    """How memory ("host", "cuda", "cuda_vmm") registers with a provider whose answer has FI_HMEM
    (hmem) and FI_MR_DMABUF (dmabuf): ("host" | "hmem" | "dmabuf" | "staged", why). csrc/fabric/registration.h."""

def provider_names() -> list[str]:
    """The providers the profile table knows."""

def default_providers() -> list[str]:
    """What Engine(provider=None) tries, in order."""

def checked_ids(ids: Any, count: int, unique: bool) -> torch.Tensor | None:
    """A list or tuple of ints in [0, count) (distinct with unique) as an int64 tensor; else None."""

def stacked_ids(ids: torch.Tensor, offset: int) -> torch.Tensor:
    """ids, then each id + offset, as one int64 tensor (a kvflat cache's K and V pages)."""

def _set_classes(pages: type, remote_tensor: type, sequence: type) -> None: ...
def _fast_paths() -> dict[str, bool]:
    """Which in-place reads of Python objects the bindings use (each checked at _set_classes);
    one that is off takes pybind11's path."""
def _disable_fast_paths() -> None: ...  # for tests of the safe paths
def _wait_done(future: torch.futures.Future, spin_us: int, timeout_s: float) -> bool: ...
def _pages(base: Any, ids: Any, dim: Any) -> Any:
    """p2p.pages(base, ids, dim): a torch_p2p.Pages, every argument checked."""

def remote_index(remote: Any, index: Any) -> Any:
    """remote[index] for a RemoteTensor: the view basic indexing gives, as a RemoteTensor."""

def remote_view(remote: Any, *shape: Any) -> Any:
    """remote.view(*shape) for a RemoteTensor: torch.Tensor.view's shape rules, as a RemoteTensor."""

def settings() -> list[tuple[str, str, str]]:
    """The settings table (csrc/core/config.h): (key, TORCH_P2P_* variable or "", default)."""

class Setup:
    """Settings resolved once (arguments, then environment, then provider defaults, then the
    table's) and the provider queried once; an Engine starts from it."""
    provider: str
    hmem: bool
    nics: list[dict[str, Any]]
    def __init__(self, args: dict[str, Any]) -> None: ...
    def setting(self, key: str) -> Any: ...
    def place(self, domains: list[str], cpu: int, node_cpus: list[int]) -> None: ...

# Private, for tests: the striper (csrc/core/striper.h).
_Run = tuple[int, int, int, int, int]  # (local address, remote offset, len, lreg, rreg)
def _stripe(runs: list[_Run], local: list[tuple[int, int]], remote: list[int], local_rails: int,
            remote_rails: int, min_chunk: int, max_chunk: int,
            max_iov: int) -> tuple[int, list[tuple[int, int, list[tuple[int, int, int, int, int, int]]]]]: ...
def _copy_rows(dst: torch.Tensor, dst_ids: list[int], src: torch.Tensor, src_ids: list[int]) -> None: ...
def _cma_copy(pid: int, spans: list[tuple[int, int, int]], write: bool) -> int: ...  # errno, 0: all moved
def _stripe_slots(runs: list[_Run], max_runs: int, slot_bytes: int) -> list[tuple[int, list[_Run]]]: ...
def _slot_size(configured: int) -> int: ...
# Private, for tests: the transfer state machine (csrc/core/transfer.h).
def _transfer_next_step(state: str, message: bool, ok: bool, held: bool, acked: bool, pending: int,
                        needs_confirm: bool) -> str: ...
def _transfer_may_enter(source: str, target: str) -> bool: ...
# Private, for tests: one peer's liveness schedule (csrc/core/liveness.h), on a given clock.
class _RegionTable:
    """A RegionTable of regions without memory, for tests of when a closing region goes."""
    def __init__(self) -> None: ...
    def add(self) -> int: ...
    def hold(self, id: int) -> None: ...
    def drop(self, id: int) -> None: ...
    def close(self, id: int, deadline: float) -> bool: ...
    def answered(self, id: int) -> int: ...
    def must_release(self, id: int, peer: int) -> None: ...
    def released(self, id: int, peer: int) -> None: ...
    def forget_peer(self, peer: int) -> None: ...
    def finish(self, now: float) -> list[int]: ...
    def live(self) -> tuple[int, list[tuple[int, int]]]: ...

class _Liveness:
    state: str
    waits: bool
    checking: bool
    last_heard: float
    def __init__(self, timeout: float) -> None: ...
    def connect(self, now: float) -> None: ...
    def answered(self) -> None: ...
    def fail(self, left: bool = False) -> None: ...
    def start_check(self, deadline: float) -> bool: ...
    def heard(self, now: float) -> None: ...
    def watch_from(self, now: float) -> None: ...
    def hello_failed(self, now: float, transient: bool) -> tuple[str, float]: ...
    def tick(self, now: float, busy: bool) -> tuple[bool, str]: ...
# Private, for tests and tools: the wire records (csrc/core/address.h, csrc/engine/remote_view.h) as dicts.
# Decoding validates as the engine does; encoding checks nothing, so that tests can forge handles.
# Address: {provider: bytes, incarnation, rails: [bytes], host: bytes, pid, routes: int (bit i: route i)}.
# Remote: {dtype (c10 code), shape, strides, offset, region: {owner: bytes, id, nbytes, access,
# staged: bool, device_type, device_index, piece_bytes, rails, entries: [(base, key)],
# route_bytes: {route id: bytes}}}. Encoders take absent fields as zero or empty.
def _decode_address(data: bytes) -> dict[str, Any]: ...
def _encode_address(fields: dict[str, Any]) -> bytes: ...
def _decode_remote(data: bytes) -> dict[str, Any]: ...
def _decode_message(data: bytes) -> tuple[Any, ...]: ...  # (type, from, to, fields, re-encoded bytes)
def _decode_stage_message(data: bytes) -> tuple[Any, ...]: ...  # (kind, fields, re-encoded bytes)
def _decode_fabric_message(data: bytes) -> tuple[Any, ...]: ...  # (kind, fields, re-encoded bytes)
def _decode_ipc_export(data: bytes, device_type: int) -> dict[str, Any]: ...  # kind, offset, ptr
def _counters() -> dict[str, int]: ...  # paths taken in this process: ipc_copy_engine_spans, ipc_kernel_spans, fences
def _encode_remote(fields: dict[str, Any]) -> bytes: ...
def _seal(body: bytes) -> bytes:
    """`body` with the CRC32 that ends every record appended."""
def _unseal(record: bytes) -> bytes:
    """`record` without its CRC32, which must be right (else ValueError)."""

class RemoteView:
    dtype: torch.dtype
    shape: list[int]
    strides: list[int]
    offset: int
    element_size: int
    owner: bytes
    region_id: int
    nbytes: int
    access: int
    staged: bool
    device: str
    keys: list[int]
    rails: int
    def view(self, offset: int, shape: list[int], strides: list[int]) -> RemoteView: ...
    def to_bytes(self) -> bytes: ...
    @staticmethod
    def from_bytes(data: bytes) -> RemoteView: ...

class Prepared:
    """A call checked and decomposed once (Engine.prepare); Engine.run starts it again."""
    @property
    def takes_pages(self) -> bool: ...

class Engine:
    address: bytes
    provider: str
    data_path: str
    delivery_complete: bool
    auto_progress: bool
    closed: bool
    rails: list[dict[str, Any]]
    def __init__(self, setup: Setup) -> None: ...
    def register(self, tensor: torch.Tensor, access: str, timeout: float) -> tuple[int, RemoteView]: ...
    def deregister(self, region_id: int, timeout: float) -> None: ...
    # Operations take the torch future they complete, made by torch._C.Future.__new__ and not
    # initialized (they set it up), into the native table of futures (which names the
    # operation's id); a success without a result completes it natively.
    # submit / prepare take write_slices' arguments as the user gave them (views, remote
    # tensors or Pages, tag, timeout) and check them natively.
    def submit(self, future: torch.futures.Future, write: bool, local: Any, remote: Any,
               notify: int | None, timeout: float | None) -> None: ...
    def prepare(self, write: bool, local: Any, remote: Any, notify: int | None, timeout: float | None) -> Prepared: ...
    def run(self, future: torch.futures.Future, call: Prepared) -> None: ...
    def run_pages(self, future: torch.futures.Future, call: Prepared, local_ids: torch.Tensor,
                  remote_ids: torch.Tensor, notify: int | None) -> None: ...
    def route(self, address: bytes, view: RemoteView | None) -> str: ...
    def connect(self, future: torch.futures.Future, address: bytes) -> None: ...
    def disconnect(self, future: torch.futures.Future, address: bytes) -> None: ...
    # send / recv / notification check their tag and timeout (None: the default) natively.
    def send(self, future: torch.futures.Future, address: bytes, payload: bytes, timeout: float | None) -> None: ...
    def recv(self, future: torch.futures.Future, timeout: float | None) -> None: ...
    def notification(self, future: torch.futures.Future, tag: int, timeout: float | None) -> None: ...
    def cancel(self, future: torch.futures.Future) -> None: ...
    def poll(self, timeout_ms: int) -> list[tuple[torch.futures.Future, int, str, bytes | None, bytes | None]]:
        """Completions for Python: (future, error kind (0 = ok), message, payload, sender
        address). Drops, meanwhile, the table's references to futures completed natively."""
    def take_futures(self) -> list[torch.futures.Future]:
        """The futures still in the table (the table then empty): at close."""
    futures_held: int
    completion_spin_us: int  # how long waiters and the dispatcher spin (0: unpinned)
    def drained(self) -> bool: ...
    def close(self) -> None: ...
    def stream_wait(self, stream: int, future: torch.futures.Future) -> None: ...
