"""A failed call has stopped, between two hosts (network namespaces joined by a veth pair,
tests/netns.py): once a call's future fails, no byte of it moves any more, and an owner that
gave up on a peer takes nothing more from it. Each test freezes, cuts, kills or restarts one
host mid-stream, reuses the memory the failed calls named (as every caller does after a
failure), brings the host back, and checks every byte of both sides.

The tcp provider carries everything (cma and IPC off): on one machine, what other providers'
hosts would see is only what a real network gives them. The futures fail within peer_timeout
plus Worker::kCancelMarginS (2 s); MARGIN adds a loaded 2-core machine's slack.
"""
import os
import signal
import time

import pytest

import netns
import torch_p2p as p2p
from conftest import PEER_TIMEOUT
from peer import Peer

MB = 1 << 20
NBYTES = 64 * MB  # per host; CALLS calls of NBYTES / CALLS each, all in flight at once
CALLS = 4
OLD, NEW, ZERO = 0x11, 0x22, 0x00
MARGIN = 3.0
BOUND = PEER_TIMEOUT + 2.0 + MARGIN
PORT = 24750  # b's: its namespace is new, so nothing else listens there
RATE = "100mbit"  # the sender's link, throttled: CALLS x NBYTES / CALLS take about 5 s to move
# libfabric < 1.18's tcp provider reports and frees a half-received RMA read response twice
# when its connection closes: the reader's cut may crash it (docs/failures.md).
TCP_CUTS_READS = p2p._C.libfabric_version() >= (1, 18)

pytestmark = pytest.mark.timeout(180)


@pytest.fixture
def two():
    """(a, b, hosts): a Peer child in each namespace, each with its engine started there."""
    with netns.hosts() as h, Peer() as a, Peer() as b:
        a.address = a.call(netns.enter, h.namespaces[0], h.interfaces[0])
        b.address = b.call(netns.enter, h.namespaces[1], h.interfaces[1], port=PORT)
        yield a, b, h


def _started(a, kind: str, remote: bytes) -> None:
    """a's calls of `kind` to b's region `dst`, in flight."""
    a.call(netns.start_calls, kind, "src", remote, CALLS)


def _failed_in_bound(outcomes) -> None:
    assert all(err is not None for err, *_ in outcomes), outcomes
    assert all(err != "pending" and t < BOUND for err, t, _ in outcomes), outcomes


def _settle(seconds: float = 3.0) -> None:
    time.sleep(seconds)  # bytes still moving would land now; nothing signals their absence


@pytest.mark.parametrize("kind", ["write", pytest.param("read", marks=pytest.mark.skipif(
    not TCP_CUTS_READS, reason="libfabric < 1.18: closing a connection with a read response half received "
    "frees it twice in the tcp provider (SIGSEGV in rxm_handle_comp_error, seen here)"))])
def test_a_call_to_a_frozen_host_moves_nothing_after_it_failed(two, kind):
    """b stops mid-stream. a's calls fail; a refills its buffer with NEW; b resumes: no byte of
    NEW reaches b (write), no byte of b's memory reaches a's refilled buffer (read). The
    sender's link is throttled, so that the calls are still moving when b stops."""
    a, b, h = two
    h.throttle(0 if kind == "write" else 1, RATE)
    remote = b.call(netns.region, "dst", NBYTES, OLD if kind == "read" else ZERO)
    a.call(netns.region, "src", NBYTES, OLD if kind == "write" else ZERO)
    _started(a, kind, remote)
    os.kill(b.pid, signal.SIGSTOP)
    try:
        _failed_in_bound(a.call(netns.outcomes, BOUND + 5, timeout=BOUND + 30))
        a.call(netns.fill, "src", NEW)
    finally:
        os.kill(b.pid, signal.SIGCONT)
    _settle()
    if kind == "write":
        new, = b.call(netns.counts, "dst", [NEW])
        assert new == 0, f"{new} bytes written after the calls failed reached the frozen host"
    else:
        new, = a.call(netns.counts, "src", [NEW])
        assert new == NBYTES, f"{NBYTES - new} bytes of the reader's reused buffer were overwritten"
    # The host that came back is a new contact: a plain write reaches it.
    a.call(netns.fill, "src", OLD)
    a.call(netns.write_once, "src", remote, 30, timeout=60)
    assert b.call(netns.counts, "dst", [OLD]) == [NBYTES]


def test_a_cut_link_fails_the_calls_and_nothing_lands_once_it_is_back(two):
    """a's link goes down mid-stream (throttled, so that the writes are still moving): the calls
    fail, a refills its buffer, the link comes back: nothing of the failed calls lands."""
    a, b, h = two
    h.throttle(0, RATE)
    remote = b.call(netns.region, "dst", NBYTES, ZERO)
    a.call(netns.region, "src", NBYTES, OLD)
    _started(a, "write", remote)
    h.link(0, False)
    try:
        _failed_in_bound(a.call(netns.outcomes, BOUND + 5, timeout=BOUND + 30))
        a.call(netns.fill, "src", NEW)
    finally:
        h.link(0, True)
    _settle()
    assert b.call(netns.counts, "dst", [NEW]) == [0]
    a.call(netns.write_once, "src", remote, 30, timeout=60)
    assert b.call(netns.counts, "dst", [NEW]) == [NBYTES]


def test_an_owner_that_gave_up_on_a_writer_takes_nothing_more_from_it(two):
    """a writes into b, and b into a; a stops. b's write fails (b gives up on a) and b's
    memory is then left as it is: a's writes, resumed, do not land. a's link is slowed so
    that its writes are still in flight when it stops; b's write is larger than the sockets'
    buffers, so that it waits for a. (b writes rather than reads: TCP_CUTS_READS.)"""
    a, b, h = two
    h.throttle(0, "200mbit")
    remote_b = b.call(netns.region, "dst", NBYTES, ZERO)
    remote_a = a.call(netns.region, "src", NBYTES, OLD)
    b.call(netns.region, "push", 32 * MB, NEW)
    _started(a, "write", remote_b)
    deadline = time.monotonic() + 30
    while b.call(netns.counts, "dst", [OLD]) == [0]:  # a's writes are on the wire
        assert time.monotonic() < deadline, "a's writes did not start"
        time.sleep(0.01)
    os.kill(a.pid, signal.SIGSTOP)
    try:
        b.call(netns.start_calls, "write", "push", remote_a, 1)
        _failed_in_bound(b.call(netns.outcomes, BOUND + 5, timeout=BOUND + 30))
        b.call(netns.snapshot, "dst")
    finally:
        os.kill(a.pid, signal.SIGCONT)
    _settle()
    assert b.call(netns.changed_since_snapshot, "dst") == 0
    # Each of a's calls ended; one that succeeded had every byte in b before b gave up on a.
    outcomes = a.call(netns.outcomes, BOUND + 5, timeout=BOUND + 30)
    assert all(err != "pending" for err, *_ in outcomes), outcomes
    landed = b.call(netns.slices_all, "dst", CALLS, OLD)
    assert all(landed[i] for i, (err, *_) in enumerate(outcomes) if err is None), (outcomes, landed)


def test_a_killed_host_fails_the_calls_at_once(two):
    """kill -9: its kernel resets the connections, which fails the calls well before
    peer_timeout would."""
    a, b, _ = two
    remote = b.call(netns.region, "dst", NBYTES, ZERO)
    a.call(netns.region, "src", NBYTES, OLD)
    _started(a, "write", remote)
    b.kill()
    outcomes = a.call(netns.outcomes, BOUND + 5, timeout=BOUND + 30)
    _failed_in_bound(outcomes)
    assert max(t for _, t, _ in outcomes) < PEER_TIMEOUT, outcomes


def test_a_host_restarted_on_the_same_port_refuses_old_handles(two):
    a, b, h = two
    remote = b.call(netns.region, "dst", NBYTES, ZERO)
    a.call(netns.region, "src", NBYTES, OLD)
    b.kill()
    with Peer() as b2:
        b2.call(netns.enter, h.namespaces[1], h.interfaces[1], port=PORT)
        b2.call(netns.region, "dst", NBYTES, ZERO)
        a.call(netns.start_calls, "write", "src", remote, CALLS, connect=False)
        outcomes = a.call(netns.outcomes, BOUND + 5, timeout=BOUND + 30)
        assert all(err == "PeerError" and "restarted" in message for err, _, message in outcomes), outcomes
        assert b2.call(netns.counts, "dst", [ZERO]) == [NBYTES]
