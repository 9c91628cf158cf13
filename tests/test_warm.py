"""engine.warm(): first contact with a peer off the request path."""
import pytest
import torch

import torch_p2p as p2p


@pytest.fixture(params=["tcp", "shm"])
def pair(request):
    with p2p.Engine("cpu", request.param) as a, p2p.Engine("cpu", request.param) as b:
        yield a, b


def test_warm_reads_every_rail_pair_and_leaves_memory_alone(pair):
    a, b = pair
    dst = torch.arange(1 << 16, dtype=torch.int32)
    remote = b.register(dst).remote
    before = dst.clone()
    a.warm(remote).wait()
    assert torch.equal(dst, before)
    (scratch,) = a._warm_buffers.values()
    pieces = len(a.plan.rails) * remote._v.rails
    assert scratch.shape == (pieces, 16) and scratch.dtype == torch.int32
    spacing = (1 << 16) // pieces // 16 * 16
    assert torch.equal(scratch, torch.stack([before[k * spacing:k * spacing + 16] for k in range(pieces)]))
    src = torch.full((4,), 7, dtype=torch.int32)
    a.register(src)
    a.write_slices([src], [remote[:4]]).wait()
    assert dst[:4].tolist() == [7] * 4


def test_warm_a_tiny_tensor_and_an_address(pair):
    a, b = pair
    one = torch.zeros(1, dtype=torch.float64)
    a.warm(b.register(one).remote).wait()
    a.warm(b.address).wait()


def test_warm_write_only_tensor_only_connects(pair):
    a, b = pair
    remote = b.register(torch.zeros(64, dtype=torch.uint8), access="w").remote
    a.warm(remote).wait()
    assert a._warm_buffers == {}


def test_warm_a_closed_peer_fails():
    with p2p.Engine("cpu", "tcp") as a:
        b = p2p.Engine("cpu", "tcp")
        remote = b.register(torch.zeros(64, dtype=torch.uint8)).remote
        b.close()
        with pytest.raises(p2p.PeerError):
            a.warm(remote).wait()


def test_warm_reads_again_once_the_first_read_is_done(pair):
    a, b = pair
    remote = b.register(torch.arange(1024, dtype=torch.int32)).remote
    reads, earlier_done, read = [], [], a.read_slices

    def recorded(views, remotes, **kwargs):
        earlier_done.append([f.done() for f in reads])
        reads.append(read(views, remotes, **kwargs))
        return reads[-1]

    a.read_slices = recorded
    a.warm(remote).wait()
    assert earlier_done == [[], [True]]
    assert all(f.done() for f in reads)


def test_warm_fails_with_the_first_failure():
    from torch_p2p.engine import _then

    def failed(error):
        fut = torch.futures.Future()
        fut.set_exception(error)
        return fut

    ok = torch.futures.Future()
    ok.set_result(None)
    done = torch.futures.Future()
    _then(failed(p2p.PeerError("gone")), lambda: pytest.fail("started after a failure"), done)
    with pytest.raises(p2p.PeerError):
        done.wait()
    done = torch.futures.Future()
    _then(ok, lambda: failed(p2p.TimeoutError("late")), done)
    with pytest.raises(p2p.TimeoutError):
        done.wait()

    def closed():
        raise p2p.ClosedError("the engine is closed")

    done = torch.futures.Future()
    _then(ok, closed, done)
    with pytest.raises(p2p.ClosedError):
        done.wait()
    done = torch.futures.Future()
    _then(ok, lambda: ok, done)
    assert done.wait() is None
