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
import dataclasses
import importlib.util
import json
import math
import os
import statistics
import sys
import tempfile
import time
import traceback

import torch

try:
    import torch_p2p as p2p
except ImportError:  # run from a checkout without installing: use the in-place build
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import torch_p2p as p2p
from torch_p2p import kv

import _baselines
from _common import Progress, aligned, exit_on_sigterm, reap, spawn_with_pipe

BLOCK = 16
TAIL_TARGET = 0.1  # of a layer's forward: the streamed push ends this soon after the prefill
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
CHUNK_TOKENS = 4096  # the stand-in forward's GEMMs go this many tokens at a time


@dataclasses.dataclass(frozen=True)
class Preset:
    layers: int
    kv_heads: int | None  # None: MLA, one latent per token
    head_dim: int         # or the latent's width
    hidden: int
    layer_params: float   # dense parameters of one layer on one GPU: the forward's FLOPs / 2 / token
    dtype: torch.dtype = torch.bfloat16

    @property
    def layout(self) -> str:
        return "mla" if self.kv_heads is None else "flash_attn"

    def layer_shape(self, blocks: int) -> tuple:
        if self.kv_heads is None:
            return (blocks, BLOCK, self.head_dim)
        return (2, blocks, BLOCK, self.kv_heads, self.head_dim)

    @property
    def block_dim(self) -> int:
        return 0 if self.kv_heads is None else 1

    @property
    def pages_per_block(self) -> int:  # what a stack without torch_p2p sends per block
        return self.layers * (1 if self.kv_heads is None else 2)


PRESETS = {
    # 32 layers, 8 KV heads of 128 (GQA), 8.0 B parameters of which 1.05 B embeddings.
    "llama3-8b": Preset(32, 8, 128, 4096, 218e6),
    # Tensor parallel 8: one of 8 KV heads per GPU, an eighth of each layer's 0.86 B parameters.
    "llama3-70b-tp8": Preset(80, 1, 128, 8192, 107e6),
    # MLA: a 512 + 64 latent per token and layer; 37 B active parameters over 61 layers, TP 8.
    "deepseek-v3": Preset(61, None, 576, 7168, 76e6),
}

ROUTES = {
    "ipc": dict(provider="tcp", domains=["lo"], ipc=True),
    "cma": dict(provider="tcp", domains=["lo"], ipc=False),
    "tcp": dict(provider="tcp", domains=["lo"], ipc=False, cma=False),
    "tcp-staged": dict(provider="tcp", domains=["lo"], data_path="staged", ipc=False, cma=False),
    "shm": dict(provider="shm", ipc=False, cma=False),
}
SAME_HOST = ("ipc", "cma")  # the routes that engine.route() names as such


# -- caches and their contents (both processes) ----------------------------------------------------
def make_cache(engine: p2p.Engine, preset: Preset, blocks: int) -> tuple[list, kv.KVCache]:
    layers = [host_shared(torch.empty(preset.layer_shape(blocks), dtype=preset.dtype, device=engine.device))
              for _ in range(preset.layers)]
    return layers, kv.KVCache(engine, layers, preset.layout)


def host_shared(t: torch.Tensor) -> torch.Tensor:
    """Host memory in shared memory, which the cma route maps (its memcpy path)."""
    return t.share_memory_() if t.device.type == "cpu" else t


def pattern(shape: tuple, seed: int, layer: int, device) -> torch.Tensor:
    """Deterministic 16-bit words, different per element (within 65521), layer and seed."""
    n = math.prod(shape)
    words = (torch.arange(n, dtype=torch.int64, device=device) + seed * 1_000_003 + layer * 7919) % 65521 - 32760
    return words.to(torch.int16).view(shape)


def fill(layers: list, seed: int) -> None:
    for i, layer in enumerate(layers):
        layer.view(torch.int16).copy_(pattern(tuple(layer.shape), seed, i, layer.device))


def count_bad(layers: list, preset: Preset, seed: int, src_ids: list, dst_ids: list) -> int:
    """Blocks of `layers` (any layer) that do not hold what fill(source, seed) put in the source
    block moved there; the source cache has as many blocks as this one."""
    dim, bad = preset.block_dim, torch.zeros(len(dst_ids), dtype=torch.bool)
    src = torch.tensor(src_ids, device=layers[0].device)
    dst = torch.tensor(dst_ids, device=layers[0].device)
    for i, layer in enumerate(layers):
        want = pattern(tuple(layer.shape), seed, i, layer.device).index_select(dim, src)
        got = layer.view(torch.int16).index_select(dim, dst)
        diff = (want != got).movedim(dim, 0).flatten(1).any(1)
        bad |= diff.cpu()
    return int(bad.sum())


def poison(layers: list) -> None:
    for layer in layers:
        layer.view(torch.uint8).fill_(0xFF)


def block_descs(addresses: list[int], layers: list, preset: Preset, ids: list) -> list[tuple[int, int]]:
    """(address, bytes) of the K and V halves of blocks `ids` of every layer, the layers at
    `addresses` and shaped as `layers`: the pages a stack without torch_p2p describes."""
    descs = []
    for address, layer in zip(addresses, layers):
        step = layer.stride(preset.block_dim) * layer.element_size()
        halves = [0] if preset.kv_heads is None else [0, layer.stride(0) * layer.element_size()]
        for half in halves:
            descs += [(address + half + i * step, step) for i in ids]
    return descs


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def open_engine(device, route: str) -> p2p.Engine:
    return p2p.Engine(device, **ROUTES[route])


# -- the decode side -------------------------------------------------------------------------------
class Decode:
    """The peer process: an engine per route, a cache and a contiguous buffer per row, the
    baselines' peer halves. Answers the driver's commands in order until "bye"."""

    def __init__(self, conn, device: str, store_path: str):
        self.conn, self.device, self.store_path = conn, torch.device(device), store_path
        self.engine = self.cache = self.layers = self.contig = None
        self.arrived: dict = {}
        self.libs: dict = {}

    def serve(self) -> None:
        try:
            while (msg := self.conn.recv())[0] != "bye":
                cmd, args = msg
                try:
                    self.conn.send(("ok", getattr(self, "do_" + cmd)(**args)))
                except Exception as e:  # noqa: BLE001 - reported to the driver
                    self.conn.send(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
        finally:
            self.do_drop()
            if self.engine:
                self.engine.close()
            import torch.distributed as dist

            if dist.is_available() and dist.is_initialized():
                dist.destroy_process_group()

    def do_engine(self, route):
        if self.engine:
            self.engine.close()
        self.engine = open_engine(self.device, route)
        return self.engine.address

    def do_cache(self, preset, blocks, nbytes):
        self.do_drop()
        self.layers, self.cache = make_cache(self.engine, preset, blocks)
        self.contig = host_shared(torch.empty(nbytes, dtype=torch.uint8, device=self.device))
        region = self.engine.register(self.contig)
        self.contig_region = region
        return self.cache.handle.to_bytes(), region.remote.to_bytes()

    def do_drop(self):
        if self.cache:
            self.cache.close()
            self.contig_region.close()
        self.cache = self.layers = self.contig = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def do_fill(self, seed):
        fill(self.layers, seed)
        _sync(self.device)

    def do_poison(self):
        poison(self.layers)
        _sync(self.device)

    def do_peer_library(self, name):
        """Registers the cache's layers with NIXL or Mooncake (opened once); says where they are."""
        if name not in self.libs:
            self.libs[name] = _baselines.open_peer_library(name, self.device, "127.0.0.1")
        self.libs[name].register(self.layers)
        return dict(self.libs[name].address(), layers=[layer.data_ptr() for layer in self.layers])

    def do_peer_library_done(self, name):
        self.libs[name].release()

    def do_check(self, preset, seed, src_ids, dst_ids):
        return count_bad(self.layers, preset, seed, src_ids, dst_ids)

    def do_expect(self, tag, count):
        """Starts waiting for `count` notifications; do_arrival gives the time of the last."""
        fut, when = self.cache.notification(tag, count, timeout=120), []
        fut.add_done_callback(lambda _: when.append(time.perf_counter()))
        self.arrived[tag] = (fut, when)

    def do_arrival(self, tag):
        fut, when = self.arrived.pop(tag)
        p2p.wait(fut, 120)  # raises the transfer's error, if any
        while not when:  # the callback runs on the dispatcher thread, just after wait() returns
            time.sleep(0.0001)
        return when[0]

    def do_dist(self, backend, nbytes, send, pages, group_ops):
        import torch.distributed as dist

        if not dist.is_initialized():
            _baselines.dist_env(True, nvlink=True)
            self.conn.send(("ok", None))  # the driver joins now
            _baselines.dist_init(backend, dist.FileStore(self.store_path, 2), 1, self.device)
        else:
            self.conn.send(("ok", None))
        _baselines.serve_dist(nbytes, send, self.device, pages, group_ops)


def _decode_main(conn, device: str, store_path: str) -> None:
    Decode(conn, device, store_path).serve()


# -- the prefill side (the driver) -----------------------------------------------------------------
class PeerFailed(RuntimeError):
    pass


class Driver:
    def __init__(self, args, conn, progress: Progress, store_path: str):
        self.args, self.conn, self.progress, self.store_path = args, conn, progress, store_path
        self.device = torch.device(args.device)
        self.rng = torch.Generator().manual_seed(args.seed)
        self.baseline = args.baseline
        self.base_ms: dict = {}
        self.lib = None  # the peer library of --baseline nixl / mooncake
        self.tag = 0
        self.rows: list[dict] = []

    def ask(self, cmd: str, **args):
        self.conn.send((cmd, args))
        return self.reply(cmd)

    def reply(self, cmd: str):
        status, value = self.conn.recv()
        if status != "ok":
            raise PeerFailed(f"the decode process failed on {cmd!r}: {value}")
        return value

    def run(self) -> list[dict]:
        if self.baseline == "nixl" and (why := _baselines.peer_library_unavailable("nixl-libfabric", self.device)):
            self.progress.say(f"nixl: its LIBFABRIC backend is skipped: {why}")
        for route in self.args.routes:
            address = self.ask("engine", route=route)
            with open_engine(self.device, route) as engine:
                actual = engine.route(address)
                if not (actual == route if route in SAME_HOST else actual not in SAME_HOST):
                    self.progress.say(f"skipping route {route}: the engines' route is {actual}")
                    continue
                for model in self.args.models:
                    for tokens in self.args.tokens:
                        self.request(engine, route, model, tokens)
        return self.rows

    def request(self, engine, route: str, model: str, tokens: int) -> None:
        preset = PRESETS[model]
        need = -(-tokens // BLOCK)
        blocks = need + need // 4 + 1
        layers, cache = make_cache(engine, preset, blocks)
        nbytes = need * cache.block_bytes
        contig = host_shared(torch.empty(nbytes, dtype=torch.uint8, device=self.device))
        contig_region = engine.register(contig)
        try:
            handle, remote = self.ask("cache", preset=preset, blocks=blocks, nbytes=nbytes)
            peer, remote = kv.KVCacheHandle.from_bytes(handle), p2p.RemoteTensor.from_bytes(remote)
            mine = torch.randperm(blocks, generator=self.rng)[:need].tolist()
            theirs = torch.randperm(blocks, generator=self.rng)[:need].tolist()
            facts = dict(kind="move", model=model, tokens=tokens, route=route, bytes=nbytes, blocks=need,
                         pages=need * preset.pages_per_block, device=str(self.device),
                         peer_device=self.args.peer_device, provider=engine.provider)
            for op in self.args.ops:
                self.rows.append(self.move(engine, preset, layers, cache, peer, contig, remote, mine, theirs,
                                           op, facts))
            if "push" in self.args.ops and self.args.stream:
                self.rows.append(self.stream(preset, layers, cache, peer, mine, theirs, tokens,
                                             dict(facts, kind="stream")))
        finally:
            self.ask("drop")
            cache.close()
            contig_region.close()
            del layers, contig
            if self.device.type == "cuda":
                torch.cuda.empty_cache()

    def timed(self, call) -> float:
        """Median seconds of one call to completion, after a warm-up."""
        p2p.wait(call(), 300)
        times = []
        for _ in range(self.args.repeat):
            t = time.perf_counter()
            p2p.wait(call(), 300)
            times.append(time.perf_counter() - t)
        return statistics.median(times)

    def move(self, engine, preset, layers, cache, peer, contig, remote, mine, theirs, op, facts) -> dict:
        row = dict(facts, op=op, ms=None, gbps=None, contig_ms=None, contig_gbps=None, ratio=None,
                   baseline=None, base_ms=None, base_gbps=None, speedup=None, ok=False, error=None)
        label = f"{op.upper()} {facts['model']} {facts['tokens']} tokens, {facts['route']}"
        nbytes = facts["bytes"]
        self.progress.begin(label, 1.0, None, "preparing caches")
        seed = len(self.rows) + 1
        push = op == "push"
        try:
            if push:
                fill(layers, seed)
                _sync(self.device)
            else:
                self.ask("fill", seed=seed)
            self.progress.status = f"timing {self.args.repeat} requests"
            if push:
                sec = self.timed(lambda: cache.push(peer, mine, theirs))
            else:
                sec = self.timed(lambda: cache.pull(peer, theirs, mine))
            bad = (self.ask("check", preset=PRESETS[facts["model"]], seed=seed, src_ids=mine, dst_ids=theirs) if push
                   else count_bad(layers, PRESETS[facts["model"]], seed, theirs, mine))
            if bad:
                raise RuntimeError(f"CORRUPT: {bad} of {len(mine)} destination blocks wrong")
            self.progress.status = "contiguous ceiling"
            move = engine.write_slices if push else engine.read_slices
            contig_sec = self.timed(lambda: move([contig], [remote]))
            row.update(ok=True, ms=1e3 * sec, gbps=nbytes / sec / 1e9, contig_ms=1e3 * contig_sec,
                       contig_gbps=nbytes / contig_sec / 1e9, ratio=contig_sec / sec)
            base = self.base(op, nbytes, facts, layers, mine, theirs)
            if base:
                row.update(baseline=self.baseline, base_ms=1e3 * base, base_gbps=nbytes / base / 1e9,
                           speedup=base / sec)
        except (p2p.P2PError, RuntimeError) as e:
            row["error"] = f"{type(e).__name__}: {e}"
            self.progress.end(text=f"FAILED: {row['error']}")
            return row
        text = (f"{row['ms']:.3f} ms, {row['gbps']:.2f} GB/s; contiguous {row['contig_gbps']:.2f} GB/s "
                f"(ratio {row['ratio']:.2f})")
        if row["base_ms"]:
            text += f"; {self.baseline} {row['base_gbps']:.2f} GB/s (x{row['speedup']:.1f})"
        self.progress.end(text=text)
        return row

    def base(self, op: str, nbytes: int, facts: dict, layers: list, mine: list, theirs: list) -> float | None:
        """Seconds per request of the baseline (the same for every route: measured once)."""
        if self.baseline == "none":
            return None
        key = (op, facts["model"], facts["tokens"])
        if key in self.base_ms:
            return self.base_ms[key]
        if self.baseline in _baselines.PEER_LIBRARIES:
            try:
                self.base_ms[key] = self.peer_library(op, facts, layers, mine, theirs)
            except _baselines.PeerLibraryError as e:
                self.progress.say(f"skipping the {self.baseline} baseline: {e}")
                self.baseline = "none"
                return None
        if key not in self.base_ms:
            why = _baselines.dist_unavailable(self.baseline, self.device)
            if not why and self.baseline == "nccl" and self.args.peer_device == str(self.device):
                why = "NCCL cannot pair two ranks on one GPU (give the peer another: --peer-device)"
            if why:
                self.progress.say(f"skipping the {self.baseline} baseline: {why}")
                self.baseline = "none"
                return None
            self.progress.status = f"{self.baseline} batch_isend_irecv of {facts['pages']} pages"
            import torch.distributed as dist

            self.conn.send(("dist", dict(backend=self.baseline, nbytes=nbytes, send=op == "pull",
                                         pages=facts["pages"], group_ops=self.args.dist_group)))
            self.reply("dist")
            if not dist.is_initialized():
                _baselines.dist_env(True, nvlink=True)
                _baselines.dist_init(self.baseline, dist.FileStore(self.store_path, 2), 0, self.device)
            moved, seconds = _baselines.measure_dist(nbytes, op == "push", self.device, self.args.duration,
                                                     facts["pages"], self.args.dist_group)
            self.reply("dist")
            self.base_ms[key] = seconds / (moved / nbytes)
        return self.base_ms[key]

    def peer_library(self, op: str, facts: dict, layers: list, mine: list, theirs: list) -> float:
        """Median seconds of one request through NIXL or Mooncake between the two caches, the
        same blocks; raises PeerLibraryError when it cannot run or moves wrong bytes."""
        name, preset, pull = self.baseline, PRESETS[facts["model"]], op == "pull"
        if self.lib is None:
            self.lib = _baselines.open_peer_library(name, self.device, "127.0.0.1")
        try:
            peer = self.ask("peer_library", name=name)
        except PeerFailed as e:  # refused before anything started
            raise _baselines.PeerLibraryError(str(e).splitlines()[0]) from None
        seed = len(self.rows) + 1000
        try:
            if pull:
                self.ask("fill", seed=seed)
                poison(layers)
            else:
                fill(layers, seed)
                self.ask("poison")
            _sync(self.device)
            with _baselines.library_errors():
                self.lib.register(layers)
                self.lib.connect(peer)
                local = block_descs([layer.data_ptr() for layer in layers], layers, preset, mine)
                remote = block_descs(peer["layers"], layers, preset, theirs)
                self.progress.status = f"{self.lib.what}: {len(local)} descriptors per request"
                seconds = _baselines.median_request_seconds(self.lib.request(pull, local, remote), self.args.repeat)
        finally:
            with _baselines.library_errors():
                self.lib.release()
            self.ask("peer_library_done", name=name)
        bad = (count_bad(layers, preset, seed, theirs, mine) if pull
               else self.ask("check", preset=preset, seed=seed, src_ids=mine, dst_ids=theirs))
        if bad:
            raise _baselines.PeerLibraryError(f"CORRUPT: {bad} of {len(mine)} destination blocks wrong")
        return seconds

    def stream(self, preset, layers, cache, peer, mine, theirs, tokens, facts) -> dict:
        row = dict(facts, op="push", layer_ms=None, prefill_ms=None, streamed_ms=None, tail_ms=None,
                   tail_per_layer=None, ok=False, error=None)
        label = f"STREAM {facts['model']} {tokens} tokens, {facts['route']}"
        self.progress.begin(label, 1.0, None, "calibrating the stand-in forward")
        forward = Forward(preset, tokens, self.device, self.args.layer_ms)
        ids = torch.tensor(mine, device=self.device)
        fresh = torch.empty(preset.layer_shape(len(mine)), dtype=preset.dtype, device=self.device)

        def prefill(stream=None) -> tuple[float, float]:
            """(seconds, the time it ended)"""
            _sync(self.device)
            t = time.perf_counter()
            for i, layer in enumerate(layers):
                forward()
                layer.index_copy_(preset.block_dim, ids, fresh)
                if stream:
                    stream.push(i)
            _sync(self.device)
            end = time.perf_counter()
            return end - t, end

        try:
            self.progress.status = "prefill alone"
            prefill()
            alone = statistics.median(prefill()[0] for _ in range(self.args.repeat))
            self.progress.status = "prefill with streamed pushes"
            runs = []
            for _ in range(self.args.repeat + 1):
                self.tag += 1
                self.ask("expect", tag=self.tag, count=preset.layers)
                stream = cache.stream(peer, mine, theirs, notify=self.tag)
                took, end = prefill(stream)
                p2p.wait(stream.future(), 300)
                runs.append((took, self.ask("arrival", tag=self.tag) - end))
            took, tail = (statistics.median(x) for x in zip(*runs[1:]))
        except (p2p.P2PError, RuntimeError) as e:
            row["error"] = f"{type(e).__name__}: {e}"
            self.progress.end(text=f"FAILED: {row['error']}")
            return row
        layer = alone / preset.layers
        row.update(ok=True, layer_ms=1e3 * layer, prefill_ms=1e3 * alone, streamed_ms=1e3 * took,
                   tail_ms=1e3 * tail, tail_per_layer=tail / layer, gemm=forward.what)
        missed = "" if row["tail_per_layer"] < TAIL_TARGET else f", above the target of {TAIL_TARGET}"
        self.progress.end(text=f"layer {row['layer_ms']:.2f} ms, prefill {row['prefill_ms']:.1f} ms, with pushes "
                               f"{row['streamed_ms']:.1f} ms, tail {row['tail_ms']:.3f} ms "
                               f"({row['tail_per_layer']:.3f} of a layer{missed})")
        return row


class Forward:
    """A stand-in for one layer's prefill: GEMMs of [tokens, hidden] x [hidden, width], width
    from the layer's parameters (its dense FLOPs), or calibrated to `layer_ms`."""

    def __init__(self, preset: Preset, tokens: int, device: torch.device, layer_ms: float | None):
        self.device, chunk = device, min(tokens, CHUNK_TOKENS)
        self.rounds = -(-tokens // chunk)
        dtype = preset.dtype if device.type == "cuda" else torch.float32  # CPUs: no slow bf16 GEMMs
        hidden = preset.hidden if layer_ms is None else 1024
        width = int(preset.layer_params // preset.hidden) if layer_ms is None else 256
        self.x = torch.randn(chunk, hidden, dtype=dtype, device=device)
        self.w = torch.randn(hidden, width, dtype=dtype, device=device)
        self.y = torch.empty(chunk, width, dtype=dtype, device=device)
        if layer_ms is not None:
            self()
            _sync(device)
            t = time.perf_counter()
            self()
            _sync(device)
            width = max(64, int(width * layer_ms / 1e3 / (time.perf_counter() - t)))
            self.w = torch.randn(hidden, width, dtype=dtype, device=device)
            self.y = torch.empty(chunk, width, dtype=dtype, device=device)
        self.what = f"{self.rounds} x [{chunk}, {hidden}] x [{hidden}, {width}] {dtype}"

    def __call__(self) -> None:
        for _ in range(self.rounds):
            torch.matmul(self.x, self.w, out=self.y)


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
    print(title)
    print(tables(rows))
    print(LEGEND)
    failed = [r for r in rows if not r["ok"]]
    for r in failed:
        print(f"! {r['kind']} {r['model']} {r['tokens']} {r.get('op', '')} {r['route']}: {r['error']}")
    missed = [r for r in rows if r["kind"] == "stream" and r["ok"] and r["tail_per_layer"] >= TAIL_TARGET]
    if missed:
        print(f"note: {len(missed)} streaming row(s) missed the tail target (< {TAIL_TARGET} of a layer): the last "
              f"layer's push ended later than that after the prefill. They completed without error: a missed "
              f"target is not a failure, and the exit status stays 0.")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1, default=str)
    if args.plot:
        plot(rows, args.plot, title)
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
    ap.add_argument("--baseline", choices=["auto", "nccl", "gloo", *_baselines.PEER_LIBRARIES, "none"], default="auto",
                    help="batch_isend_irecv of the same pages, at most 4096 per group (default: nccl on GPUs, gloo on "
                         "CPUs), or NIXL or Mooncake moving the same blocks")
    ap.add_argument("--duration", type=float, default=1.0, metavar="S", help="seconds of baseline per row")
    ap.add_argument("--dist-group", type=int, default=_baselines.DIST_GROUP_OPS, metavar="N",
                    help=f"pages per batch_isend_irecv group of the nccl / gloo baseline (default "
                         f"{_baselines.DIST_GROUP_OPS}: NCCL does not finish one group of 65,536)")
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
        conn, proc = spawn_with_pipe(_decode_main, (args.peer_device, store), "kv-decode")
        try:
            rows = Driver(args, conn, Progress(), store).run()
            conn.send(("bye", {}))
        except (PeerFailed, p2p.P2PError, EOFError, ConnectionResetError) as e:  # the last two: it died
            print(f"kv.py: error: {e}", file=sys.stderr)
            return 2
        finally:
            import torch.distributed as dist

            if dist.is_available() and dist.is_initialized():
                dist.destroy_process_group()
            reap([proc])
    return report(args, rows)


if __name__ == "__main__":
    exit_on_sigterm()
    sys.exit(main())
