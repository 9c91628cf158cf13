"""How the benchmarks time work: a device synchronised before the clock is read, and batches
of calls timed until a row's seconds have passed."""
from __future__ import annotations

import time

import torch

TIMEOUT_S = 120.0  # no socket or process-group wait lasts longer


def sync(device: torch.device) -> None:
    """Returns once the work queued on `device` is done (nothing to wait for on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(batch, seconds: float, nbytes: int):
    """Runs batch(n) (it returns its seconds) in batches of about 0.1 s until `seconds` have
    passed, after a warm-up of 2; batch(0) ends it. Returns (bytes, seconds) of the timed part."""
    per_call = batch(2) / 2
    moved, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        n = max(1, min(int(0.1 / max(per_call, 1e-6)), 1 << 16))
        per_call = batch(n) / n
        moved += n
    elapsed = time.perf_counter() - t0
    batch(0)
    return moved * nbytes, elapsed
