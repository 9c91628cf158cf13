"""The side channel: how a decode worker gets a prefill worker's cache handle (its engine
address and registered caches: metadata and keys, no data). A TCP listener per prefill worker
hands the same bytes to whoever connects; a decode worker asks once per prefill worker."""
from __future__ import annotations

import socket
import struct
import threading

_HEADER = struct.Struct("!I")
_MAX_INFO = 1 << 24


class SideChannel:
    """A TCP listener that hands `info` (bytes) to whoever connects, then closes: one
    round trip, no state between connections."""

    def __init__(self, host: str, port: int, info: bytes):
        self._info = _HEADER.pack(len(info)) + info
        self._sock = socket.create_server((host, port))
        self._sock.settimeout(0.2)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="torch_p2p-side-channel", daemon=True)
        self._thread.start()

    @property
    def port(self) -> int:
        return self._sock.getsockname()[1]

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except (socket.timeout, OSError):
                continue
            with conn:
                try:
                    conn.settimeout(5)
                    conn.sendall(self._info)
                except OSError:
                    pass  # the asker went away; it will ask again

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self._sock.close()


def fetch(host: str, port: int, timeout: float) -> bytes:
    """What a SideChannel at host:port serves; OSError (refused, reset, timeout) otherwise."""
    with socket.create_connection((host, port), timeout=timeout) as s:
        s.settimeout(timeout)
        size = _HEADER.unpack(_read(s, _HEADER.size))[0]
        if size > _MAX_INFO:
            raise ValueError(f"side channel at {host}:{port} announced {size} bytes: not a torch_p2p peer")
        return _read(s, size)


def _read(s: socket.socket, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        chunk = s.recv(n - len(out))
        if not chunk:
            raise ConnectionError(f"side channel closed after {len(out)} of {n} bytes")
        out += chunk
    return bytes(out)
