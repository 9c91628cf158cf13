"""SGLang's memory pools as torch_p2p.kv caches, free of SGLang: what ``KVArgs`` gives a transfer
backend (raw pointers, byte lengths, bytes per page) turned into tensors that ``kv.KVCache``
registers once per engine.

SGLang hands a backend no tensors, only ``kv_data_ptrs`` / ``kv_data_lens`` / ``kv_item_lens``
(one entry per buffer, item = one page of ``page_size`` tokens) and the same for the aux
(metadata) buffers, one row per request. Its MHA pool lists every layer's K buffer, then every
layer's V buffer, each [tokens, kv heads, head dim]; its MLA pool one latent buffer per layer,
[tokens, latent]. The views are bytes (uint8): both sides compare the dtype's name instead
(``compat``), and the head slicing for tensor parallelism needs only the bytes of one head.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from ... import Engine, kv


class _DeviceMemory:
    """A device allocation by address, for ``torch.as_tensor`` (CUDA array interface): no copy."""

    def __init__(self, ptr: int, nbytes: int):
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False),
                                         "version": 3, "strides": None}


def bytes_at(ptr: int, nbytes: int, device: torch.device) -> torch.Tensor:
    """The `nbytes` bytes at address `ptr` on `device` as a uint8 tensor viewing them (the pool
    keeps owning the memory; the tensor must not outlive it)."""
    if nbytes <= 0:
        raise ValueError(f"a pool buffer of {nbytes} bytes at {ptr:#x}")
    if device.type == "cuda":
        return torch.as_tensor(_DeviceMemory(ptr, nbytes), device=device)
    if device.type != "cpu":
        raise ValueError(f"torch_p2p's SGLang backend moves CPU and CUDA pools, not {device.type}")
    return torch.frombuffer((ctypes.c_uint8 * nbytes).from_address(ptr), dtype=torch.uint8)


@dataclass
class PoolShape:
    """What both sides of a transfer must agree on, read from one side's KVArgs."""
    mla: bool
    layers: int
    page_size: int
    heads: int           # KV heads this rank holds (1 for MLA: the latent is not split)
    first_head: int      # its first head in the model's (0 for MLA)
    head_bytes: int      # bytes of one token of one head (of the latent for MLA)
    dtype: str

    def compat(self) -> dict:
        return dict(mla=self.mla, layers=self.layers, page_size=self.page_size, head_bytes=self.head_bytes,
                    dtype=self.dtype)


def pool_shape(args, mla: bool, tp_rank: int) -> PoolShape:
    """The shape of the pool `args` (an SGLang KVArgs) describes, checked for what this backend
    moves; ValueError naming the first thing it cannot."""
    ptrs, lens, items = args.kv_data_ptrs, args.kv_data_lens, args.kv_item_lens
    if not ptrs or not (len(ptrs) == len(lens) == len(items)):
        raise ValueError(f"KVArgs lists {len(ptrs)} KV buffers, {len(lens)} lengths and {len(items)} item sizes")
    if len(set(items)) != 1 or len(set(lens)) != 1:
        raise ValueError("torch_p2p's SGLang backend moves pools whose buffers are all alike "
                         f"(item sizes {sorted(set(items))}, lengths {sorted(set(lens))})")
    if getattr(args, "num_draft_entries", 0):
        raise ValueError("torch_p2p's SGLang backend does not move speculative-decoding draft KV")
    if not mla and len(ptrs) % 2:
        raise ValueError(f"an MHA pool lists K then V buffers: an even count, not {len(ptrs)}")
    heads = 1 if mla else args.kv_head_num
    per_token = items[0] // args.page_size
    if items[0] % args.page_size or per_token % heads:
        raise ValueError(f"a page of {items[0]} bytes does not hold {args.page_size} tokens of {heads} heads")
    return PoolShape(mla=mla, layers=len(ptrs) if mla else len(ptrs) // 2, page_size=args.page_size, heads=heads,
                     first_head=0 if mla else tp_rank * heads, head_bytes=per_token // heads,
                     dtype=str(args.kv_cache_dtype_str))


def kv_cache(engine: Engine, args, shape: PoolShape) -> kv.KVCache:
    """The pool as one KVCache: pages are its blocks, as SGLang's kv_indices number them."""
    device = engine.device
    bufs = [bytes_at(p, n, device) for p, n in zip(args.kv_data_ptrs, args.kv_data_lens)]
    if shape.mla:
        layers = [b.view(-1, shape.page_size, shape.head_bytes) for b in bufs]
        return kv.KVCache(engine, layers, "mla")
    tokens = [b.view(-1, shape.heads, shape.head_bytes) for b in bufs]
    layers = list(zip(tokens[:shape.layers], tokens[shape.layers:]))
    return kv.KVCache(engine, layers, "sglang", block_size=shape.page_size, first_head=shape.first_head)


def aux_caches(engine: Engine, args) -> list[kv.KVCache]:
    """The aux (metadata) buffers as KVCaches of one-row blocks: a request's row of each buffer
    is one block (the aux_index both sides give). A KVCache's layers are alike, so buffers are
    grouped by row size, in the order of their first buffer (both sides list them alike)."""
    rows = {n // i for n, i in zip(args.aux_data_lens, args.aux_item_lens)}
    if len(rows) > 1:
        raise ValueError(f"the aux buffers hold different numbers of rows ({sorted(rows)})")
    groups: dict[int, list[torch.Tensor]] = {}
    for p, n, i in zip(args.aux_data_ptrs, args.aux_data_lens, args.aux_item_lens):
        # SGLang's MetadataBuffers live in host memory whatever the pool's device.
        groups.setdefault(i, []).append(bytes_at(p, n, torch.device("cpu")).view(-1, 1, i))
    return [kv.KVCache(engine, layers, "mla") for layers in groups.values()]
