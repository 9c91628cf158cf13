"""The live line a benchmark draws on stderr while a row runs."""
from __future__ import annotations

import sys
import threading
import time

from _table import fmt_bytes, fmt_rate


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
