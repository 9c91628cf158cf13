"""close() and deregistration with operations in flight (to a SIGSTOPped peer): close() fails
them with ClosedError promptly; Region.close(timeout) waits for the local operations using it.
"""
import threading
import time

import pytest
import torch

import host_steps as hs
import peer_helpers as ph
import torch_p2p as p2p
from conftest import FABRIC_PROVIDERS, engine_kwargs
from peer import Peer


@pytest.mark.timeout(120)
@pytest.mark.parametrize("provider", FABRIC_PROVIDERS)
def test_close_with_operations_in_flight(provider):
    """Writes, reads and a send to a hung peer, a recv, a notification and a thread blocked in
    wait(): close() fails them all with ClosedError promptly and its threads exit."""
    src = torch.ones(16 << 20, dtype=torch.uint8)
    src.add_(0)  # torch's own worker threads exist from here on
    threads_before = ph.native_threads()
    a = p2p.Engine("cpu", **engine_kwargs(provider, peer_timeout=60))
    with Peer() as b, a:
        address = b.call(ph.start_engine, provider)
        rb = p2p.RemoteTensor.from_bytes(b.call(ph.target, "t", 16 << 20))
        a.register(src)
        p2p.wait(a.write_slices(src[:10], [rb[:10]]), 10)
        with ph.stopped(b.pid, 20):
            # (An shm read may complete without the peer's help: it is not required to hang.)
            futs = [a.write_slices(src, [rb]), a.send(address, b"x" * (1 << 20)), a.recv(), a.notification(3),
                    a.read_slices(src[:1 << 20], [rb[:1 << 20]])]
            blocked = []
            waiter = threading.Thread(target=lambda: blocked.append(ph.wait_all([futs[0]], 30)[0]))
            waiter.start()
            ph.taken_by_worker(a)
            deadline = time.monotonic() + 10
            while not ph.waiting(waiter):
                assert time.monotonic() < deadline, "the waiter never began to wait"
                time.sleep(0.01)
            assert not any(f.done() for f in futs[:4])
            pending = [f for f in futs if not f.done()]
            start = time.monotonic()
            a.close()
            took = time.monotonic() - start
            errors = ph.wait_all(pending, 5)
            waiter.join(10)
    # No hang: a close() that waited for the stopped b would take until b resumes (20 s).
    assert took < 15, f"close() took {took:.1f} s"
    assert all(isinstance(e, p2p.ClosedError) for e in errors), errors
    assert not waiter.is_alive() and isinstance(blocked[0], p2p.ClosedError)
    assert not a._dispatcher.is_alive()
    assert not any(t.name == "torch_p2p-dispatch" and t is a._dispatcher for t in threading.enumerate())
    deadline = time.monotonic() + 5
    while ph.native_threads() > threads_before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert ph.native_threads() <= threads_before
    # A closed engine refuses new work at once.
    for call in (lambda: a.write_slices(src, [rb]), lambda: a.send(address, b"x"), a.recv,
                 lambda: a.register(torch.zeros(4)), lambda: a.connect(address)):
        with pytest.raises(p2p.ClosedError):
            call()
    a.close()  # idempotent


@pytest.mark.timeout(60)
def test_close_from_a_completion_callback():
    """Callbacks run on the dispatcher thread; closing the engine from one must not deadlock."""
    with p2p.Engine("cpu", **engine_kwargs("tcp")) as other:
        a = p2p.Engine("cpu", **engine_kwargs("tcp"))
        closed = threading.Event()
        first, second, third = a.recv(timeout=30), a.recv(timeout=30), a.recv(timeout=30)

        def close(_):
            a.close()
            closed.set()
        second.add_done_callback(close)
        p2p.wait(other.send(a.address, b"one"), 10)
        p2p.wait(other.send(a.address, b"two"), 10)
        assert closed.wait(10)
        assert a.closed
        assert first.value() == (other.address, b"one") and second.value() == (other.address, b"two")
        assert isinstance(ph.wait_all([third], 5)[0], p2p.ClosedError)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("provider", FABRIC_PROVIDERS)
def test_deregister_waits_for_local_operations(provider):
    """Region.close(timeout) waits for local operations using the region: with a write to a
    hung peer in flight it raises TimeoutError after `timeout`, the region refuses new
    operations meanwhile, and once the write is done close() succeeds."""
    with p2p.Engine("cpu", **engine_kwargs(provider, peer_timeout=60)) as a, Peer() as b:
        b.call(ph.start_engine, provider)
        rb = p2p.RemoteTensor.from_bytes(b.call(ph.target, "t", 8 << 20))
        src = torch.randint(0, 256, (8 << 20,), dtype=torch.uint8)
        idle = torch.zeros(16)
        region, idle_region = a.register(src), a.register(idle)
        p2p.wait(a.write_slices(src[:10], [rb[:10]]), 10)
        with ph.stopped(b.pid, 20):
            fut = a.write_slices(src, [rb])
            ph.taken_by_worker(a)
            start = time.monotonic()
            with pytest.raises(p2p.TimeoutError):
                region.close(timeout=0.5)
            took = time.monotonic() - start
            # It waited its timeout, not for the write (b stays stopped for 20 s).
            assert 0.4 <= took < 15, took
            assert not fut.done()
            with pytest.raises(p2p.ClosedError):
                a.write_slices(src[:10], [rb[:10]])
            if provider == "shm":
                # shm: closing also waits for the peers that know us to release the region
                # (README, Closing), and the stopped b cannot answer yet.
                with pytest.raises(p2p.TimeoutError):
                    idle_region.close(timeout=0.5)
            else:
                idle_region.close(timeout=5)  # nothing uses it: no TimeoutError, b being stopped
            assert idle_region.closed
        p2p.wait(fut, 20)
        region.close(timeout=10)
        idle_region.close(timeout=10)
        assert region.closed
        assert b.call(ph.checksum, "t") == ph.zlib.crc32(src.numpy().tobytes())


@pytest.mark.timeout(120)
def test_deregister_retry_still_waits():
    provider = "tcp"
    with p2p.Engine("cpu", **engine_kwargs(provider, peer_timeout=60)) as a, Peer() as b:
        b.call(ph.start_engine, provider)
        rb = p2p.RemoteTensor.from_bytes(b.call(ph.target, "t", 8 << 20))
        src = torch.ones(8 << 20, dtype=torch.uint8)
        region = a.register(src)
        p2p.wait(a.write_slices(src[:10], [rb[:10]]), 10)
        with ph.stopped(b.pid, 20):
            fut = a.write_slices(src, [rb])
            ph.taken_by_worker(a)
            with pytest.raises(p2p.TimeoutError):
                region.close(timeout=0.5)
            assert not fut.done()
            with pytest.raises(p2p.TimeoutError):
                region.close(timeout=0.5)  # the write is still in flight
            ph.wait_all([fut], 20)


@pytest.mark.timeout(120)
def test_deregister_beside_a_submitting_thread():
    """One thread registers and deregisters tensors while another submits writes. The engine
    must not drop its reference to a deregistered tensor under the lock that submit() takes
    with the GIL held: PyTorch takes the GIL for that, and the two threads would wait for each
    other forever (within a second, here). Runs in a child: a hang holds the GIL."""
    with Peer() as host:
        host.call(ph.start_engine, "tcp")
        host.call(hs.start_churn)
        writes = host.call(hs.writes_to_self, 3.0, timeout=60)
        churned = host.call(hs.stop_churn, timeout=60)
        assert churned > 10 and writes > 10, (churned, writes)
