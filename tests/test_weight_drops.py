"""torch_p2p.weights when a destination fails a push: a relay killed mid-push is dropped and its
children repaired, one not ready in ready_timeout or lacking the version at `timeout` is
dropped, one stalled past peer_timeout learns that it is out and joins again; the relay tree
follows `fanout`. Destinations run in the module's Peer children (the `peers` fixture)."""
import time

import pytest

import peer_helpers as ph
import torch_p2p as p2p
from conftest import PEER_TIMEOUT
from peer import Peer
from weight_setup import BIG, Setup, dest_joined, dest_rejoin, dest_relayed, dest_stop_after, dest_version, dest_wait


@pytest.mark.timeout(120)
@pytest.mark.parametrize("position", [0, 1], ids=["head", "middle"])
def test_relay_killed_mid_push_is_dropped_and_repaired(peers, position):
    """A chain of three; one stops after two chunks and is killed (kill -9). Its parent (the
    source for the head, the head for the middle) adopts its child, which says what it lacks;
    the others get the version, the result names the dead one, and the next push goes to the
    survivors."""
    _, b, c = peers
    with Peer() as doomed, Setup("tcp", shapes=BIG, chunk_bytes=64 << 10, window=1) as s:
        order = [b, c]
        order.insert(position, doomed)
        for i, peer in enumerate(order):
            s.add(peer, "doomed" if peer is doomed else f"d{i}")
        doomed.start(dest_stop_after, "doomed", 2)
        fut = s.source.push()
        deadline = time.monotonic() + 30
        while not ph.stopped_now(doomed.pid):
            assert time.monotonic() < deadline and not fut.done(), "the relay never stopped mid-push"
            time.sleep(0.01)
        doomed.kill()
        result = p2p.wait(fut, 60)
        survivors = sorted(key for peer, key in s.dests if peer is not doomed)
        assert list(result.dropped) == ["doomed"] and "Error" in result.dropped["doomed"], result
        assert sorted(result.received) == survivors
        for peer, key in s.dests:
            if peer is not doomed:
                s.check(peer, key)
        s.load(2)
        result = p2p.wait(s.source.push(), 60)
        assert sorted(result.received) == survivors and result.dropped == {}
        s.check(c, dict((id(p), k) for p, k in s.dests)[id(c)])


@pytest.mark.timeout(120)
@pytest.mark.parametrize("fanout", [1, 2])
def test_relay_tree_follows_fanout(peers, fanout):
    """Three destinations of one layout: a chain (fanout 1) has two of them forward the version
    once each; a tree of fanout 2 has the first forward it to both others. The source writes it
    once either way."""
    a, b, c = peers
    with Setup("tcp", chunk_bytes=2048, fanout=fanout) as s:
        for i, peer in enumerate(peers):
            s.add(peer, f"f{i}")
        result = p2p.wait(s.source.push(), 60)
        assert sorted(result.received) == ["f0", "f1", "f2"] and result.dropped == {}
        whole = sum(t.numel() * 4 for t in s.full.values())
        assert result.bytes_sent == whole
        relayed = sorted(peer.call(dest_relayed, key) for peer, key in s.dests)
        assert relayed == ([0, whole, whole] if fanout == 1 else [0, 0, 2 * whole]), relayed
        for peer, key in s.dests:
            s.check(peer, key)


@pytest.mark.timeout(120)
def test_destination_not_ready_in_ready_timeout_is_dropped(peers):
    """A destination that does not answer the push's `begin` within ready_timeout (stopped,
    here) is dropped with that reason, before the engine's peer_timeout would say it is
    silent; the others get the version."""
    a, b, _ = peers
    with Setup("tcp", chunk_bytes=2048, ready_timeout=0.5) as s:
        s.add(a, "ready")
        s.add(b, "asleep")
        with ph.stopped(b.pid, 30):
            result = p2p.wait(s.source.push(), 20)
        assert result.received == ["ready"] and list(result.dropped) == ["asleep"], result
        assert "not ready within 0.5 s" in result.dropped["asleep"], result
        s.check(a, "ready")


@pytest.mark.timeout(120)
def test_push_longer_than_timeout_drops_who_lacks_it(peers):
    """A destination that stops mid-push is dropped once the push has taken `timeout`, with
    that reason (before peer_timeout); the others get the version."""
    a, _, _ = peers
    with Peer() as slow, Setup("tcp", shapes=BIG, chunk_bytes=64 << 10, window=1, timeout=0.5) as s:
        s.add(a, "fine")
        s.add(slow, "slow")
        slow.start(dest_stop_after, "slow", 2)
        try:
            result = p2p.wait(s.source.push(), 20)
        finally:
            ph.resume(slow.pid)
        slow.result(timeout=30)
        assert result.received == ["fine"] and list(result.dropped) == ["slow"], result
        assert "the push took more than 0.5 s" in result.dropped["slow"], result
        s.check(a, "fine")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("stalls", ["between versions", "mid-push"])
def test_destination_stalled_past_peer_timeout_learns_it_is_out(peers, stalls):
    """A destination stopped for longer than peer_timeout, before a push or in the middle of
    it, is dropped (the push ends for the others); resumed, it still names the last version
    whose every byte arrived, learns that it is out (rather than waiting as a member for versions
    that never come), joins again and receives the next version bitwise."""
    a, _, _ = peers
    with Peer() as slow, Setup("tcp", shapes=BIG, chunk_bytes=64 << 10, window=1) as s:
        s.add(a, "fine")
        s.add(slow, "slow")
        s.load(1)
        assert sorted(p2p.wait(s.source.push(), 60).received) == ["fine", "slow"]
        s.load(2)
        if stalls == "mid-push":
            slow.start(dest_stop_after, "slow", 2, 2)
        else:
            ph.stop(slow.pid)
        try:
            fut = s.source.push()
            deadline = time.monotonic() + 30
            while not ph.stopped_now(slow.pid):
                assert time.monotonic() < deadline and not fut.done(), "the destination never stopped mid-push"
                time.sleep(0.01)
            result = p2p.wait(fut, 30)  # its timeout (600 s) and ready_timeout (30 s) do not drop it
        finally:
            ph.resume(slow.pid)
        if stalls == "mid-push":
            slow.result(timeout=30)
        assert result.received == ["fine"] and list(result.dropped) == ["slow"], result
        assert "peer_timeout" in result.dropped["slow"], result
        s.check(a, "fine")
        assert slow.call(dest_version, "slow") == 1
        deadline = time.monotonic() + 10 * PEER_TIMEOUT
        while slow.call(dest_joined, "slow"):
            assert time.monotonic() < deadline, "the resumed destination never learnt it was dropped"
            time.sleep(0.05)
        slow.call(dest_rejoin, "slow")
        s.load(3)
        result = p2p.wait(s.source.push(), 60)
        assert sorted(result.received) == ["fine", "slow"] and result.dropped == {}, result
        assert slow.call(dest_wait, "slow", 3) == 3
        s.check(slow, "slow")
        s.check(a, "fine")
