"""The client of remote_gpu.py: its host arrays and their check, one run of each kind (local,
remote), rounds of checked runs, and its engine beside the server process."""
from __future__ import annotations

import json
import math
import statistics
import sys
import time

import torch

import torch_p2p as p2p
from _remote_gpu_server import ServerError, ServerProcess, timed_sum
from _timing import sync

SAMPLE = 4096  # random indices checked per run above --check-all
FIELDS = ["input", "ops", "gpu", "output", "latency"]
_T0 = time.perf_counter()


class WrongResult(RuntimeError):
    """c differs from a + b: the run's time must not be reported."""


def progress(text: str) -> None:
    print(f"[{time.perf_counter() - _T0:7.1f}s] {text}", file=sys.stderr, flush=True)


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
