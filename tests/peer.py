"""Peer processes for multi-process tests.

A Peer is a spawned child that runs functions sent to it, with a `state` dict that lives as
long as the child (engines, tensors, regions). Functions must be importable module-level
functions taking `state` first. Every call has a timeout; close() ends the child, killing it
if it does not leave in time, so no test leaves processes behind.

    with Peer() as b:
        blob = b.call(tests.helpers.make_target, "tcp", (4, 1024))
"""
from __future__ import annotations

import glob
import multiprocessing as mp
import os
import shutil
import signal
import subprocess
import traceback


class PeerFailed(RuntimeError):
    """The function raised in the child; the message carries its traceback."""


class PeerDied(RuntimeError):
    """The child died before answering (a crash, or a kill): its pipe ended."""


def _serve(conn) -> None:
    state: dict = {}
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            break
        if msg is None:
            break
        fn, args, kwargs = msg
        try:
            conn.send((True, fn(state, *args, **kwargs)))
        except BaseException as exc:  # noqa: BLE001 - reported to the parent
            conn.send((False, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    for value in list(state.values()):
        close = getattr(value, "close", None)
        if callable(close):
            try:
                close()
            except Exception:
                pass


def stacks(pid: int) -> str:
    """What a child that stopped answering was doing: its Python threads (py-spy) and every
    native thread, the engine's workers included (gdb); each where it is installed."""
    tools = (["py-spy", "dump", "--native", "--pid", str(pid)],
             ["gdb", "-nx", "-batch", "-p", str(pid), "-ex", "set print frame-arguments none",
              "-ex", "thread apply all bt 30"])
    out = []
    for cmd in tools:
        if shutil.which(cmd[0]) is None:
            continue
        try:
            run = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
            out.append(f"--- {cmd[0]}:\n{run.stdout}{run.stderr}")
        except subprocess.TimeoutExpired:
            out.append(f"--- {cmd[0]} timed out")
    return "".join("\n" + o for o in out)


def shm_endpoint_files(pid: int) -> list[str]:
    """The shm endpoint files of process `pid` (the engine names them p2p-<pid>-<random>)."""
    return glob.glob(f"/dev/shm/p2p-{pid}-*")


class Peer:
    def __init__(self, env: dict | None = None):
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        old = {k: os.environ.get(k) for k in (env or {})}
        os.environ.update(env or {})
        try:
            self.proc = ctx.Process(target=_serve, args=(child,), daemon=True)
            self.proc.start()
        finally:
            for k, v in old.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        child.close()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def call(self, fn, *args, timeout: float = 60, **kwargs):
        """Runs fn(state, *args, **kwargs) in the child and returns its result."""
        self.start(fn, *args, **kwargs)
        return self.result(timeout=timeout)

    def start(self, fn, *args, **kwargs) -> None:
        """Starts fn in the child without waiting; collect with result()."""
        self._conn.send((fn, args, kwargs))

    def result(self, timeout: float = 60):
        if not self._conn.poll(timeout):
            raise TimeoutError(f"peer {self.pid} did not answer within {timeout} s{stacks(self.pid)}")
        try:
            ok, value = self._conn.recv()
        except (EOFError, ConnectionResetError) as exc:
            # Which of the two a dead child's pipe gives depends on whether it had unread data.
            self.proc.join(10)
            raise PeerDied(f"peer {self.pid} died (exit code {self.proc.exitcode}): {exc!r}") from exc
        if not ok:
            raise PeerFailed(value)
        return value

    def kill(self) -> None:
        """kill -9: the child gets no chance to clean up."""
        if self.proc.is_alive():
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.join(10)

    def close(self, timeout: float = 10) -> None:
        if self.proc.is_alive():
            try:
                self._conn.send(None)
            except (BrokenPipeError, OSError):
                pass
            self.proc.join(timeout)
        if self.proc.is_alive():
            self.kill()
        self._conn.close()
        # A child killed with shm endpoints open leaves their files: tests kill many, so remove
        # them.
        if not self.proc.is_alive():
            for leftover in shm_endpoint_files(self.proc.pid):
                try:
                    os.unlink(leftover)
                except OSError:
                    pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
