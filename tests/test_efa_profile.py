"""The EFA-shaped profile (TORCH_P2P_PROFILE=efa): EFA's published limits kept on tcp and shm.
Rail enforces each limit as EFA would (an op that breaks one fails with -FI_EINVAL or
-FI_EMSGSIZE), so each test here fails if the engine's path ignores the limit it names. The
engines take the fabric route (conftest.fabric_pair: cma off, route() == "direct"): on the cma
route no RMA would be posted."""
import pytest
import torch

import torch_p2p as p2p
from conftest import engine_kwargs
from peer_helpers import pattern

MAX_RMA = 256 << 10  # fabric::EfaShape::kMaxRma


@pytest.fixture(autouse=True)
def efa_profile(monkeypatch):
    monkeypatch.setenv("TORCH_P2P_PROFILE", "efa")


def test_keys_fit_efa_key_size(fabric_pair):
    for engine in fabric_pair:
        remote = engine.register(torch.zeros(1 << 16, dtype=torch.uint8)).remote
        assert remote.keys and all(0 <= k < 1 << 32 for k in remote.keys)


@pytest.mark.parametrize("nbytes", [MAX_RMA, MAX_RMA + 1, 4 * MAX_RMA + 3])
def test_transfers_split_at_the_rma_limit(fabric_pair, nbytes):
    a, b = fabric_pair
    src, dst = pattern(1, nbytes), torch.zeros(nbytes + 8, dtype=torch.uint8)
    a.register(src)
    remote = b.register(dst).remote
    a.write_slices([src], [remote[4:4 + nbytes]]).wait()
    assert torch.equal(dst[4:4 + nbytes], src) and not dst[:4].any() and not dst[4 + nbytes:].any()
    back = torch.zeros(nbytes, dtype=torch.uint8)
    a.register(back)
    a.read_slices([back], [remote[4:4 + nbytes]]).wait()
    assert torch.equal(back, src)


def test_small_pages_go_one_iov_per_op(fabric_pair):
    a, b = fabric_pair
    pages, page = 256, 64
    src, dst = pattern(2, pages * page).view(pages, page), torch.zeros(pages, page, dtype=torch.uint8)
    a.register(src)
    remote = b.register(dst).remote
    mine, theirs = torch.randperm(pages).tolist(), torch.randperm(pages).tolist()
    a.write_slices([p2p.pages(src, mine)], [p2p.pages(remote, theirs)]).wait()
    assert torch.equal(dst[theirs], src[mine])
    back = torch.zeros_like(src)
    a.register(back)
    a.read_slices([p2p.pages(back, mine)], [p2p.pages(remote, theirs)]).wait()
    assert torch.equal(back[mine], src[mine])


def test_views_and_notification_with_descriptors_and_no_cq_data(fabric_pair):
    """Every op carries a local descriptor (FI_MR_LOCAL) and no remote CQ data (EFA's is 4
    bytes): notify= goes as a message after the writes complete, so the bytes are there when
    the notification is."""
    a, b = fabric_pair
    src, dst = pattern(3, 1 << 20).view(256, 4096), torch.zeros(256, 4096, dtype=torch.uint8)
    a.register(src)
    remote = b.register(dst).remote
    arrived = b.notification(9, timeout=30)
    a.write_slices([src[:, :2048]], [remote[:, 2048:]], notify=9).wait()
    arrived.wait()
    assert torch.equal(dst[:, 2048:], src[:, :2048]) and not dst[:, :2048].any()


def test_a_larger_chunk_setting_is_held_to_the_limit(monkeypatch):
    monkeypatch.setenv("TORCH_P2P_MAX_CHUNK", str(16 << 20))
    with p2p.Engine("cpu", **engine_kwargs("tcp")) as a, p2p.Engine("cpu", **engine_kwargs("tcp")) as b:
        src, dst = pattern(4, 8 << 20), torch.zeros(8 << 20, dtype=torch.uint8)
        a.register(src)
        remote = b.register(dst).remote
        assert a.route(remote) == "direct"
        a.write_slices([src], [remote]).wait()
        assert torch.equal(dst, src)


def test_unknown_profile_is_refused(monkeypatch):
    monkeypatch.setenv("TORCH_P2P_PROFILE", "ib")  # the autouse fixture's setting, replaced
    with pytest.raises(ValueError, match="TORCH_P2P_PROFILE"):
        p2p.Engine("cpu", "tcp")
