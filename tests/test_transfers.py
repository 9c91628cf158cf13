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
from conftest import DATA_PATHS
from peer import Peer

pytestmark = pytest.mark.timeout(240)

# A staging pool of 8 slots (4 for this engine's transfers, 4 for serving the peer's) of
# 128 KiB: the larger cases below need several rounds of slots.


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


def _random_rows(n: int, out_of: int, seed: int) -> list[int]:
    return torch.randperm(out_of, generator=torch.Generator().manual_seed(seed))[:n].tolist()


MANY_LOCAL, MANY_REMOTE = _random_rows(10_000, 20_000, 1), _random_rows(10_000, 20_000, 2)

# KV caches are [layers, blocks, block_size, heads, dim]; a block is cache[:, block], a view
# with one slab per layer.
KV_LOCAL_BLOCKS, KV_REMOTE_BLOCKS = [3, 7, 8, 15], [11, 0, 6, 5]

CASES = {
    "contiguous": Case((64, 256), (80, 256), lambda t: [t], lambda r: [r[8:72]]),
    "rows_and_elements": Case(
        (64, 256), (64, 256),
        lambda t: [t[3], t[10:20], t[63], t[7, 9]],
        lambda r: [r[40], r[0:10], r[-1], r[30, 2]]),
    "transposed_local": Case(
        (48, 64), (64, 48),
        lambda t: [t.t()[:32], t.t()[40:60:2, 1::3]],
        lambda r: [r[32:], r[2:12, :16]]),
    "transposed_remote": Case(
        (48, 64), (48, 64),
        lambda t: [t[:20], t[30:40, ::3]],
        lambda r: [r[10:30], r[0:10, ::3]],
        remote_transposed=True, mirror=False),
    "stepped": Case(
        (60, 100), (70, 120),
        lambda t: [t[::3, 1::2], t[1::7, ::9]],
        lambda r: [r[2:62:3, 10:110:2], r[61:70, :108:9]]),
    "sliced_3d": Case(
        (6, 40, 33), (8, 30, 40),
        lambda t: [t[1:4, 5:25, 3:30], t[5, :, 7]],
        lambda r: [r[4:7, 10:30, :27], r[0, 0, :]]),
    "kv_cache_blocks": Case(
        (4, 16, 8, 2, 16), (4, 12, 8, 2, 16),
        lambda c: [c[:, b] for b in KV_LOCAL_BLOCKS],
        lambda c: [c[:, b] for b in KV_REMOTE_BLOCKS]),
    "large_4MiB": Case((256, 4096), (300, 4096), lambda t: [t], lambda r: [r[20:276]]),
    "10k_small_views": Case(
        (20_000, 4), (20_000, 4),
        lambda t: [t[i] for i in MANY_LOCAL],
        lambda r: [r[i] for i in MANY_REMOTE]),
}


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
            into, out_of = (rv, lv) if write else (lv, rv)
            helpers.bits(into).copy_(helpers.bits(out_of))
        if write:
            before, expected = remote_before, expected_remote
        else:
            before, expected = helpers.poisoned(case.local_shape, dtype), expected_local
        assert not torch.equal(helpers.bits(expected), helpers.bits(before)), "the case moves nothing"
        helpers.assert_same_bits(link.fetch(name) if write else local, expected)
        if write:  # and the source is as it was
            helpers.assert_same_bits(local, helpers.random_tensor(case.local_shape, dtype, seed))
    finally:
        region.close()
        link.drop(name)


def _case_params(mirror: bool):
    return [pytest.param(case, id=name) for name, case in CASES.items() if case.mirror or not mirror]


DIRECTIONS = [pytest.param(True, id="write"), pytest.param(False, id="read")]


def test_data_path_is_what_the_engines_were_asked_for(link):
    staged = link.engine.data_path == "staged"
    name, remote = link.remote((4, 4))
    try:
        assert remote.staged == staged
        assert (len(remote.keys) == 0) == staged  # staged regions are not registered with the NICs
    finally:
        link.drop(name)


@pytest.mark.parametrize("write", DIRECTIONS)
@pytest.mark.parametrize("case", _case_params(mirror=False))
def test_explicit_views(link, case, write):
    """A list of RemoteTensors, one per view: view i goes to remote view i."""
    check_transfer(link, case, write=write, mirror=False)


@pytest.mark.parametrize("write", DIRECTIONS)
@pytest.mark.parametrize("case", _case_params(mirror=True))
def test_mirror(link, case, write):
    """One RemoteTensor laid out like the local tensor: each view keeps its element positions."""
    check_transfer(link, case, write=write, mirror=True)


@pytest.mark.parametrize("write", DIRECTIONS)
def test_spread_out_local_view_to_a_small_remote_tensor(link, write):
    """A column of a [256, 64] local tensor (its elements span 64 KiB) to or from a remote
    [256] tensor (1 KiB): the remote bounds are those of the remote view."""
    column = Case((256, 64), (256,), lambda t: [t[:, 5]], lambda r: [r[:]], mirror=False)
    check_transfer(link, column, write=write, mirror=False)


@pytest.mark.parametrize("write", DIRECTIONS)
def test_empty_views_move_nothing(link, write):
    """An empty view (a slice of no rows) next to a real one: it moves nothing, the other arrives."""
    case = Case((64, 256), (64, 256), lambda t: [t[3], t[5:5]], lambda r: [r[40], r[20:20]])
    check_transfer(link, case, write=write, mirror=False)


DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.complex64, torch.int8,
          torch.uint8, torch.int16, torch.int32, torch.int64, torch.bool]


@pytest.mark.parametrize("write", DIRECTIONS)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_dtypes(link, dtype, write):
    for seed, name in enumerate(["rows_and_elements", "stepped", "kv_cache_blocks"]):
        check_transfer(link, CASES[name], write=write, mirror=False, dtype=dtype, seed=seed)
    check_transfer(link, CASES["transposed_local"], write=write, mirror=True, dtype=dtype, seed=7)


@pytest.mark.parametrize("write", DIRECTIONS)
def test_one_call_spans_several_regions_on_each_side(link, write):
    """Views of two local tensors go to views of two remote tensors of the peer in one call."""
    a, b = ((helpers.random_tensor((32, 64), torch.float32, s) for s in (1, 2)) if write
            else (helpers.poisoned((32, 64), torch.float32) for _ in range(2)))
    seeds = (None, None) if write else (3, 4)
    (name_x, x), (name_y, y) = (link.remote((40, 64), seed=s) for s in seeds)
    regions = [link.engine.register(t) for t in (a, b)]
    try:
        pairs = [(a[0:8], x[0:8]), (b[0:8], x[8:16]), (a[8:16], y[32:40]), (b[::4], y[0:32:4])]
        move = link.engine.write_slices if write else link.engine.read_slices
        p2p.wait(move([lv for lv, _ in pairs], [rv for _, rv in pairs]), timeout=60)

        if write:
            want = {name: helpers.poisoned((40, 64), torch.float32) for name in (name_x, name_y)}
            targets = [want[name_x][0:8], want[name_x][8:16], want[name_y][32:40], want[name_y][0:32:4]]
            for t, (lv, _) in zip(targets, pairs):
                helpers.bits(t).copy_(helpers.bits(lv))
            for name in (name_x, name_y):
                helpers.assert_same_bits(link.fetch(name), want[name])
        else:
            xs, ys = (helpers.random_tensor((40, 64), torch.float32, s) for s in seeds)
            want_a, want_b = (helpers.poisoned((32, 64), torch.float32) for _ in range(2))
            for t, src in zip([want_a[0:8], want_b[0:8], want_a[8:16], want_b[::4]],
                              [xs[0:8], xs[8:16], ys[32:40], ys[0:32:4]]):
                helpers.bits(t).copy_(helpers.bits(src))
            helpers.assert_same_bits(a, want_a)
            helpers.assert_same_bits(b, want_b)
    finally:
        for r in regions:
            r.close()
        link.drop(name_x)
        link.drop(name_y)


# -- Staging pool much smaller than a transfer --------------------------------------------------

@pytest.mark.timeout(180)
def test_tiny_staging_pool_applies_back_pressure(provider):
    """2 slots of 64 KiB per engine (one for its transfers, one for serving) against 16 MiB
    in one call, then several calls in flight at once: all of it arrives, in both directions."""
    tiny = dict(data_path="staged", staging_bytes=128 << 10, staging_slot_bytes=64 << 10)
    with Peer() as b:
        link = helpers.Link(b, provider, **tiny)
        try:
            whole = Case((4, 1 << 20), (4, 1 << 20), lambda t: [t], lambda r: [r[:]])
            check_transfer(link, whole, write=True, mirror=False, seed=1)
            check_transfer(link, whole, write=False, mirror=True, seed=2)

            # Four writes and four reads in flight together, competing for the two slots.
            src = helpers.random_tensor((8, 1 << 18), torch.float32, 3)
            out = helpers.poisoned((8, 1 << 18), torch.float32)
            name_w, dst = link.remote((8, 1 << 18))
            name_r, theirs = link.remote((8, 1 << 18), seed=4)
            with link.engine.register(src), link.engine.register(out):
                futures = [link.engine.write_slices([src[2 * i:2 * i + 2]], [dst[2 * i:2 * i + 2]])
                           for i in range(4)]
                futures += [link.engine.read_slices([out[2 * i:2 * i + 2]], [theirs[2 * i:2 * i + 2]])
                            for i in range(4)]
                for f in futures:
                    p2p.wait(f, timeout=120)
                helpers.assert_same_bits(link.fetch(name_w), src)
                helpers.assert_same_bits(out, helpers.random_tensor((8, 1 << 18), torch.float32, 4))
        finally:
            link.close()


# -- Registrations split into pieces ----------------------------------------------------------

PIECE_BYTES = 64 << 10

# 512 x 512 float32 = 1 MiB: 16 pieces of 32 rows on both sides.
PIECE_CASES = {
    "whole": Case((512, 512), (512, 512), lambda t: [t], lambda r: [r[:]]),
    "shifted_rows": Case((512, 512), (512, 512), lambda t: [t[10:300]], lambda r: [r[100:390]]),
    "stepped": Case((512, 512), (512, 512), lambda t: [t[::3, 100:400]], lambda r: [r[1::3, :300]]),
    "odd_offsets_1d": Case((1 << 18,), (1 << 18,), lambda t: [t[1001:200001]], lambda r: [r[33333:232333]]),
}


@pytest.mark.timeout(180)
@pytest.mark.parametrize("local_path", ["direct", "staged"])
def test_transfers_cross_registration_pieces(provider, local_path, monkeypatch):
    """With 64 KiB registration pieces, views whose bytes cross piece boundaries at different
    places on the two sides arrive intact. A staged local engine exercises the slot path
    into the peer's pieces."""
    monkeypatch.setenv("TORCH_P2P_MR_PIECE_BYTES", str(PIECE_BYTES))
    with Peer(env={"TORCH_P2P_MR_PIECE_BYTES": str(PIECE_BYTES)}) as b:
        link = helpers.Link(b, provider, remote_options=dict(data_path=None), **DATA_PATHS[local_path])
        try:
            pieces = (1 << 20) // PIECE_BYTES
            name, remote = link.remote((512, 512))
            assert len(remote.keys) == pieces  # a key per piece and rail (one rail)
            link.drop(name)
            if local_path == "direct":  # the setting reached this process's engine too
                with link.engine.register(torch.zeros(512, 512)) as region:
                    assert len(region.remote.keys) == pieces
            for seed, case in enumerate(PIECE_CASES.values()):
                for write in (True, False):
                    check_transfer(link, case, write=write, mirror=False, seed=seed)
                check_transfer(link, case, write=True, mirror=True, seed=seed)
        finally:
            link.close()


# -- Several rails on one host ------------------------------------------------------------------

@pytest.fixture(scope="module")
def rails_peer():
    with Peer() as b:
        yield b


@pytest.mark.timeout(180)
@pytest.mark.parametrize("path", DATA_PATHS)
@pytest.mark.parametrize("local_rails,remote_rails", [(4, 4), (1, 3), (3, 1)])
def test_several_rails(rails_peer, local_rails, remote_rails, path):
    """tcp on "lo" with several rails per engine (each its own domain and endpoint), also with
    different rail counts on the two sides."""
    link = helpers.Link(rails_peer, "tcp", num_rails=local_rails, remote_options=dict(num_rails=remote_rails),
                        **DATA_PATHS[path])
    try:
        assert len(link.engine.rails) == local_rails
        name, remote = link.remote((4, 4))
        assert len(remote.keys) == (0 if path == "staged" else remote_rails)  # one key per rail
        link.drop(name)
        for seed, case in enumerate(["large_4MiB", "kv_cache_blocks", "10k_small_views"]):
            for write in (True, False):
                check_transfer(link, CASES[case], write=write, mirror=False, seed=seed)
    finally:
        link.close()
