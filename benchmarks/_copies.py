"""The in-process copy ceilings, measured in the driver process alone. memcpy: the call's bytes as
one block between this process's GPU and the peer's (cudaMemcpyPeerAsync, torch's cross-device
copy): the copy engines' ceiling for the same-host IPC route; on host memory, one memcpy per
page of the row's pages in the row's orders on one thread: one core's ceiling for the cma route.
kernel: the call's pages moved by one plain Triton copy kernel per call."""
from __future__ import annotations

import time

import torch

from _timing import sync, timed


class BaselineUnavailable(RuntimeError):
    """A baseline that cannot run here (a missing package): skipped with this reason."""


def measure_host_memcpy(buf: torch.Tensor, mine: list, theirs: list, seconds: float):
    """The call's pages copied between `buf` and a second buffer like it in this process, one
    memcpy per page on one thread (_C._copy_rows), mine -> theirs."""
    from torch_p2p import _C

    rows = buf.reshape(buf.shape[0], -1)
    other = torch.empty_like(rows)

    def batch(n: int) -> float:
        t = time.perf_counter()
        for _ in range(n):
            _C._copy_rows(other, theirs, rows, mine)
        return time.perf_counter() - t

    return timed(batch, seconds, len(mine) * rows[0].numel() * rows.element_size())


def measure_memcpy(nbytes: int, send: bool, device: torch.device, peer: torch.device, seconds: float):
    """Copies of `nbytes` between `device` and `peer` (to the peer if `send`) in this process,
    one block per call on the copy engines."""
    here = torch.empty(nbytes, dtype=torch.uint8, device=device)
    there = torch.empty(nbytes, dtype=torch.uint8, device=peer)
    src, dst = (here, there) if send else (there, here)

    def batch(n: int) -> float:
        t = time.perf_counter()
        for _ in range(n):
            dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize(device)
        torch.cuda.synchronize(peer)
        return time.perf_counter() - t

    return timed(batch, seconds, nbytes)


def measure_page_kernel(page_bytes: int, mine: list, theirs: list, send: bool, device: torch.device,
                        peer: torch.device, seconds: float):
    """The call's pages moved by one plain copy kernel per call (Triton; one program per page),
    between a buffer on `device` and one on `peer` in this process through peer
    access, mine -> theirs (theirs -> mine if not `send`): what a paged call of the IPC route
    could reach if it cost nothing but its kernel."""
    kernel = _page_kernel()
    words = page_bytes // 8
    if kernel is None or page_bytes % 8:
        raise BaselineUnavailable("the page-kernel baseline needs Triton and pages of a multiple of 8 bytes")
    here = torch.zeros(len(mine), words, dtype=torch.int64, device=device)
    there = torch.zeros(len(theirs), words, dtype=torch.int64, device=peer)
    there.copy_(here.to(peer))  # peer access, as torch enables it for its own copies
    src, dst = (here, there) if send else (there, here)
    src_ids = torch.tensor(mine if send else theirs, dtype=torch.int64, device=src.device)
    dst_ids = torch.tensor(theirs if send else mine, dtype=torch.int64, device=src.device)
    block = min(1024, 1 << (words - 1).bit_length())

    def batch(n: int) -> float:
        t = time.perf_counter()
        with torch.cuda.device(src.device):
            for _ in range(n):
                kernel[(len(mine),)](src, dst, src_ids, dst_ids, words, BLOCK=block)
        sync(device)
        sync(peer)
        return time.perf_counter() - t

    try:
        return timed(batch, seconds, len(mine) * page_bytes)
    except Exception as e:  # noqa: BLE001 - Triton's compile or launch refused: say why, skip
        raise BaselineUnavailable(f"the page kernel did not run: {type(e).__name__}: {e}") from None


_PAGE_KERNEL: list = []


def _page_kernel():
    """The Triton page-copy kernel, compiled at first use; None without Triton."""
    if not _PAGE_KERNEL:
        try:
            import triton
            import triton.language as tl
        except ImportError:
            _PAGE_KERNEL.append(None)
            return None

        @triton.jit
        def copy_pages(src, dst, src_ids, dst_ids, words, BLOCK: tl.constexpr):
            k = tl.program_id(0)
            s = src + tl.load(src_ids + k) * words
            d = dst + tl.load(dst_ids + k) * words
            for off in range(0, words, BLOCK):
                o = off + tl.arange(0, BLOCK)
                m = o < words
                tl.store(d + o, tl.load(s + o, mask=m), mask=m)

        _PAGE_KERNEL.append(copy_pages)
    return _PAGE_KERNEL[0]
