"""The prefill side's leases (free of vLLM): a finished request's blocks are kept until every
decode worker that reads them has sent a release notice (each notice says how many decode
workers read this prefill worker), or until the request's lease ends."""
from __future__ import annotations

import json
import logging
import threading
import time

from ...errors import ClosedError
from ...errors import TimeoutError as P2PTimeout

_log = logging.getLogger("vllm.torch_p2p")  # the logger the connector's worker half uses


def release_notice(remote_request_id: str, readers: int) -> bytes:
    """What a decode worker sends a prefill worker once it has read the request's blocks."""
    return json.dumps(dict(release=remote_request_id, readers=readers)).encode()


class Leases:
    """A prefill worker's leases and the release notices heard so far. Notices arrive in
    `engine`'s inbox, read by a thread of this object's (give it an engine of its own);
    ``start`` and ``freed`` run on the caller's thread."""

    def __init__(self, engine, seconds: float):
        self.engine, self.seconds = engine, seconds
        self._ends: dict[str, float] = {}  # request -> when its lease ends (time.monotonic())
        # request -> [notices heard, readers they announced, when the first was heard]
        self._released: dict[str, list] = {}
        self._lock = threading.Lock()
        self._closing = threading.Event()
        self._inbox = threading.Thread(target=self._receive, name="torch_p2p-kv-inbox", daemon=True)
        self._inbox.start()

    def start(self, request_id: str, seconds: float | None = None) -> None:
        """Keeps a finished request's blocks until its readers have released them, or
        `seconds` (default: the object's) pass."""
        seconds = self.seconds if seconds is None else seconds
        with self._lock:
            self._ends[request_id] = time.monotonic() + seconds

    def freed(self) -> dict[str, bool]:
        """Requests whose blocks may be freed now -> whether their readers released them
        (False: the lease ran out). Each is reported once."""
        freed, now = {}, time.monotonic()
        with self._lock:
            for rid, end in list(self._ends.items()):
                seen = self._released.get(rid)
                if seen is not None and seen[0] >= seen[1]:
                    freed[rid] = True
                elif now >= end:
                    freed[rid] = False
                else:
                    continue
                del self._ends[rid]
                self._released.pop(rid, None)
            # A notice for a request never leased here (aborted before its lease began) is dropped.
            for rid in [r for r, s in self._released.items() if r not in self._ends and now - s[2] > self.seconds]:
                del self._released[rid]
        return freed

    def _receive(self) -> None:
        """The inbox: the decode workers' release notices, counted by request."""
        while not self._closing.is_set():
            try:
                _, payload = self.engine.recv(timeout=0.5).wait()
            except P2PTimeout:
                continue
            except Exception as e:  # noqa: BLE001 - closed, or a peer's error: logged, not raised
                if self._closing.is_set() or isinstance(e, ClosedError):
                    return
                _log.warning("TorchP2PConnector: receiving a release notice failed (%s: %s)", type(e).__name__, e)
                continue
            try:
                notice = json.loads(payload)
                request_id, readers = str(notice["release"]), max(1, int(notice["readers"]))
            except (ValueError, KeyError, TypeError):
                _log.warning("TorchP2PConnector: ignored a message that is no release notice (%d bytes)", len(payload))
                continue
            with self._lock:
                seen = self._released.setdefault(request_id, [0, readers, time.monotonic()])
                seen[0], seen[1] = seen[0] + 1, max(seen[1], readers)

    def close(self) -> None:
        """Stops the inbox thread (before the engine closes)."""
        self._closing.set()
        self._inbox.join(timeout=2)
