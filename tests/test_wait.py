"""p2p.wait(future, timeout): waits without the GIL for any torch future, completed from any
thread; a timeout or a signal handler's exception ends the wait."""
import signal
import threading
import time

import pytest
import torch

import torch_p2p as p2p


def later(seconds: float, action) -> threading.Timer:
    timer = threading.Timer(seconds, action)
    timer.start()
    return timer


def test_returns_the_value_set_by_another_thread():
    fut = torch.futures.Future()
    later(0.2, lambda: fut.set_result(7))
    start = time.monotonic()
    assert p2p.wait(fut, 30) == 7
    assert time.monotonic() - start < 10


def test_takes_what_then_and_collect_all_return():
    fut = torch.futures.Future()
    chained = fut.then(lambda f: f.value() + 1)
    both = torch.futures.collect_all([fut, chained])
    assert not isinstance(chained, torch.futures.Future)  # torch._C.Future: torch's own wrapper
    later(0.1, lambda: fut.set_result(1))
    assert p2p.wait(chained, 30) == 2
    assert [f.value() for f in p2p.wait(both, 30)] == [1, 2]


def test_a_done_future_returns_at_once_whatever_the_timeout():
    fut = torch.futures.Future()
    fut.set_result("x")
    assert p2p.wait(fut, 0) == "x"
    assert p2p.wait(fut, -1) == "x"
    assert p2p.wait(fut) == "x"


def test_raises_the_future_s_error():
    fut = torch.futures.Future()
    later(0.1, lambda: fut.set_exception(p2p.PeerError("gone")))
    with pytest.raises(p2p.PeerError, match="gone"):
        p2p.wait(fut, 30)


@pytest.mark.parametrize("timeout", [0.3, 0, -1])
def test_times_out(timeout):
    fut = torch.futures.Future()
    start = time.monotonic()
    with pytest.raises(p2p.TimeoutError, match=f"did not complete within {timeout} s"):
        p2p.wait(fut, timeout)
    took = time.monotonic() - start
    assert max(timeout, 0) <= took < max(timeout, 0) + 5
    fut.set_result(None)  # completing it after the wait gave up harms nothing
    assert p2p.wait(fut, 0) is None


def test_a_signal_handler_s_exception_ends_the_wait():
    class Interrupted(Exception):
        pass

    def handler(signum, frame):
        raise Interrupted

    old = signal.signal(signal.SIGUSR1, handler)
    try:
        main = threading.main_thread().ident
        later(0.2, lambda: signal.pthread_kill(main, signal.SIGUSR1))
        start = time.monotonic()
        with pytest.raises(Interrupted):
            p2p.wait(torch.futures.Future())  # no timeout: only the handler ends it
        assert time.monotonic() - start < 10
    finally:
        signal.signal(signal.SIGUSR1, old)


def test_only_futures_are_taken():
    with pytest.raises(TypeError, match="takes a torch.futures.Future, not int"):
        p2p.wait(3, 1)


def test_an_engine_s_future():
    with p2p.Engine("cpu") as a, p2p.Engine("cpu") as b:
        dst = torch.zeros(1024)
        region = b.register(dst)
        src = torch.arange(1024, dtype=torch.float32)
        a.register(src)
        assert p2p.wait(a.write_slices([src], [region.remote]), 60) is None
        assert torch.equal(dst, src)
        region.close()
