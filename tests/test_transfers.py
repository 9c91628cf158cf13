"""Two processes move strided views of tensors to each other: writes and reads, per provider
and data path, for many layouts and dtypes.

Every case fills the sources with seeded random bits and every destination byte with poison
(helpers.POISON) first. After the transfer the whole destination tensor must equal, bit for
bit, what torch computes for the same views: the targeted elements hold the source's bits,
every other byte still holds the poison.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import pytest
import torch

import helpers
import torch_p2p as p2p
from conftest import PROVIDERS
from peer import Peer

pytestmark = pytest.mark.timeout(240)

# A staging pool of 8 slots (4 for this engine's transfers, 4 for serving the peer's) of
# 128 KiB: the larger cases below need several rounds of slots.
STAGED = dict(data_path="staged", staging_bytes=1 << 20, staging_slot_bytes=128 << 10)
DATA_PATHS = {"direct": {}, "staged": STAGED}


@dataclasses.dataclass(frozen=True)
class Case:
    """Views of a local [local_shape] tensor paired with views of a remote [remote_shape] one.

    In explicit mode view i of local_views goes to (or comes from) view i of remote_views.
    remote_views may only index, so that it applies to a RemoteTensor and to a torch tensor
    alike: on the latter it computes the expected result. Explicit destinations never overlap.
    In mirror mode the remote tensor is laid out like the local one and each local view lands
    at its own element positions; remote_views is not used.
    """

    local_shape: tuple
    remote_shape: tuple  # the handle's shape: transposed already if remote_transposed
    local_views: Callable[[torch.Tensor], list]
    remote_views: Callable[[object], list]
    remote_transposed: bool = False  # the peer registers the transpose of a contiguous tensor
    mirror: bool = True  # mirror mode needs identical layouts on both sides

    @property
    def remote_base_shape(self) -> tuple:
        return self.remote_shape[::-1] if self.remote_transposed else self.remote_shape


def check_transfer(link: helpers.Link, case: Case, *, write: bool, mirror: bool,
                   dtype: torch.dtype = torch.float32, seed: int = 0) -> None:
    """Runs one case through link and compares both whole tensors with torch's answer."""
    assert case.mirror or not mirror
    transposed = case.remote_transposed and not mirror
    remote_base_shape = case.local_shape if mirror else case.remote_base_shape
    if write:
        local = helpers.random_tensor(case.local_shape, dtype, seed)
        name, remote = link.remote(remote_base_shape, dtype, transpose=transposed)
        remote_before = helpers.poisoned(remote_base_shape, dtype)
    else:
        local = helpers.poisoned(case.local_shape, dtype)
        name, remote = link.remote(remote_base_shape, dtype, seed=seed, transpose=transposed)
        remote_before = helpers.random_tensor(remote_base_shape, dtype, seed)
    region = link.engine.register(local)
    try:
        move = link.engine.write_slices if write else link.engine.read_slices
        dst = remote if mirror else case.remote_views(remote)
        p2p.wait(move(case.local_views(local), dst), timeout=120)

        # What torch says: the same views of plain tensors, copied as bits.
        expected_local = local.clone() if write else helpers.poisoned(case.local_shape, dtype)
        expected_remote = remote_before.clone()
        remote_like = expected_remote.t() if transposed else expected_remote
        local_views = case.local_views(expected_local)
        remote_views = case.local_views(remote_like) if mirror else case.remote_views(remote_like)
        for lv, rv in zip(local_views, remote_views):
            src, dst = (lv, rv) if write else (rv, lv)
            helpers.bits(dst).copy_(helpers.bits(src))
        before, expected = (remote_before, expected_remote) if write else (helpers.poisoned(case.local_shape, dtype),
                                                                            expected_local)
        assert not torch.equal(helpers.bits(expected), helpers.bits(before)), "the case moves nothing"
        helpers.assert_same_bits(link.fetch(name) if write else local, expected)
    finally:
        region.close()
        link.drop(name)


# -- One peer process per module; a pair of engines per provider and data path ---------------

@pytest.fixture(scope="module")
def peer():
    with Peer() as b:
        yield b


@pytest.fixture(scope="module", params=[(p, d) for p in sorted(PROVIDERS) for d in DATA_PATHS],
                ids=lambda pd: "-".join(pd))
def link(request, peer):
    provider, path = request.param
    link = helpers.Link(peer, provider, **DATA_PATHS[path])
    yield link
    link.close()


DIRECTIONS = [pytest.param(True, id="write"), pytest.param(False, id="read")]


@pytest.mark.parametrize("write", DIRECTIONS)
def test_spread_out_local_view_to_a_small_remote_tensor(link, write):
    """A column of a [256, 64] local tensor (its elements span 64 KiB) to or from a remote
    [256] tensor (1 KiB): the remote bounds are those of the remote view."""
    column = Case((256, 64), (256,), lambda t: [t[:, 5]], lambda r: [r[:]], mirror=False)
    check_transfer(link, column, write=write, mirror=False)
