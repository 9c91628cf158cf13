"""TORCH_P2P as a Ray Direct Transport, with real Ray actors on a local cluster: what arrives
is bitwise what the owner returned, registrations do not pile up, and a dead or stopped owner
fails the fetch within seconds instead of hanging it."""
from __future__ import annotations

import os
import signal
import time

import pytest
import ray

from conftest import eventually, worker_env
from ray_actors import Node, digest, sample_tensors

from torch_p2p._shared import process_alive


@pytest.fixture(scope="module")
def pair(ray_cluster):
    a, b = Node.remote(), Node.remote()
    ray.get([a.pid.remote(), b.pid.remote()])
    return a, b


@pytest.fixture(scope="module")
def fabric_reader(ray_cluster):
    """A reader that takes the fabric instead of the cma route (which reads a stopped process's
    memory all the same): its reads need the owner's engine to answer, so stopping the owner
    holds them in flight."""
    reader = Node.options(runtime_env=worker_env(TORCH_P2P_CMA="0")).remote()
    ray.get(reader.pid.remote())
    return reader


def test_dtypes_shapes_and_views_arrive_bitwise(pair):
    a, b = pair
    ref = a.sample.remote(7)
    expected = ray.get(a.digests_of.remote(7))
    assert expected == [digest(t) for t in sample_tensors(7)]  # the same tensors here and there
    assert ray.get(b.digests.remote(ref)) == expected  # actor to actor
    assert ray.get(b.route_to.remote(ray.get(a.engine_address.remote()))) == "cma"  # the path it took
    assert [digest(t) for t in ray.get(ref)] == expected  # into the driver (its ray.get fetches)


def test_a_received_object_is_passed_on_bitwise(pair, ray_cluster):
    """owner -> relay -> receiver: the relay returns the host tensors it received (views of its
    receive buffer, which its engine registered already) through TORCH_P2P again."""
    a, b = pair
    c = Node.remote()
    expected = ray.get(a.digests_of.remote(9))
    relayed = b.relay.remote(a.sample.remote(9))
    assert ray.get(c.digests.remote(relayed)) == expected  # relay to actor
    assert [digest(t) for t in ray.get(relayed)] == expected  # relay to the driver
    del relayed
    # The relay's handles were views of its pooled buffer: once let go, the pool has it back
    # and no registration of the relay's is left over.
    assert eventually(lambda: (lambda n: n["storages"] == n["objects"] == n["pool_leased"] == 0)(
        ray.get(b.counts.remote()))), ray.get(b.counts.remote())
    ray.kill(c)


def test_256_mib_arrives_bitwise(pair):
    a, b = pair
    size = 256 << 20
    ref = a.random.remote(size, 3)
    expected = ray.get(a.digests_of.remote(3, size))
    assert ray.get(b.digests.remote(ref)) == expected
    assert ray.get(b.route_to.remote(ray.get(a.engine_address.remote()))) == "cma"
    del ref


def test_1000_transfers_leave_nothing_registered(pair):
    a, b = pair

    def transfers(first: int, count: int):
        for start in range(first, first + count, 100):
            numbers = range(start, start + 100)
            assert ray.get([b.numbered_check.remote(a.numbered.remote(n, 16384)) for n in numbers]) == list(numbers)

    def settled():
        # Ray frees an object on its owner (garbage_collect) after the last reference goes; a
        # receive buffer goes back to the pool when the tensors on it die, and stays registered.
        counts = ray.get([a.counts.remote(), b.counts.remote()])
        return counts if all(c["storages"] == c["objects"] == c["fetches"] == c["pool_leased"] == 0
                             and c["engine_regions"] == c["pool_idle"] for c in counts) else None

    transfers(0, 100)  # engines, connections and allocator pools reach their steady state
    before = eventually(settled)
    assert before, ray.get([a.counts.remote(), b.counts.remote()])
    transfers(100, 1000)
    after = eventually(settled)
    assert after, ray.get([a.counts.remote(), b.counts.remote()])
    for was, now in zip(before, after):
        assert now["rss"] - was["rss"] < 64 << 20, (was, now)
        assert now["pool_idle_bytes"] - was["pool_idle_bytes"] < 64 << 20, (was, now)


def _stopped_owner_fetch(reader, seed: int):
    """A new owner, stopped (SIGSTOP) with a 64 MiB object that `reader` is fetching: (owner,
    its pid, ref, the reader's pending task)."""
    owner = Node.remote()
    pid = ray.get(owner.pid.remote())
    ref = owner.random.remote(64 << 20, seed)
    ready, _ = ray.wait([ref], timeout=60)
    assert ready, "the owner did not make the object"
    os.kill(pid, signal.SIGSTOP)
    pending = reader.digests.remote(ref)
    assert eventually(lambda: ray.get(reader.counts.remote())["fetches"] == 1), "the fetch never started"
    assert ray.wait([pending], timeout=0.5)[0] == [], "the fetch ended while its owner was stopped"
    return owner, pid, ref, pending


def test_owner_killed_mid_fetch_fails_it_within_seconds(pair, fabric_reader):
    reader = fabric_reader
    owner, pid, ref, pending = _stopped_owner_fetch(reader, 5)
    killed = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    # The reader's fetch fails in TORCH_P2P with the engine's verdict on the owner (its task's
    # error is an instance of the fetch's), not elsewhere in Ray.
    with pytest.raises(ray.exceptions.RayDirectTransportError, match=r"TORCH_P2P: the transfer .* failed: PeerError"):
        ray.get(pending, timeout=60)
    assert time.monotonic() - killed < 15
    assert eventually(lambda: ray.get(reader.counts.remote())["fetches"] == 0)
    assert ray.get(reader.counts.remote())["storages"] == 0
    # The reader goes on with live owners.
    live = pair[0]
    assert ray.get(reader.digests.remote(live.sample.remote(11))) == ray.get(live.digests_of.remote(11))


def test_owner_killed_before_the_drivers_fetch_fails_it_within_seconds(pair):
    owner = Node.remote()
    pid = ray.get(owner.pid.remote())
    ref = owner.sample.remote(13)
    assert ray.wait([ref], timeout=60)[0]
    ray.kill(owner)
    killed = time.monotonic()
    # Gone before the fetch starts: a killed worker may take a moment to exit, and a fetch from a
    # live owner succeeds with the owner's bytes.
    assert eventually(lambda: not process_alive(pid), timeout=10), "the killed owner's process is still there"
    # The driver's own fetch fails in TORCH_P2P (the engine's verdict on the owner), not
    # elsewhere in Ray.
    with pytest.raises(ray.exceptions.RayDirectTransportError, match=r"TORCH_P2P: the transfer .* failed: PeerError"):
        ray.get(ref, timeout=60)
    assert time.monotonic() - killed < 15
    a, b = pair
    assert ray.get(b.digests.remote(a.sample.remote(14))) == ray.get(a.digests_of.remote(14))


def test_abort_cancels_a_fetch_in_flight_and_the_owner_serves_again(fabric_reader):
    reader = fabric_reader
    owner, pid, ref, pending = _stopped_owner_fetch(reader, 6)
    try:
        aborted = time.monotonic()
        ray.get(reader.abort.remote(ref.hex()))
        with pytest.raises(ray.exceptions.RayDirectTransportError, match="failed: CancelledError"):
            ray.get(pending, timeout=60)
        assert time.monotonic() - aborted < 5
        assert eventually(lambda: ray.get(reader.counts.remote())["fetches"] == 0)
    finally:
        os.kill(pid, signal.SIGCONT)
    assert ray.get(reader.digests.remote(ref)) == ray.get(owner.digests_of.remote(6, 64 << 20))
    ray.kill(owner)


def test_owner_stopped_past_the_timeout_fails_the_fetch_and_serves_after_it_resumes(pair, fabric_reader):
    """The fetch fails on the engine's peer_timeout; the reader's memory handed out after the
    failure keeps its bytes once the owner resumes; the next fetch from that owner works."""
    reader, live = fabric_reader, pair[0]
    owner, pid, ref, pending = _stopped_owner_fetch(reader, 8)
    try:
        stopped = time.monotonic()
        with pytest.raises(ray.exceptions.RayDirectTransportError, match=r"failed: PeerError\(.*\(peer_timeout\)"):
            ray.get(pending, timeout=60)
        assert time.monotonic() - stopped < 15
        assert eventually(lambda: ray.get(reader.counts.remote())["fetches"] == 0)
        # The reader goes on: a fetch of the same size from a live owner, kept on its buffer.
        kept = ray.get(reader.keep.remote(live.random.remote(64 << 20, 9)))
        assert kept == ray.get(live.digests_of.remote(9, 64 << 20))
    finally:
        os.kill(pid, signal.SIGCONT)
    # The resumed owner serves the object the failed fetch wanted, and a new one.
    assert ray.get(reader.digests.remote(ref), timeout=60) == ray.get(owner.digests_of.remote(8, 64 << 20))
    assert ray.get(reader.digests.remote(owner.random.remote(64 << 20, 10)), timeout=60) == \
        ray.get(owner.digests_of.remote(10, 64 << 20))
    assert ray.get(reader.kept_digests.remote()) == kept  # nothing of the failed fetch landed
    assert ray.get(reader.route_to.remote(ray.get(owner.engine_address.remote()))) == "direct"  # the fabric
    ray.kill(owner)
