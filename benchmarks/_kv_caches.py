"""What both processes of kv.py make: a model preset's paged KV cache on an engine of the row's
route, its blocks filled, poisoned and checked, and the descriptors a stack without torch_p2p
sends them with."""
from __future__ import annotations

import dataclasses
import math

import torch

import torch_p2p as p2p
from torch_p2p import kv

BLOCK = 16


@dataclasses.dataclass(frozen=True)
class Preset:
    layers: int
    kv_heads: int | None  # None: MLA, one latent per token
    head_dim: int         # or the latent's width
    hidden: int
    layer_params: float   # dense parameters of one layer on one GPU: the forward's FLOPs / 2 / token
    dtype: torch.dtype = torch.bfloat16

    @property
    def layout(self) -> str:
        return "mla" if self.kv_heads is None else "flash_attn"

    def layer_shape(self, blocks: int) -> tuple:
        if self.kv_heads is None:
            return (blocks, BLOCK, self.head_dim)
        return (2, blocks, BLOCK, self.kv_heads, self.head_dim)

    @property
    def block_dim(self) -> int:
        return 0 if self.kv_heads is None else 1

    @property
    def pages_per_block(self) -> int:  # what a stack without torch_p2p sends per block
        return self.layers * (1 if self.kv_heads is None else 2)


PRESETS = {
    # 32 layers, 8 KV heads of 128 (GQA), 8.0 B parameters of which 1.05 B embeddings.
    "llama3-8b": Preset(32, 8, 128, 4096, 218e6),
    # Tensor parallel 8: one of 8 KV heads per GPU, an eighth of each layer's 0.86 B parameters.
    "llama3-70b-tp8": Preset(80, 1, 128, 8192, 107e6),
    # MLA: a 512 + 64 latent per token and layer; 37 B active parameters over 61 layers, TP 8.
    "deepseek-v3": Preset(61, None, 576, 7168, 76e6),
}

ROUTES = {
    "ipc": dict(provider="tcp", domains=["lo"], ipc=True),
    "cma": dict(provider="tcp", domains=["lo"], ipc=False),
    "tcp": dict(provider="tcp", domains=["lo"], ipc=False, cma=False),
    "tcp-staged": dict(provider="tcp", domains=["lo"], data_path="staged", ipc=False, cma=False),
    "shm": dict(provider="shm", ipc=False, cma=False),
}
SAME_HOST = ("ipc", "cma")  # the routes that engine.route() names as such


# -- caches and their contents (both processes) ----------------------------------------------------
def make_cache(engine: p2p.Engine, preset: Preset, blocks: int) -> tuple[list, kv.KVCache]:
    layers = [host_shared(torch.empty(preset.layer_shape(blocks), dtype=preset.dtype, device=engine.device))
              for _ in range(preset.layers)]
    return layers, kv.KVCache(engine, layers, preset.layout)


def host_shared(t: torch.Tensor) -> torch.Tensor:
    """Host memory in shared memory, which the cma route maps (its memcpy path)."""
    return t.share_memory_() if t.device.type == "cpu" else t


def pattern(shape: tuple, seed: int, layer: int, device) -> torch.Tensor:
    """Deterministic 16-bit words, different per element (within 65521), layer and seed."""
    n = math.prod(shape)
    words = (torch.arange(n, dtype=torch.int64, device=device) + seed * 1_000_003 + layer * 7919) % 65521 - 32760
    return words.to(torch.int16).view(shape)


def fill(layers: list, seed: int) -> None:
    for i, layer in enumerate(layers):
        layer.view(torch.int16).copy_(pattern(tuple(layer.shape), seed, i, layer.device))


def count_bad(layers: list, preset: Preset, seed: int, src_ids: list, dst_ids: list) -> int:
    """Blocks of `layers` (any layer) that do not hold what fill(source, seed) put in the source
    block moved there; the source cache has as many blocks as this one."""
    dim, bad = preset.block_dim, torch.zeros(len(dst_ids), dtype=torch.bool)
    src = torch.tensor(src_ids, device=layers[0].device)
    dst = torch.tensor(dst_ids, device=layers[0].device)
    for i, layer in enumerate(layers):
        want = pattern(tuple(layer.shape), seed, i, layer.device).index_select(dim, src)
        got = layer.view(torch.int16).index_select(dim, dst)
        diff = (want != got).movedim(dim, 0).flatten(1).any(1)
        bad |= diff.cpu()
    return int(bad.sum())


def poison(layers: list) -> None:
    for layer in layers:
        layer.view(torch.uint8).fill_(0xFF)


def block_descs(addresses: list[int], layers: list, preset: Preset, ids: list) -> list[tuple[int, int]]:
    """(address, bytes) of the K and V halves of blocks `ids` of every layer, the layers at
    `addresses` and shaped as `layers`: the pages a stack without torch_p2p describes."""
    descs = []
    for address, layer in zip(addresses, layers):
        step = layer.stride(preset.block_dim) * layer.element_size()
        halves = [0] if preset.kv_heads is None else [0, layer.stride(0) * layer.element_size()]
        for half in halves:
            descs += [(address + half + i * step, step) for i in ids]
    return descs


def open_engine(device, route: str) -> p2p.Engine:
    return p2p.Engine(device, **ROUTES[route])
