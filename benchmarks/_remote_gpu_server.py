"""The server of remote_gpu.py: a child process with its own engine, which receives a and b,
sums them on its GPU and tells the client that c is ready; and the client's handle on it.
Thread model: the child's main thread serves the pipe and runs the GPU work; the engine's own
threads move the data."""
from __future__ import annotations

import json
import time
import traceback

import torch

import torch_p2p as p2p
from _processes import messages, reap, spawn_with_pipe
from _timing import sync

SERVER_DATA_PATH = {"remote-pageable": None, "remote-pinned": None, "remote-staged": "staged",
                    "remote-direct": "direct"}


class ServerError(RuntimeError):
    """The server process failed, died or did not answer."""


class Unavailable(RuntimeError):
    """The method cannot run with this provider or device: a note, not a failure."""


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
        for cmd, args in messages(conn):
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
