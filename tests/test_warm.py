"""engine.warm(): first contact with a peer off the request path, on the fabric route
(conftest.fabric_pair), where it reads from every pair of rails."""
import pytest
import torch

import torch_p2p as p2p
from conftest import engine_kwargs


def test_warm_reads_every_rail_pair_and_leaves_memory_alone(fabric_pair):
    a, b = fabric_pair
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


def test_warm_a_tiny_tensor_and_an_address(fabric_pair):
    """A tensor smaller than one piece is read whole, once per warm() read; an address only
    connects (nothing read, no scratch)."""
    a, b = fabric_pair
    a.warm(b.address).wait()
    assert a._warm_buffers == {}
    one = torch.full((1,), 2.5, dtype=torch.float64)
    a.warm(b.register(one).remote).wait()
    (scratch,) = a._warm_buffers.values()
    assert scratch.shape[0] == 1 and scratch[0, 0].item() == 2.5


def test_warm_write_only_tensor_only_connects(fabric_pair):
    a, b = fabric_pair
    remote = b.register(torch.zeros(64, dtype=torch.uint8), access="w").remote
    a.warm(remote).wait()
    assert a._warm_buffers == {}


def test_warm_a_closed_peer_fails():
    with p2p.Engine("cpu", **engine_kwargs("tcp")) as a:
        b = p2p.Engine("cpu", **engine_kwargs("tcp"))
        remote = b.register(torch.zeros(64, dtype=torch.uint8)).remote
        b.close()
        with pytest.raises(p2p.PeerError):
            a.warm(remote).wait()


def test_warm_reads_again_once_the_first_read_is_done(fabric_pair):
    a, b = fabric_pair
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
