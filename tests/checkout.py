"""This checkout as the processes of every test suite need it (tests/; tests_vllm/,
tests_sglang/ and tests_rl/ put tests/ on sys.path for it): where it is, the environment of a
child that imports its torch_p2p, and a loopback port for a child to listen on."""
from __future__ import annotations

import os
import socket

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the checkout
TESTS = os.path.join(ROOT, "tests")  # what the other suites add to sys.path to import this module


def pythonpath(*paths: str) -> str:
    """A PYTHONPATH that has this checkout first, then `paths` (empty ones left out)."""
    return os.pathsep.join(p for p in (ROOT, *paths) if p)


def checkout_env(**extra: str) -> dict:
    """This process's environment plus `extra`, for a child that must import this checkout's
    torch_p2p: the checkout comes first on its PYTHONPATH (extra's, else this process's)."""
    env = dict(os.environ, **extra)
    env["PYTHONPATH"] = pythonpath(env.get("PYTHONPATH", ""))
    return env


def free_port() -> int:
    """A loopback TCP port that nobody listens on right now."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
