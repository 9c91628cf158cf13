"""The EFA-shaped profile (TORCH_P2P_PROFILE=efa): EFA's published limits kept on tcp and shm.
Rail enforces each limit as EFA would (an op that breaks one fails with -FI_EINVAL or
-FI_EMSGSIZE), so each test here fails if the engine's path ignores the limit it names."""
import pytest
import torch

import torch_p2p as p2p

MAX_RMA = 256 << 10  # fabric::EfaShape::kMaxRma


@pytest.fixture(params=["tcp", "shm"])
def pair(request, monkeypatch):
    monkeypatch.setenv("TORCH_P2P_PROFILE", "efa")
    with p2p.Engine("cpu", request.param) as a, p2p.Engine("cpu", request.param) as b:
        yield a, b


def pattern(n, seed):
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def test_keys_fit_efa_key_size(pair):
    a, b = pair
    for engine in pair:
        remote = engine.register(torch.zeros(1 << 16, dtype=torch.uint8)).remote
        assert remote.keys and all(0 <= k < 1 << 32 for k in remote.keys)


@pytest.mark.parametrize("nbytes", [MAX_RMA, MAX_RMA + 1, 4 * MAX_RMA + 3])
def test_transfers_split_at_the_rma_limit(pair, nbytes):
    a, b = pair
    src, dst = pattern(nbytes, 1), torch.zeros(nbytes + 8, dtype=torch.uint8)
    a.register(src)
    remote = b.register(dst).remote
    a.write_slices([src], [remote[4:4 + nbytes]]).wait()
    assert torch.equal(dst[4:4 + nbytes], src) and not dst[:4].any() and not dst[4 + nbytes:].any()
    back = torch.zeros(nbytes, dtype=torch.uint8)
    a.register(back)
    a.read_slices([back], [remote[4:4 + nbytes]]).wait()
    assert torch.equal(back, src)


def test_small_pages_go_one_iov_per_op(pair):
    a, b = pair
    pages, page = 256, 64
    src, dst = pattern(pages * page, 2).view(pages, page), torch.zeros(pages, page, dtype=torch.uint8)
    a.register(src)
    remote = b.register(dst).remote
    mine, theirs = torch.randperm(pages).tolist(), torch.randperm(pages).tolist()
    a.write_slices([p2p.pages(src, mine)], [p2p.pages(remote, theirs)]).wait()
    assert torch.equal(dst[theirs], src[mine])
    back = torch.zeros_like(src)
    a.register(back)
    a.read_slices([p2p.pages(back, mine)], [p2p.pages(remote, theirs)]).wait()
    assert torch.equal(back[mine], src[mine])


def test_views_and_notification_with_descriptors_and_no_cq_data(pair):
    """Every op carries a local descriptor (FI_MR_LOCAL) and no remote CQ data (EFA's is 4
    bytes): notify= goes as a message after the writes complete, so the bytes are there when
    the notification is."""
    a, b = pair
    src, dst = pattern(1 << 20, 3).view(256, 4096), torch.zeros(256, 4096, dtype=torch.uint8)
    a.register(src)
    remote = b.register(dst).remote
    arrived = b.notification(9, timeout=30)
    a.write_slices([src[:, :2048]], [remote[:, 2048:]], notify=9).wait()
    arrived.wait()
    assert torch.equal(dst[:, 2048:], src[:, :2048]) and not dst[:, :2048].any()


def test_a_larger_chunk_setting_is_held_to_the_limit(monkeypatch):
    monkeypatch.setenv("TORCH_P2P_PROFILE", "efa")
    monkeypatch.setenv("TORCH_P2P_MAX_CHUNK", str(16 << 20))
    with p2p.Engine("cpu", "tcp") as a, p2p.Engine("cpu", "tcp") as b:
        src, dst = pattern(8 << 20, 4), torch.zeros(8 << 20, dtype=torch.uint8)
        a.register(src)
        a.write_slices([src], [b.register(dst).remote]).wait()
        assert torch.equal(dst, src)


def test_unknown_profile_is_refused(monkeypatch):
    monkeypatch.setenv("TORCH_P2P_PROFILE", "ib")
    with pytest.raises(ValueError, match="TORCH_P2P_PROFILE"):
        p2p.Engine("cpu", "tcp")
