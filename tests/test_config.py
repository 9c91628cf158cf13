"""The settings table (csrc/core/config.h): arguments, then TORCH_P2P_* variables, then the
provider's defaults, then the table's. _C.Setup only resolves settings and queries the
provider; an engine is started only for a setting that its rails apply."""
import pytest

import torch_p2p as p2p
from torch_p2p import _C
from conftest import engine_kwargs

MiB = 1 << 20


def table():
    return {key: (variable, default) for key, variable, default in _C.settings()}


def test_table_lists_variables_and_defaults():
    rows = table()
    assert rows["max_chunk_bytes"] == ("TORCH_P2P_MAX_CHUNK", str(4 * MiB))
    assert rows["staging_bytes"] == ("TORCH_P2P_STAGING_BYTES", str(64 * MiB))
    assert rows["timeout"] == ("", "120")
    assert rows["ipc"] == ("TORCH_P2P_IPC", "1")
    assert all(v.startswith("TORCH_P2P_") for v, _ in rows.values() if v)


def test_arguments_then_environment_then_defaults(monkeypatch):
    monkeypatch.setenv("TORCH_P2P_STAGING_BYTES", str(8 * MiB))
    monkeypatch.setenv("TORCH_P2P_TX_DEPTH", "64")
    monkeypatch.setenv("TORCH_P2P_MIN_CHUNK", "")  # an empty variable is no choice
    setup = _C.Setup(dict(provider="tcp", staging_bytes=2 * MiB, timeout=None))
    assert setup.setting("staging_bytes") == 2 * MiB
    assert setup.setting("tx_depth") == 64
    assert setup.setting("min_chunk_bytes") == 64 << 10
    assert setup.setting("timeout") == 120.0
    assert setup.provider.startswith("tcp") and setup.nics


def test_pinned_worker_spins_unless_told(monkeypatch):
    setup = _C.Setup(dict(provider="tcp"))
    setup.place(["lo"], 0, [0])
    assert setup.setting("spin_us") == -1
    monkeypatch.setenv("TORCH_P2P_SPIN_US", "50")
    setup = _C.Setup(dict(provider="tcp"))
    setup.place(["lo"], 0, [0])
    assert setup.setting("spin_us") == 50


@pytest.mark.parametrize("var, value, message", [
    ("TORCH_P2P_IPC", "yes", "TORCH_P2P_IPC must be 0 or 1"),
    ("TORCH_P2P_POST_BATCH", "many", "TORCH_P2P_POST_BATCH must be an integer"),
    ("TORCH_P2P_MAX_CHUNK", "-1", "TORCH_P2P_MAX_CHUNK must be an integer"),
    ("TORCH_P2P_POST_BATCH", "0", "sizes and batch must be positive"),
    ("TORCH_P2P_CMA_PTRACE", "all", 'TORCH_P2P_CMA_PTRACE must be "peers" or "any"'),
])
def test_bad_variables_raise(monkeypatch, var, value, message):
    monkeypatch.setenv(var, value)
    with pytest.raises(ValueError, match=message):
        _C.Setup(dict(provider="tcp"))


def test_shm_chunk_is_a_provider_default(monkeypatch):
    try:
        setup = _C.Setup(dict(provider="shm"))
    except ValueError:
        pytest.skip("no shm provider here")
    assert setup.setting("max_chunk_bytes") == 64 * MiB
    monkeypatch.setenv("TORCH_P2P_MAX_CHUNK", str(MiB))
    assert _C.Setup(dict(provider="shm")).setting("max_chunk_bytes") == MiB
    assert _C.Setup(dict(provider="shm", max_chunk_bytes=2 * MiB)).setting("max_chunk_bytes") == 2 * MiB


def test_provider_profile_is_one_table():
    """Every provider quirk comes from csrc/fabric/profile.h, matched by the stack's first name."""
    assert _C.provider_profile("tcp;ofi_rxm") == _C.provider_profile("tcp")
    assert _C.default_providers() == ["efa", "verbs", "tcp"]
    assert set(_C.default_providers()) < set(_C.provider_names())
    shm = _C.provider_profile("shm")
    assert not shm["remote"] and shm["max_chunk"] == 64 * MiB and shm["peers_must_release"] and shm["known_problem"]
    assert shm["target_progress"]
    assert not any(_C.provider_profile(p)["target_progress"] for p in ("efa", "verbs", "tcp"))
    assert _C.provider_profile("tcp")["rails_from_cores"] and _C.provider_profile("tcp")["auto_progress"]
    assert _C.provider_profile("efa")["rdma"] and not _C.provider_profile("efa")["auto_progress"]
    unknown = _C.provider_profile("sockets")
    assert unknown["name"] == "" and unknown["remote"] and not any(
        unknown[k] for k in ("rdma", "auto_progress", "max_chunk", "peers_must_release", "target_progress",
                             "known_problem"))


@pytest.mark.parametrize("provider, value, cuda_ipc", [
    ("shm", None, True), ("shm", "0", False), ("shm", "1", True), ("tcp", None, False)])
def test_hmem_device_only_setting(monkeypatch, provider, value, cuda_ipc):
    """TORCH_P2P_HMEM_DEVICE_ONLY (shm): on by default, the rail registers CUDA memory
    FI_HMEM_DEVICE_ONLY, so that shm moves it by CUDA IPC and the fabric route fences its
    transfers; 0 leaves it to shm's host bounce buffers. The rail's decision is made for host
    engines too, which shows it here; tests/test_cuda.py shows what it changes for GPU memory."""
    if value is None:
        monkeypatch.delenv("TORCH_P2P_HMEM_DEVICE_ONLY", raising=False)
    else:
        monkeypatch.setenv("TORCH_P2P_HMEM_DEVICE_ONLY", value)
    with p2p.Engine("cpu", **engine_kwargs(provider)) as e:
        assert [r["cuda_ipc"] for r in e.rails] == [cuda_ipc] * len(e.rails)
