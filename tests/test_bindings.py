"""The bindings' in-place reads of Python objects (csrc/bindings/objects.h, futures.h,
engine/view_pages.h): each is checked on the live classes when torch_p2p.engine loads, and one
whose check fails is replaced by pybind11's (or the dispatcher's) path. On the torch this is
built against every one must be on: a torch, pybind11 or Python upgrade that breaks one fails
here, not silently in a call. With every one off, the calls still do what they do with them.
"""
from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

import torch_p2p as p2p  # noqa: F401 - sets the classes, which runs the checks
from torch_p2p import _C

pytestmark = pytest.mark.timeout(600)

TESTS = pathlib.Path(__file__).resolve().parent


def test_every_in_place_read_is_on():
    paths = _C._fast_paths()
    assert paths == {"remote_tensor_slot": True, "remote_view_holder": True, "future_init": True,
                     "pages_without_dispatcher": True}


SAFE_RUN = """
import sys
import pytest
import torch_p2p as p2p
from torch_p2p import _C
_C._disable_fast_paths()
assert not any(_C._fast_paths().values()), _C._fast_paths()
sys.exit(pytest.main(sys.argv[1:]))
"""


def test_calls_on_the_safe_paths():
    """The views, RemoteTensor and API-error suites with every in-place read off."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(TESTS.parent), os.environ.get("PYTHONPATH", "")]))
    files = [str(TESTS / f) for f in ("test_views.py", "test_remote_tensor.py", "test_api_errors.py")]
    r = subprocess.run([sys.executable, "-c", SAFE_RUN, "-q", "-x", "-p", "no:cacheprovider", *files],
                       cwd=TESTS, env=env, capture_output=True, text=True, timeout=580)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
