"""benchmarks/bw.py's peer-library baselines (NIXL, Mooncake) when their package is missing:
the run says why in one line and measures its rows without them."""
from __future__ import annotations

import os
import sys

import pytest

from checkout import ROOT

sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import _peer_library  # noqa: E402
import bw  # noqa: E402

pytestmark = pytest.mark.timeout(120)
MODULES = {"nixl": ("nixl", "nixl._api"), "mooncake": ("mooncake", "mooncake.engine")}


@pytest.fixture(params=sorted(MODULES))
def missing(request, monkeypatch):
    """A peer library whose package this process cannot import (None in sys.modules)."""
    for module in MODULES[request.param]:
        monkeypatch.setitem(sys.modules, module, None)
    return request.param


def test_reason_names_the_package_and_the_extra(missing):
    import torch

    why = _peer_library.peer_library_unavailable(missing, torch.device("cpu"))
    assert why and "cannot be imported" in why and f"torch_p2p[{missing}]" in why and "\n" not in why
    with pytest.raises(_peer_library.PeerLibraryError, match="cannot be imported"):
        _peer_library.open_peer_library(missing, torch.device("cpu"), "127.0.0.1")


def test_bw_skips_it_and_measures_the_row(missing, capsys):
    code = bw.main(["--device", "cpu", "--provider", "tcp", "--sizes", "4K", "--pages", "16", "--layouts", "paged",
                    "--ops", "write", "--duration", "0.1", "--first-contact", "0", "--baseline", missing, "tcp"])
    out, err = capsys.readouterr()
    assert code == 0, out + err
    skips = [line for line in err.splitlines() if f"skipping the {missing} baseline" in line]
    assert len(skips) == 1 and "cannot be imported" in skips[0], err
    assert "tcp Gbps" in out and f"{missing} Gbps" not in out, out
