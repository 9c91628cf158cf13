"""weights.py: one weight update from a source to N destinations, torch_p2p.weights against a
bucketed torch.distributed.broadcast of the same tensors, in the same run.

    python benchmarks/weights.py                                     # Llama-3-8B, GPUs if any
    python benchmarks/weights.py --model qwen2.5-0.5b --dests 1 2 3 4 --device cpu

One source process (this one) and max(--dests) destination processes on this machine; for each
N in --dests the first N destinations take part (torch_p2p: they join, then leave; baseline: a
process group of ranks 0..N). Each row pushes --updates timed updates after warm-ups (until two
agree) and reports the median; then every destination's tensors are checksummed against the
source's (a row whose data arrived wrong fails). Processes go to GPUs round robin from --device on
(1 + 3 on a 4-GPU machine), and share GPUs when there are fewer.

State dict: a real model's names and shapes (--model; --layers keeps fewer layers), random
values, in --dtype at the destinations; --source-dtype float32 makes the source hold fp32 and
convert on the way (torch_p2p: its bounded staging; the baseline: while packing buckets).

Baseline (--baseline): "nccl" on GPUs (NVLink/P2P as NCCL picks, NCCL_NVLS_ENABLE=0; with
--nccl-sockets held to its socket transport on lo, as bw.py does), "gloo" on CPUs. Tensors are
packed into --bucket buffers broadcast one after the other, as RL frameworks do; a tensor
larger than a bucket is broadcast alone. NCCL needs one GPU per process: with fewer GPUs it is
skipped, and said so.

Every process freezes its heap once set up (gc.freeze(), as vLLM does; --no-freeze leaves it):
otherwise a full collection, which walks all of torch's objects, falls in a timed update now and
then, the same for both systems.

A live line per row goes to stderr; the table to stdout (columns: see the end). The whole model
runs by default wherever it fits: each process may fill 80% of its device's free memory, shared
by the processes on that device (on CPUs, the host's available memory shared by all of them).
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import time

import torch

try:
    import torch_p2p.weights as pw
except ImportError:  # run from a checkout without installing: use the in-place build
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import torch_p2p.weights as pw

from _dist import dist_unavailable
from _processes import exit_on_sigterm, freeze_heap
from _table import aligned, fmt_bytes, parse_size, save_rows
from _weights_broadcast import broadcast_update, join_group
from _weights_dests import Peers
from _weights_state import (DEFAULT_MODELS, DTYPES, HOST_DEFAULT_BYTES, PRESETS, USABLE, checksum, device_of,
                            fit_layers, open_engine, process_budget, shapes, state_dict)

LEGEND = """\
columns:
  s/update      median seconds of one update, push to the last byte at every destination
  GB/s/dest     state-dict bytes / s/update, per destination (1e9 bytes/s)
  source sent   bytes the source wrote per update (torch_p2p: relays between destinations make
                the other copies)
  x N=1         s/update / the N=1 row's of the same chunk, window and fanout: how the time grows
                with destinations (1.00: not at all)
  ratio         the baseline's s/update at the same N / torch_p2p's (above 1: torch_p2p is faster)"""


WARM_SPREAD = 0.05  # see timed_updates
BROADCAST_WARMUPS = 3  # a collective's rows: its peers must know the count beforehand


# -- the source ------------------------------------------------------------------------------------
def live(text: str) -> None:
    sys.stderr.write(text + "\n")
    sys.stderr.flush()


def run(args) -> tuple[list[dict], list[str]]:
    """The rows, and what went wrong in the destinations as they left."""
    spec = shapes(args.model, args.layers)
    dtype, src_dtype = DTYPES[args.dtype], DTYPES[args.source_dtype or args.dtype]
    device = device_of(args.device, 0)
    tensors = state_dict(spec, src_dtype, device, fill=True)
    model_bytes = sum(t.numel() for t in tensors.values()) * dtype.itemsize
    want = checksum(tensors.values(), dtype)
    live(f"# {args.model}{'' if args.layers is None else f' ({args.layers} layers)'}: {len(spec)} tensors, "
         f"{fmt_bytes(model_bytes)} {args.dtype} per destination; source {src_dtype} on {device}")
    peers = Peers(args)
    rows = []
    try:
        addresses = [peers.answer(r) for r in range(1, max(args.dests) + 1)]  # started, engine open
        engine = open_engine(args, device)
        freeze_heap(not args.no_freeze)
        for chunk in args.chunk:
            for window in args.window:
                for fanout in args.fanout:
                    source = pw.WeightSource(engine, pw.whole(tensors), chunk_bytes=chunk, window=window,
                                             fanout=fanout)
                    for n in args.dests:
                        rows.append(engine_row(args, peers, source, n, model_bytes, want, chunk, window, fanout))
                    source.close()
        # After the pushes: a same-host route that failed to map a peer has handed it on by now.
        args.routes = sorted({engine.route(a) for a in addresses})  # the title names what carried the bytes
        engine.close()
        baseline_rows(args, peers, tensors, dtype, rows)
    finally:
        errors = peers.close()
    return rows, errors


def timed_updates(update, updates: int, warmups: tuple[int, int], label: str, model_bytes: int) -> list[float]:
    """The seconds of `updates` timed calls of update(), after warm-ups: at least warmups[0]
    (connections, handles), more until one takes within WARM_SPREAD of the one before, at most
    warmups[1]: with one warm-up, the first row of a run once took 1.4 x what the same row took
    in the next run. A collective's peers must know the count beforehand: (k, k) makes it k."""
    def once() -> float:
        t0 = time.perf_counter()
        update()
        return time.perf_counter() - t0

    least, most = max(1, warmups[0]), max(1, warmups[1])
    last, warm = once(), 1
    while warm < most:
        dt = once()
        warm += 1
        steady = abs(dt - last) <= WARM_SPREAD * last
        last = dt
        if steady and warm >= least:
            break
    times = []
    for i in range(1, updates + 1):
        times.append(once())
        live(f"[{label}] update {i}/{updates} (after {warm} warm-ups): {times[-1]:.3f} s, "
             f"{model_bytes / times[-1] / 1e9:.2f} GB/s per destination")
    return times


def engine_row(args, peers, source, n, model_bytes, want, chunk, window, fanout) -> dict:
    ranks = range(1, n + 1)
    label = f"torch_p2p N={n} chunk={fmt_bytes(chunk)} window={window} fanout={fanout}"
    peers.ask(ranks, "join", source.address, window)
    sent = 0

    def update() -> None:
        nonlocal sent
        result = source.push().wait()
        if result.dropped or len(result.received) != n:
            raise RuntimeError(f"{label}: dropped {result.dropped}")
        sent = result.bytes_sent

    times = timed_updates(update, args.updates, (1, args.warmups), label, model_bytes)
    bad = [r for r, c in zip(ranks, peers.ask(ranks, "checksum")) if c != want]
    peers.ask(ranks, "leave")
    s = statistics.median(times)
    return dict(system="torch_p2p", n=n, chunk=chunk, window=window, fanout=fanout, seconds=s, times=times,
                gbps_per_dest=model_bytes / s / 1e9, source_bytes=sent, model_bytes=model_bytes,
                ok=not bad, error=f"checksum differs at destinations {bad}" if bad else None)


def baseline_rows(args, peers, tensors, dtype, rows) -> None:
    backend = args.baseline
    if backend == "none":
        return
    why = dist_unavailable(backend, torch.device(device_of(args.device, 0)))
    if not why and backend == "nccl" and torch.cuda.device_count() < max(args.dests) + 1:
        why = f"NCCL needs a GPU per process: {max(args.dests) + 1} processes, {torch.cuda.device_count()} GPUs"
    if why:
        live(f"skipping the {backend} baseline: {why}")
        return
    import torch.distributed as dist

    everyone = range(1, max(args.dests) + 1)
    for r in everyone:
        peers.conns[r - 1].send(("dist",))
    join_group(args, 0, device_of(args.device, 0))
    for r in everyone:
        peers.answer(r)
    elem = dtype.itemsize
    buf = torch.empty(args.bucket // elem, dtype=dtype, device=device_of(args.device, 0))
    order = list(tensors.values())
    model_bytes = sum(t.numel() for t in order) * elem
    warm = min(BROADCAST_WARMUPS, args.warmups)  # fixed: the peers run the same count
    for n in args.dests:
        for r in everyone:
            peers.conns[r - 1].send(("group", n))
        group = dist.new_group(list(range(n + 1)))
        for r in range(1, n + 1):
            peers.conns[r - 1].send(("broadcast", n, warm + args.updates))
        times = timed_updates(lambda: broadcast_update(order, dtype, args.bucket, group, True, buf), args.updates,
                              (warm, warm), f"{backend} broadcast N={n}", model_bytes)
        for r in range(1, n + 1):
            peers.answer(r)
        s = statistics.median(times)
        rows.append(dict(system=f"{backend} broadcast", n=n, chunk=args.bucket, window=None, fanout=None, seconds=s,
                         times=times, gbps_per_dest=model_bytes / s / 1e9, source_bytes=None,
                         model_bytes=model_bytes, ok=True, error=None))
    for r in everyone:  # NCCL's teardown waits for every rank: all of them leave together
        peers.conns[r - 1].send(("undist",))
    dist.destroy_process_group()
    for r in everyone:
        peers.answer(r)


def table(rows: list[dict]) -> str:
    base = {r["n"]: r["seconds"] for r in rows if r["system"] != "torch_p2p"}
    one = {(r["chunk"], r["window"], r["fanout"]): r["seconds"]
           for r in rows if r["system"] == "torch_p2p" and r["n"] == 1}
    head = ["system", "N", "chunk/bucket", "window", "fanout", "s/update", "GB/s/dest", "source sent", "x N=1",
            "ratio"]
    lines = [head]
    for r in rows:
        key = (r["chunk"], r["window"], r["fanout"])
        lines.append([r["system"], str(r["n"]), fmt_bytes(r["chunk"]), str(r["window"] or "-"), str(r["fanout"] or "-"),
                      f"{r['seconds']:.3f}" if r["ok"] else "FAILED", f"{r['gbps_per_dest']:.2f}",
                      fmt_bytes(r["source_bytes"]) if r["source_bytes"] is not None else "-",
                      f"{r['seconds'] / one[key]:.2f}" if key in one else "-",
                      f"{base[r['n']] / r['seconds']:.2f}" if r["system"] == "torch_p2p" and r["n"] in base else "-"])
    return aligned(lines, 1)


def plot(rows: list[dict], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4.5))
    series: dict[str, dict] = {}
    for r in rows:
        name = r["system"] if r["system"] != "torch_p2p" else (
            f"torch_p2p chunk {fmt_bytes(r['chunk'])} w{r['window']} f{r['fanout']}")
        series.setdefault(name, {})[r["n"]] = r["seconds"]
    for name, points in sorted(series.items()):
        xs, ys = zip(*sorted(points.items()))
        ax.plot(xs, ys, ":" if "broadcast" in name else "-", marker="o", label=name)
    ax.set(xlabel="destinations N", ylabel="seconds per update", title=title)
    ax.set_xticks(sorted({r["n"] for r in rows}))
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    fig.savefig(path, dpi=120, bbox_inches="tight")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, epilog=LEGEND, formatter_class=argparse.RawDescriptionHelpFormatter)
    gpu = torch.cuda.is_available()
    ap.add_argument("--model", choices=sorted(PRESETS), default=None,
                    help=f"shapes (default: the first of {', '.join(DEFAULT_MODELS)} that fits the free memory)")
    ap.add_argument("--layers", type=int, default=None,
                    help="keep only this many decoder layers (default: as many as fit in the memory each process "
                         "may fill: 80%% of its device's free memory shared by the processes on that device; on CPU "
                         "of the host's available memory shared by all processes, at most 2 GiB each)")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16", help="the destinations' dtype")
    ap.add_argument("--source-dtype", choices=sorted(DTYPES), default=None,
                    help="the source's dtype (default: --dtype; another one converts on the way)")
    ap.add_argument("--dests", type=int, nargs="+", default=[1, 2, 3], metavar="N", help="destination counts")
    ap.add_argument("--device", default="cuda:0" if gpu else "cpu", help="the source's device; destinations follow")
    ap.add_argument("--provider", default=None if gpu else "tcp",
                    help="libfabric provider (default: tcp on CPU, the engine's choice on GPUs; same-host GPUs "
                         "take the CUDA IPC route whatever it is)")
    ap.add_argument("--rails", type=int, default=None, help="rails per engine (default: the engine's choice)")
    ap.add_argument("--no-ipc", action="store_true",
                    help="GPUs: no CUDA IPC route; GPU memory goes over the provider (compare with --nccl-sockets)")
    ap.add_argument("--updates", type=int, default=3, help="timed updates per row, after warm-ups")
    ap.add_argument("--warmups", type=int, default=8, metavar="N",
                    help="most warm-up updates per row (they stop once two agree within 5%%; at least 1)")
    ap.add_argument("--chunk", type=parse_size, nargs="+", default=[pw.CHUNK_BYTES], help="chunk sizes to sweep")
    ap.add_argument("--window", type=int, nargs="+", default=[pw.WINDOW], help="windows to sweep")
    ap.add_argument("--fanout", type=int, nargs="+", default=[pw.FANOUT], help="relay fan-outs to sweep")
    ap.add_argument("--no-freeze", action="store_true",
                    help="leave every process's garbage collector as it is (by default each freezes what it "
                         "holds once set up, as vLLM does: a full collection of a torch process, 66-78 ms on "
                         "an H200 host, otherwise falls in a timed update now and then)")
    ap.add_argument("--bucket", type=parse_size, default=256 << 20, help="baseline bucket size (default 256M)")
    ap.add_argument("--baseline", choices=["auto", "nccl", "gloo", "none"], default="auto")
    ap.add_argument("--nccl-sockets", action="store_true", help="hold NCCL to its socket transport on lo")
    ap.add_argument("--json", metavar="PATH", help="write the rows as a JSON list")
    ap.add_argument("--plot", metavar="PATH", help="plot seconds per update against N (needs matplotlib)")
    args = ap.parse_args(argv)
    if min(args.dests) < 1 or args.updates < 1:
        ap.error("--dests and --updates must be >= 1")
    if args.plot and importlib.util.find_spec("matplotlib") is None:  # now, not after the run
        ap.error("--plot needs matplotlib: pip install matplotlib")
    if args.baseline == "auto":
        args.baseline = "nccl" if torch.device(args.device).type == "cuda" else "gloo"
    if args.model is None or args.layers is None:
        devices = [device_of(args.device, i) for i in range(1 + max(args.dests))]
        budget = process_budget(devices)
        where = (f"{fmt_bytes(budget)} per process ({USABLE:.0%} of the free memory of "
                 f"{', '.join(sorted(set(devices)))}, shared by the {len(devices)} processes on them"
                 f"{f', at most {fmt_bytes(HOST_DEFAULT_BYTES)} on CPUs to end in minutes' if budget == HOST_DEFAULT_BYTES else ''})")
    if args.model is None:  # the largest default that fits, cut to the layers that fit
        args.model = next((m for m in DEFAULT_MODELS if fit_layers(args, m, budget) != 0), None)
        if args.model is None:
            ap.error(f"not even --model tiny fits in {where}")
        if args.model != DEFAULT_MODELS[0]:
            live(f"# {args.model}: the largest default model that fits in {where} (pass --model to choose)")
    if args.layers is None and (fit := fit_layers(args, args.model, budget)) is not None:
        if fit == 0:
            ap.error(f"{args.model} does not fit in {where} even with one layer: pass a smaller --model or "
                     f"fewer --dests")
        args.layers = fit
        live(f"# {args.model} cut to {fit} of its {PRESETS[args.model][2]} layers to fit in {where} "
             f"(pass --model and --layers to choose)")
    return args


def route_text(args) -> str:
    """The routes the source's engine takes to the destinations: the same-host routes (cma for
    host memory, ipc for GPUs) use no provider, so the provider is named only where the fabric
    carries the bytes."""
    routes = getattr(args, "routes", [])
    fabric = [r for r in routes if r in ("direct", "staged")]
    text = f"route {', '.join(routes) or 'unknown'}"
    if fabric:
        text += f" over provider {args.provider or 'auto'}, {args.rails or 'default'} rails"
    else:
        text += " (same host: no provider)"
    return text + (", no IPC" if args.no_ipc else "")


def main(argv=None) -> int:
    args = parse_args(argv)
    import tempfile

    with tempfile.TemporaryDirectory(prefix="weights-") as tmp:
        args.store = os.path.join(tmp, "store")
        rows, errors = run(args)
    title = (f"{args.model} {args.dtype}, source {args.source_dtype or args.dtype} on {args.device}, "
             f"{route_text(args)}, median of {args.updates}")
    print("# torch_p2p.weights: " + title)
    print(table(rows))
    print(LEGEND)
    save_rows(args, rows, plot, title)
    for error in errors:
        print(f"! {error}")
    return 0 if all(r["ok"] for r in rows) and not errors else 1


if __name__ == "__main__":
    exit_on_sigterm()
    sys.exit(main())
