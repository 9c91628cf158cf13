"""Timeouts and cancel: a call's timeout (its own or the engine's) to a hung peer ends it with
TimeoutError, cancel() with CancelledError, and the peer is fine afterwards.
"""
import builtins
import time

import pytest
import torch

import peer_helpers as ph
import torch_p2p as p2p
from conftest import FABRIC_PROVIDERS, engine_kwargs
from peer import Peer


@pytest.mark.timeout(60)
def test_recv_and_notification_time_out():
    with p2p.Engine("cpu", **engine_kwargs("shm")) as a:
        for make in (lambda: a.recv(timeout=0.3), lambda: a.notification(5, timeout=0.3)):
            start = time.monotonic()
            fut = make()
            with pytest.raises(p2p.TimeoutError) as info:
                p2p.wait(fut, 10)
            assert time.monotonic() - start >= 0.25  # not before its timeout; wait() bounds a hang
            assert isinstance(info.value, builtins.TimeoutError)


def test_zero_or_negative_timeout_is_refused():
    """A timeout of zero or less would never wait (or wait forever, as None does): every call
    that takes one refuses it before starting anything."""
    with p2p.Engine("cpu", **engine_kwargs("tcp")) as a:
        buf = torch.zeros(64, dtype=torch.uint8)
        remote = a.register(buf).remote
        for call in (lambda t: a.recv(timeout=t), lambda t: a.notification(1, timeout=t),
                     lambda t: a.send(a.address, b"x", timeout=t), lambda t: a.write_slices(buf, [remote], timeout=t),
                     lambda t: a.read_slices(buf, [remote], timeout=t), lambda t: a.warm(remote, timeout=t)):
            for timeout in (0, -1.0):
                with pytest.raises(ValueError, match="timeout must be positive"):
                    call(timeout)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("provider", FABRIC_PROVIDERS)
def test_transfer_timeout(provider):
    """write_slices(timeout=...) to a hung peer raises TimeoutError after about that long."""
    with p2p.Engine("cpu", **engine_kwargs(provider, peer_timeout=60)) as a, Peer() as b:
        b.call(ph.start_engine, provider)
        rb = p2p.RemoteTensor.from_bytes(b.call(ph.target, "t", 8 << 20))
        src = torch.ones(8 << 20, dtype=torch.uint8)
        a.register(src)
        p2p.wait(a.write_slices(src[:10], [rb[:10]]), 10)
        with ph.stopped(b.pid, 20):
            start = time.monotonic()
            errors = ph.wait_all([a.write_slices(src, [rb], timeout=0.5)], 10)
            took = time.monotonic() - start
        # TimeoutError, not after b resumes (20 s) nor as PeerError (peer_timeout is 60 s).
        assert isinstance(errors[0], p2p.TimeoutError), errors
        assert 0.4 <= took < 15, took
        with pytest.raises(ValueError):
            a.write_slices(src, [rb], timeout=0)
        # The peer is fine afterwards.
        p2p.wait(a.write_slices(src, [rb]), 20)


@pytest.mark.timeout(120)
def test_engine_timeout_and_send_timeout():
    """The engine's timeout= is the deadline of calls given none (a's write), and
    send(timeout=) bounds a message on an engine whose own deadline is far off (c's): to a
    hung peer both fail with TimeoutError (peer_timeout being longer still), and the peer is
    fine afterwards."""
    with p2p.Engine("cpu", **engine_kwargs("tcp", peer_timeout=60, timeout=0.5)) as a, \
            p2p.Engine("cpu", **engine_kwargs("tcp", peer_timeout=60, timeout=60)) as c, Peer() as b:
        address = b.call(ph.start_engine, "tcp")
        rb = p2p.RemoteTensor.from_bytes(b.call(ph.target, "t", 8 << 20))
        src = torch.ones(8 << 20, dtype=torch.uint8)
        a.register(src)
        p2p.wait(a.write_slices(src[:10], [rb[:10]]), 10)
        p2p.wait(c.connect(address), 10)
        with ph.stopped(b.pid, 20):
            start = time.monotonic()
            errors = ph.wait_all([a.write_slices(src, [rb]), c.send(address, b"x" * (1 << 20), timeout=0.5)], 10)
            took = time.monotonic() - start
        assert [type(e) for e in errors] == [p2p.TimeoutError] * 2, errors
        assert took >= 0.4, took  # not before the deadline; wait_all bounds a hang
        p2p.wait(c.send(address, b"after", timeout=10), 20)
        got = b.call(ph.recv, 10)[1]
        if got != b"after":  # the timed-out message may still arrive: the timeout ends our wait
            got = b.call(ph.recv, 10)[1]
        assert got == b"after"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("provider", FABRIC_PROVIDERS)
def test_cancel(provider):
    """cancel() fails a pending recv, notification or transfer with CancelledError at once; a
    cancelled recv consumes no message; cancelling a finished future does nothing."""
    with p2p.Engine("cpu", **engine_kwargs(provider, peer_timeout=60)) as a, Peer() as b:
        address = b.call(ph.start_engine, provider)
        rb = p2p.RemoteTensor.from_bytes(b.call(ph.target, "t", 8 << 20))
        src = torch.ones(8 << 20, dtype=torch.uint8)
        a.register(src)
        recv, note = a.recv(), a.notification(11)
        for fut in (recv, note):
            a.cancel(fut)
            with pytest.raises(p2p.CancelledError):
                p2p.wait(fut, 5)
        # The cancelled recv did not take the next message.
        b.call(ph.send, a.address, b"kept")
        assert p2p.wait(a.recv(timeout=10), 20) == (address, b"kept")
        done = a.write_slices(src[:10], [rb[:10]])
        p2p.wait(done, 10)
        a.cancel(done)
        assert done.value() is None
        with ph.stopped(b.pid, 20):
            fut = a.write_slices(src, [rb])
            ph.taken_by_worker(a)  # in flight, not still queued
            assert not fut.done()
            a.cancel(fut)
            with pytest.raises(p2p.CancelledError):
                p2p.wait(fut, 5)  # at once: b stays stopped for 20 s
        p2p.wait(a.write_slices(src, [rb]), 20)
