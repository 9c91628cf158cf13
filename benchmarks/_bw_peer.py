"""The peer of bw.py: an engine and one registered buffer per row that the driver writes into
and reads from, plus the baselines' peer halves, served over the side channel."""
from __future__ import annotations

import socket
import traceback

import torch

import torch_p2p as p2p
from _bw_buffers import count_bad_pages, fill, new_buffer, open_engine, poison
from _channel import Channel, SocketChannel
from _dist import dist_env, dist_init, dist_leave, dist_unavailable, serve_dist
from _peer_library import PeerLibrary, open_peer_library
from _tcp import serve_tcp, tcp_listen


def dist_store(spec: dict, shared, host: str | None, port: int | None = None):
    """The store in which the dist baseline's two ranks meet: a file (both on one machine),
    torchrun's store, or a TCPStore that the peer hosts (port None) and the driver joins."""
    import torch.distributed as dist

    if spec["kind"] == "file":
        return dist.FileStore(spec["path"], 2)
    if spec["kind"] == "shared":
        return dist.PrefixStore(spec["prefix"], shared)
    return dist.TCPStore(host, port or 0, 2, is_master=port is None, wait_for_workers=False)


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
        self.libs: dict[str, PeerLibrary] = {}

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
            dist_leave()

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
            self.listener = tcp_listen(self.host)
        self.channel.send(host=self.host, port=self.listener.getsockname()[1])
        return {"bytes": serve_tcp(self.listener, streams, chunk, send, seconds)}

    def do_dist(self, backend, nbytes, send, store, loopback, nvlink, pages):
        import torch.distributed as dist

        if why := dist_unavailable(backend, self.device):
            raise RuntimeError(why)  # before "ready": the driver goes on without the baseline
        if dist.is_initialized():
            self.channel.send()
        else:
            dist_env(loopback, nvlink)
            meet = dist_store(store, self.shared_store, self.host)
            self.channel.send(port=getattr(meet, "port", None))  # a TCPStore listens here
            dist_init(backend, meet, 1, self.device)
        serve_dist(nbytes, send, self.device, pages)

    def do_peer_library(self, name):
        """Registers the buffer with NIXL or Mooncake (opened once); says where it is."""
        if name not in self.libs:
            self.libs[name] = open_peer_library(name, self.device, self.host)
        self.libs[name].register([self.buf])
        return dict(self.libs[name].address(), address=self.buf.data_ptr())

    def do_peer_library_done(self, name):
        self.libs[name].release()


def serve_socket(sock: socket.socket, device: str, host: str) -> None:
    """Entry of a peer process that talks over a connected socket."""
    channel = SocketChannel(sock, None)
    try:
        Target(channel, torch.device(device), host).serve()
    finally:
        channel.close()


def serve_listener(listener: socket.socket, device: str) -> None:
    """Entry of a --listen process: serves the first driver that connects, then exits."""
    conn, _ = listener.accept()
    listener.close()
    serve_socket(conn, device, conn.getsockname()[0])
