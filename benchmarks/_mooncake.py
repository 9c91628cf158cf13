"""The Mooncake Transfer Engine baseline (pip install 'torch_p2p[mooncake]'): P2PHANDSHAKE, the
tcp transport for host memory, nvlink_intra for GPU memory, per-peer TCP queues raised to their
maximum so that a batch of thousands of pages is not refused."""
from __future__ import annotations

import os

import torch

from _peer_library import PeerLibrary, PeerLibraryError, Request, load

# Mooncake's tcp transport refuses a batch beyond 1024 queued slices per peer by default
# (a 4096-page call fails with "TCP lane queue-full"); 65535 is the most it accepts.
MOONCAKE_ENV = {
    "MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER": "65535",
    "MC_TCP_MAX_PENDING_ADMISSIONS_PER_PEER": "65535",
    "MC_LOG_LEVEL": "ERROR",
}


class Mooncake(PeerLibrary):
    @staticmethod
    def unavailable(name: str, device: torch.device) -> str | None:
        module, why = load("mooncake.engine", "mooncake-transfer-engine", "mooncake", MOONCAKE_ENV)
        if why:
            return why
        if device.type == "cuda" and not getattr(module, "SUPPORT_INTRA_NVLINK", False):
            return "this Mooncake wheel has no nvlink_intra transport for GPU memory (install a CUDA wheel)"
        return None

    def __init__(self, name: str, device: torch.device, host: str):
        super().__init__(name, device, host)
        protocol = "tcp"
        if device.type == "cuda":
            protocol = "nvlink_intra"
            os.environ.setdefault("MC_INTRA_NVLINK", "true")
            torch.cuda.set_device(device)
        from mooncake.engine import TransferEngine

        self.engine = TransferEngine()
        if self.engine.initialize(host, "P2PHANDSHAKE", protocol, "") != 0:
            raise PeerLibraryError(f"Mooncake TransferEngine.initialize({host!r}, P2PHANDSHAKE, {protocol}) failed")
        self.what = f"Mooncake {protocol}"
        self.registered: list[int] = []
        self.session: str | None = None

    def register(self, tensors):
        location = f"cuda:{self.device.index or 0}" if self.device.type == "cuda" else "*"
        for base, size in dict.fromkeys(_allocation(t) for t in tensors):
            if self.engine.register_memory(base, size, location) != 0:
                raise PeerLibraryError(f"Mooncake register_memory of {size} bytes at {location} failed")
            self.registered.append(base)

    def address(self):
        return {"session": f"{self.host}:{self.engine.get_rpc_port()}"}

    def connect(self, peer):
        self.session = peer["session"]

    def request(self, read, local, remote):
        return _MooncakeRequest(self.engine, self.session, read, local, remote)

    def release(self):
        for base in self.registered:
            self.engine.unregister_memory(base)
        self.registered, self.session = [], None


def _allocation(tensor: torch.Tensor) -> tuple[int, int]:
    """(base, bytes) to register for `tensor`: on GPUs the whole cudaMalloc block holding it,
    since nvlink_intra shares memory with cudaIpcGetMemHandle, which maps from a block's start."""
    ptr = tensor.data_ptr()
    if tensor.is_cuda:
        for seg in torch.cuda.memory_snapshot():
            if seg["address"] <= ptr < seg["address"] + seg["total_size"]:
                return seg["address"], seg["total_size"]
    return ptr, tensor.nbytes


class _MooncakeRequest(Request):
    def __init__(self, engine, session, read, local, remote):
        self.engine, self.session = engine, session
        self.post_batch = engine.batch_transfer_async_read if read else engine.batch_transfer_async_write
        self.args = ([a for a, _ in local], [a for a, _ in remote], [n for _, n in local])
        self.batch = 0

    def post(self):
        self.batch = self.post_batch(self.session, *self.args)
        if not self.batch:
            raise PeerLibraryError(f"Mooncake refused a batch of {len(self.args[0])} descriptors")

    def wait(self):
        if self.engine.get_batch_transfer_status([self.batch]) != 0:
            raise PeerLibraryError(f"Mooncake batch of {len(self.args[0])} descriptors failed")
