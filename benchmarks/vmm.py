"""vmm.py: the same-host IPC route with CUDA VMM memory (PyTorch's expandable segments) against
ordinary caching-allocator memory, in the same run, on the same GPU pair.

    python benchmarks/vmm.py                     # paged 256 x 64 KiB and contiguous 256 MiB
    python benchmarks/vmm.py --rounds 9 --seconds 2

Two processes (this one writes, a child owns the targets), each allocating one set of tensors
with expandable segments off and one with them on (torch.cuda.memory._set_allocator_settings
between the two), so both kinds live side by side and the rounds alternate between them. The
VMM tensors are allocated after the segment grew several times, so each spans several
mappings (checked). Workloads: `paged` writes 256 random 64 KiB pages of a 512-page buffer into
random pages of the peer's (one write_slices call of p2p.pages), `contiguous` writes 256 MiB in
one call; 4 calls are in flight at a time. Each number is the best of --rounds rounds of
--seconds each; `ratio` is VMM over ordinary. Target: ratio >= 0.95 for both. Without CUDA it says so and exits 0.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
import warnings

warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
import torch  # noqa: E402

try:
    import torch_p2p as p2p
except ImportError:  # run from a checkout without installing: use the in-place build
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import torch_p2p as p2p
from torch_p2p import _C  # noqa: E402
from _processes import dismiss, message_from, spawn_with_pipe  # noqa: E402
from _table import aligned  # noqa: E402

TARGET = 0.95
PAGES, PAGE = 256, 64 << 10
CONTIGUOUS = 256 << 20
DEPTH = 4  # calls in flight
ENGINE = dict(provider="tcp", domains=["lo"], ipc=True)
KINDS = ("ordinary", "vmm")


def allocate(kind: str, device: str) -> dict:
    """The buffers of one kind: `paged` (2 x PAGES pages) and `contiguous`."""
    settings = getattr(torch._C, "_accelerator_setAllocatorSettings", None) or torch.cuda.memory._set_allocator_settings
    settings(f"expandable_segments:{kind == 'vmm'}")
    if kind == "vmm":  # grow the segment first, so that the buffers span several mappings
        for n in (24, 48, 72):
            junk = torch.empty(n << 20, dtype=torch.uint8, device=device)
            del junk
    bufs = {"paged": torch.randint(0, 255, (2 * PAGES, PAGE), dtype=torch.uint8, device=device),
            "contiguous": torch.randint(0, 255, (CONTIGUOUS,), dtype=torch.uint8, device=device)}
    for name, t in bufs.items():
        n, why = _C._vmm_layout(t.data_ptr(), t.untyped_storage().nbytes(), t.device.index)
        if (n > 1) != (kind == "vmm"):
            raise SystemExit(f"vmm.py: the {kind} {name} buffer spans {n} VMM mappings ({why or 'VMM memory'}): "
                             "expandable segments did not switch as asked")
    return bufs


def owner(conn, device: str) -> None:
    engine = p2p.Engine(device, **ENGINE)
    handles, keep = {}, []
    for kind in KINDS:
        for name, t in allocate(kind, device).items():
            region = engine.register(t)
            keep.append((t, region))
            handles[f"{kind}.{name}"] = region.remote.to_bytes()
    conn.send({"address": engine.address, "handles": handles})
    conn.recv()  # the driver is done
    engine.close()


def rate(engine, src, dst, paged: bool, seconds: float, gen: torch.Generator) -> float:
    """Bytes per second of calls for `seconds`, DEPTH of them in flight (as a server's requests
    are), the page tables drawn ahead of time."""
    tables = [(torch.randperm(2 * PAGES, generator=gen)[:PAGES], torch.randperm(2 * PAGES, generator=gen)[:PAGES])
              for _ in range(64)]

    def call(i):
        if paged:
            mine, theirs = tables[i % len(tables)]
            return engine.write_slices(p2p.pages(src, mine), p2p.pages(dst, theirs))
        return engine.write_slices(src, dst)
    p2p.wait(call(0), 60)  # warm: the mapping, the kernels
    nbytes = PAGES * PAGE if paged else CONTIGUOUS
    calls, start, flight = 0, time.perf_counter(), []
    while time.perf_counter() - start < seconds:
        flight.append(call(calls))
        calls += 1
        if len(flight) == DEPTH:
            p2p.wait(flight.pop(0), 60)
    for f in flight:
        p2p.wait(f, 60)
    return calls * nbytes / (time.perf_counter() - start)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--seconds", type=float, default=1.0)
    args = ap.parse_args()
    if not torch.cuda.is_available() or not hasattr(_C, "_vmm_layout"):
        print("vmm.py: skipped: no CUDA here (torch or this build of torch_p2p has none)")
        return 0
    device = "cuda:0"
    peer_device = "cuda:1" if torch.cuda.device_count() > 1 else device
    parent, proc = spawn_with_pipe(owner, (peer_device,), "vmm-owner")
    try:
        if not parent.poll(120):
            raise SystemExit("vmm.py: the owner process did not start within 120 s")
        peer = message_from(parent, proc, "vmm.py: the owner process")
        engine = p2p.Engine(device, **ENGINE)
        local = {kind: allocate(kind, device) for kind in KINDS}
        for bufs in local.values():
            for t in bufs.values():
                engine.register(t)
        gen = torch.Generator().manual_seed(0)
        best = {}
        for _ in range(args.rounds):
            for workload in ("paged", "contiguous"):
                for kind in KINDS:
                    dst = p2p.RemoteTensor.from_bytes(peer["handles"][f"{kind}.{workload}"])
                    route = engine.route(dst)
                    if route != "ipc":
                        raise SystemExit(f"vmm.py: the {kind} {workload} target takes route {route!r}, not 'ipc'")
                    src = local[kind][workload]
                    bps = rate(engine, src, dst, workload == "paged", args.seconds, gen)
                    best[kind, workload] = max(best.get((kind, workload), 0.0), bps)
        rows = [["workload", "ordinary GB/s", "vmm GB/s", "ratio", "target"]]
        ok = True
        for workload in ("paged", "contiguous"):
            ratio = best["vmm", workload] / best["ordinary", workload]
            ok &= ratio >= TARGET
            label = f"{PAGES} x {PAGE >> 10} KiB" if workload == "paged" else f"{CONTIGUOUS >> 20} MiB"
            rows.append([f"{workload} ({label})", f"{best['ordinary', workload] / 1e9:.1f}",
                         f"{best['vmm', workload] / 1e9:.1f}", f"{ratio:.3f}", f">= {TARGET}"])
        print(f"IPC route, {torch.cuda.get_device_name(0)}, {device} -> {peer_device}, best of {args.rounds} "
              f"rounds of {args.seconds:g} s")
        print(aligned(rows, 1))
        print("target met" if ok else "target NOT met")
        engine.close()
        return 0
    finally:
        dismiss([parent], [proc], "done")


if __name__ == "__main__":
    sys.exit(main())
