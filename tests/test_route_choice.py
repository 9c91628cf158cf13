"""Route choice and host identity: which route a host engine takes to a peer (the fabric, cma,
staged; never IPC for host memory), what an address says of its host and process, the cma
route's copy past the kernel's per-call limit, and the IPC setting (TORCH_P2P_IPC, ipc=)."""
import errno
import os

import pytest
import torch

import helpers
import torch_p2p as p2p
from torch_p2p import _C
from conftest import PEER_GPU, ROUTES, engine_kwargs, shares_memory
from peer import Peer
cuda = pytest.mark.cuda


def test_address_names_the_host_and_process():
    with p2p.Engine("cpu", **engine_kwargs("tcp")) as e:
        a = _C._decode_address(e.address)
        assert a["pid"] == os.getpid()
        boot = open("/proc/sys/kernel/random/boot_id").read().strip()
        assert a["host"].decode().startswith(boot + "/")
        assert a["routes"] & 1 == 0  # a host engine maps nothing (route 0 is the IPC route)


def test_host_engines_take_the_fabric_or_cma(provider):
    """Host memory never takes the IPC route: the fabric, or on one host the cma route where it
    is on; data_path="staged" keeps the staged path."""
    expected = ROUTES[provider]
    with p2p.Engine("cpu", **engine_kwargs(provider)) as a, p2p.Engine("cpu", **engine_kwargs(provider)) as b:
        t = torch.zeros(16)
        if shares_memory(provider):
            t.share_memory_()
        region = b.register(t)
        assert a.route(b.address) == expected
        assert a.route(region.remote) == expected
        with p2p.Engine("cpu", **engine_kwargs(provider, data_path="staged")) as c:
            assert c.route(b.address) == "staged"
        with pytest.raises(ValueError, match="invalid engine address"):
            a.route(b"x" * 40)
        with pytest.raises(TypeError):
            a.route(7)


def test_cma_copies_past_the_kernels_limit_per_call():
    """The kernel moves at most about 2 GiB per process_vm_writev / readv and returns a short
    count past that: the cma route's copy goes on where a call stopped. Five spans of the same
    512 MiB (2.5 GiB in all, into this process) move every byte; a span that runs past the end
    of a mapping is a fault, not a hang."""
    src = torch.arange(1 << 27, dtype=torch.int32)  # 512 MiB
    dst = torch.zeros_like(src)
    nbytes = src.numel() * 4
    spans = [(src.data_ptr(), dst.data_ptr(), nbytes)] * 5
    assert _C._cma_copy(os.getpid(), spans, True) == 0
    assert torch.equal(dst, src)
    dst.zero_()
    assert _C._cma_copy(os.getpid(), [(dst.data_ptr(), src.data_ptr(), 0)] + spans, False) == 0
    assert torch.equal(dst, src)
    small = torch.zeros(1024, dtype=torch.uint8)
    assert _C._cma_copy(os.getpid(), [(small.data_ptr(), 4096, 1024)], True) == errno.EFAULT


def test_ipc_setting_is_checked(monkeypatch):
    monkeypatch.setenv("TORCH_P2P_IPC", "yes")
    with pytest.raises(ValueError, match="TORCH_P2P_IPC must be 0 or 1"):
        p2p.Engine("cpu", **engine_kwargs("tcp"))


@cuda
def test_ipc_off_takes_the_fabric():
    with Peer() as b, p2p.Engine("cuda:0", **engine_kwargs("tcp", ipc=False)) as a:
        address = b.call(helpers.start_engine, "tcp", device=PEER_GPU)
        assert a.route(address) == "staged"
    with Peer(env={"TORCH_P2P_IPC": "0"}) as b, p2p.Engine("cuda:0", **engine_kwargs("tcp")) as a:
        address = b.call(helpers.start_engine, "tcp", device=PEER_GPU)
        assert a.route(address) == "staged"  # the peer maps nothing, so exports nothing either
