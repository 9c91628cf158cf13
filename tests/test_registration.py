"""How each memory kind registers with each provider's NICs (csrc/fabric/registration.h): the
decision the worker takes for every region, for every profile, and what doctor says of it on a
p5 (EFA) fixture. No GPU or NIC needed: the dma-buf path itself needs EFA or verbs hardware."""
import pytest

from torch_p2p import _C, doctor
from test_doctor import aws_report
from topologies import p5

RDMA = ("efa", "verbs")


@pytest.mark.parametrize("provider", _C.provider_names())
def test_host_memory_registers_as_it_is(provider):
    for hmem in (False, True):
        assert _C.registration(provider, hmem, hmem, "host")[0] == "host"


@pytest.mark.parametrize("provider", _C.provider_names())
@pytest.mark.parametrize("memory", ["cuda", "cuda_vmm"])
def test_gpu_memory_without_fi_hmem_is_staged(provider, memory):
    how, why = _C.registration(provider, False, False, memory)
    assert how == "staged" and "FI_HMEM" in why


@pytest.mark.parametrize("provider", _C.provider_names())
@pytest.mark.parametrize("memory", ["cuda", "cuda_vmm"])
def test_dmabuf_where_the_provider_offers_it(provider, memory):
    """libfabric >= 1.20 on efa or verbs: GPU memory, VMM or not, registers by dma-buf; a
    provider that does not register dma-bufs (shm, tcp) keeps FI_HMEM_CUDA even if offered."""
    how, why = _C.registration(provider, True, True, memory)
    assert _C.provider_profile(provider)["dmabuf"] == (provider in RDMA)
    assert how == ("dmabuf" if provider in RDMA else "hmem"), why


@pytest.mark.parametrize("provider", RDMA)
def test_before_1_20_gpu_memory_needs_peermem_and_vmm_may_be_staged(provider):
    how, why = _C.registration(provider, True, False, "cuda")
    assert how == "hmem" and "nvidia-peermem" in why
    how, why = _C.registration(provider, True, False, "cuda_vmm")
    assert how == "hmem" and "staging slots" in why


def test_bad_memory_kind_is_a_value_error():
    with pytest.raises(ValueError, match="'host', 'cuda' or 'cuda_vmm'"):
        _C.registration("efa", True, True, "gpu")


@pytest.mark.parametrize("version, dmabuf, how", [("1.22", True, "dmabuf"), ("1.19", False, "hmem")])
def test_doctor_tells_a_p5_user_how_gpu_memory_registers(tmp_path, version, dmabuf, how):
    report, _ = aws_report(p5(tmp_path), version=version)
    report["providers"]["efa"]["dmabuf"] = dmabuf  # what the query reports below 1.20
    text = doctor.render(report, doctor.diagnose(report))
    assert f"GPU memory registers: cuda {how}; vmm {how}" in text
    assert any("dma-buf" in p for p in (w["problem"] for w in doctor.diagnose(report))) == (not dmabuf)
