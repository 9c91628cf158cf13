"""kv.py: KV-cache migration (torch_p2p.kv) per request, prefill process -> decode process.

    python benchmarks/kv.py                                    # CPU: the cma and tcp routes
    python benchmarks/kv.py --device cuda:0 --peer-device cuda:1 --tokens 4096
                                                               # GPUs: the same-host IPC route
    python benchmarks/kv.py --models llama3-8b llama3-70b-tp8 deepseek-v3

The decode side is a spawned peer process. Each row moves one request of a model preset
(`--models`; real layer counts, KV heads, head dims and dtypes; block size 16) between paged
caches with random block tables on both sides (a quarter more blocks than the request needs),
`--repeat` times after a warm-up, and reports the median request (columns: see the end).
The baseline is what a serving stack without torch_p2p does: NCCL batch_isend_irecv of the
same pages (one K or V block of one layer each), GPUs on both sides, NCCL free to use NVLink,
at most 4096 pages per group (NCCL does not finish one group of 65,536, which 16k tokens of
Llama-3-8B make); on CPUs gloo (--baseline gloo, the default there); measured in this run.
--baseline nixl / nixl-libfabric / mooncake: that library's Python API between the same caches,
one descriptor per K or V block of each layer (as vLLM's connectors describe them), one request
(NIXL transfer, Mooncake batch) per request; NIXL's UCX or LIBFABRIC backend, Mooncake's tcp
transport (nvlink_intra on GPUs); the destination blocks are checked after them too. A library
that is missing or cannot run here is skipped with a one-line reason.
The destination blocks of every push and pull row are checked against the source's afterwards.

Streaming rows (push only, unless --no-stream): a stand-in prefill runs one GEMM per layer of
the layer's FLOPs per GPU (2 x tokens x layer_params; --layer-ms calibrates one to that many
ms instead, the default on CPUs), copies the layer's K/V into its blocks and pushes that layer
at once (KVCache.stream), so the transfer overlaps the rest of the prefill.

Routes (--routes): ipc (CUDA engines of one host, engine.route() == "ipc"), cma (host memory of
one host, engine.route() == "cma": the caches live in shared memory, which the route maps), tcp
(the tcp provider, same-host routes off: host memory direct, GPU memory staged through pinned
slots), tcp-staged (host memory through the staging slots too), shm. Defaults: ipc on GPUs,
cma and tcp on CPUs.

Output as bw.py: a live line per row on stderr, tables on stdout, --json PATH, --plot PATH.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import tempfile

import torch

try:
    import torch_p2p as p2p
except ImportError:  # run from a checkout without installing: use the in-place build
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import torch_p2p as p2p

from _channel import PeerFailed
from _dist import DIST_GROUP_OPS, dist_leave
from _kv_caches import BLOCK, PRESETS, ROUTES
from _kv_decode import decode_main
from _kv_prefill import TAIL_TARGET, Driver
from _peer_library import PEER_LIBRARIES
from _processes import exit_on_sigterm, reap, spawn_with_pipe
from _progress import Progress
from _table import aligned, print_rows, save_rows

LEGEND = f"""\
columns:
  MiB, pages    one request's KV bytes, and the K or V blocks of one layer a stack without
                torch_p2p sends one by one (the baseline's pages)
  ms, GB/s      one KVCache.push (prefill writes decode's blocks) or pull (decode reads prefill's
                blocks), call to completion: one engine call per request; GB/s = 1e9 bytes/s
  contig GB/s   the same bytes as one contiguous view, same engines and route: the ceiling
  ratio         GB/s / contig GB/s: how close the paged request comes to the ceiling
  <b> ms, GB/s  the baseline <b> moving the same pages, measured in this run
  x <b>         <b> ms / ms: how many times faster torch_p2p is
  layer ms      one layer's stand-in forward alone; prefill ms: every layer's
  +push ms      the same forward with each layer pushed right after it (KVCache.stream)
  tail ms       end of that forward -> the decode side's notification for the last layer
                (time.perf_counter in both processes: CLOCK_MONOTONIC, one host)
  tail/layer    tail ms / layer ms; target: < {TAIL_TARGET}, the push of the last layer ending within a
                tenth of a layer's forward. A performance target, not a check: a "missed" row
                completed without error, and only failed rows set the exit status"""


# -- results -----------------------------------------------------------------------------------------
def fmt(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def tables(rows: list[dict]) -> str:
    out = []
    moves = [r for r in rows if r["kind"] == "move"]
    if moves:
        base = next((r["baseline"] for r in moves if r["baseline"]), "base")
        head = ["model", "tokens", "op", "route", "MiB", "pages", "ms", "GB/s", "contig GB/s", "ratio",
                f"{base} ms", f"{base} GB/s", f"x {base}"]
        lines = [head] + [[r["model"], str(r["tokens"]), r["op"], r["route"], f"{r['bytes'] / 2**20:.1f}",
                           str(r["pages"]), fmt(r["ms"], ".3f"), fmt(r["gbps"], ".2f"), fmt(r["contig_gbps"], ".2f"),
                           fmt(r["ratio"], ".2f"), fmt(r["base_ms"], ".3f"), fmt(r["base_gbps"], ".2f"),
                           fmt(r["speedup"], ".1f")] for r in moves]
        out.append(aligned(lines, 4))
    streams = [r for r in rows if r["kind"] == "stream"]
    if streams:
        head = ["model", "tokens", "route", "MiB", "layer ms", "prefill ms", "+push ms", "tail ms", "tail/layer",
                "target"]
        lines = [head] + [[r["model"], str(r["tokens"]), r["route"], f"{r['bytes'] / 2**20:.1f}",
                           fmt(r["layer_ms"], ".3f"), fmt(r["prefill_ms"], ".2f"), fmt(r["streamed_ms"], ".2f"),
                           fmt(r["tail_ms"], ".3f"), fmt(r["tail_per_layer"], ".3f"),
                           "-" if r["tail_per_layer"] is None else "met" if r["tail_per_layer"] < TAIL_TARGET
                           else "missed"] for r in streams]
        out.append(aligned(lines, 4))
    return "\n\n".join(out)


def plot(rows: list[dict], path: str, title: str) -> None:
    """GB/s against prompt tokens, one panel per model: paged per op and route, the contiguous
    ceiling dashed, the baseline dotted."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    moves = [r for r in rows if r["kind"] == "move" and r["ok"]]
    models = sorted({r["model"] for r in moves})
    if not models:
        return
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4.5), squeeze=False)
    for ax, model in zip(axes[0], models):
        lines: dict = {}
        for r in moves:
            if r["model"] != model:
                continue
            for name, key, style in ((f"{r['op']} {r['route']}", "gbps", "-"),
                                     (f"{r['op']} {r['route']} contiguous", "contig_gbps", "--"),
                                     (f"{r['op']} {r['baseline']}", "base_gbps", ":")):
                if r[key]:
                    lines.setdefault((name, style), {})[r["tokens"]] = r[key]
        for (name, style), points in sorted(lines.items()):
            xs, ys = zip(*sorted(points.items()))
            ax.plot(xs, ys, style, marker="o", label=name)
        ax.set_xscale("log", base=2)
        ax.set(title=model, xlabel="prompt tokens", ylabel="GB/s")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=8)
    fig.savefig(path, dpi=120, bbox_inches="tight")


def report(args, rows: list[dict]) -> int:
    title = (f"# torch_p2p kv: {args.device} -> peer {args.peer_device}, block size {BLOCK}, median of "
             f"{args.repeat} requests; GB/s = 1e9 bytes/s")
    if args.baseline in ("nccl", "gloo"):
        title += f"; {args.baseline}: batch_isend_irecv, {args.dist_group} pages per group"
    failed = print_rows(title, tables(rows), LEGEND, rows,
                        lambda r: f"! {r['kind']} {r['model']} {r['tokens']} {r.get('op', '')} {r['route']}: {r['error']}")
    missed = [r for r in rows if r["kind"] == "stream" and r["ok"] and r["tail_per_layer"] >= TAIL_TARGET]
    if missed:
        print(f"note: {len(missed)} streaming row(s) missed the tail target (< {TAIL_TARGET} of a layer): the last "
              f"layer's push ended later than that after the prefill. They completed without error: a missed "
              f"target is not a failure, and the exit status stays 0.")
    save_rows(args, rows, plot, title)
    return 1 if failed or not rows else 0


# -- command line -----------------------------------------------------------------------------------
def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, epilog=LEGEND, formatter_class=argparse.RawDescriptionHelpFormatter)
    cuda = torch.cuda.is_available()
    ap.add_argument("--device", default="cuda:0" if cuda else "cpu", help="the prefill process's device")
    ap.add_argument("--peer-device", default=None, help="the decode process's device (default: the next GPU, or cpu)")
    ap.add_argument("--models", nargs="+", choices=sorted(PRESETS), default=["llama3-8b"],
                    help="model presets (default llama3-8b)")
    ap.add_argument("--tokens", nargs="+", type=int, default=None, metavar="N",
                    help="prompt lengths (default: 1024 4096 16384 32768 on GPUs, 1024 on CPUs)")
    ap.add_argument("--ops", nargs="+", choices=["push", "pull"], default=["push", "pull"])
    ap.add_argument("--routes", nargs="+", choices=sorted(ROUTES), default=None,
                    help="default: ipc on GPUs, cma tcp on CPUs")
    ap.add_argument("--repeat", type=int, default=5, metavar="N", help="timed requests per row (default 5)")
    ap.add_argument("--baseline", choices=["auto", "nccl", "gloo", *PEER_LIBRARIES, "none"], default="auto",
                    help="batch_isend_irecv of the same pages, at most 4096 per group (default: nccl on GPUs, gloo on "
                         "CPUs), or NIXL or Mooncake moving the same blocks")
    ap.add_argument("--duration", type=float, default=1.0, metavar="S", help="seconds of baseline per row")
    ap.add_argument("--dist-group", type=int, default=DIST_GROUP_OPS, metavar="N",
                    help=f"pages per batch_isend_irecv group of the nccl / gloo baseline (default "
                         f"{DIST_GROUP_OPS}: NCCL does not finish one group of 65,536)")
    ap.add_argument("--no-stream", dest="stream", action="store_false", help="no layer-streaming rows")
    ap.add_argument("--layer-ms", type=float, default=None, metavar="MS",
                    help="the stand-in forward's time per layer (default: the model's FLOPs on GPUs, 20 on CPUs)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the block tables")
    ap.add_argument("--json", metavar="PATH", help="write the rows as a JSON list")
    ap.add_argument("--plot", metavar="PATH", help="plot GB/s against prompt tokens (needs matplotlib)")
    args = ap.parse_args(argv)
    dev = torch.device(args.device)
    if dev.type == "cuda":
        if not cuda:
            ap.error(f"--device {dev} but CUDA is not available here")
        args.device = str(torch.device("cuda", dev.index or 0))
    if args.peer_device is None:
        args.peer_device = (f"cuda:{(dev.index or 0) + 1 if torch.cuda.device_count() > 1 else 0}"
                            if dev.type == "cuda" else "cpu")
    on_gpu = dev.type == "cuda"
    args.tokens = args.tokens or ([1024, 4096, 16384, 32768] if on_gpu else [1024])
    args.routes = args.routes or (["ipc"] if on_gpu else ["cma", "tcp"])
    if "ipc" in args.routes and not (on_gpu and args.peer_device.startswith("cuda")):
        ap.error("route ipc needs GPUs on both sides (--device cuda:N --peer-device cuda:M)")
    if args.baseline == "auto":
        args.baseline = "nccl" if on_gpu else "gloo"
    if args.layer_ms is None and not on_gpu:
        args.layer_ms = 20.0
    if min(args.tokens) < 1 or args.repeat < 1 or args.duration <= 0 or args.dist_group < 1:
        ap.error("--tokens, --repeat and --dist-group must be >= 1 and --duration > 0")
    if args.plot and importlib.util.find_spec("matplotlib") is None:  # now, not after the sweep
        ap.error("--plot needs matplotlib: pip install matplotlib")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="kv-") as tmp:
        store = os.path.join(tmp, "dist-store")
        conn, proc = spawn_with_pipe(decode_main, (args.peer_device, store), "kv-decode")
        try:
            rows = Driver(args, conn, Progress(), store).run()
            conn.send(("bye", {}))
        except (PeerFailed, p2p.P2PError, EOFError, ConnectionResetError) as e:  # the last two: it died
            print(f"kv.py: error: {e}", file=sys.stderr)
            return 2
        finally:
            dist_leave()
            reap([proc])
    return report(args, rows)


if __name__ == "__main__":
    exit_on_sigterm()
    sys.exit(main())
