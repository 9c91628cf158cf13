"""Client host arrays -> a remote GPU -> pairwise sum -> back, against a local GPU.

Reproduces the experiment of the paper "Data Transfer to Remote GPUs Over High-Performance
Networks" (Marafi, Bocci; CERN) with torch_p2p. The client (this process) holds two float32
arrays a and b in host memory. They go to a GPU, which computes c = a + b (``--reps-sum K``
times, to emulate heavier compute), and c comes back to the client's host memory, which checks
it. Methods, one row group each:

  local            the client's own GPU: pageable host -> GPU copy, sum, GPU -> pageable host
  local-pinned     the same from and to pinned host memory
  remote-pageable  paper's part 1: the client writes into pageable host buffers registered on
                   the server (a child process), which copies them to its GPU, sums, copies
                   back to a pageable registered buffer; the client reads it
  remote-pinned    paper's part 2: the same with pinned server host buffers
  remote-staged    the client writes straight into the server's GPU tensors, the server engine
                   staging through its pinned slots (data_path "staged"); the client reads c
  remote-direct    paper's part 3: the same with data_path "direct" (the NIC reaches GPU
                   memory, FI_HMEM); only with such a provider, e.g. shm built with CUDA

Timing, per run, as in the paper's Section 3 (every number in milliseconds):

  input       client: start of the write of a and b -> the server's message that the
              notification of their arrival came (local: host -> GPU copies)
  ops client  client: that message -> the server's "done" message (the server's own copies
              between its host buffers and GPU, if any, fall here, and its compute)
  ops GPU     the K sums alone, timed with CUDA events on the GPU that ran them
  output      client: read of c (local: GPU -> host copy)

      Latency = input + ops client + output - ops GPU

i.e. the time of every copy between the client's memory and the GPU, as the client sees it.
Effective GB/s = bytes moved (2 arrays in, 1 out) / Latency. Where the server's compute takes
no longer than a message (small sizes), the split between input and ops client can shift by
a message's latency; their sum, and so Latency, cannot.

Protocol: each (method, size) runs ``--warmup`` runs (the paper warms up with 3 runs of part
1), then ``--rounds`` rounds of up to ``--repeat`` runs (the paper: 10 rounds of 6), and
reports the mean and standard deviation of the round whose latency has the lowest standard
deviation, as the paper does. A round stops early once it used its share of ``--budget``
seconds (at least 2 runs), so that 4e8 elements over tcp stay affordable: the default run
takes about a minute on 2 x H200 over tcp. The paper's protocol in full:
``--warmup 3 --rounds 10 --budget 60``.

Every result is checked before its time counts: each run gives a and b fresh random values
and poisons c with NaN (every element up to ``--check-all`` elements, else 4096 random ones
and both ends), and c must equal a + b exactly there. A stale or missing byte anywhere on the
path therefore fails the run, and a failed run fails its (method, size): no time is reported
for a wrong result.

The server runs in a spawned child with its own engine on ``--server-device``; control goes
over a pipe, while the data, the arrival notification and the per-run messages go through the
engines. ``--server-device cpu`` runs the whole protocol without a GPU (a dry run: the
"GPU" tensors are host tensors, remote-staged stages host memory through slots, and methods
that need CUDA are skipped with a note).

    python benchmarks/remote_gpu.py                                # 2 GPUs, tcp on loopback
    python benchmarks/remote_gpu.py --json out.json --plot out.png
    python benchmarks/remote_gpu.py --provider shm --methods remote-direct,local
    python benchmarks/remote_gpu.py --server-device cpu --local-device cpu --sizes 1e4,1e5,1e6
"""
from __future__ import annotations

import argparse
import math
import os
import platform
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # run from a checkout without installing

import torch_p2p as p2p  # noqa: E402
from _processes import exit_on_sigterm  # noqa: E402
from _remote_gpu_client import Client, HostArrays, measure, progress, run_local, run_remote, summarize  # noqa: E402
from _remote_gpu_report import fmt_ms, fmt_n, plot, print_table, write_json  # noqa: E402
from _remote_gpu_server import Unavailable  # noqa: E402

METHODS = ["local", "local-pinned", "remote-pageable", "remote-pinned", "remote-staged", "remote-direct"]
DEFAULT_SIZES = "1e4,1e5,1e6,1e7,1e8,4e8"
DRY_RUN_SIZES = "1e4,1e5,1e6,1e7,1e8"  # the default with the server on the CPU


def unavailable(method: str, args, hmem: bool) -> str | None:
    """Why `method` cannot run here, or None."""
    server_cuda = args.server_device.startswith("cuda")
    if method == "local" and args.local_device is None:
        return "no CUDA on the client (--local-device cpu runs it on the CPU as a dry run)"
    if method == "local-pinned" and not (args.local_device or "").startswith("cuda"):
        return "pinned host memory needs CUDA on the client"
    if method == "remote-pinned" and not server_cuda:
        return "pinned host memory needs CUDA on the server"
    if method == "remote-direct":
        if not server_cuda:
            return "needs a GPU on the server"
        if not hmem:
            return (f"provider {args.provider!r} has no FI_HMEM here (GPUDirect); needs one that has, "
                    "e.g. --provider shm with a libfabric built with CUDA")
    return None


def bench_local(method: str, n: int, args, master: tuple, gen: torch.Generator) -> tuple[list, int, str]:
    device = torch.device(args.local_device)
    pinned = method == "local-pinned"
    if pinned:
        host = [torch.empty(n, pin_memory=True) for _ in range(3)]
        host[0].copy_(master[0][:n])
        host[1].copy_(master[1][:n])
    else:
        host = [m[:n] for m in master]
    arrays = HostArrays(*host, args.check_all, gen)
    dev = tuple(torch.empty(n, device=device) for _ in range(3))
    samples, runs = measure(lambda: run_local(arrays, dev, pinned, args.reps_sum), arrays, args,
                            f"{method} {fmt_n(n)}")
    return samples, runs, str(device)


def bench_remote(method: str, n: int, args, master: tuple, gen: torch.Generator,
                 client: "Client") -> tuple[list, int, str]:
    server = client.server
    timeout = 60 + 3 * 4 * n / 50e6  # generous: 50 MB/s
    remote = [p2p.RemoteTensor.from_bytes(blob) for blob in server.call("alloc", n, timeout=timeout)]
    want_staged = method == "remote-staged"
    want_device = "cpu" if method in ("remote-pageable", "remote-pinned") else args.server_device
    for r in remote:  # the server's tensors must be what the method claims to measure
        if r.staged != want_staged or r.device != want_device:
            raise RuntimeError(f"{method}: the server's tensor is on {r.device}, staged={r.staged}; "
                               f"expected {want_device}, staged={want_staged}")
    arrays = HostArrays(*(m[:n] for m in master), args.check_all, gen)
    samples, runs = measure(
        lambda: run_remote(client.engine, server, arrays, remote, next(client.tags), args.reps_sum, timeout),
        arrays, args, f"{method} {fmt_n(n)}")
    server.call("free", timeout=timeout)  # after a failure the caller replaces the server instead
    return samples, runs, args.server_device


def parse_sizes(text: str) -> list[int]:
    sizes = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        try:
            value = float(part)
        except ValueError:
            value = 0.5
        if not value.is_integer() or value < 1:
            raise argparse.ArgumentTypeError(f"sizes are positive whole numbers of elements, not {part!r}")
        sizes.append(int(value))
    if not sizes:
        raise argparse.ArgumentTypeError("no sizes given")
    return sizes


def parse_methods(text: str) -> list[str]:
    methods = [m.strip() for m in text.split(",") if m.strip()]
    for m in methods:
        if m not in METHODS:
            raise argparse.ArgumentTypeError(f"unknown method {m!r}; choose from {', '.join(METHODS)}")
    return [m for m in METHODS if m in methods]


def parse_args(argv=None):
    cuda = torch.cuda.device_count() if torch.cuda.is_available() else 0
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", type=parse_sizes, default=None,
                   help=f"float32 elements per array, comma-separated (default {DEFAULT_SIZES}, "
                        f"{DRY_RUN_SIZES} in a dry run); "
                        "memory: 3 arrays of 4 B each on the client, the server host and each GPU")
    p.add_argument("--methods", type=parse_methods, default=list(METHODS),
                   help=f"comma-separated subset of {','.join(METHODS)} (default: all)")
    p.add_argument("--reps-sum", type=int, default=1, metavar="K", help="sums per run (default 1)")
    p.add_argument("--repeat", type=int, default=6, help="runs per round (default 6, as the paper)")
    p.add_argument("--rounds", type=int, default=1,
                   help="rounds per (method, size); the one with the lowest latency std is kept "
                        "(default 1; the paper uses 10)")
    p.add_argument("--warmup", type=int, default=1,
                   help="untimed runs per (method, size) first (default 1; the paper warms up with 3)")
    p.add_argument("--budget", type=float, default=10.0,
                   help="seconds of timed runs per (method, size), split over the rounds; a round "
                        "stops early past its share, after at least 2 runs (default 10)")
    p.add_argument("--check-all", type=int, default=1_000_000, metavar="N",
                   help="check every element up to N elements, else 4096 random ones (default 1e6)")
    p.add_argument("--server-device", "--server-gpu", default=None,
                   help="the server's device: cuda:N, or cpu for a dry run (default cuda:1 with 2 GPUs, "
                        "else cuda:0, and cpu without CUDA)")
    p.add_argument("--local-device", default="cuda:0" if cuda else None,
                   help="the client's GPU for the local methods (default cuda:0; cpu: a dry run)")
    p.add_argument("--provider", default="tcp", help="libfabric provider (default tcp)")
    p.add_argument("--domains", default=None,
                   help="comma-separated libfabric domains (default: lo for tcp, the provider's own else)")
    p.add_argument("--rails", type=int, default=None, help="rails per engine (default: the engine's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="PATH", help="write one record per (method, size) here")
    p.add_argument("--plot", metavar="PATH", help="plot transfer latency vs size here (needs matplotlib)")
    p.add_argument("-v", "--verbose", action="store_true", help="the engines' log on stderr")
    args = p.parse_args(argv)
    if args.server_device is None:
        # Without CUDA, the protocol runs on host memory: a dry run (said in the header).
        args.server_device = "cuda:1" if cuda >= 2 else "cuda:0" if cuda else "cpu"
    if args.sizes is None:
        args.sizes = parse_sizes(DRY_RUN_SIZES if args.server_device == "cpu" else DEFAULT_SIZES)
    for name in ("server_device", "local_device"):
        dev = getattr(args, name)
        if dev is None:
            continue
        dev = str(torch.device(dev))
        if dev == "cuda":
            dev = "cuda:0"
        if dev.startswith("cuda") and int(dev.split(":")[1]) >= cuda:
            p.error(f"--{name.replace('_', '-')} {dev}: this machine has {cuda} CUDA device(s)")
        setattr(args, name, dev)
    if min(args.reps_sum, args.repeat, args.rounds) < 1 or args.warmup < 0 or args.budget <= 0:
        p.error("--reps-sum, --repeat and --rounds must be >= 1, --warmup >= 0, --budget > 0")
    for flag, path in (("--json", args.json), ("--plot", args.plot)):
        if path and not os.path.isdir(os.path.dirname(os.path.abspath(path))):
            p.error(f"{flag} {path}: its folder does not exist")
    if args.plot:
        try:
            import matplotlib  # noqa: F401 - fail now, not after minutes of measuring
        except ImportError:
            p.error("--plot needs matplotlib: pip install matplotlib (or pip install -e .[bench])")
    return args


def bench_method(method: str, args, master: tuple, gen: torch.Generator, client: Client | None,
                 config: dict, records: list[dict]) -> None:
    """Every size of one method, smallest first; a failure skips the larger sizes."""
    info = {}
    try:
        if client is not None:
            info = client.open(method)
            host = " (host buffers: direct RMA)" if method in ("remote-pageable", "remote-pinned") else ""
            progress(f"{method}: server engine on {args.server_device}, {info['provider']}, "
                     f"{info['rails']} rail(s), {args.server_device} data path {info['data_path']}{host}")
        for n in args.sizes:
            label = f"{method} {fmt_n(n)}"
            progress(f"{label}: start")
            record = {"method": method, "elements": n, "reps_sum": args.reps_sum,
                      "server_engine_data_path": info.get("data_path")}
            records.append(record)
            if client is None:
                samples, runs, device = bench_local(method, n, args, master, gen)
            else:
                samples, runs, device = bench_remote(method, n, args, master, gen, client)
            stats = summarize(samples)
            record.update(status="ok", device=device, runs=runs, rounds=args.rounds,
                          input_ms=stats["input"], ops_client_ms=stats["ops"], ops_gpu_ms=stats["gpu"],
                          output_ms=stats["output"], latency_ms=stats["latency"],
                          gbps=3 * 4 * n / (stats["latency"]["mean"] * 1e-3) / 1e9, samples=samples)
            for k in ("copy_in", "copy_out"):
                if k in stats:
                    record[f"server_{k}_ms"] = stats[k]
            if runs < args.repeat * args.rounds:
                record["note"] = f"{runs} of {args.repeat * args.rounds} runs (time budget)"
            progress(f"{label}: latency {fmt_ms(stats['latency']['mean'])} ± {fmt_ms(stats['latency']['std'])} "
                     f"ms, {record['gbps']:.2f} GB/s, {runs} runs")
            if args.json:
                write_json(args.json, config, records)
        if client is not None:
            client.close_method()
    except Unavailable as exc:
        progress(f"{method}: skipped: {exc}")
        records.append({"method": method, "status": "skipped", "note": str(exc)})
    except Exception as exc:  # noqa: BLE001 - recorded, and the benchmark goes on
        what = f"{type(exc).__name__}: {exc}"
        progress(f"{method}: FAILED: {what}")
        if not records or records[-1]["method"] != method or records[-1].get("status"):
            records.append({"method": method, "elements": 0})  # failed before its first size
        records[-1].update(status="failed", note=what.splitlines()[0], error=what)
        if client is not None:
            client.drop_server()


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.provider.split(";")[0] == "shm" and "FI_SHM_DISABLE_CMA" not in os.environ:
        # shm settles once per endpoint, at its first peer, whether it copies with CMA, which
        # cannot reach GPU memory: the client's host engine meets the staged server first and
        # its writes into the direct server's GPU tensors then fail (README, shm and CMA).
        os.environ["FI_SHM_DISABLE_CMA"] = "1"
        progress("shm: FI_SHM_DISABLE_CMA=1, so that one host engine can reach host and GPU peers")
    if args.verbose:
        import logging

        logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    tcp = args.provider.split(";")[0] == "tcp"
    domains = args.domains.split(",") if args.domains else (["lo"] if tcp else None)
    engine_kwargs = dict(provider=args.provider, num_rails=args.rails, domains=domains)
    try:
        hmem = bool(p2p._C.list_nics(args.provider, True)[1])
    except Exception:  # noqa: BLE001 - the engines will say what is wrong with the provider
        hmem = False

    max_n = max(args.sizes)
    gib = 3 * 4 * max_n / 2**30
    progress(f"sizes {', '.join(fmt_n(n) for n in args.sizes)}: {gib:.1f} GiB of client host arrays, "
             f"up to {gib:.1f} GiB on the server host and on each GPU")
    gen = torch.Generator().manual_seed(args.seed)
    master = tuple(torch.empty(max_n) for _ in range(3))  # pageable, like the paper's client
    master[0].uniform_(-1, 1, generator=gen)
    master[1].uniform_(-1, 1, generator=gen)
    master[2].fill_(math.nan)

    config = dict(vars(args), hostname=platform.node(), torch=torch.__version__,
                  date=time.strftime("%Y-%m-%d %H:%M:%S"),
                  gpus=[torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())])
    records: list[dict] = []
    client = None
    try:
        for method in args.methods:
            why = unavailable(method, args, hmem)
            if why:
                progress(f"{method}: skipped: {why}")
                records.append({"method": method, "status": "skipped", "note": why})
                continue
            if method.startswith("remote") and client is None:
                client = Client(args, engine_kwargs, master)
                config.update(provider_resolved=client.engine.provider, domains=domains,
                              client_rails=len(client.engine.rails))
            bench_method(method, args, master, gen, client if method.startswith("remote") else None,
                         config, records)
    finally:
        if client is not None:
            client.close()

    header = (f"remote_gpu: provider {config.get('provider_resolved', args.provider)}, server {args.server_device}, "
              f"local {args.local_device}, K={args.reps_sum} sum(s), {args.repeat} runs x {args.rounds} "
              f"round(s), budget {args.budget:g} s")
    print_table(records, header)
    if args.json:
        write_json(args.json, config, records)
    if args.plot:
        plot(args.plot, records, header)
        progress(f"plot written to {args.plot}")
    return 1 if any(r["status"] == "failed" for r in records) else 0


if __name__ == "__main__":
    exit_on_sigterm()
    sys.exit(main())
