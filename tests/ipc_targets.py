"""Poisoned CUDA targets in a peer child, for the IPC route's tests: each is registered with 4 KiB
of unregistered guard bytes on each side, in the same allocation, so that a copy that lands
whole and only where it should can be told from one that does not."""
import torch

import helpers
from conftest import PEER_GPU


def make_cuda_target(state, name: str, shape, dtype=torch.uint8, access: str = "rw") -> bytes:
    """A poisoned CUDA tensor registered under `name`, with 4 KiB of guard bytes on each side
    (unregistered, in the same allocation); returns the handle of the middle."""
    n = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    whole = torch.full((n + 8192,), helpers.POISON, dtype=torch.uint8, device=PEER_GPU)
    state[name + ".whole"] = whole
    t = whole[4096:4096 + n].view(dtype).view(shape)
    state[name] = t
    state[f"{name}.region"] = state["engine"].register(t, access=access)
    return state[f"{name}.region"].remote.to_bytes()


def fetch_whole(state, name: str) -> torch.Tensor:
    return state[name + ".whole"].cpu()


def gpu_random(shape, dtype, seed):
    return helpers.random_tensor(shape, dtype, seed).to("cuda:0")


def guards_whole(whole: torch.Tensor) -> bool:
    return bool((whole[:4096] == helpers.POISON).all() and (whole[-4096:] == helpers.POISON).all())


def check_guards(whole: torch.Tensor):
    assert guards_whole(whole), "guard bytes hit"


def check_landed(b, want: torch.Tensor, name: str = "t"):
    """Peer b's target `name` (make_cuda_target) holds exactly the bytes of `want` (uint8, in
    its shape), its guard bytes untouched."""
    whole = b.call(fetch_whole, name)
    check_guards(whole)
    assert torch.equal(whole[4096:-4096].view(want.shape), want)
