"""The plugin as SGLang loads it: the backend name reaches SGLang's argument choices, its
enum and get_kv_class (also the copy prefill.py imported), and the built-in backends keep
theirs. Through the entry point where the environment declares it (pip install -e
".[sglang]"), through register() otherwise."""
from __future__ import annotations

import os
import subprocess
import sys
import tomllib

from checkout import ROOT, checkout_env  # tests/ is on sys.path (conftest, harness.py)

HERE = os.path.dirname(__file__)

SCRIPT = """
import sys; sys.path.insert(0, %r)
import stubs; stubs.install()
from importlib.metadata import entry_points
from sglang.srt.disaggregation import prefill, decode
from sglang.srt.plugins import load_plugins
from sglang.srt.plugins.hook_registry import HookRegistry
declared = any(ep.name == "torch_p2p" for ep in entry_points(group="sglang.srt.plugins"))
load_plugins()
if not declared:
    import torch_p2p.integrations.sglang as plugin
    plugin.register(); HookRegistry.apply_hooks()
from sglang.srt.arg_groups.choices import DISAGG_TRANSFER_BACKEND_CHOICES
from sglang.srt.disaggregation.utils import KVClassType, TransferBackend
assert "torch_p2p" in DISAGG_TRANSFER_BACKEND_CHOICES
for get in (prefill.get_kv_class, decode.get_kv_class):
    assert get(TransferBackend("torch_p2p"), KVClassType.SENDER).__name__ == "TorchP2PKVSender"
    assert get(TransferBackend("torch_p2p"), KVClassType.BOOTSTRAP_SERVER).__name__ == "TorchP2PKVBootstrapServer"
    assert get(TransferBackend("mooncake"), KVClassType.SENDER).__name__ == "MooncakeKVSender"
print("declared" if declared else "registered")
"""


def test_entry_point_is_declared():
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)
    assert project["project"]["entry-points"]["sglang.srt.plugins"] == {
        "torch_p2p": "torch_p2p.integrations.sglang:register"}
    assert "torch_p2p.integrations.sglang" in project["tool"]["setuptools"]["packages"]


def test_backend_reaches_sglang():
    out = subprocess.run([sys.executable, "-W", "ignore", "-c", SCRIPT % HERE], env=checkout_env(), capture_output=True,
                         text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] in ("declared", "registered")
