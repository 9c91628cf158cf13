"""tests_sglang: the torch_p2p transfer backend driven the way SGLang's scheduler drives one,
with SGLang's own code (its disaggregation classes, KVArgs, bootstrap server), each rank a
process of its own (rank.py). They run in a virtual environment with SGLang (.ci/run says
how) and skip without it."""
from __future__ import annotations

import os

import pytest

pytest.importorskip("sglang", reason="tests_sglang needs SGLang (see .ci/run)")

from harness import Rank  # noqa: E402  (and tests/ on sys.path, for checkout.py)


@pytest.fixture
def ranks():
    """Starts ranks (start(role, port, **opts)); kills them all at the end."""
    started = []

    def start(role, port=None, **opts):
        r = Rank(role, port, **opts)
        started.append(r)
        return r

    yield start
    for r in started:
        r.close()


def device():
    return os.environ.get("TORCH_P2P_SGLANG_DEVICE", "cpu")
