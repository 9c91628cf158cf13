"""The decode process of kv.py: the side a request migrates to, answering the driver's commands."""
from __future__ import annotations

import time
import traceback

import torch

import torch_p2p as p2p
from _dist import dist_env, dist_init, dist_leave, serve_dist
from _kv_caches import count_bad, fill, host_shared, make_cache, open_engine, poison
from _peer_library import open_peer_library
from _timing import sync


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
            dist_leave()

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
        sync(self.device)

    def do_poison(self):
        poison(self.layers)
        sync(self.device)

    def do_peer_library(self, name):
        """Registers the cache's layers with NIXL or Mooncake (opened once); says where they are."""
        if name not in self.libs:
            self.libs[name] = open_peer_library(name, self.device, "127.0.0.1")
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
            dist_env(True, nvlink=True)
            self.conn.send(("ok", None))  # the driver joins now
            dist_init(backend, dist.FileStore(self.store_path, 2), 1, self.device)
        else:
            self.conn.send(("ok", None))
        serve_dist(nbytes, send, self.device, pages, group_ops)


def decode_main(conn, device: str, store_path: str) -> None:
    Decode(conn, device, store_path).serve()
