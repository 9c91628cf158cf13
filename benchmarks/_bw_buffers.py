"""What both sides of bw.py make: an engine (on loopback an IP provider stays on "lo") and one
[pages, page_bytes] buffer, filled, poisoned and checked."""
from __future__ import annotations

import os

import torch

import torch_p2p as p2p
from _timing import sync


# Word i (int64) of a source buffer holds seed + i, so every page differs from every other page
# and from any earlier row's; destinations start as all ones (-1 words).
def fill(buf: torch.Tensor, seed: int) -> None:
    flat = buf.view(torch.int64).view(-1)
    torch.arange(seed, seed + flat.numel(), dtype=torch.int64, device=buf.device, out=flat)
    sync(buf.device)


def poison(buf: torch.Tensor) -> None:
    buf.fill_(0xFF)
    sync(buf.device)


def count_bad_pages(buf: torch.Tensor, seed: int, src_order: list[int], dst_order: list[int]):
    """(pages of the destination `buf` that do not hold what fill(source, seed) put in the
    source page moved there, first such destination page or -1). Page src_order[i] of the
    source moved to page dst_order[i] of `buf`."""
    words = buf.view(torch.int64)
    per_page = words.shape[1]
    src = torch.tensor(src_order, dtype=torch.int64, device=buf.device)
    dst = torch.tensor(dst_order, dtype=torch.int64, device=buf.device)
    step = torch.arange(per_page, dtype=torch.int64, device=buf.device)
    k = max(1, (32 << 20) // (per_page * 8))  # pages compared at a time: bounds the memory
    bad = torch.cat([(words[dst[i:i + k]] != (seed + src[i:i + k] * per_page)[:, None] + step).any(1)
                     for i in range(0, len(dst), k)])
    wrong = dst[bad]
    return int(wrong.numel()), int(wrong.min()) if wrong.numel() else -1


def open_engine(device: torch.device, provider: str | None, rails: int | None, loopback: bool) -> p2p.Engine:
    """An engine as the benchmark uses it: on loopback an IP provider stays on "lo"."""
    domains = None
    if loopback:
        name = provider or os.environ.get("TORCH_P2P_PROVIDER") or ""
        resolved = p2p._C.list_nics(name, device.type == "cuda")[0]
        if resolved.split(";")[0] in ("tcp", "udp", "sockets"):
            domains = ["lo"]
    return p2p.Engine(device, provider, rails, domains=domains)


def new_buffer(pages: int, page_bytes: int, device: torch.device, shared: bool) -> torch.Tensor:
    """One side's [pages, page_bytes] buffer; host memory in shared memory if `shared`."""
    buf = torch.empty(pages, page_bytes, dtype=torch.uint8, device=device)
    return buf.share_memory_() if shared and buf.device.type == "cpu" else buf
