"""Functions that run inside Peer children (see peer.py): each takes `state` first."""
from __future__ import annotations

import torch

import torch_p2p as p2p
from conftest import engine_kwargs


def start_engine(state, provider: str, **kwargs) -> bytes:
    """Creates state["engine"]; returns its address."""
    state["engine"] = p2p.Engine(kwargs.pop("device", "cpu"), **engine_kwargs(provider, **kwargs))
    return state["engine"].address


def make_target(state, name: str, shape, dtype=torch.float32, fill: float = -1.0, access: str = "rw",
                device: str = "cpu") -> bytes:
    """Registers a tensor filled with `fill` under `name`; returns its RemoteTensor bytes."""
    t = torch.full(shape, fill, dtype=dtype, device=device)
    state[name] = t
    state[f"{name}.region"] = state["engine"].register(t, access=access)
    return state[f"{name}.region"].remote.to_bytes()


def fetch(state, name: str) -> torch.Tensor:
    return state[name].cpu().clone()


def put(state, name: str, value: torch.Tensor) -> None:
    state[name].copy_(value)


def deregister(state, name: str) -> None:
    state[f"{name}.region"].close()


def close_engine(state) -> None:
    state.pop("engine").close()
