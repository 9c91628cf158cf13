"""The tcp baseline: plain TCP, one stream per rail, Python sockets. Every stream moves its share
of a call (call bytes / streams) with sendall() and recv_into() on preallocated buffers, one
thread per stream (both calls release the GIL), for the row's duration. The peer's half
(serve_tcp) runs in the benchmark's peer process, the driver's (measure_tcp) in the process that
drives the engine and returns (bytes, seconds)."""
from __future__ import annotations

import socket
import struct
import threading
import time

from _timing import TIMEOUT_S


def _threads(fn, items) -> list:
    """Runs fn(item) in one thread per item; returns the results, raises the first error."""
    results: list = [None] * len(items)
    errors: list[BaseException] = []

    def run(i):
        try:
            results[i] = fn(items[i])
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(items))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


def _send_for(sock: socket.socket, chunk: int, seconds: float) -> None:
    buf = memoryview(bytearray(chunk))
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        sock.sendall(buf)
    sock.shutdown(socket.SHUT_WR)


def _recv_all(sock: socket.socket, chunk: int) -> int:
    buf = memoryview(bytearray(chunk))
    total = 0
    while n := sock.recv_into(buf):
        total += n
    return total


def tcp_listen(host: str) -> socket.socket:
    """A listening socket on `host` (the address the driver reached the peer on)."""
    s = socket.create_server((host, 0), backlog=64)
    s.settimeout(TIMEOUT_S)
    return s


def serve_tcp(listener: socket.socket, streams: int, chunk: int, send: bool, seconds: float) -> int:
    """The peer's half: accepts `streams` connections, then receives until the driver closes
    (replying with the byte count) or, if `send`, streams to the driver for `seconds`."""
    conns = []
    try:
        for _ in range(streams):
            conn, _ = listener.accept()
            conn.settimeout(TIMEOUT_S)
            conns.append(conn)

        def one(conn):
            if send:
                _send_for(conn, chunk, seconds)
                return 0
            n = _recv_all(conn, chunk)
            conn.sendall(struct.pack("!Q", n))
            return n

        return sum(_threads(one, conns))
    finally:
        for c in conns:
            c.close()


def measure_tcp(host: str, port: int, streams: int, chunk: int, send: bool, seconds: float):
    """The driver's half: (bytes that arrived, seconds from connecting until the last did)."""
    socks = [socket.create_connection((host, port), timeout=TIMEOUT_S) for _ in range(streams)]
    try:
        t0 = time.perf_counter()

        def one(sock):
            if not send:
                return _recv_all(sock, chunk)
            _send_for(sock, chunk, seconds)
            ack = b""
            while len(ack) < 8 and (part := sock.recv(8 - len(ack))):
                ack += part
            return struct.unpack("!Q", ack)[0]

        total = sum(_threads(one, socks))
        return total, time.perf_counter() - t0
    finally:
        for s in socks:
            s.close()
