"""Client host arrays -> a remote GPU -> pairwise sum -> back, against a local GPU.

Reproduces the experiment of "Data Transfer to Remote GPUs Over High-Performance Networks"
(Marafi, Bocci, CERN) with torch_p2p. The client
(this process) holds two float32 arrays a and b in host memory. They go to a GPU, which
computes c = a + b (``--reps-sum K`` times, to emulate heavier compute), and c comes back
to the client's host memory, which checks it. Methods, one row group each:

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
import json
import math
import os
import platform
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # run from a checkout without installing

import torch_p2p as p2p  # noqa: E402
from _common import exit_on_sigterm, reap, spawn_with_pipe  # noqa: E402

METHODS = ["local", "local-pinned", "remote-pageable", "remote-pinned", "remote-staged", "remote-direct"]
DEFAULT_SIZES = "1e4,1e5,1e6,1e7,1e8,4e8"
DRY_RUN_SIZES = "1e4,1e5,1e6,1e7,1e8"  # the default with the server on the CPU
SERVER_DATA_PATH = {"remote-pageable": None, "remote-pinned": None, "remote-staged": "staged",
                    "remote-direct": "direct"}
SAMPLE = 4096  # random indices checked per run above --check-all
FIELDS = ["input", "ops", "gpu", "output", "latency"]
_T0 = time.perf_counter()


class WrongResult(RuntimeError):
    """c differs from a + b: the run's time must not be reported."""


class ServerError(RuntimeError):
    """The server process failed, died or did not answer."""


class Unavailable(RuntimeError):
    """The method cannot run with this provider or device: a note, not a failure."""


def progress(text: str) -> None:
    print(f"[{time.perf_counter() - _T0:7.1f}s] {text}", file=sys.stderr, flush=True)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_sum(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, reps: int) -> float:
    """c = a + b, `reps` times; returns the device's time for it in ms (CUDA events on a
    GPU, the host clock on the CPU). Returns once c is final."""
    if c.is_cuda:
        stream = torch.cuda.current_stream(c.device)
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)
        for _ in range(reps):
            torch.add(a, b, out=c)
        stop.record(stream)
        stop.synchronize()
        return start.elapsed_time(stop)
    t = time.perf_counter()
    for _ in range(reps):
        torch.add(a, b, out=c)
    return (time.perf_counter() - t) * 1e3


# ---------------------------------------------------------------------------------------------
# Server: the child process. Thread model: its main thread serves the pipe and runs the GPU
# work; the engine's own threads move the data.

class Server:
    """One engine at a time (the current method's data path) and the buffers of one size."""

    def __init__(self, device: str, engine_kwargs: dict):
        self.device = torch.device(device)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.engine_kwargs = engine_kwargs
        self.engine: p2p.Engine | None = None
        self.client = b""
        self.method = ""
        self.regions: list = []
        self.host: tuple | None = None  # (a, b, c) host buffers of the part 1 / 2 methods
        self.dev: tuple | None = None   # (a, b, c) on the device

    def open(self, method: str, client: bytes) -> dict:
        self.close_engine()
        self.method, self.client = method, client
        self.engine = p2p.Engine(self.device, data_path=SERVER_DATA_PATH[method], **self.engine_kwargs)
        if method == "remote-direct":
            # NOTE: libfabric 1.17's shm without CUDA support claims FI_HMEM, then refuses to
            # register GPU memory (FI_ENOSYS): find out before timing anything.
            try:
                self.engine.register(torch.empty(1024, device=self.device)).close()
            except p2p.P2PError as exc:
                self.close_engine()
                raise Unavailable(f"the {self.device} engine reports data path 'direct' but cannot register "
                                  f"GPU memory ({exc}); is this libfabric built with CUDA?") from exc
        return {"address": self.engine.address, "provider": self.engine.provider,
                "data_path": self.engine.data_path, "rails": len(self.engine.rails)}

    def alloc(self, n: int) -> list[bytes]:
        """Buffers for n elements; returns the RemoteTensor bytes of a, b and c."""
        self.free()
        self.dev = tuple(torch.empty(n, device=self.device) for _ in range(3))
        targets = self.dev
        if self.method in ("remote-pageable", "remote-pinned"):
            pin = self.method == "remote-pinned"
            self.host = tuple(torch.empty(n, pin_memory=pin) for _ in range(3))
            targets = self.host
        self.regions = [self.engine.register(t) for t in targets]
        return [r.remote.to_bytes() for r in self.regions]

    def run(self, tag: int, reps: int, timeout: float, conn) -> dict:
        """One run: wait until a and b arrived, sum, tell the client c is ready."""
        engine = self.engine
        arrived = engine.notification(tag, timeout=timeout)
        conn.send(("armed", None))
        try:
            arrived.wait()
            told = engine.send(self.client, _message("arrived", tag), timeout=timeout)
            da, db, dc = self.dev
            stats = {}
            if self.host is not None:
                ha, hb, hc = self.host
                pinned = self.method == "remote-pinned"
                t = time.perf_counter()
                da.copy_(ha, non_blocking=pinned)
                db.copy_(hb, non_blocking=pinned)
                sync(self.device)
                stats["copy_in"] = (time.perf_counter() - t) * 1e3
            gpu_ms = timed_sum(da, db, dc, reps)  # synchronizes: c is final before "done"
            if self.host is not None:
                t = time.perf_counter()
                hc.copy_(dc, non_blocking=pinned)
                sync(self.device)
                stats["copy_out"] = (time.perf_counter() - t) * 1e3
            engine.send(self.client, _message("done", tag, gpu_ms=gpu_ms), timeout=timeout).wait()
            told.wait()
            return stats
        except BaseException as exc:
            try:  # the client waits on the engine, not on the pipe: wake it
                engine.send(self.client, _message("error", tag, text=f"{type(exc).__name__}: {exc}"),
                            timeout=10).wait()
            except Exception:  # noqa: BLE001 - the original error matters more
                pass
            raise

    def free(self) -> None:
        for region in self.regions:
            region.close()
        self.regions, self.host, self.dev = [], None, None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def close_engine(self) -> None:
        self.free()
        if self.engine is not None:
            self.engine.close()
            self.engine = None


def _message(kind: str, tag: int, **fields) -> bytes:
    return json.dumps({"kind": kind, "tag": tag, **fields}).encode()


def _serve(conn, device: str, engine_kwargs: dict) -> None:
    """The child's loop: (command, args) in, ("ok", result) or ("err", traceback) out; "run"
    also answers ("armed", None) once it waits for the data."""
    server = Server(device, engine_kwargs)
    commands = {"open": server.open, "alloc": server.alloc, "free": server.free,
                "close_engine": server.close_engine}
    try:
        while True:
            try:
                msg = conn.recv()
            except EOFError:
                break
            if msg is None:
                break
            cmd, args = msg
            try:
                result = server.run(*args, conn=conn) if cmd == "run" else commands[cmd](*args)
                conn.send(("ok", result))
            except Unavailable as exc:
                conn.send(("skip", str(exc)))
            except BaseException as exc:  # noqa: BLE001 - reported to the client
                conn.send(("err", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    finally:
        server.close_engine()


class ServerProcess:
    """The client's handle on the child: commands over the pipe, every wait bounded."""

    def __init__(self, device: str, engine_kwargs: dict):
        self._conn, self.proc = spawn_with_pipe(_serve, (device, engine_kwargs), "remote_gpu-server")

    def send(self, cmd: str, *args) -> None:
        self._conn.send((cmd, args))

    def reply(self, timeout: float, expect: str = "ok"):
        deadline = time.monotonic() + timeout
        while not self._conn.poll(0.5):
            if not self.proc.is_alive():
                raise ServerError(f"the server process died (exit code {self.proc.exitcode})")
            if time.monotonic() > deadline:
                raise ServerError(f"the server did not answer within {timeout:.0f} s")
        status, value = self._conn.recv()
        if status == "err":
            raise ServerError(f"the server failed: {value}")
        if status == "skip":
            raise Unavailable(value)
        if status != expect:
            raise ServerError(f"the server answered {status!r}, expected {expect!r}")
        return value

    def call(self, cmd: str, *args, timeout: float = 300):
        self.send(cmd, *args)
        return self.reply(timeout)

    def close(self) -> None:
        if self.proc.is_alive():
            try:
                self._conn.send(None)
            except OSError:
                pass
        reap([self.proc])
        self._conn.close()


# ---------------------------------------------------------------------------------------------
# Client

class HostArrays:
    """The client's a, b (inputs) and c (result) for one size, in host memory. refresh()
    gives each run fresh inputs, so that a stale or missing byte anywhere on the way to the
    GPU and back fails check()."""

    def __init__(self, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, check_all: int,
                 gen: torch.Generator):
        self.a, self.b, self.c = a, b, c
        self.n = a.numel()
        self.full = self.n <= check_all
        self.gen = gen
        self.idx: torch.Tensor | None = None

    def refresh(self) -> None:
        if self.full:
            self.a.uniform_(-1, 1, generator=self.gen)
            self.b.uniform_(-1, 1, generator=self.gen)
            self.c.fill_(math.nan)
            return
        picks = torch.randint(self.n, (SAMPLE,), generator=self.gen)
        self.idx = torch.cat([picks, torch.tensor([0, self.n - 1])])
        self.a[self.idx] = torch.rand(len(self.idx), generator=self.gen)
        self.b[self.idx] = torch.rand(len(self.idx), generator=self.gen)
        self.c[self.idx] = math.nan

    def check(self) -> None:
        """c == a + b, bit for bit (both sides add float32 once, correctly rounded)."""
        if self.full:
            got, want, where = self.c, self.a + self.b, None
        else:
            got, want, where = self.c[self.idx], self.a[self.idx] + self.b[self.idx], self.idx
        if torch.equal(got, want):
            return
        bad = (got != want).nonzero().flatten()
        i = int(bad[0])
        at = i if where is None else int(where[i])
        raise WrongResult(f"{len(bad)} of {got.numel()} checked elements are wrong; c[{at}] = "
                          f"{float(got[i])}, a + b = {float(want[i])}")


def run_local(arrays: HostArrays, dev: tuple, pinned: bool, reps: int) -> dict:
    """One local run: host -> GPU, sum, GPU -> host, timed from the host."""
    a, b, c = arrays.a, arrays.b, arrays.c
    da, db, dc = dev
    t0 = time.perf_counter()
    da.copy_(a, non_blocking=pinned)
    db.copy_(b, non_blocking=pinned)
    sync(da.device)
    t1 = time.perf_counter()
    gpu_ms = timed_sum(da, db, dc, reps)
    t2 = time.perf_counter()
    c.copy_(dc, non_blocking=pinned)
    sync(dc.device)
    t3 = time.perf_counter()
    return {"input": (t1 - t0) * 1e3, "ops": (t2 - t1) * 1e3, "gpu": gpu_ms, "output": (t3 - t2) * 1e3}


def run_remote(engine: p2p.Engine, server: ServerProcess, arrays: HostArrays, remote: list,
               tag: int, reps: int, timeout: float) -> dict:
    """One remote run: write a and b (notify), wait for "arrived" and "done", read c."""
    ra, rb, rc = remote
    arrived, done = engine.recv(timeout=timeout), engine.recv(timeout=timeout)
    try:
        server.send("run", tag, reps, timeout)
        server.reply(timeout, expect="armed")
        t0 = time.perf_counter()
        engine.write_slices([arrays.a, arrays.b], [ra, rb], notify=tag, timeout=timeout).wait()
        _expect(arrived, "arrived", tag)
        t1 = time.perf_counter()
        gpu_ms = _expect(done, "done", tag)["gpu_ms"]
        t2 = time.perf_counter()
        engine.read_slices([arrays.c], [rc], timeout=timeout).wait()
        t3 = time.perf_counter()
    except BaseException:
        for fut in (arrived, done):
            if not fut.done():
                engine.cancel(fut)
        raise
    sample = {"input": (t1 - t0) * 1e3, "ops": (t2 - t1) * 1e3, "gpu": gpu_ms, "output": (t3 - t2) * 1e3}
    sample.update(server.reply(timeout))  # the server's own copy times, if any
    return sample


def _expect(fut, kind: str, tag: int) -> dict:
    _, payload = fut.wait()
    msg = json.loads(payload)
    if msg.get("kind") == "error":
        raise ServerError(f"the server failed in run {tag}: {msg.get('text')}")
    if msg.get("kind") != kind or msg.get("tag") != tag:
        raise ServerError(f"expected the server's {kind!r} of run {tag}, got {msg}")
    return msg


def measure(run_once, arrays: HostArrays, args, label: str) -> tuple[list[dict], int]:
    """Warm-up, then rounds of checked runs; returns the samples of the round with the lowest
    latency standard deviation, and the number of timed runs made."""
    def checked_run():
        arrays.refresh()
        sample = run_once()
        arrays.check()
        sample["latency"] = sample["input"] + sample["ops"] + sample["output"] - sample["gpu"]
        return sample

    for _ in range(args.warmup):
        checked_run()
    best, total = None, 0
    round_budget = args.budget / args.rounds
    for r in range(args.rounds):
        samples, start = [], time.perf_counter()
        while len(samples) < args.repeat:
            samples.append(checked_run())
            total += 1
            if samples[-1]["latency"] > 1000:
                progress(f"{label}: round {r + 1} run {len(samples)}: latency {samples[-1]['latency']:.0f} ms")
            if len(samples) >= min(2, args.repeat) and time.perf_counter() - start > round_budget:
                break
        if best is None or _std([s["latency"] for s in samples]) < _std([s["latency"] for s in best]):
            best = samples
    return best, total


def _std(values: list[float]) -> float:
    return statistics.stdev(values) if len(values) > 1 else 0.0


def summarize(samples: list[dict]) -> dict:
    keys = FIELDS + [k for k in ("copy_in", "copy_out") if k in samples[0]]
    return {k: {"mean": statistics.fmean(s[k] for s in samples), "std": _std([s[k] for s in samples])}
            for k in keys}


# ---------------------------------------------------------------------------------------------
# Driver

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


def fmt_n(n: int) -> str:
    """1e4, 28e6, 4e8: the paper's way of naming sizes."""
    if n <= 0:
        return "-"
    for exp in range(15, 0, -1):
        if n % 10 ** exp == 0:
            return f"{n // 10 ** exp}e{exp}"
    return str(n)


def fmt_ms(x: float) -> str:
    return f"{x:.0f}" if x >= 100 else f"{x:.1f}" if x >= 10 else f"{x:.2f}" if x >= 1 else f"{x:.3f}"


def print_table(records: list[dict], header: str) -> None:
    print(header)
    cols = f"{'method':<16}{'elements':>9}{'input ms':>11}{'ops client ms':>15}{'ops GPU ms':>12}" \
           f"{'output ms':>11}{'latency ms':>22}{'GB/s':>8}{'runs':>6}"
    print(cols)
    print("-" * len(cols))
    notes = []
    for r in records:
        if r["status"] == "skipped":
            notes.append(f"{r['method']}: skipped: {r['note']}")
            continue
        name = f"{r['method']:<16}{fmt_n(r['elements']):>9}"
        if r["status"] == "failed":
            print(f"{name}   FAILED (see below)")
            notes.append(f"{r['method']} {fmt_n(r['elements'])}: FAILED: {r['note']}")
            continue
        lat = r["latency_ms"]
        print(f"{name}{fmt_ms(r['input_ms']['mean']):>11}{fmt_ms(r['ops_client_ms']['mean']):>15}"
              f"{fmt_ms(r['ops_gpu_ms']['mean']):>12}{fmt_ms(r['output_ms']['mean']):>11}"
              f"{fmt_ms(lat['mean']) + ' ± ' + fmt_ms(lat['std']):>22}{r['gbps']:>8.2f}{r['runs']:>6}")
        if r.get("note"):
            notes.append(f"{r['method']} {fmt_n(r['elements'])}: {r['note']}")
    print("\nLatency = input + ops client + output - ops GPU; GB/s = 3 x elements x 4 B / latency. "
          "Means over the kept round (± its std).")
    for note in notes:
        print(f"  {note}")


def write_json(path: str, config: dict, records: list[dict]) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump({"config": config, "records": records}, f, indent=1)
    os.replace(tmp, path)


def plot(path: str, records: list[dict], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5.5))
    for method in METHODS:
        rows = [r for r in records if r["method"] == method and r["status"] == "ok"]
        if rows:
            ax.errorbar([r["elements"] for r in rows], [r["latency_ms"]["mean"] for r in rows],
                        yerr=[r["latency_ms"]["std"] for r in rows], marker="o", capsize=3, label=method)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("buffer size (float32 elements)")
    ax.set_ylabel("transfer latency (ms)")
    ax.set_title(title, fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


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


class Client:
    """The client's engine, with the arrays of every size registered once (views serve the
    smaller sizes), and the server process, replaced after a failure."""

    def __init__(self, args, engine_kwargs: dict, master: tuple):
        self.args, self.engine_kwargs = args, engine_kwargs
        self.engine = p2p.Engine("cpu", **engine_kwargs)
        for t in master:
            self.engine.register(t)
        self.server: ServerProcess | None = None
        self.server_address = b""
        self.tags = iter(range(1, 1 << 32))  # one notification tag per run

    def open(self, method: str) -> dict:
        """Gives the server an engine for `method`; returns what it says of it."""
        if self.server is None:
            self.server = ServerProcess(self.args.server_device, self.engine_kwargs)
        info = self.server.call("open", method, self.engine.address)
        self.server_address = info["address"]
        self.engine.connect(self.server_address).wait()
        return info

    def close_method(self) -> None:
        self.engine.disconnect(self.server_address).wait()
        self.server.call("close_engine")

    def drop_server(self) -> None:
        """After a failure its state is unknown: the next method gets a fresh one."""
        if self.server is not None:
            self.server.close()
            self.server = None

    def close(self) -> None:
        self.drop_server()
        self.engine.close()


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
