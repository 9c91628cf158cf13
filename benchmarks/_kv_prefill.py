"""The prefill side of kv.py (the driver): each request pushed and pulled between the two caches,
against the contiguous ceiling and the baseline, and streamed layer by layer behind a stand-in
prefill."""
from __future__ import annotations

import statistics
import time

import torch

import torch_p2p as p2p
from torch_p2p import kv
from _channel import PeerFailed
from _dist import dist_env, dist_init, dist_unavailable, measure_dist
from _kv_caches import (BLOCK, PRESETS, SAME_HOST, Preset, block_descs, count_bad, fill, host_shared, make_cache,
                        open_engine, poison)
from _peer_library import (PEER_LIBRARIES, PeerLibraryError, library_errors, median_request_seconds, open_peer_library,
                           peer_library_unavailable)
from _progress import Progress
from _timing import sync

TAIL_TARGET = 0.1  # of a layer's forward: the streamed push ends this soon after the prefill
CHUNK_TOKENS = 4096  # the stand-in forward's GEMMs go this many tokens at a time


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
        if self.baseline == "nixl" and (why := peer_library_unavailable("nixl-libfabric", self.device)):
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
                sync(self.device)
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
        if self.baseline in PEER_LIBRARIES:
            try:
                self.base_ms[key] = self.peer_library(op, facts, layers, mine, theirs)
            except PeerLibraryError as e:
                self.progress.say(f"skipping the {self.baseline} baseline: {e}")
                self.baseline = "none"
                return None
        if key not in self.base_ms:
            why = dist_unavailable(self.baseline, self.device, self.args.peer_device)
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
                dist_env(True, nvlink=True)
                dist_init(self.baseline, dist.FileStore(self.store_path, 2), 0, self.device)
            moved, seconds = measure_dist(nbytes, op == "push", self.device, self.args.duration,
                                                     facts["pages"], self.args.dist_group)
            self.reply("dist")
            self.base_ms[key] = seconds / (moved / nbytes)
        return self.base_ms[key]

    def peer_library(self, op: str, facts: dict, layers: list, mine: list, theirs: list) -> float:
        """Median seconds of one request through NIXL or Mooncake between the two caches, the
        same blocks; raises PeerLibraryError when it cannot run or moves wrong bytes."""
        name, preset, pull = self.baseline, PRESETS[facts["model"]], op == "pull"
        if self.lib is None:
            self.lib = open_peer_library(name, self.device, "127.0.0.1")
        try:
            peer = self.ask("peer_library", name=name)
        except PeerFailed as e:  # refused before anything started
            raise PeerLibraryError(str(e).splitlines()[0]) from None
        seed = len(self.rows) + 1000
        try:
            if pull:
                self.ask("fill", seed=seed)
                poison(layers)
            else:
                fill(layers, seed)
                self.ask("poison")
            sync(self.device)
            with library_errors():
                self.lib.register(layers)
                self.lib.connect(peer)
                local = block_descs([layer.data_ptr() for layer in layers], layers, preset, mine)
                remote = block_descs(peer["layers"], layers, preset, theirs)
                self.progress.status = f"{self.lib.what}: {len(local)} descriptors per request"
                seconds = median_request_seconds(self.lib.request(pull, local, remote), self.args.repeat)
        finally:
            with library_errors():
                self.lib.release()
            self.ask("peer_library_done", name=name)
        bad = (count_bad(layers, preset, seed, theirs, mine) if pull
               else self.ask("check", preset=preset, seed=seed, src_ids=mine, dst_ids=theirs))
        if bad:
            raise PeerLibraryError(f"CORRUPT: {bad} of {len(mine)} destination blocks wrong")
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
            sync(self.device)
            t = time.perf_counter()
            for i, layer in enumerate(layers):
                forward()
                layer.index_copy_(preset.block_dim, ids, fresh)
                if stream:
                    stream.push(i)
            sync(self.device)
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
            sync(device)
            t = time.perf_counter()
            self()
            sync(device)
            width = max(64, int(width * layer_ms / 1e3 / (time.perf_counter() - t)))
            self.w = torch.randn(hidden, width, dtype=dtype, device=device)
            self.y = torch.empty(chunk, width, dtype=dtype, device=device)
        self.what = f"{self.rounds} x [{chunk}, {hidden}] x [{hidden}, {width}] {dtype}"

    def __call__(self) -> None:
        for _ in range(self.rounds):
            torch.matmul(self.x, self.w, out=self.y)
