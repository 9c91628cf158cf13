"""The driver of bw.py: the sweep against one peer, a row per op, layout, page size and pages,
each with the baselines measured beside it."""
from __future__ import annotations

import collections
import functools
import statistics
import time

import torch

import torch_p2p as p2p
from _bw_buffers import count_bad_pages, fill, new_buffer, open_engine, poison
from _bw_peer import dist_store
from _bw_report import copy_threads, route_long, route_short
from _channel import Channel, PeerFailed
from _copies import BaselineUnavailable, measure_host_memcpy, measure_memcpy, measure_page_kernel
from _dist import dist_env, dist_init, dist_leave, dist_unavailable, measure_dist
from _peer_library import (PEER_LIBRARIES, PeerLibrary, PeerLibraryError, library_errors, local_address,
                           measure_peer_library, open_peer_library, page_descs, peer_library_unavailable)
from _progress import Progress
from _table import fmt_size
from _tcp import measure_tcp

CONTROL_TIMEOUT_S = 300.0  # longest wait for the peer's answer (checks of big buffers included)


class BaselineRefused(RuntimeError):
    """The peer cannot run the baseline (no CUDA, no NCCL): the run goes on without it."""


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
        self.libs: dict[str, PeerLibrary] = {}
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
        dist_leave()  # the dist baseline's group
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
            if why := peer_library_unavailable("nixl-libfabric", self.device):
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
                why = dist_unavailable(name, self.device, peer_device if self.loopback else None)
            if name in PEER_LIBRARIES:
                why = peer_library_unavailable(name, self.device)
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
                if name in PEER_LIBRARIES:
                    (nbytes, seconds), what = self._peer_library(name, op == "read", *moved)
                elif name == "kernel":
                    _, mine, theirs = moved
                    nbytes, seconds = measure_page_kernel(
                        call_bytes // pages, mine, theirs, op == "write", self.device,
                        torch.device(self.engine_facts["peer_device"]), self.args.duration)
                elif name == "memcpy" and self.device.type == "cpu":
                    buf, mine, theirs = moved
                    nbytes, seconds = measure_host_memcpy(buf, mine or list(range(len(buf))),
                                                                     theirs or list(range(len(buf))),
                                                                     self.args.duration)
                else:
                    measure = {"tcp": self._tcp, "memcpy": self._memcpy}.get(name, self._dist)
                    nbytes, seconds = measure(name, op == "read", call_bytes, streams, pages)
            except (BaselineRefused, BaselineUnavailable) as e:
                self.progress.say(f"skipping the {name} baseline: {e}")
                self.baselines.remove(name)
                return None
            except PeerLibraryError as e:  # this row only: the next may work
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
                host = local_address(self.peer_host or "127.0.0.1")
                self.libs[name] = open_peer_library(name, self.device, host)
            except (OSError, PeerLibraryError) as e:
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
            with library_errors():
                lib.register([buf])
                lib.connect(peer)
                if mine is None:
                    local, remote = [(buf.data_ptr(), buf.nbytes)], [(peer["address"], buf.nbytes)]
                else:
                    local = page_descs(buf.data_ptr(), buf.shape[1], mine)
                    remote = page_descs(peer["address"], buf.shape[1], theirs)
                if self.barrier:
                    self.barrier.wait(CONTROL_TIMEOUT_S)
                result = measure_peer_library(lib, read, local, remote, self.args.window,
                                                         self.args.duration)
        finally:
            with library_errors():
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
            raise PeerLibraryError(f"CORRUPT: {bad} of {buf.shape[0]} destination pages wrong "
                                              f"(first: page {first})")
        descs = len(local)
        return result, f"{lib.what}, {descs} descriptor{'s' * (descs > 1)}, window {self.args.window}"

    def _tcp(self, _name: str, peer_sends: bool, call_bytes: int, streams: int, _pages: int):
        chunk = max(1, call_bytes // streams)
        self.channel.send(cmd="tcp", streams=streams, chunk=chunk, send=peer_sends, seconds=self.args.duration)
        where = self.channel.reply("tcp")
        if self.barrier:
            self.barrier.wait(CONTROL_TIMEOUT_S)
        result = measure_tcp(where["host"], where["port"], streams, chunk, not peer_sends,
                                        self.args.duration)
        self.channel.reply("tcp")
        return result

    def _memcpy(self, _name: str, peer_sends: bool, call_bytes: int, _streams: int, _pages: int):
        peer = torch.device(self.engine_facts["peer_device"])
        return measure_memcpy(call_bytes, not peer_sends, self.device, peer, self.args.duration)

    def _dist(self, name: str, peer_sends: bool, call_bytes: int, _streams: int, pages: int):
        import torch.distributed as dist

        self.channel.send(cmd="dist", backend=name, nbytes=call_bytes, send=peer_sends,
                          store=self.dist_store, loopback=self.loopback, nvlink=self.args.nccl_nvlink, pages=pages)
        try:
            ready = self.channel.reply("dist")
        except PeerFailed as e:  # refused before anything started: the two sides are still in step
            raise BaselineRefused(str(e).splitlines()[0]) from None
        if not dist.is_initialized():
            dist_env(self.loopback, self.args.nccl_nvlink)
            store = dist_store(self.dist_store, self.shared_store, self.peer_host, ready.get("port"))
            dist_init(name, store, 0, self.device)
        if self.barrier:
            self.barrier.wait(CONTROL_TIMEOUT_S)
        result = measure_dist(call_bytes, not peer_sends, self.device, self.args.duration, pages)
        self.channel.reply("dist")
        return result
