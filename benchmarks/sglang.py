"""sglang.py: one request's KV through SGLang's PD-disaggregation transfer backends, prefill
process -> decode process: torch_p2p's (this repository's plugin) against SGLang's own
``mooncake`` and ``nixl`` backends, in the same run, over the same pools and pages.

    python benchmarks/sglang.py                         # in the SGLang venv (.ci/run builds one)
    python benchmarks/sglang.py --requests 20 --pages 128 --device cuda

Each backend gets a fresh prefill rank and decode rank (tests_sglang/rank.py: SGLang's own
manager, sender, receiver and bootstrap server classes over KVArgs of real pools), then
`--requests` requests of `--pages` random pages each (and one aux row), bootstrapped as SGLang's
scheduler does; a request is timed on the prefill rank from ``send`` to its sender polling
Success, and the decode rank checks every page afterwards. The pool: `--layers` layers of K and
V, `--heads` KV heads of `--head-bytes` bytes (256: a 128-dim bf16 head), pages of 16 tokens.
Mooncake runs its TCP transport (MC_FORCE_TCP=1: no RDMA device here), NIXL its UCX backend;
torch_p2p picks its own route (same host: cross-memory copy). A backend that cannot start here
is reported with the reason.
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests_sglang"))
from harness import Rank, free_port  # noqa: E402

BACKENDS = ("torch_p2p", "mooncake", "nixl")
SUCCESS, WAITING, FAILED = 4, 2, 0


def run_backend(backend: str, a, pool_pages: int) -> list[float]:
    os.environ["TORCH_P2P_SGLANG_POOL"] = f"{a.layers},{a.heads},{a.head_bytes},16,{pool_pages}"
    os.environ["MC_FORCE_TCP"] = "1"
    port = free_port()
    prefill = Rank("prefill", port, backend=backend, device=a.device)
    decode = Rank("decode", port, backend=backend, device=a.device)
    rng, times = random.Random(0), []
    try:
        for room in range(1, a.requests + 2):  # the first is a warm-up (first contact)
            src, dst = rng.sample(range(pool_pages), a.pages), rng.sample(range(pool_pages), a.pages)
            for r in (prefill, decode):
                r.call("open", room=room)
            decode.call("bootstrap", room=room, timeout=60)
            decode.call("wait", room=room, states=[WAITING, FAILED], timeout=60)
            decode.call("metadata", room=room, pages=dst, aux_index=1)
            prefill.call("wait", room=room, states=[WAITING, FAILED], timeout=60)
            sent = prefill.call("timed_send", room=room, pages=src, aux_index=2, timeout=120)
            got = decode.call("wait", room=room, states=[SUCCESS, FAILED], timeout=60)
            if sent["seconds"] is None or got["state"] != SUCCESS:
                raise RuntimeError(f"{backend}: request {room} ended {sent['state']} / {got['state']}: "
                                   f"{decode.call('failure', room=room)}")
            bad = decode.call("check", src_pages=src, dst_pages=dst, aux_src=2, aux_dst=1)["mismatch"]
            if bad:
                raise RuntimeError(f"{backend}: request {room}: {bad}")
            for r in (prefill, decode):
                r.call("clear", room=room)
            if room > 1:
                times.append(sent["seconds"])
    finally:
        prefill.close()
        decode.close()
    return times


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backends", nargs="+", default=list(BACKENDS), choices=BACKENDS)
    p.add_argument("--requests", type=int, default=10)
    p.add_argument("--pages", type=int, default=64, help="pages of 16 tokens a request")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-bytes", type=int, default=256)
    p.add_argument("--device", default="cpu")
    a = p.parse_args()
    pool_pages = 4 * a.pages
    request_bytes = a.pages * 16 * a.heads * a.head_bytes * 2 * a.layers
    print(f"# {a.requests} requests of {a.pages} pages ({request_bytes / 2**20:.1f} MiB: {a.layers} layers, "
          f"{a.heads} heads x {a.head_bytes} B, 16 tokens a page), random pages of {pool_pages}, {a.device}")
    rows = {}
    for backend in a.backends:
        try:
            rows[backend] = statistics.median(run_backend(backend, a, pool_pages))
        except Exception as e:  # noqa: BLE001 - a baseline that cannot run is reported, not fatal
            print(f"{backend}: not run: {type(e).__name__}: {e}")
    print(f"{'backend':<10} {'median ms':>10} {'GB/s':>7} {'torch_p2p x':>12}")
    for backend, t in rows.items():
        ratio = t / rows["torch_p2p"] if "torch_p2p" in rows else float("nan")
        print(f"{backend:<10} {t * 1e3:>10.2f} {request_bytes / t / 1e9:>7.2f} {ratio:>12.2f}")


if __name__ == "__main__":
    main()
