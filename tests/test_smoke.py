"""The smallest end-to-end check, per provider: one write and one read between two processes."""
import threading
import time

import pytest
import torch

import helpers
import torch_p2p as p2p
from conftest import ROUTES, engine_kwargs
from peer import Peer


def test_write_then_read(provider):
    with Peer() as b, p2p.Engine("cpu", **engine_kwargs(provider)) as a:
        b.call(helpers.start_engine, provider)
        remote = p2p.RemoteTensor.from_bytes(b.call(helpers.make_target, "t", (8, 256)))
        assert a.route(remote) == ROUTES[provider]
        src = torch.randn(8, 256)
        out = torch.zeros(8, 256)
        a.register(src)
        a.register(out)
        a.write_slices(src[2], [remote[5]]).wait()
        got = b.call(helpers.fetch, "t")
        assert torch.equal(got[5], src[2])
        assert (got[torch.arange(8) != 5] == -1).all()
        a.read_slices(out[0], [remote[5]]).wait()
        assert torch.equal(out[0], src[2])


def test_future_callbacks_run_on_the_dispatcher_thread():
    """A success completes its torch future in C++, without the GIL; a callback attached before
    that still runs, on the engine's dispatcher thread, and wait() returns None."""
    with p2p.Engine("cpu", **engine_kwargs("tcp")) as e:
        src = torch.arange(4096, dtype=torch.int32)
        dst = torch.zeros(4096, dtype=torch.int32)
        e.register(src)
        region = e.register(dst)
        note = e.notification(7, timeout=30)
        chained = note.then(lambda f: (f.wait(), threading.current_thread().name))
        assert p2p.wait(e.write_slices([src], [region.remote], notify=7), 30) is None
        assert p2p.wait(chained, 30) == (None, "torch_p2p-dispatch")
        assert torch.equal(dst, src)


def test_futures_are_torch_futures_set_up_by_their_operation():
    """The engine makes each future with torch._C.Future.__new__ and its operation sets it up
    natively (torch's __init__ skipped): a torch.futures.Future of Python values like any other,
    which no second operation can take."""
    with p2p.Engine("cpu", **engine_kwargs("tcp")) as e:
        src = torch.arange(64, dtype=torch.int32)
        region = e.register(torch.zeros(64, dtype=torch.int32))
        e.register(src)
        f = e.write_slices(src, region.remote)
        assert type(f) is torch.futures.Future
        assert p2p.wait(f.then(lambda done: (done.value(), {"any": "python value"})), 30) == (None, {"any": "python value"})
        with pytest.raises(ValueError, match="in use already"):
            e._c.submit(f, True, src, region.remote, None, None)
        with pytest.raises(ValueError, match="not a torch future: object"):
            e._c.submit(object(), True, src, region.remote, None, None)
        recv = e.recv(timeout=30)
        e.send(e.address, b"payload").wait()
        assert p2p.wait(recv, 30)[1] == b"payload"  # a result set from Python


def test_engine_lets_go_of_completed_futures():
    """Futures completed in C++ leave the engine's registry too (the dispatcher hears of them in
    batches), so a long run of calls holds no futures once they are done."""
    with p2p.Engine("cpu", **engine_kwargs("tcp")) as e:
        src = torch.arange(1024, dtype=torch.int32)
        dst = torch.zeros(1024, dtype=torch.int32)
        e.register(src)
        region = e.register(dst)
        futures = [e.write_slices([src[i : i + 8]], [region.remote[i : i + 8]]) for i in range(0, 1024, 8)]
        for f in futures:
            assert p2p.wait(f, 30) is None
        deadline = time.monotonic() + 5
        while e._c.futures_held and time.monotonic() < deadline:
            time.sleep(0.005)
        assert not e._c.futures_held, f"{e._c.futures_held} completed futures still held"
        assert torch.equal(dst, src)


def test_a_pinned_engines_futures_spin_then_sleep():
    """The futures of a pinned engine spin for their completion before wait() sleeps
    (engine.py's _SpinningFuture): a write's, a message's value, an error, a callback and a
    future that takes longer than the spin all behave as any torch future's, through wait() and
    p2p.wait alike."""
    with p2p.Engine("cpu", cpus=[0], **engine_kwargs("tcp")) as a, p2p.Engine("cpu", **engine_kwargs("tcp")) as b:
        assert a.plan.cpu == 0 and a._c.completion_spin_us > 0 and b._c.completion_spin_us == 0
        src = torch.arange(4096, dtype=torch.int32)
        dst = torch.zeros(4096, dtype=torch.int32)
        a.register(src)
        remote = b.register(dst).remote
        write = a.write_slices([src], [remote])
        assert isinstance(write, torch.futures.Future) and type(write) is not type(b.recv(timeout=1))
        assert write.wait() is None and torch.equal(dst, src)
        assert write.then(lambda f: "called").wait() == "called"
        with pytest.raises(p2p.TimeoutError):
            a.recv(timeout=0.3).wait()  # an error, after more than the spin
        late = a.recv(timeout=30)
        threading.Timer(0.05, lambda: b.send(a.address, b"late")).start()
        assert late.wait()[1] == b"late"
        # p2p.wait spins as wait() does, then waits natively: a timeout, then the value.
        later = a.recv(timeout=30)
        with pytest.raises(p2p.TimeoutError):
            p2p.wait(later, 0.1)
        b.send(a.address, b"later")
        assert p2p.wait(later, 30)[1] == b"later"
