"""When a deregistered region goes (csrc/core/region_table.h): once no local operation holds
it and every peer that had to release it did, or its deadline passed. No engine, no peers."""
from torch_p2p import _C


def test_a_region_goes_once_released_and_unheld():
    t = _C._RegionTable()
    a, b = t.add(), t.add()
    t.hold(a)
    assert t.close(a, deadline=10.0)
    t.must_release(a, peer=7)
    t.must_release(a, peer=8)
    assert t.finish(now=1.0) == [] and t.answered(a) == 0
    t.released(a, peer=7)
    t.drop(a)
    assert t.finish(now=1.0) == []  # peer 8 has not released it
    t.forget_peer(8)  # a dead peer releases everything
    assert t.finish(now=1.0) == [a] and t.answered(a) == 1
    assert t.finish(now=1.0) == []
    assert t.live() == (b, [(b, b)])


def test_a_silent_peer_is_waited_for_until_the_deadline_but_a_holder_always():
    t = _C._RegionTable()
    a = t.add()
    t.hold(a)
    assert t.close(a, deadline=5.0)
    t.must_release(a, peer=1)
    assert t.finish(now=6.0) == []  # past the deadline, but a local operation holds it
    t.drop(a)
    assert t.finish(now=4.0) == []
    assert t.finish(now=6.0) == [a]


def test_closing_twice_waits_for_the_same_end_and_unknown_ids_answer_at_once():
    t = _C._RegionTable()
    a = t.add()
    t.hold(a)
    assert t.close(a, deadline=1.0)
    assert not t.close(a, deadline=1.0)  # an earlier close gave up waiting: join it
    assert t.answered(a) == 0
    assert not t.close(99, deadline=1.0) and t.answered(99) == 1
    t.drop(a)
    assert t.finish(now=0.0) == [a] and t.answered(a) == 2


def test_live_ranges_tell_peers_which_ids_are_gone():
    t = _C._RegionTable()
    ids = [t.add() for _ in range(6)]
    for i in (ids[1], ids[2], ids[4]):
        t.close(i, deadline=0.0)
    assert t.live() == (ids[-1], [(ids[0], ids[0]), (ids[3], ids[3]), (ids[5], ids[5])])
    t = _C._RegionTable()
    ids = [t.add() for _ in range(600)]
    for i in ids[1::2]:
        t.close(i, deadline=0.0)
    assert t.live() == (0, [])  # more than 256 ranges: too scattered to list, peers check nothing
