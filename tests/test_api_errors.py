"""Mistakes in a call fail at once, with a clear exception, before anything is posted.

Each test makes its mistakes against a poisoned remote tensor of a peer and checks the
exception's type and message; assert_nothing_moved then shows that no byte reached the peer
and that the engine still works. What only the peer can know (its region is gone) fails
through the future instead, as a P2PError.
"""
from __future__ import annotations

import types

import pytest
import torch

import helpers
import torch_p2p as p2p
from conftest import DATA_PATHS, engine_kwargs, shares_memory

pytestmark = pytest.mark.timeout(120)

SHAPE = (8, 64)


@pytest.fixture
def target(link):
    """A poisoned [8, 64] float32 tensor of the peer, and a registered random local one."""
    name, remote = link.remote(SHAPE)
    src = helpers.random_tensor(SHAPE, torch.float32, 0)
    with link.engine.register(src):
        yield types.SimpleNamespace(name=name, remote=remote, src=src)
    link.drop(name)


def assert_nothing_moved(link, target) -> None:
    """The peer's tensor is still all poison and the local one unchanged; then a correct call
    on the same engine goes through."""
    helpers.assert_same_bits(link.fetch(target.name), helpers.poisoned(SHAPE, torch.float32))
    helpers.assert_same_bits(target.src, helpers.random_tensor(SHAPE, torch.float32, 0))
    p2p.wait(link.engine.write_slices([target.src[1]], [target.remote[6]]), timeout=60)
    helpers.assert_same_bits(link.fetch(target.name)[6], target.src[1])


# -- Local memory ------------------------------------------------------------------------------

def test_unregistered_memory_is_refused(link, target):
    stray = torch.randn(SHAPE)
    with pytest.raises(ValueError, match="source view 0 is not inside a tensor registered with this engine"):
        link.engine.write_slices([stray[0]], [target.remote[0]])
    # One bad view refuses the whole call: view 0, which is fine, is not read into either.
    with pytest.raises(ValueError, match="destination view 1 is not inside a tensor registered"):
        link.engine.read_slices([target.src[0], stray[1]], [target.remote[0], target.remote[1]])
    assert_nothing_moved(link, target)


def test_registration_covers_the_whole_storage(link, target):
    """register() takes the tensor's storage: views outside the registered view but inside its
    storage are registered memory too."""
    storage = helpers.random_tensor(SHAPE, torch.float32, 1)
    with link.engine.register(storage[4:]):
        p2p.wait(link.engine.write_slices([storage[0]], [target.remote[2]]), timeout=60)
    helpers.assert_same_bits(link.fetch(target.name)[2], storage[0])


def test_memory_of_a_closed_region_is_unregistered(link, target):
    mine = helpers.random_tensor(SHAPE, torch.float32, 1)
    region = link.engine.register(mine)
    handle = region.remote
    region.close()
    assert region.closed
    with pytest.raises(ValueError, match="source view 0 is not inside a tensor registered"):
        link.engine.write_slices([mine[0]], [target.remote[0]])
    with pytest.raises(ValueError, match="destination view 0 is not inside a tensor registered"):
        link.engine.read_slices([mine[0]], [target.remote[0]])
    # The handle is metadata only: it still describes and indexes the (closed) region.
    assert handle[1:3].shape == (2, 64)
    assert_nothing_moved(link, target)


def test_the_handle_of_a_closed_local_region_fails_through_the_future(provider):
    """This engine's own handle, after close(): the call is accepted (handles are metadata),
    and its future fails with a P2PError within the peer timeout instead of hanging."""
    with p2p.Engine("cpu", **engine_kwargs(provider, peer_timeout=2.0)) as engine:
        src = helpers.random_tensor(SHAPE, torch.float32, 1)
        mine = helpers.poisoned(SHAPE, torch.float32)
        if shares_memory(provider):
            mine.share_memory_()
        engine.register(src)
        region = engine.register(mine)
        region.close()
        with pytest.raises(p2p.P2PError):
            p2p.wait(engine.write_slices([src[0]], [region.remote[0]]), timeout=30)
        helpers.assert_same_bits(mine, helpers.poisoned(SHAPE, torch.float32))


def test_the_handle_of_a_closed_local_region_is_refused_at_once(provider):
    with p2p.Engine("cpu", **engine_kwargs(provider, peer_timeout=2.0)) as engine:
        src = helpers.random_tensor(SHAPE, torch.float32, 1)
        engine.register(src)
        mine = helpers.poisoned(SHAPE, torch.float32)
        if shares_memory(provider):
            mine.share_memory_()
        region = engine.register(mine)
        region.close()
        with pytest.raises((p2p.ClosedError, ValueError)):
            engine.write_slices([src[0]], [region.remote[0]])


def test_a_region_closing_under_a_transfer_refuses_new_ones(peer, provider):
    """close() waits for transfers in flight; when it gives up (here at once) the region stays
    closed to new transfers (ClosedError), and the one in flight still completes."""
    slow = helpers.Link(peer, provider, data_path="staged", staging_bytes=128 << 10,
                        staging_slot_bytes=64 << 10)  # one 64 KiB slot per direction: 16 MiB takes a while
    try:
        big = helpers.random_tensor((4, 1 << 20), torch.float32, 2)
        region = slow.engine.register(big)
        name, remote = slow.remote((4, 1 << 20))
        in_flight = slow.engine.write_slices(big, remote)
        with pytest.raises(p2p.TimeoutError, match="in flight|did not answer"):
            region.close(timeout=0)
        with pytest.raises(p2p.ClosedError, match="source view 0 lies in region .*, which is being deregistered"):
            slow.engine.write_slices([big[0]], [remote[0]])
        p2p.wait(in_flight, timeout=100)
        helpers.assert_same_bits(slow.fetch(name), big)
        region.close()
        assert region.closed
        with pytest.raises(ValueError, match="not inside a tensor registered"):
            slow.engine.write_slices([big[0]], [remote[0]])
    finally:
        slow.close()


# -- Remote bounds, shapes, dtypes, counts -------------------------------------------------------

def test_out_of_bounds_destinations(link, target):
    with pytest.raises(IndexError, match="index 8 is out of bounds for dimension 0 with size 8"):
        target.remote[8]
    with pytest.raises(IndexError, match="out of bounds for dimension 1"):
        target.remote[0, -65]
    # Slices clip, as torch's do: a shorter view, no error.
    assert target.remote[6:100].shape == (2, 64)

    # A hand-made (tampered) view past the region's end is refused when it is made. RemoteView
    # is private; this is what a forged or corrupted descriptor would hold.
    with pytest.raises(ValueError, match="beyond"):
        p2p.RemoteTensor(target.remote._v.view(0, [9, 64], [64, 1]))
    with pytest.raises(ValueError, match="beyond"):
        p2p.RemoteTensor(target.remote._v.view(7 * 64 + 1, [64], [1]))

    # Mirror mode: a view outside the registered tensor (in its storage) has no mirror image in
    # the remote tensor.
    storage = helpers.random_tensor((16, 64), torch.float32, 1)
    with link.engine.register(storage[:8]):
        with pytest.raises(ValueError, match="source view 0 would reach bytes 3072..3328 of a remote region "
                                             "of 2048 bytes"):
            link.engine.write_slices([storage[12]], target.remote)
    assert_nothing_moved(link, target)


def assert_refused(link, target, cases) -> None:
    """Each (message pattern, call) raises ValueError with that message; nothing moved."""
    for pattern, call in cases:
        with pytest.raises(ValueError, match=pattern):
            call()
    assert_nothing_moved(link, target)


def test_shape_mismatch(link, target):
    src, remote, e = target.src, target.remote, link.engine
    assert_refused(link, target, [
        (r"source view 0 has shape \[3, 64\] but its RemoteTensor has shape \[4, 64\]",
         lambda: e.write_slices([src[0:3]], [remote[0:4]])),
        # As many elements is not enough.
        (r"source view 0 has shape \[64\] but its RemoteTensor has shape \[2, 32\]",
         lambda: e.write_slices([src[0]], [remote[0:2, :32]])),
        (r"destination view 1 has shape \[8\] but its RemoteTensor has shape \[8, 1\]",
         lambda: e.read_slices([src[0], src[:, 0]], [remote[0], remote[:, 0:1]])),
        # Mirror mode needs the remote tensor laid out like the registered local one.
        (r"mirror mode needs the RemoteTensor laid out like the registered local tensor: remote \[4, 64\]",
         lambda: e.write_slices([src[0]], remote[0:4])),
    ])


def test_dtype_mismatch(link, target):
    half = helpers.random_tensor(SHAPE, torch.float16, 1)
    with link.engine.register(half):
        with pytest.raises(ValueError, match="source view 0 is Half but its RemoteTensor is Float"):
            link.engine.write_slices([half[0]], [target.remote[0]])
        with pytest.raises(ValueError, match="destination view 0 is Half but its RemoteTensor is Float"):
            link.engine.read_slices([half[0]], [target.remote[0]])
        with pytest.raises(ValueError, match=r"mirror mode needs .* Float, "
                                             r"local \[8, 64\] strides \[64, 1\] Half"):
            link.engine.write_slices([half[0]], target.remote)
    assert_nothing_moved(link, target)


def test_one_remote_tensor_per_view(link, target):
    src, remote, e = target.src, target.remote, link.engine
    assert_refused(link, target, [
        (r"expected one RemoteTensor per local view \(2 local views, 1 RemoteTensors\)",
         lambda: e.write_slices([src[0], src[1]], [remote[0]])),
        (r"\(1 local views, 2 RemoteTensors\)", lambda: e.read_slices([src[0]], [remote[0], remote[1]])),
        ("no RemoteTensor given", lambda: e.write_slices([src[0]], [])),
    ])


def test_arguments_of_the_wrong_type(link, target):
    src, remote = target.src, target.remote
    with pytest.raises(TypeError, match="local view 0 is a ndarray, not a tensor"):
        link.engine.write_slices([src[0].numpy()], [remote[0]])
    with pytest.raises(TypeError, match="the local views must be a tensor or a sequence"):
        link.engine.write_slices(5, [remote[0]])
    with pytest.raises(TypeError, match="remote 0 is a Tensor, not a RemoteTensor"):
        link.engine.write_slices([src[0]], [src[1]])
    with pytest.raises(TypeError, match="remote 0 is a int, not a RemoteTensor"):
        link.engine.write_slices([src[0]], remote.to_bytes())  # bytes are a sequence of ints
    with pytest.raises(ValueError, match="notify must be a 32-bit unsigned tag"):
        link.engine.write_slices([src[0]], [remote[0]], notify=1 << 32)
    with pytest.raises(ValueError, match="timeout must be positive"):
        link.engine.read_slices([src[0]], [remote[0]], timeout=0)
    assert_nothing_moved(link, target)


def test_one_call_reaches_one_peer(link, target):
    mine = helpers.poisoned(SHAPE, torch.float32)
    with link.engine.register(mine) as region:
        with pytest.raises(ValueError, match="must belong to one peer; RemoteTensor 1 belongs to another"):
            link.engine.write_slices([target.src[0], target.src[1]], [target.remote[0], region.remote[1]])
    assert_nothing_moved(link, target)


# -- Overlapping elements and access modes --------------------------------------------------------

def test_destinations_with_overlapping_elements(link, target):
    """Two elements landing on one address would make the result depend on arrival order."""
    name, expanded = link.expanded(8, 64)  # the peer registered t.expand(8, 64)
    try:
        assert expanded.stride() == (0, 1)
        with pytest.raises(ValueError, match="source view 0: the destination has overlapping elements"):
            link.engine.write_slices([target.src], [expanded])
        with pytest.raises(ValueError, match="source view 0: the destination has overlapping elements"):
            link.engine.write_slices([target.src[2:5]], [expanded[2:5]])
        # One row of it has no overlap: fine.
        p2p.wait(link.engine.write_slices([target.src[3]], [expanded[5]]), timeout=60)
        helpers.assert_same_bits(link.fetch(name), target.src[3])

        # A read into an overlapping local view is refused the same way; overlapping sources
        # are fine: reading the stride-0 remote tensor repeats its row.
        row = helpers.poisoned((64,), torch.float32)
        out = helpers.poisoned(SHAPE, torch.float32)
        with link.engine.register(row), link.engine.register(out):
            with pytest.raises(ValueError, match="destination view 0: the destination has overlapping elements"):
                link.engine.read_slices([row.expand(8, 64)], [target.remote])
            p2p.wait(link.engine.read_slices([out], [expanded]), timeout=60)
        helpers.assert_same_bits(out, target.src[3].expand(SHAPE))
    finally:
        link.drop(name)
    assert_nothing_moved(link, target)


def test_access_mode_is_checked_locally(link, target):
    name_r, read_only = link.remote(SHAPE, seed=3, access="r")
    name_w, write_only = link.remote(SHAPE, access="w")
    try:
        assert (read_only.access, write_only.access) == ("r", "w")
        with pytest.raises(ValueError, match=r"does not accept remote writes \(registered with access='r'\)"):
            link.engine.write_slices([target.src[0]], [read_only[0]])
        with pytest.raises(ValueError, match=r"does not accept remote reads \(registered with access='w'\)"):
            link.engine.read_slices([target.src[0]], [write_only[0]])
        helpers.assert_same_bits(link.fetch(name_r), helpers.random_tensor(SHAPE, torch.float32, 3))
        assert_nothing_moved(link, target)

        # What each mode allows still works.
        out = helpers.poisoned(SHAPE, torch.float32)
        with link.engine.register(out):
            p2p.wait(link.engine.read_slices([out], [read_only]), timeout=60)
        helpers.assert_same_bits(out, helpers.random_tensor(SHAPE, torch.float32, 3))
        p2p.wait(link.engine.write_slices([target.src], [write_only]), timeout=60)
        helpers.assert_same_bits(link.fetch(name_w), target.src)
    finally:
        link.drop(name_r)
        link.drop(name_w)


# -- Regions gone on the peer -------------------------------------------------------------------

def test_write_to_a_region_its_owner_deregistered_fails_through_the_future(link):
    """Only the owner knows its region is gone; it tells peers as it introduces itself (the
    census of live regions) and when it deregisters: the future fails with ClosedError before
    anything reaches the owner's memory."""
    own = helpers.Link(link.peer, link.provider, peer_timeout=2.0, **DATA_PATHS[link.path])
    try:
        src = helpers.random_tensor(SHAPE, torch.float32, 1)
        name, gone = own.remote(SHAPE)
        own.peer.call(helpers.close_region, name)
        with own.engine.register(src):
            future = own.engine.write_slices([src[0]], [gone[0]])
            with pytest.raises(p2p.ClosedError, match="deregistered by its owner"):
                p2p.wait(future, timeout=30)
    finally:
        own.close()


def test_a_deregistered_remote_region_is_refused_and_the_peer_lives_on(peer, provider):
    """The peer knew the owner before the region went (RegionClosed), and keeps working with it."""
    own = helpers.Link(peer, provider, peer_timeout=2.0)
    try:
        src = helpers.random_tensor(SHAPE, torch.float32, 1)
        name, gone = own.remote(SHAPE)
        live_name, live = own.remote(SHAPE)
        with own.engine.register(src):
            p2p.wait(own.engine.write_slices([src], [live]), timeout=30)  # connected
            own.peer.call(helpers.close_region, name)
            # Refused here (the owner's RegionClosed arrived first) or by the owner's provider.
            with pytest.raises((p2p.ClosedError, p2p.RemoteError), match="deregistered by its owner|RMA write"):
                p2p.wait(own.engine.write_slices([src[0]], [gone[0]]), timeout=30)
            p2p.wait(own.engine.write_slices([src], [live]), timeout=30)
        helpers.assert_same_bits(own.fetch(live_name), src)
    finally:
        own.close()


# -- Closed engines, bad engine arguments ---------------------------------------------------------

def test_a_closed_engine_refuses_everything(link):
    own = helpers.Link(link.peer, link.provider, **DATA_PATHS[link.path])
    try:
        name, remote = own.remote(SHAPE)
        src = helpers.random_tensor(SHAPE, torch.float32, 1)
        region = own.engine.register(src)
        own.engine.close()
        own.engine.close()  # idempotent
        assert own.engine.closed and region.closed
        with pytest.raises(p2p.ClosedError, match="closed"):
            own.engine.write_slices([src[0]], [remote[0]])
        with pytest.raises(p2p.ClosedError, match="closed"):
            own.engine.read_slices([src[0]], [remote[0]])
        with pytest.raises(p2p.ClosedError, match="closed"):
            own.engine.register(torch.zeros(4))
        with pytest.raises(p2p.ClosedError, match="closed"):
            own.engine.send(remote.owner, b"hello")
        with pytest.raises(p2p.ClosedError, match="closed"):
            own.engine.recv()
        helpers.assert_same_bits(own.fetch(name), helpers.poisoned(SHAPE, torch.float32))
    finally:
        own.close()


def test_unknown_provider_names_the_available_ones():
    with pytest.raises(ValueError, match="provider 'nosuchprovider' is not available .*"
                                         "this machine offers: .*tcp"):
        p2p.Engine("cpu", provider="nosuchprovider")


def test_bad_engine_arguments():
    with pytest.raises(ValueError, match=r"unknown domain\(s\) \['nosuchnic'\]; available: .*'lo'"):
        p2p.Engine("cpu", **engine_kwargs("tcp", domains=["nosuchnic"]))
    with pytest.raises(ValueError, match="data_path must be None, 'direct' or 'staged'"):
        p2p.Engine("cpu", **engine_kwargs("tcp", data_path="fast"))
    with pytest.raises(ValueError, match="device must be 'cpu' or 'cuda"):
        p2p.Engine("meta", **engine_kwargs("tcp"))
    with pytest.raises(ValueError, match="num_rails must be >= 1"):
        p2p.Engine("cpu", **engine_kwargs("tcp", num_rails=0))
    with pytest.raises(ValueError, match="access must be 'rw', 'r' or 'w'"), \
            p2p.Engine("cpu", **engine_kwargs("tcp")) as engine:
        engine.register(torch.zeros(4), access="x")


def test_stream_wait_needs_a_cuda_engine(link, target):
    fut = link.engine.write_slices([target.src[1]], [target.remote[6]])
    with pytest.raises(ValueError, match="stream_wait needs a CUDA engine"):
        link.engine.stream_wait(fut)
    p2p.wait(fut, timeout=60)


def test_a_message_over_1_gib_is_refused():
    """send() takes up to 1 GiB (README): one byte more is refused before anything is sent.
    (bytes(n) is calloc'ed: its pages are not touched until the engine copies them.)"""
    with p2p.Engine("cpu", **engine_kwargs("tcp")) as a:
        with pytest.raises(ValueError, match="at most 1073741824 bytes"):
            a.send(a.address, bytes((1 << 30) + 1))


def test_deregister_a_region():
    """engine.deregister(region) is region.close(): the region is closed, its tensor is no
    longer a source, its handle fails, and deregistering again does nothing."""
    with p2p.Engine("cpu", **engine_kwargs("tcp")) as e:
        src, dst = torch.ones(64), torch.zeros(64)
        source, target = e.register(src), e.register(dst)
        p2p.wait(e.write_slices([src], [target.remote]), 10)
        e.deregister(source)
        assert source.closed and not target.closed
        with pytest.raises(ValueError, match="not inside a tensor registered"):
            e.write_slices([src], [target.remote])
        e.deregister(target)
        back = torch.zeros(64)
        e.register(back)
        with pytest.raises(p2p.ClosedError):
            p2p.wait(e.read_slices([back], [target.remote]), 10)
        e.deregister(target)
        assert target.closed
