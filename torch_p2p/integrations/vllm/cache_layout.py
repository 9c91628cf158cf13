"""How a vLLM attention layer's KV cache is laid out, as torch_p2p.kv sees it.

vLLM gives each attention layer's cache as a tensor of logical shape [blocks, kv heads,
tokens, 2 x head dim] (any strides). ``CACHE_LAYOUTS`` names where K and V sit inside it, per
device kind: the CPU backend reads each head's block as all K rows then all V rows, CUDA
backends keep a token's K and V side by side.
"""
from __future__ import annotations

import re

import torch

CACHE_LAYOUTS = {"cpu": "blocks heads kv tokens dim", "cuda": "blocks heads tokens kv dim"}


def layer_view(cache: torch.Tensor, layout: str) -> torch.Tensor:
    """`cache` ([blocks, heads, tokens, 2 x dim]) with K and V as an axis of its own, as
    CACHE_LAYOUTS[layout] names the axes."""
    if cache.dim() != 4 or cache.shape[-1] % 2:
        raise ValueError(f"expected a KV cache of shape [blocks, heads, tokens, 2 x head dim], "
                         f"got {tuple(cache.shape)}")
    blocks, heads, tokens, both = cache.shape
    if layout == "cpu":
        return cache.view(blocks, heads, 2, tokens, both // 2)
    if layout == "cuda":
        return cache.unflatten(-1, (2, both // 2))
    raise ValueError(f"unknown layout {layout!r}: use one of {sorted(CACHE_LAYOUTS)}")


def share_in_place(tensors) -> None:
    """Moves the tensors' storages into shared memory; every view of them (the model's own)
    follows, as ``Tensor.share_memory_()`` swaps a storage's memory in place."""
    for t in tensors:
        try:
            t.share_memory_()  # a storage already shared is left as it is
        except (RuntimeError, OSError) as e:
            raise RuntimeError(f"moving the KV cache ({t.untyped_storage().nbytes()} bytes) into shared memory "
                               f"failed ({e}): make /dev/shm larger, or turn share_cpu_cache off "
                               "(transfers then take the kernel's cross-memory copy)") from e


def layer_order(names) -> list[str]:
    """Layer names in model order (layers.10 after layers.2), the order both sides pair."""
    return sorted(names, key=lambda n: [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", n)])


def expand_blocks(ids, per_block: int) -> list[int]:
    """Scheduler block ids as the cache tensor's blocks, where a kernel block is smaller than
    the scheduler's (`per_block` kernel blocks each)."""
    return [b * per_block + i for b in ids for i in range(per_block)]
