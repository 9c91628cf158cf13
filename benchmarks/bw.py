"""bw.py: torch_p2p's bandwidth benchmark, write_slices / read_slices between two engines.

Quick start, one machine (spawns its peer process; loopback only):

    python benchmarks/bw.py

sweeps page size x pages per call, the three layouts, write and read, and prints a table on
stdout. On stderr a live line shows the row in progress (on a terminal; elsewhere, as in CI
logs, one line per finished row). Each row issues calls of `pages` views for --duration
seconds, keeping --window calls in flight, after a warm-up of about one window; then every
page of the destination is checked. A row whose data arrived wrong reports no bandwidth.
Exit status: 0, 1 if a row failed or was corrupt, 2 if the peer or the setup failed.

Layouts (each side owns one [pages, page_bytes] buffer):
  contiguous  one view of the whole buffer per call
  paged       `pages` pages per call, source pages taken in one random order and destination
              pages in another, as when a KV cache migrates between two block tables; given as
              p2p.pages(buffer, ids) on both sides
  views       the paged layout's pages as a list of views on each side, [buf[i] for i in mine]
              and [remote[j] for j in theirs] (built once per row), the form users write
              first; its "x paged" column is its Gbps over the paged row's
              (--page-views: views rows only, no paged rows)
With --prepared each row's call is checked once (engine.prepare_write / prepare_read) and every
call of the row is a run() of it: the host cost of calls that move the same views again.

Route: the engine's choice for the peer (engine.route): "ipc" between GPUs of one host (CUDA
IPC, no fabric), "cma" between host memory of one host (the peer's buffer is in shared memory
by default, which the route maps and copies with memcpy; with --host-memory private the kernel
copies between the two processes), else "direct" or "staged" over the provider; the table's
title names it.

Baselines (--baseline, one or several; by default memcpy on the ipc and cma routes and kernel on the ipc
route, else tcp where the
line rate is unknown: loopback, shm):
  tcp    plain TCP to the same peer address, one stream per rail, Python sockets
         (sendall / recv_into on preallocated buffers, one thread per stream)
  nccl   torch.distributed send/recv between the same two processes, GPU tensors (paged rows:
         batch_isend_irecv of the call's pages, at most 4096 per group: NCCL does not finish
         one group of 65,536); in local mode NCCL is held to its socket transport on lo
         (NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 NCCL_IB_DISABLE=1 NCCL_NET=Socket
         NCCL_SOCKET_IFNAME=lo, unless set), or with --nccl-nvlink left to its own choice
         (NVLink between GPUs of one host); it needs the peer on another GPU
  gloo   the same with gloo on CPU tensors
  kernel paged rows on GPUs: the call's pages moved by one plain copy kernel per call (Triton,
         one program per page) between the two GPUs in this process, through peer access:
         what a paged call could reach if it cost nothing but its kernel (auto on the ipc route)
  memcpy cudaMemcpyPeerAsync of the call's bytes as one block, GPU to GPU in this process
         (local mode): the ceiling of the same-host route; on host memory ("1-thread memcpy"),
         one memcpy per page of the row's pages on one thread of this process: one core's
         ceiling, while the cma route copies on several (the title and rows say how many)
  nixl   NIXL (pip install 'torch_p2p[nixl]') between the same buffers, the row's pages in the
         row's orders as one descriptor each, one transfer per call, --window in flight; UCX
         backend, plus a nixl-libfabric column (its LIBFABRIC backend) where libfabric >= 1.21
  mooncake  Mooncake Transfer Engine (pip install 'torch_p2p[mooncake]') the same way, one
         batch per call: tcp transport for host memory, nvlink_intra for GPU memory
  none
  The destination pages of nixl and mooncake are checked after their timed calls. A baseline
  whose package is missing or cannot run here is skipped with a one-line reason.

Examples:
  python benchmarks/bw.py --rails 1 2 4 8 --baseline tcp --provider tcp --device cpu
  python benchmarks/bw.py --device cuda:0 --baseline nccl          # peer on cuda:1
  python benchmarks/bw.py --baseline nccl --nccl-nvlink --sizes 4K 64K --pages 256 4096
  python benchmarks/bw.py --sizes 64K 1M --pages 256 --ops write --json bw.json --plot bw.png
  python benchmarks/bw.py --device cpu --provider shm --sizes 4K 64K --pages 256 --baseline nixl mooncake

Two machines, one process per GPU on each, each with its own engine and peer (the table
sums the GPUs, whose rows start together; the live line is the first GPU's):
  node B:  python benchmarks/bw.py --listen --gpus 8        # prints the ADDR for node A
  node A:  python benchmarks/bw.py --connect ADDR           # ADDR = HOST:PORT[,PORT...]
or under torchrun, whose first half of the ranks drive and second half serve (rank 0 prints;
on one node, as with --standalone, everything stays on loopback):
  torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29500 benchmarks/bw.py
The side channel (engine addresses, RemoteTensor bytes, commands) is JSON over TCP, or the
torchrun store; data moves only through the engines and the baselines.
"""
from __future__ import annotations

import argparse
import collections
import functools
import importlib.util
import ipaddress
import json
import multiprocessing as mp
import os
import queue
import socket
import statistics
import sys
import tempfile
import time
import traceback
import warnings

# torch warns at import (in every process) when NumPy is missing; nothing here uses NumPy, and
# the quick start does not install it.
warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
import torch  # noqa: E402

try:
    import torch_p2p as p2p
except ImportError:  # run from a checkout without installing: use the in-place build
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import torch_p2p as p2p

import _baselines
from _common import (Channel, PeerFailed, Progress, SocketChannel, StoreBarrier, StoreChannel, aligned,
                     exit_on_sigterm, fmt_rate, fmt_size, parse_size, reap, spawn)

CONTROL_TIMEOUT_S = 300.0  # longest wait for the peer's answer (checks of big buffers included)
LEGEND = """\
columns:
  MiB/call       bytes one call moves (pages x page size), in MiB
  Gbps           payload, 1e9 bits per second of the timed calls (time.perf_counter() around them)
  %line          Gbps / the rails' link speed, where the provider reports one (EFA, verbs); "-" on
                 loopback, shm and the same-host routes (ipc, cma), which have no line rate
  views/s        views per second (k = 1e3, M = 1e6): pages on paged and views rows, calls on
                 contiguous rows
  <b> Gbps       baseline <b> moving the same bytes per call, measured in this run
  ratio          Gbps / the baseline's Gbps to its left (above 1: torch_p2p is faster)
  x paged        a views row's Gbps / the paged row's of the same op, page size and pages: what a
                 list of views costs against p2p.pages()"""


# -- buffers --------------------------------------------------------------------------------------
# Word i (int64) of a source buffer holds seed + i, so every page differs from every other page
# and from any earlier row's; destinations start as all ones (-1 words).
def fill(buf: torch.Tensor, seed: int) -> None:
    flat = buf.view(torch.int64).view(-1)
    torch.arange(seed, seed + flat.numel(), dtype=torch.int64, device=buf.device, out=flat)
    _sync(buf.device)


def poison(buf: torch.Tensor) -> None:
    buf.fill_(0xFF)
    _sync(buf.device)


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


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def open_engine(device: torch.device, provider: str | None, rails: int | None, loopback: bool) -> p2p.Engine:
    """An engine as the benchmark uses it: on loopback an IP provider stays on "lo"."""
    domains = None
    if loopback:
        name = provider or os.environ.get("TORCH_P2P_PROVIDER") or ""
        resolved = p2p._C.list_nics(name, device.type == "cuda")[0]
        if resolved.split(";")[0] in ("tcp", "udp", "sockets"):
            domains = ["lo"]
    return p2p.Engine(device, provider, rails, domains=domains)


# -- side channel ---------------------------------------------------------------------------------
class BaselineRefused(RuntimeError):
    """The peer cannot run the baseline (no CUDA, no NCCL): the run goes on without it."""


def _dist_store(spec: dict, shared, host: str | None, port: int | None = None):
    """The store in which the dist baseline's two ranks meet: a file (both on one machine),
    torchrun's store, or a TCPStore that the peer hosts (port None) and the driver joins."""
    import torch.distributed as dist

    if spec["kind"] == "file":
        return dist.FileStore(spec["path"], 2)
    if spec["kind"] == "shared":
        return dist.PrefixStore(spec["prefix"], shared)
    return dist.TCPStore(host, port or 0, 2, is_master=port is None, wait_for_workers=False)


# -- the peer -------------------------------------------------------------------------------------
class Target:
    """The peer's side: an engine and one registered [pages, page_bytes] buffer that the driver
    writes into and reads from, plus the baselines' peer halves. One thread: it answers the
    driver's commands in order until "bye" or until the driver is gone."""

    def __init__(self, channel: Channel, device: torch.device, host: str | None, shared_store=None):
        self.channel, self.device, self.shared_store = channel, device, shared_store
        self.host = host or socket.getfqdn()  # where the driver reaches this process
        self.engine: p2p.Engine | None = None
        self.buf: torch.Tensor | None = None
        self.region = None
        self.listener: socket.socket | None = None
        self.libs: dict[str, _baselines.PeerLibrary] = {}

    def serve(self) -> None:
        try:
            while (msg := self.channel.recv()) is not None and msg["cmd"] != "bye":
                try:
                    self.channel.send(**(getattr(self, "do_" + msg.pop("cmd"))(**msg) or {}))
                except Exception as e:  # noqa: BLE001 - reported to the driver
                    self.channel.send(error=f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
        finally:
            self.libs.clear()
            self._close_engine()
            if self.listener:
                self.listener.close()
            import torch.distributed as dist

            if dist.is_available() and dist.is_initialized():
                dist.destroy_process_group()

    def _close_engine(self) -> None:
        if self.engine:
            self.engine.close()
        self.engine = self.buf = self.region = None

    def do_engine(self, provider, rails, loopback):
        self._close_engine()
        self.engine = open_engine(self.device, provider, rails, loopback)
        return {"address": self.engine.address, "device": str(self.device)}

    def do_buffer(self, pages, page_bytes, shared=False):
        if self.region:
            self.region.close()
            self.buf = self.region = None
        self.buf = new_buffer(pages, page_bytes, self.device, shared)
        self.region = self.engine.register(self.buf)
        return {"remote": self.region.remote.to_bytes()}

    def do_fill(self, seed):
        fill(self.buf, seed)

    def do_poison(self):
        poison(self.buf)

    def do_check(self, seed, src_order, dst_order):
        bad, first = count_bad_pages(self.buf, seed, src_order, dst_order)
        return {"bad": bad, "first": first}

    def do_tcp(self, streams, chunk, send, seconds):
        if self.listener is None:
            self.listener = _baselines.tcp_listen(self.host)
        self.channel.send(host=self.host, port=self.listener.getsockname()[1])
        return {"bytes": _baselines.serve_tcp(self.listener, streams, chunk, send, seconds)}

    def do_dist(self, backend, nbytes, send, store, loopback, nvlink, pages):
        import torch.distributed as dist

        if why := _baselines.dist_unavailable(backend, self.device):
            raise RuntimeError(why)  # before "ready": the driver goes on without the baseline
        if dist.is_initialized():
            self.channel.send()
        else:
            _baselines.dist_env(loopback, nvlink)
            meet = _dist_store(store, self.shared_store, self.host)
            self.channel.send(port=getattr(meet, "port", None))  # a TCPStore listens here
            _baselines.dist_init(backend, meet, 1, self.device)
        _baselines.serve_dist(nbytes, send, self.device, pages)

    def do_peer_library(self, name):
        """Registers the buffer with NIXL or Mooncake (opened once); says where it is."""
        if name not in self.libs:
            self.libs[name] = _baselines.open_peer_library(name, self.device, self.host)
        self.libs[name].register([self.buf])
        return dict(self.libs[name].address(), address=self.buf.data_ptr())

    def do_peer_library_done(self, name):
        self.libs[name].release()


def _serve_socket(sock: socket.socket, device: str, host: str) -> None:
    """Entry of a peer process that talks over a connected socket."""
    channel = SocketChannel(sock, None)
    try:
        Target(channel, torch.device(device), host).serve()
    finally:
        channel.close()


def _serve_listener(listener: socket.socket, device: str) -> None:
    """Entry of a --listen process: serves the first driver that connects, then exits."""
    conn, _ = listener.accept()
    listener.close()
    _serve_socket(conn, device, conn.getsockname()[0])


# -- the driver -----------------------------------------------------------------------------------
def pump(submit, window: int, stop, on_done=None) -> int:
    """Keeps up to `window` calls in flight until stop(issued, now); returns the number of
    calls completed. Whatever happens, nothing is in flight when it returns."""
    inflight: collections.deque = collections.deque()
    issued = done = 0
    try:
        while True:
            while len(inflight) < window and not stop(issued, time.perf_counter()):
                inflight.append(submit())
                issued += 1
            if not inflight:
                return done
            inflight.popleft().wait()
            done += 1
            if on_done:
                on_done()
    finally:
        for fut in inflight:  # after a failure: let the rest finish before buffers are reused
            try:
                fut.wait()
            except Exception:  # noqa: BLE001 - the first failure is the one reported
                pass


class Driver:
    """Runs the sweep against one peer over `channel` and returns one dict per row. In a
    multi-GPU run each GPU has its own Driver, engine and peer; `barrier` lines them up
    before every timed loop so that their rows run together."""

    def __init__(self, args, channel: Channel, device: torch.device, progress: Progress, *, loopback: bool,
                 dist_store: dict, peer_host: str | None = None, shared_store=None, barrier=None):
        self.args, self.channel, self.device, self.progress = args, channel, device, progress
        self.loopback, self.barrier = loopback, barrier
        self.dist_store, self.peer_host, self.shared_store = dist_store, peer_host, shared_store
        self.rng = torch.Generator().manual_seed(args.seed)
        self.seed = 0
        self.baselines = list(dict.fromkeys(b for b in args.baseline if b != "none"))
        self._baselines: dict[tuple, float | None] = {}
        self.libs: dict[str, _baselines.PeerLibrary] = {}
        self.engine_facts: dict = {}  # of the engine in use: provider, rails, line rate...
        self.rows: list[dict] = []

    def run(self) -> list[dict]:
        combos = [(s, p) for s in self.args.sizes for p in self.args.pages if s * p <= self.args.max_bytes]
        skipped = [f"{fmt_size(s)} x{p}" for s in self.args.sizes for p in self.args.pages if (s, p) not in combos]
        if skipped:
            limit = fmt_size(self.args.max_bytes)
            self.progress.say(f"skipping {', '.join(skipped)}: above --max-bytes {limit} per call")
        if self.args.first_contact:
            self.first_contact(self.args.first_contact)
        for rails in self.args.rails:
            peer = self.channel.ask("engine", provider=self.args.provider, rails=rails, loopback=self.loopback)
            engine = open_engine(self.device, self.args.provider, rails, self.loopback)
            try:
                engine.connect(peer["address"]).wait()
                self._describe(engine, peer["device"], peer["address"])
                for page_bytes, pages in combos:
                    self._buffer(engine, page_bytes, pages)
            finally:
                engine.close()
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():  # the dist baseline's group
            dist.destroy_process_group()
        return self.rows

    def first_contact(self, trials: int) -> None:
        """The first 4 KiB write to a new peer (new engines on both sides), cold and after
        engine.warm(), against the median of the writes after it; medians over `trials`."""
        times: dict[str, list[float]] = {"cold": [], "warmed": [], "steady": []}
        route = "?"

        def timed(fn) -> float:
            start = time.perf_counter()
            fn().wait()
            return (time.perf_counter() - start) * 1e6

        for _ in range(trials):
            for warm in (False, True):
                self.channel.ask("engine", provider=self.args.provider, rails=None, loopback=self.loopback)
                remote = p2p.RemoteTensor.from_bytes(self.channel.ask("buffer", pages=1, page_bytes=4096)["remote"])
                with open_engine(self.device, self.args.provider, None, self.loopback) as engine:
                    buf = torch.ones(1, 4096, dtype=torch.uint8, device=self.device)
                    engine.register(buf)
                    if warm:
                        engine.warm(remote).wait()
                    times["warmed" if warm else "cold"].append(timed(lambda: engine.write_slices([buf], [remote])))
                    if warm:
                        times["steady"].append(statistics.median(
                            timed(lambda: engine.write_slices([buf], [remote])) for _ in range(20)))
                    route = engine.route(remote)
        us = {k: statistics.median(v) for k, v in times.items()}
        self.progress.say(f"first 4 KiB write to a new peer (route {route}, median of {trials}): cold "
                          f"{us['cold']:.0f} us, after engine.warm() {us['warmed']:.0f} us, steady "
                          f"{us['steady']:.0f} us; warmed first / steady = {us['warmed'] / us['steady']:.2f}")

    def _describe(self, engine: p2p.Engine, peer_device: str, peer_address: bytes) -> None:
        line = p2p.topology.line_rate_bps(engine.plan.rails)
        route = engine.route(peer_address)
        if "auto" in self.baselines:
            auto = (["memcpy", "kernel"] if route == "ipc" else ["memcpy"] if route == "cma" else []
                    if line else ["tcp"])
            self.baselines = [b for b in self.baselines if b != "auto"] + auto
        if "nixl" in self.baselines and "nixl-libfabric" not in self.baselines:
            if why := _baselines.peer_library_unavailable("nixl-libfabric", self.device):
                self.progress.say(f"nixl: its LIBFABRIC backend is skipped: {why}")
            else:
                self.baselines.insert(self.baselines.index("nixl") + 1, "nixl-libfabric")
        for name in list(self.baselines):
            why = None
            if name == "memcpy" and not self.loopback:
                why = "it needs both sides on this host"
            elif name == "memcpy" and self.device.type == "cuda" and not peer_device.startswith("cuda"):
                why = "it needs GPUs on both sides, or host memory on both"
            if name in ("nccl", "gloo"):
                why = _baselines.dist_unavailable(name, self.device)
                if not why and name == "nccl" and self.loopback and peer_device == str(self.device):
                    why = "NCCL cannot pair two ranks on one GPU (give the peer another: --peer-device)"
            if name in _baselines.PEER_LIBRARIES:
                why = _baselines.peer_library_unavailable(name, self.device)
            if why:
                self.progress.say(f"skipping the {name} baseline: {why}")
                self.baselines.remove(name)
        domains = ",".join(dict.fromkeys(nic.domain for nic in engine.plan.rails))
        self.engine_facts = dict(provider=engine.provider, domains=domains, device=str(self.device),
                                 peer_device=peer_device, rails=len(engine.plan.rails), line_rate_bps=line,
                                 data_path=engine.data_path, route=route,
                                 copy_threads=copy_threads() if route == "cma" else None)
        # Said before the first row runs: what is measured, and why %line may stay empty.
        memory = f" ({self.args.host_memory} memory)" if self.device.type == "cpu" else ""
        self.progress.say(f"# {self.device}{memory} -> peer {peer_device}: {route_long(self.engine_facts)}; %line is "
                          + (f"of {line / 1e9:g} Gbps" if line else "'-': no link speed is known on this route"))

    def _buffer(self, engine: p2p.Engine, page_bytes: int, pages: int) -> None:
        shared = self.args.host_memory == "shared"
        reply = self.channel.ask("buffer", pages=pages, page_bytes=page_bytes, shared=shared)
        remote = p2p.RemoteTensor.from_bytes(reply["remote"])
        buf = new_buffer(pages, page_bytes, self.device, shared)
        with engine.register(buf):
            for layout in self.args.layouts:
                for op in self.args.ops:
                    self.rows.append(self._row(engine, buf, remote, op, layout))

    def _row(self, engine, buf: torch.Tensor, remote: p2p.RemoteTensor, op: str, layout: str) -> dict:
        pages, page_bytes = buf.shape
        facts = self.engine_facts
        rails = facts["rails"]
        row = dict(op=op, layout=layout, page_bytes=page_bytes, pages=pages, **facts, window=self.args.window,
                   prepared=self.args.prepared,
                   gpus=1, gbps=None, mops=None, seconds=None, bytes=None, calls=None, views=None,
                   baseline=None, baseline_gbps=None, ratio=None, baselines={}, ratios={}, ok=False, error=None)
        label = f"{op.upper()} {layout} {fmt_size(page_bytes)} x{pages}, {route_short(facts)}"
        call_bytes = pages * page_bytes
        paged = layout in ("paged", "views")
        if paged:
            mine = torch.randperm(pages, generator=self.rng).tolist()
            theirs = torch.randperm(pages, generator=self.rng).tolist()
            if layout == "views":
                views, remotes = [buf[i] for i in mine], [remote[j] for j in theirs]
            else:
                views, remotes = [p2p.pages(buf, mine)], [p2p.pages(remote, theirs)]
        else:
            mine = theirs = list(range(pages))
            views, remotes = [buf], [remote]
        for name in list(self.baselines):
            if name == "kernel" and not (paged and self.device.type == "cuda"):
                continue  # a paged row's baseline
            host_memcpy = name == "memcpy" and self.device.type == "cpu"
            split = pages if paged and (name not in ("tcp", "memcpy") or host_memcpy) else 1
            moved = (buf, mine, theirs) if split > 1 or host_memcpy else (buf, None, None)
            row["baselines"][name] = self._baseline_gbps(name, op, call_bytes, rails, label, split, moved)
        if (first := next(iter(row["baselines"].items()), None)) and first[1]:
            row.update(baseline=first[0], baseline_gbps=first[1])
        self.seed += 1
        seed = self.seed << 40  # disjoint from every other row's words
        write = op == "write"
        self.progress.begin(label, self.args.duration, facts["line_rate_bps"], "preparing buffers")
        if write:
            fill(buf, seed)
            self.channel.ask("poison")
        else:
            self.channel.ask("fill", seed=seed)
            poison(buf)
        if self.args.prepared:
            move = (engine.prepare_write if write else engine.prepare_read)(views, remotes).run
        else:
            move = functools.partial(engine.write_slices if write else engine.read_slices, views, remotes)

        issued = [0.0]
        latencies: list[float] = []  # with --window 1: call to completion, seconds

        def submit():
            issued[0] = time.perf_counter()
            return move()

        per_call = len(mine) if paged else 1

        def counted():
            self.progress.add(per_call, call_bytes)
            if self.args.window == 1:
                latencies.append(time.perf_counter() - issued[0])

        try:
            self.progress.status = "warming up"
            t = time.perf_counter()
            pump(submit, self.args.window,
                 lambda n, now: n >= 1 and (n >= self.args.window or now - t >= self.args.duration / 5))
            if self.barrier:
                self.progress.status = "waiting for the other GPUs"
                self.barrier.wait(CONTROL_TIMEOUT_S)
            self.progress.timing()
            t0 = time.perf_counter()
            end = t0 + self.args.duration
            calls = pump(submit, self.args.window, lambda n, now: now >= end, counted)
            seconds = time.perf_counter() - t0
        except p2p.P2PError as e:
            row["error"] = f"{type(e).__name__}: {e}"
            self.progress.end(text=f"FAILED: {row['error']}")
            return row
        src, dst = (mine, theirs) if write else (theirs, mine)
        if write:
            found = self.channel.ask("check", seed=seed, src_order=src, dst_order=dst)
            bad, first = found["bad"], found["first"]
        else:
            bad, first = count_bad_pages(buf, seed, src, dst)
        if bad:
            row["error"] = f"CORRUPT: {bad} of {pages} destination pages wrong (first: page {first})"
            self.progress.end(text=row["error"])
            return row
        nbytes = calls * call_bytes
        row.update(ok=True, seconds=seconds, bytes=nbytes, calls=calls, views=calls * per_call,
                   gbps=nbytes * 8 / seconds / 1e9, mops=calls * per_call / seconds / 1e6)
        row["ratios"] = {name: row["gbps"] / base if base else None for name, base in row["baselines"].items()}
        if row["baseline_gbps"]:
            row["ratio"] = row["gbps"] / row["baseline_gbps"]
        if latencies:
            latencies.sort()
            row.update(latency_p50_us=1e6 * latencies[len(latencies) // 2],
                       latency_p99_us=1e6 * latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))])
        self.progress.end(seconds)
        return row

    def _baseline_gbps(self, name: str, op: str, call_bytes: int, rails: int, label: str, pages: int,
                       moved: tuple) -> float | None:
        """Baseline `name`'s Gbps for calls of `call_bytes` (in `pages` pieces) in the direction
        of `op`, measured the first time it is asked for (tcp: for each number of streams too).
        `moved`: (buffer, its pages, the peer's pages) for the peer libraries (None: whole)."""
        streams = rails if name == "tcp" else 1
        key = (name, op, call_bytes, streams, pages)
        if key not in self._baselines:
            self.progress.begin(label, self.args.duration, None, f"measuring the {name} baseline")
            what = (f"{streams} stream{'s' * (streams > 1)}" if name == "tcp" else f"{pages} pages, one thread"
                    if name == "memcpy" and self.device.type == "cpu" else "one block"
                    if name == "memcpy" else f"{pages} pages" if pages > 1 else "send/recv")
            try:
                if name in _baselines.PEER_LIBRARIES:
                    (nbytes, seconds), what = self._peer_library(name, op == "read", *moved)
                elif name == "kernel":
                    _, mine, theirs = moved
                    nbytes, seconds = _baselines.measure_page_kernel(
                        call_bytes // pages, mine, theirs, op == "write", self.device,
                        torch.device(self.engine_facts["peer_device"]), self.args.duration)
                elif name == "memcpy" and self.device.type == "cpu":
                    buf, mine, theirs = moved
                    nbytes, seconds = _baselines.measure_host_memcpy(buf, mine or list(range(len(buf))),
                                                                     theirs or list(range(len(buf))),
                                                                     self.args.duration)
                else:
                    measure = {"tcp": self._tcp, "memcpy": self._memcpy}.get(name, self._dist)
                    nbytes, seconds = measure(name, op == "read", call_bytes, streams, pages)
            except (BaselineRefused, _baselines.BaselineUnavailable) as e:
                self.progress.say(f"skipping the {name} baseline: {e}")
                self.baselines.remove(name)
                return None
            except _baselines.PeerLibraryError as e:  # this row only: the next may work
                self.progress.end(text=f"{name} baseline FAILED: {e}")
                self._baselines[key] = None
                return None
            self._baselines[key] = nbytes * 8 / seconds / 1e9
            self.progress.end(text=f"{name} baseline ({what}, {fmt_size(call_bytes)} per call): "
                                   f"bw={self._baselines[key]:.3f}Gbps")
        return self._baselines[key]

    def _peer_library(self, name: str, read: bool, buf: torch.Tensor, mine: list | None, theirs: list | None):
        """NIXL or Mooncake between this row's buffer and the peer's, the row's pages (None:
        the whole buffer as one descriptor); the destination checked afterwards."""
        if name not in self.libs:
            try:
                host = _baselines.local_address(self.peer_host or "127.0.0.1")
                self.libs[name] = _baselines.open_peer_library(name, self.device, host)
            except (OSError, _baselines.PeerLibraryError) as e:
                raise BaselineRefused(str(e)) from None
        lib = self.libs[name]
        try:
            peer = self.channel.ask("peer_library", name=name)
        except PeerFailed as e:  # refused before anything started: the two sides are still in step
            raise BaselineRefused(str(e).splitlines()[0]) from None
        self.seed += 1
        seed = self.seed << 40
        try:
            if read:
                self.channel.ask("fill", seed=seed)
                poison(buf)
            else:
                fill(buf, seed)
                self.channel.ask("poison")
            with _baselines.library_errors():
                lib.register([buf])
                lib.connect(peer)
                if mine is None:
                    local, remote = [(buf.data_ptr(), buf.nbytes)], [(peer["address"], buf.nbytes)]
                else:
                    local = _baselines.page_descs(buf.data_ptr(), buf.shape[1], mine)
                    remote = _baselines.page_descs(peer["address"], buf.shape[1], theirs)
                if self.barrier:
                    self.barrier.wait(CONTROL_TIMEOUT_S)
                result = _baselines.measure_peer_library(lib, read, local, remote, self.args.window,
                                                         self.args.duration)
        finally:
            with _baselines.library_errors():
                lib.release()
            self.channel.ask("peer_library_done", name=name)
        if mine is None:
            mine = theirs = list(range(buf.shape[0]))
        src, dst = (theirs, mine) if read else (mine, theirs)
        if read:
            bad, first = count_bad_pages(buf, seed, src, dst)
        else:
            found = self.channel.ask("check", seed=seed, src_order=src, dst_order=dst)
            bad, first = found["bad"], found["first"]
        if bad:
            raise _baselines.PeerLibraryError(f"CORRUPT: {bad} of {buf.shape[0]} destination pages wrong "
                                              f"(first: page {first})")
        descs = len(local)
        return result, f"{lib.what}, {descs} descriptor{'s' * (descs > 1)}, window {self.args.window}"

    def _tcp(self, _name: str, peer_sends: bool, call_bytes: int, streams: int, _pages: int):
        chunk = max(1, call_bytes // streams)
        self.channel.send(cmd="tcp", streams=streams, chunk=chunk, send=peer_sends, seconds=self.args.duration)
        where = self.channel.reply("tcp")
        if self.barrier:
            self.barrier.wait(CONTROL_TIMEOUT_S)
        result = _baselines.measure_tcp(where["host"], where["port"], streams, chunk, not peer_sends,
                                        self.args.duration)
        self.channel.reply("tcp")
        return result

    def _memcpy(self, _name: str, peer_sends: bool, call_bytes: int, _streams: int, _pages: int):
        peer = torch.device(self.engine_facts["peer_device"])
        return _baselines.measure_memcpy(call_bytes, not peer_sends, self.device, peer, self.args.duration)

    def _dist(self, name: str, peer_sends: bool, call_bytes: int, _streams: int, pages: int):
        import torch.distributed as dist

        self.channel.send(cmd="dist", backend=name, nbytes=call_bytes, send=peer_sends,
                          store=self.dist_store, loopback=self.loopback, nvlink=self.args.nccl_nvlink, pages=pages)
        try:
            ready = self.channel.reply("dist")
        except PeerFailed as e:  # refused before anything started: the two sides are still in step
            raise BaselineRefused(str(e).splitlines()[0]) from None
        if not dist.is_initialized():
            _baselines.dist_env(self.loopback, self.args.nccl_nvlink)
            store = _dist_store(self.dist_store, self.shared_store, self.peer_host, ready.get("port"))
            _baselines.dist_init(name, store, 0, self.device)
        if self.barrier:
            self.barrier.wait(CONTROL_TIMEOUT_S)
        result = _baselines.measure_dist(call_bytes, not peer_sends, self.device, self.args.duration, pages)
        self.channel.reply("dist")
        return result


# -- results ---------------------------------------------------------------------------------------
def merge(per_gpu: list[list[dict]]) -> list[dict]:
    """One row per row index over the GPUs of a multi-GPU run: bandwidths and counts add up
    (the rows ran together); a row is ok only if it is ok on every GPU."""
    if len(per_gpu) == 1:
        return per_gpu[0]
    merged = []
    for rows in zip(*per_gpu):
        row = dict(rows[0], gpus=len(rows), device=",".join(r["device"] for r in rows),
                   peer_device=",".join(r["peer_device"] for r in rows),
                   ok=all(r["ok"] for r in rows), error="; ".join(r["error"] for r in rows if r["error"]) or None)
        for key in ("gbps", "mops", "bytes", "calls", "views", "baseline_gbps", "line_rate_bps"):
            values = [r[key] for r in rows]
            row[key] = sum(values) if None not in values else None
        row["seconds"] = max(r["seconds"] or 0 for r in rows) or None
        if not row["ok"]:
            row.update(gbps=None, mops=None)
        row["ratio"] = row["gbps"] / row["baseline_gbps"] if row["gbps"] and row["baseline_gbps"] else None
        row["baselines"] = {}
        for name in rows[0]["baselines"]:
            values = [r["baselines"].get(name) for r in rows]
            row["baselines"][name] = sum(values) if all(values) else None
        row["ratios"] = {name: row["gbps"] / base if row["gbps"] and base else None
                         for name, base in row["baselines"].items()}
        merged.append(row)
    return merged


def table(rows: list[dict]) -> str:
    head = ["op", "layout", "page", "pages", "rails", "MiB/call", "Gbps", "%line", "views/s"]
    names = list(dict.fromkeys(name for r in rows for name in r["baselines"]))
    host = rows[0]["device"].startswith("cpu")
    for name in names:
        head += [f"{'1-thread memcpy' if name == 'memcpy' and host else name} Gbps", "ratio"]
    paged = {(r["op"], r["page_bytes"], r["pages"], r["rails"]): r["gbps"] for r in rows if r["layout"] == "paged"}
    beside = any(r["layout"] == "views" for r in rows) and paged
    if beside:
        head.append("x paged")
    lines = [head]
    for r in rows:
        cells = [r["op"], r["layout"], fmt_size(r["page_bytes"]), str(r["pages"]), str(r["rails"]),
                 f"{r['pages'] * r['page_bytes'] / (1 << 20):.2f}"]
        if r["ok"]:
            line = r["line_rate_bps"]
            cells += [f"{r['gbps']:.3f}", f"{100 * r['gbps'] * 1e9 / line:.1f}" if line else "-", fmt_rate(r['mops'] * 1e6, "")]
        else:
            cells += ["CORRUPT" if (r["error"] or "").startswith("CORRUPT") else "FAILED", "-", "-"]
        for name in names:
            base, ratio = r["baselines"].get(name), r["ratios"].get(name)
            cells += [f"{base:.3f}" if base else "-", f"{ratio:.2f}" if ratio else "-"]
        if beside:
            ref = paged.get((r["op"], r["page_bytes"], r["pages"], r["rails"]))
            cells.append(f"{r['gbps'] / ref:.2f}" if r["layout"] == "views" and r["gbps"] and ref else "-")
        lines.append(cells)
    return aligned(lines, 2)


def summary(args, rows: list[dict]) -> str:
    r = rows[0]
    gpus = f", {r['gpus']} process pairs summed" if r["gpus"] > 1 else ""
    return (f"# torch_p2p bw: {r['device']} -> peer {r['peer_device']}, {route_long(r)}{gpus}, "
            f"window {args.window}{', prepared calls' if args.prepared else ''}, {args.duration:g} s per row")


def copy_threads() -> int:
    """The cma route's copy threads in this process (csrc/core/copies.cpp names them)."""
    names = []
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/comm") as f:
                names.append(f.read().strip())
        except FileNotFoundError:  # a thread that ended meanwhile
            pass
    return names.count("p2p-copy")


def _threads(n: int) -> str:
    return f"{n} copy thread{'s' * (n != 1)}" if n else "copied by the worker thread"


def route_short(facts: dict) -> str:
    """The route in a row's live line: what carries the bytes."""
    if facts["route"] == "ipc":
        return "ipc"
    if facts["route"] == "cma":
        return f"cma, {_threads(facts['copy_threads'])}"
    rails = facts["rails"]
    return f"{facts['provider'].split(';')[0]} {facts['route']}, {rails} rail{'s' * (rails > 1)}"


def route_long(facts: dict) -> str:
    """The route in a title: the same-host routes name no provider, the fabric names no copy threads."""
    if facts["route"] == "ipc":
        return "route ipc (CUDA IPC: the GPUs' copy engines, no fabric)"
    if facts["route"] == "cma":
        return f"route cma (host memory copied between the processes, {_threads(facts['copy_threads'])}; no fabric)"
    how = "the NIC reads and writes the memory" if facts["route"] == "direct" else "through pinned host slots"
    return f"route {facts['route']} over {facts['provider']} [{facts['domains']}] ({how})"


def plot(rows: list[dict], path: str, title: str) -> None:
    """Gbps against page size: one panel per pages-per-call, one line per rails/layout/op,
    the baseline dotted."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    counts = sorted({r["pages"] for r in rows})
    fig, axes = plt.subplots(1, len(counts), figsize=(6 * len(counts), 4.5), squeeze=False, sharey=True)
    for ax, pages in zip(axes[0], counts):
        lines: dict[tuple, dict] = collections.defaultdict(dict)  # (name, rails, style) -> {x: y}
        for r in rows:
            if r["pages"] != pages:
                continue
            if r["gbps"] is not None:
                lines[(f"{r['op']} {r['layout']}", r["rails"], "-")][r["page_bytes"]] = r["gbps"]
            for name, base in r["baselines"].items():
                if base:
                    lines[(f"{r['op']} {r['layout']} {name}", r["rails"], ":")][r["page_bytes"]] = base
        for (name, rails, style), points in sorted(lines.items()):
            xs, ys = zip(*sorted(points.items()))
            ax.plot(xs, ys, style, marker="o", label=f"{name}, {rails} rail{'s' * (rails > 1)}")
        sizes = sorted({r["page_bytes"] for r in rows})
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, [fmt_size(x) for x in sizes])
        ax.set(title=f"{pages} pages per call", xlabel="page size", ylabel="Gbps")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=8)
    fig.savefig(path, dpi=120, bbox_inches="tight")


SMALL_CALL_BYTES = 1 << 20  # calls up to this size can be bound by the engine's cost per call


def small_call_note(args, rows: list[dict]) -> str | None:
    """Why rows of small calls fall far below the memcpy baseline: each call pays the engine's
    fixed cost (the Python call and its checks; unless the calling thread copies it, a mapped
    host call of at most TORCH_P2P_CMA_INLINE bytes, the hand-off to the worker thread and the
    future's completion), which a memcpy loop does not, and with few bytes a call that cost outweighs the copy. Says
    so with the row's own numbers: the time per call against the baseline's time for its bytes."""
    slow = [r for r in rows if r["ok"] and r["pages"] * r["page_bytes"] <= SMALL_CALL_BYTES
            and r["baselines"].get("memcpy") and r["ratios"].get("memcpy") is not None
            and r["ratios"]["memcpy"] < 0.5]
    if not slow:
        return None
    worst = min(slow, key=lambda r: r["ratios"]["memcpy"])
    call_bytes = worst["pages"] * worst["page_bytes"]
    per_call_us = 1e6 * worst["seconds"] / worst["calls"]
    copy_us = 1e6 * call_bytes * 8 / (worst["baselines"]["memcpy"] * 1e9)
    return (f"note: {len(slow)} row(s) of at most {fmt_size(SMALL_CALL_BYTES)} a call are under 0.5 x memcpy, e.g. "
            f"{worst['op']} {worst['layout']} {fmt_size(worst['page_bytes'])} x{worst['pages']}: "
            f"{per_call_us:.1f} us a call ({args.window} in flight) where memcpy copies its "
            f"{fmt_size(call_bytes)} in {copy_us:.1f} us. Such calls pay the engine's fixed cost per call (the "
            f"Python call and its checks, and where the calling thread does not copy them, the hand-off to the "
            f"worker thread and the future's completion), which a memcpy loop does not: their ratio measures that cost, not the copy (docs/performance.md).")


def report(args, rows: list[dict]) -> int:
    """Table on stdout, then --json and --plot; the exit status: 1 if a row failed."""
    if not rows:
        print("no rows: every size x pages combination is above --max-bytes", file=sys.stderr)
        return 1
    title = summary(args, rows)
    print(title)
    print(table(rows))
    print(LEGEND)
    failed = [r for r in rows if not r["ok"]]
    for r in failed:
        print(f"! {r['op']} {r['layout']} {fmt_size(r['page_bytes'])} x{r['pages']}, {r['rails']} rails: {r['error']}")
    small = small_call_note(args, rows)
    if small:
        print(small)
    for r in rows:
        if r.get("latency_p50_us") is not None:
            print(f"latency {r['op']} {r['layout']} {fmt_size(r['page_bytes'])} x{r['pages']}: "
                  f"median {r['latency_p50_us']:.1f} us, p99 {r['latency_p99_us']:.1f} us (call to completion)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    if args.plot:
        plot(rows, args.plot, title)
    return 1 if failed else 0


# -- modes ------------------------------------------------------------------------------------------
def device_for(base: str, i: int) -> torch.device:
    """The device of the i-th process of a multi-GPU run: cuda:(N + i) from --device cuda:N."""
    dev = torch.device(base)
    return torch.device("cuda", (dev.index or 0) + i) if dev.type == "cuda" else dev


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
    except (OSError, ValueError):
        return False


def drive(args, sock: socket.socket, host: str, device: str, progress: Progress, barrier=None) -> list[dict]:
    """Runs the sweep over `sock`, connected to a peer at `host`; says bye at the end."""
    loopback = is_loopback(host)
    channel = SocketChannel(sock, CONTROL_TIMEOUT_S)
    try:
        with tempfile.TemporaryDirectory(prefix="bw-") as tmp:
            # A FileStore needs both ranks on one machine; elsewhere the peer hosts a TCPStore.
            store = {"kind": "file", "path": os.path.join(tmp, "dist-store")} if loopback else {"kind": "tcp"}
            rows = Driver(args, channel, torch.device(device), progress, loopback=loopback, dist_store=store,
                          peer_host=host, barrier=barrier).run()
            channel.send(cmd="bye")
            return rows
    finally:
        channel.close()


def run_local(args) -> int:
    """The default: a spawned peer process on this machine, talking over a socket pair."""
    device = torch.device(args.device)
    if args.peer_device:
        peer_device = args.peer_device
    elif device.type == "cuda":  # another GPU where there is one, as a migration would
        peer_device = f"cuda:{(device.index + 1) % torch.cuda.device_count()}"
    else:
        peer_device = "cpu"
    mine, theirs = socket.socketpair()
    proc = spawn(_serve_socket, (theirs, peer_device, "127.0.0.1"), "bw-peer")
    theirs.close()
    try:
        rows = drive(args, mine, "127.0.0.1", args.device, Progress())
    finally:
        reap([proc])
    return report(args, rows)


def run_listen(args) -> int:
    """--listen: serves as the peer of a --connect run, one process per GPU, one port each."""
    host, _, port = args.listen.rpartition(":") if ":" in args.listen else (args.listen, "", "0")
    host, port = host or "0.0.0.0", int(port or 0)
    listeners = [socket.create_server((host, port + i if port else 0)) for i in range(args.gpus)]
    shown = socket.getfqdn() if host in ("0.0.0.0", "::") else host
    addr = f"{shown}:{','.join(str(s.getsockname()[1]) for s in listeners)}"
    print(f"listening on {addr}; on the other node run: python benchmarks/bw.py --connect {addr}", flush=True)
    devices = [str(device_for(args.device, i)) for i in range(args.gpus)]
    if args.gpus == 1:
        _serve_listener(listeners[0], devices[0])
        return 0
    procs = [spawn(_serve_listener, (s, d), f"bw-peer{i}") for i, (s, d) in enumerate(zip(listeners, devices))]
    for s in listeners:
        s.close()
    try:
        for p in procs:
            p.join()
    finally:
        reap(procs)
    return max(p.exitcode or 0 for p in procs)


def _drive_worker(args, host: str, port: int, rank: int, barrier, results) -> None:
    """Entry of the i-th driver process of a multi-GPU --connect run."""
    try:
        sock = socket.create_connection((host, port), timeout=CONTROL_TIMEOUT_S)
        rows = drive(args, sock, host, str(device_for(args.device, rank)), Progress(rank == 0), barrier)
        results.put((rank, rows, None))
    except BaseException as e:  # noqa: BLE001 - reported by the parent
        barrier.abort()
        results.put((rank, None, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))


def run_connect(args) -> int:
    """--connect HOST:PORT[,PORT...]: drives the peers that --listen started, one per port."""
    host, _, ports_text = args.connect.rpartition(":")
    ports = [int(p) for p in ports_text.split(",")]
    if args.gpus not in (None, len(ports)):
        sys.exit(f"--gpus {args.gpus} but {args.connect} names {len(ports)} ports: one per GPU")
    if len(ports) == 1:
        sock = socket.create_connection((host, ports[0]), timeout=CONTROL_TIMEOUT_S)
        return report(args, drive(args, sock, host, args.device, Progress()))
    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(len(ports)), ctx.Queue()
    procs = [spawn(_drive_worker, (args, host, port, i, barrier, results), f"bw-driver{i}")
             for i, port in enumerate(ports)]
    per_gpu: list = [None] * len(ports)
    answered = 0
    try:
        while answered < len(procs):
            try:
                rank, rows, error = results.get(timeout=1)
            except queue.Empty:
                if any(p.is_alive() for p in procs):
                    continue
                break  # a driver died without a word (the others' barrier waits end in time)
            answered += 1
            per_gpu[rank] = rows
            if error:
                print(f"driver {rank} failed: {error}", file=sys.stderr)
    finally:
        reap(procs)
    if None in per_gpu:
        return 1
    return report(args, merge(per_gpu))


def run_torchrun(args) -> int:
    """Under torchrun: ranks [0, W/2) drive, rank r + W/2 serves rank r; rank 0 reports."""
    import torch.distributed as dist

    store, rank, world = next(dist.rendezvous("env://"))
    if world % 2:
        sys.exit(f"bw.py under torchrun pairs ranks: WORLD_SIZE must be even, not {world}")
    half, pair = world // 2, rank % (world // 2)
    device = device_for(args.device, int(os.environ.get("LOCAL_RANK", 0)))
    loopback = int(os.environ.get("LOCAL_WORLD_SIZE", 0)) == world  # one node: keep to loopback
    pair_store = dist.PrefixStore(f"bw/pair{pair}", store)
    if rank >= half:
        channel = StoreChannel(pair_store, "peer", "driver")
        Target(channel, device, "127.0.0.1" if loopback else None, shared_store=store).serve()
        return 0
    channel = StoreChannel(pair_store, "driver", "peer")
    rows = Driver(args, channel, device, Progress(rank == 0), loopback=loopback,
                  dist_store={"kind": "shared", "prefix": f"bw/dist{pair}"}, shared_store=store,
                  barrier=StoreBarrier(dist.PrefixStore("bw/barrier", store), half)).run()
    channel.send(cmd="bye")
    store.set(f"bw/rows/{rank}", json.dumps(rows))
    if rank:
        return 0
    return report(args, merge([json.loads(store.get(f"bw/rows/{r}")) for r in range(half)]))


def new_buffer(pages: int, page_bytes: int, device: torch.device, shared: bool) -> torch.Tensor:
    """One side's [pages, page_bytes] buffer; host memory in shared memory if `shared`."""
    buf = torch.empty(pages, page_bytes, dtype=torch.uint8, device=device)
    return buf.share_memory_() if shared and buf.device.type == "cpu" else buf


# -- command line -----------------------------------------------------------------------------------
def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, epilog=LEGEND, formatter_class=argparse.RawDescriptionHelpFormatter)
    default_device = "cuda:0" if torch.cuda.is_available() else "cpu"
    ap.add_argument("--sizes", nargs="+", type=parse_size, default=[4 << 10, 64 << 10, 1 << 20, 16 << 20],
                    metavar="SIZE", help="page sizes, e.g. 4K 64K 1M 16M (default); multiples of 8 bytes")
    ap.add_argument("--pages", nargs="+", type=int, default=[16, 256], metavar="N",
                    help="pages (views) per call (default: 16 256)")
    ap.add_argument("--max-bytes", type=parse_size, default=256 << 20, metavar="SIZE",
                    help="skip size x pages above this many bytes per call (default 256M)")
    ap.add_argument("--layouts", nargs="+", choices=["contiguous", "paged", "views"],
                    default=["contiguous", "paged", "views"])
    ap.add_argument("--ops", nargs="+", choices=["write", "read"], default=["write", "read"])
    ap.add_argument("--rails", nargs="+", type=int, default=[None], metavar="N",
                    help="rails (NICs, or domains on one NIC) per engine; several values sweep them "
                         "(default: the engine's choice)")
    ap.add_argument("--provider", default=None,
                    help="libfabric provider (default: the engine's: efa, verbs, then tcp; on loopback tcp "
                         "uses the 'lo' domain)")
    ap.add_argument("--device", default=default_device, help=f"this side's device (default {default_device})")
    ap.add_argument("--peer-device", default=None,
                    help="local mode: the peer's device (default: the next GPU, or cpu)")
    ap.add_argument("--host-memory", choices=["shared", "private"], default="shared",
                    help="host buffers in shared memory (share_memory_(), default: the cma route maps the "
                         "peer's and copies with memcpy) or private (the kernel copies between the processes)")
    ap.add_argument("--duration", type=float, default=0.5, metavar="S",
                    help="timed seconds per row (default 0.5)")
    ap.add_argument("--window", type=int, default=4, metavar="N",
                    help="calls in flight (default 4); 1 also reports each call's latency (median, p99)")
    ap.add_argument("--baseline", nargs="+", default=["auto"],
                    choices=["auto", "tcp", "nccl", "gloo", "memcpy", "kernel", *_baselines.PEER_LIBRARIES, "none"],
                    help="measured beside the engine, a Gbps and ratio column each (default auto: memcpy on "
                         "the ipc route, tcp when the line rate is unknown, else none)")
    ap.add_argument("--nccl-nvlink", action="store_true",
                    help="local mode: let NCCL use NVLink / shared memory instead of holding it to sockets")
    ap.add_argument("--page-views", action="store_true",
                    help="views rows instead of paged rows (one view per page instead of p2p.pages())")
    ap.add_argument("--prepared", action="store_true",
                    help="prepare each row's call once (engine.prepare_write / prepare_read) and run it "
                         "again and again, instead of one write_slices / read_slices per call")
    ap.add_argument("--first-contact", type=int, default=3, metavar="N",
                    help="before the sweep, time the first 4 KiB write to a new peer, cold and after "
                         "engine.warm(), against the steady state; median of N trials (0: skip)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the paged layouts' page orders")
    ap.add_argument("--json", metavar="PATH", help="write the rows as a JSON list")
    ap.add_argument("--plot", metavar="PATH", help="plot Gbps against page size (needs matplotlib)")
    ap.add_argument("--listen", nargs="?", const="0.0.0.0:0", metavar="[HOST][:PORT]",
                    help="serve as the peer of a --connect run on another node (default: all addresses, "
                         "free ports); prints the ADDR to connect to")
    ap.add_argument("--connect", metavar="ADDR", help="drive the peers of a --listen run: HOST:PORT[,PORT...]")
    ap.add_argument("--gpus", type=int, default=None, metavar="N",
                    help="with --listen / --connect: processes, one per GPU from --device on (default: 1 / "
                         "one per port of ADDR)")
    args = ap.parse_args(argv)
    if any(s % 8 for s in args.sizes):
        ap.error("page sizes must be multiples of 8 bytes")
    if min(args.pages) < 1 or args.window < 1 or args.duration <= 0:
        ap.error("--pages and --window must be >= 1 and --duration > 0")
    if any(r is not None and r < 1 for r in args.rails):
        ap.error("--rails must be >= 1")
    if args.listen is not None and args.connect:
        ap.error("--listen and --connect exclude each other")
    if args.gpus is not None and args.listen is None and not args.connect:
        ap.error("--gpus needs --listen or --connect")
    if args.listen is not None:
        args.gpus = args.gpus or 1
    for name in ("device", "peer_device"):
        dev = getattr(args, name) and torch.device(getattr(args, name))
        if dev and dev.type == "cuda":
            if not torch.cuda.is_available():
                ap.error(f"--{name.replace('_', '-')} {dev} but CUDA is not available here")
            setattr(args, name, str(torch.device("cuda", dev.index or 0)))
    if args.page_views:
        args.layouts = list(dict.fromkeys("views" if layout == "paged" else layout for layout in args.layouts))
    if args.plot and importlib.util.find_spec("matplotlib") is None:  # now, not after the sweep
        ap.error("--plot needs matplotlib: pip install matplotlib")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        if args.listen is not None:
            return run_listen(args)
        if args.connect:
            return run_connect(args)
        if int(os.environ.get("WORLD_SIZE", "1")) > 1 and "MASTER_ADDR" in os.environ:
            return run_torchrun(args)
        return run_local(args)
    except (PeerFailed, p2p.P2PError) as e:  # the message names the call; the peer's carries its traceback
        print(f"bw.py: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    exit_on_sigterm()
    sys.exit(main())
