"""Native part of torch_p2p (csrc/bindings.cpp). Use the Python API (torch_p2p.Engine,
torch_p2p.RemoteTensor); these names may change."""
from typing import Any

import torch

with_cuda: bool

def libfabric_version() -> tuple[int, int]:
    """(major, minor) of the libfabric loaded at run time."""

def list_nics(provider: str, want_hmem: bool) -> tuple[str, bool, list[dict[str, Any]]]:
    """(resolved provider, FI_HMEM granted, [{domain, fabric, pci, speed_bps}])."""

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

class Engine:
    address: bytes
    provider: str
    data_path: str
    delivery_complete: bool
    auto_progress: bool
    closed: bool
    rails: list[dict[str, Any]]
    def __init__(self, config: dict[str, Any]) -> None: ...
    def register(self, tensor: torch.Tensor, access: str, timeout: float) -> tuple[int, RemoteView]: ...
    def deregister(self, region_id: int, timeout: float) -> None: ...
    def submit(self, id: int, write: bool, local: list[torch.Tensor], remote: list[RemoteView],
               local_pages: list[tuple[torch.Tensor, int] | None], remote_pages: list[tuple[torch.Tensor, int] | None],
               mirror: bool, notify: int, timeout: float) -> None: ...
    def route(self, address: bytes, view: RemoteView | None) -> str: ...
    def connect(self, id: int, address: bytes) -> None: ...
    def disconnect(self, id: int, address: bytes) -> None: ...
    def send(self, id: int, address: bytes, payload: bytes, timeout: float) -> None: ...
    def recv(self, id: int, timeout: float) -> None: ...
    def notification(self, id: int, tag: int, timeout: float) -> None: ...
    def cancel(self, id: int) -> None: ...
    def poll(self, timeout_ms: int) -> list[tuple[int, int, str, bytes | None, bytes | None]]:
        """Completions: (id, error kind (0 = ok), message, payload, sender address)."""
    def drained(self) -> bool: ...
    def close(self) -> None: ...
    def stream_wait(self, stream: int) -> int: ...
    def stream_release(self, token: int) -> None: ...
