"""The striper alone (csrc/core/striper.h), through the private _C._stripe bindings: how a
call's runs become RMA segments over rail pairs, and staged calls slot jobs. No engine, no
process."""
import pytest

from torch_p2p import _C

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
GATHER_BELOW = 256 * KiB  # kGatherBelow
HUGE = 1 << 62            # a piece larger than anything here: no piece boundary


def stripe(runs, local=None, remote=None, L=1, R=1, min_chunk=64 * KiB, max_chunk=4 * MiB, max_iov=4):
    """runs: (local address, remote offset, len, lreg, rreg). local: (base, piece) per lreg."""
    local = local or [(0, HUGE)]
    remote = remote or [HUGE]
    return _C._stripe(runs, local, remote, L, R, min_chunk, max_chunk, max_iov)


def covered(ops, runs):
    """Every byte of every run exactly once, in order."""
    segs = [s for _, _, op in ops for s in op]
    pos = {}
    for run, offset, length, *_ in segs:
        assert offset == pos.get(run, 0), (run, offset)
        pos[run] = offset + length
    assert {i: p for i, p in pos.items()} == {i: r[2] for i, r in enumerate(runs)}


def test_one_large_run_is_cut_into_one_chunk_per_rail_pair():
    runs = [(0, 0, 64 * MiB, 0, 0)]
    chunk, ops = stripe(runs, L=2, R=4, max_chunk=64 * MiB)
    assert chunk == 16 * MiB  # 4 pairs: every rail of the larger side carries a share
    assert [(l, r) for l, r, _ in ops] == [(0, 0), (1, 1), (0, 2), (1, 3)]
    assert all(len(segs) == 1 and segs[0][2] == 16 * MiB for _, _, segs in ops)
    covered(ops, runs)


def test_chunk_is_clamped_by_min_and_max():
    assert stripe([(0, 0, 100, 0, 0)], L=4, R=4)[0] == 64 * KiB
    chunk, ops = stripe([(0, 0, 1 * GiB, 0, 0)], L=2, R=2, max_chunk=4 * MiB)
    assert chunk == 4 * MiB
    assert len(ops) == 256
    assert all(s[2] == 4 * MiB for _, _, segs in ops for s in segs)


def test_segments_never_cross_a_local_piece():
    # The local region starts at 1000 and is registered in 1 MiB pieces; the run starts
    # 100 bytes before the first piece boundary.
    base, piece = 1000, 1 * MiB
    runs = [(base + piece - 100, 0, 3 * MiB, 0, 0)]
    _, ops = stripe(runs, local=[(base, piece)], max_chunk=64 * MiB)
    segs = [s for _, _, op in ops for s in op]
    assert [(s[2], s[3]) for s in segs] == [(100, 0), (1 * MiB, 1), (1 * MiB, 2), (1 * MiB - 100, 3)]
    covered(ops, runs)


def test_segments_never_cross_a_remote_piece():
    runs = [(0, 3 * MiB, 2 * MiB, 0, 0)]
    _, ops = stripe(runs, remote=[2 * MiB], max_chunk=64 * MiB)
    segs = [s for _, _, op in ops for s in op]
    # (run, offset, len, local piece, remote piece, offset in the remote piece)
    assert segs == [(0, 0, 1 * MiB, 0, 1, 1 * MiB), (0, 1 * MiB, 1 * MiB, 0, 2, 0)]


def test_many_small_runs_are_gathered_and_go_round_robin():
    runs = [(i * 128 * KiB, i * 64 * KiB, 64 * KiB, 0, 0) for i in range(16)]
    _, ops = stripe(runs, L=2, R=2, max_iov=4, max_chunk=4 * MiB)
    # 16 runs, 4 per op, ops alternating between the two rail pairs.
    assert [len(segs) for _, _, segs in ops] == [4, 4, 4, 4]
    assert [(l, r) for l, r, _ in ops] == [(0, 0), (1, 1), (0, 0), (1, 1)]
    covered(ops, runs)


def test_gathering_stops_at_the_rails_iov_limit_and_at_another_local_region():
    runs = [(i * MiB, i * KiB, KiB, 0 if i < 3 else 1, 0) for i in range(6)]
    _, ops = stripe(runs, local=[(0, HUGE), (0, HUGE)], max_iov=2)
    assert [[s[0] for s in segs] for _, _, segs in ops] == [[0, 1], [2], [3, 4], [5]]
    _, ops = stripe(runs, local=[(0, HUGE), (0, HUGE)], max_iov=1)
    assert len(ops) == 6


def test_large_segments_are_not_gathered():
    runs = [(0, 0, GATHER_BELOW, 0, 0), (1 * MiB, 1 * MiB, 4 * KiB, 0, 0)]
    _, ops = stripe(runs, max_iov=4)
    assert [len(segs) for _, _, segs in ops] == [1, 1]
    runs = [(0, 0, 4 * KiB, 0, 0), (1 * MiB, 1 * MiB, GATHER_BELOW, 0, 0)]
    _, ops = stripe(runs, max_iov=4)
    assert [len(segs) for _, _, segs in ops] == [1, 1]


def test_gathered_ops_stay_within_a_chunk():
    runs = [(i * MiB, i * MiB, 40 * KiB, 0, 0) for i in range(4)]
    chunk, ops = stripe(runs, min_chunk=100 * KiB, max_chunk=100 * KiB)
    assert chunk == 100 * KiB
    assert [len(segs) for _, _, segs in ops] == [2, 2]


def test_no_runs_make_no_ops():
    chunk, ops = stripe([], L=2, R=3)
    assert ops == []
    assert chunk == 64 * KiB
    assert _C._stripe_slots([], 4, 4096) == []


def test_bad_geometry_is_refused():
    with pytest.raises(ValueError):
        stripe([(0, 0, 10, 0, 1)])  # no remote region 1
    with pytest.raises(ValueError):
        stripe([(0, 0, 10, 0, 0)], local=[(0, 0)])
    with pytest.raises(ValueError):
        stripe([(0, 0, 10, 0, 0)], max_iov=0)


def test_slot_jobs_fill_slots_and_split_runs_at_their_end():
    runs = [(1000, 0, 6000, 0, 0), (9000, 8000, 5000, 0, 0)]
    jobs = _C._stripe_slots(runs, 16, 4096)
    assert [b for b, _ in jobs] == [4096, 4096, 2808]
    assert jobs[0][1] == [(1000, 0, 4096, 0, 0)]
    assert jobs[1][1] == [(5096, 4096, 1904, 0, 0), (9000, 8000, 2192, 0, 0)]
    assert jobs[2][1] == [(11192, 10192, 2808, 0, 0)]


def test_slot_jobs_hold_one_remote_region_and_at_most_max_runs():
    runs = [(i * 100, i * 100, 10, 0, 0 if i < 5 else 1) for i in range(8)]
    jobs = _C._stripe_slots(runs, 2, 1 << 20)
    assert [[r[1] // 100 for r in taken] for _, taken in jobs] == [[0, 1], [2, 3], [4], [5, 6], [7]]


def test_slot_size_is_whole_pages():
    assert _C._slot_size(0) == 4096
    assert _C._slot_size(4096) == 4096
    assert _C._slot_size(4097) == 8192
    assert _C._slot_size(128 << 10) == 128 << 10
