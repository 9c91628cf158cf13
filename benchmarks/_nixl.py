"""The NIXL baseline (pip install 'torch_p2p[nixl]'): an agent with the UCX backend and
num_threads=4, as vLLM's NixlConnector makes it, or its LIBFABRIC backend (libfabric 1.21 or
newer); DRAM or VRAM descriptors after the tensors' device."""
from __future__ import annotations

import os

import torch

from _peer_library import PeerLibrary, PeerLibraryError, Request, load

NIXL_LIBFABRIC_MIN = (1, 21)  # NIXL's src/plugins/libfabric/README.md
NIXL_ENV = {"NIXL_LOG_LEVEL": "WARN"}  # no INFO line per agent and backend


class Nixl(PeerLibrary):
    @staticmethod
    def unavailable(name: str, device: torch.device) -> str | None:
        _, why = load("nixl._api", "nixl", "nixl", NIXL_ENV)
        if why or name != "nixl-libfabric":
            return why
        from torch_p2p import _C

        version = _C.libfabric_version()
        if version < NIXL_LIBFABRIC_MIN:
            return (f"libfabric {version[0]}.{version[1]} is installed; NIXL's LIBFABRIC backend needs "
                    f"{NIXL_LIBFABRIC_MIN[0]}.{NIXL_LIBFABRIC_MIN[1]} or newer")
        return None

    def __init__(self, name: str, device: torch.device, host: str):
        super().__init__(name, device, host)
        from nixl._api import nixl_agent, nixl_agent_config

        backend = "LIBFABRIC" if name == "nixl-libfabric" else "UCX"
        # NOTE: vLLM's NixlConnector gives UCX num_threads=4 (its default) and other backends none.
        config = nixl_agent_config(backends=[backend], num_threads=4 if backend == "UCX" else 0)
        self.agent = nixl_agent(f"{name}-{os.getpid()}", config)
        if backend not in self.agent.backends:
            raise PeerLibraryError(f"NIXL has no usable {backend} plugin here")
        self.backend, self.what = backend, f"NIXL {backend}"
        self.mem = "VRAM" if device.type == "cuda" else "DRAM"
        self.dev = (device.index or 0) if device.type == "cuda" else 0
        self.registered: list = []
        self.requests: list = []
        self.peer: dict | None = None

    def register(self, tensors):
        self.registered.append(self.agent.register_memory(tensors, backends=[self.backend]))

    def address(self):
        return {"metadata": self.agent.get_agent_metadata(), "mem": self.mem, "dev": self.dev}

    def connect(self, peer):
        self.peer = dict(peer, name=self.agent.add_remote_agent(peer["metadata"]))

    def request(self, read, local, remote):
        agent, peer = self.agent, self.peer
        handle = agent.initialize_xfer(
            "READ" if read else "WRITE",
            agent.get_xfer_descs([(a, n, self.dev) for a, n in local], self.mem),
            agent.get_xfer_descs([(a, n, peer["dev"]) for a, n in remote], peer["mem"]),
            peer["name"], backends=[self.backend])
        self.requests.append(handle)
        return _NixlRequest(agent, handle)

    def release(self):
        for handle in self.requests:
            handle.release()
        for descs in self.registered:
            self.agent.deregister_memory(descs, backends=[self.backend])
        if self.peer:
            self.agent.remove_remote_agent(self.peer["name"])
        self.requests, self.registered, self.peer = [], [], None


class _NixlRequest(Request):
    def __init__(self, agent, handle):
        self.agent, self.handle = agent, handle

    def post(self):
        if self.agent.transfer(self.handle) == "ERR":
            raise PeerLibraryError("NIXL refused to post the transfer")

    def wait(self):
        while (state := self.agent.check_xfer_state(self.handle)) == "PROC":
            pass
        if state != "DONE":
            raise PeerLibraryError(f"NIXL transfer ended in state {state}")
