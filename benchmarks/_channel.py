"""The side channel between a benchmark's driver and its peer: request/response messages over
a socket, or over the torchrun store, and the barrier that lines up the drivers of a
multi-GPU run."""
from __future__ import annotations

import base64
import json
import socket


class PeerFailed(RuntimeError):
    """The peer raised; the message carries its traceback."""


class Channel:
    """Request/response messages between a driver and its peer: JSON objects, bytes values
    travelling as {"b64": ...}. No pickle: a listening peer runs nothing it is sent."""

    def send(self, **msg) -> None:
        self._put(json.dumps(msg, default=lambda b: {"b64": base64.b64encode(b).decode()}).encode())

    def recv(self) -> dict | None:
        """The next message; None once the other side has gone."""
        data = self._get()
        if data is None:
            return None
        return json.loads(data, object_hook=lambda d: base64.b64decode(d["b64"]) if d.keys() == {"b64"} else d)

    def ask(self, cmd: str, **args) -> dict:
        self.send(cmd=cmd, **args)
        return self.reply(cmd)

    def reply(self, cmd: str) -> dict:
        """The peer's next answer to `cmd`; raises PeerFailed if it failed or left."""
        reply = self.recv()
        if reply is None:
            raise PeerFailed(f"the peer left while answering {cmd!r}")
        if "error" in reply:
            raise PeerFailed(f"the peer failed on {cmd!r}: {reply['error']}")
        return reply

    def _put(self, data: bytes) -> None:
        raise NotImplementedError

    def _get(self) -> bytes | None:
        raise NotImplementedError


class SocketChannel(Channel):
    """One JSON document per line over a connected socket."""

    def __init__(self, sock: socket.socket, timeout: float | None):
        sock.settimeout(timeout)
        self.sock = sock
        self._file = sock.makefile("rb")

    def _put(self, data: bytes) -> None:
        try:
            self.sock.sendall(data + b"\n")
        except ConnectionError as e:
            raise PeerFailed(f"the peer is gone ({e})") from None

    def _get(self) -> bytes | None:
        try:
            return self._file.readline() or None
        except ConnectionError:
            return None

    def close(self) -> None:
        self._file.close()
        self.sock.close()


class StoreChannel(Channel):
    """Numbered keys in a torch.distributed Store (torchrun mode); read keys are deleted."""

    def __init__(self, store, me: str, other: str):
        self.store, self.me, self.other = store, me, other
        self.sent = self.received = 0

    def _put(self, data: bytes) -> None:
        self.sent += 1
        self.store.set(f"{self.me}/{self.sent}", data)

    def _get(self) -> bytes | None:
        self.received += 1
        key = f"{self.other}/{self.received}"
        data = self.store.get(key)
        self.store.delete_key(key)
        return data


class StoreBarrier:
    """Lines up the drivers of a multi-GPU run (torchrun mode) before each timed loop."""

    def __init__(self, store, n: int):
        self.store, self.n, self.k = store, n, 0

    def wait(self, timeout: float | None = None) -> None:
        self.k += 1
        if self.store.add(f"{self.k}", 1) == self.n:
            self.store.set(f"{self.k}/done", b"1")
        self.store.wait([f"{self.k}/done"])
