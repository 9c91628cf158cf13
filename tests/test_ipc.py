"""The same-host CUDA IPC route (csrc/routes/cuda_ipc): pages, views, calls in flight together,
stream order, access checks, block reuse, a peer killed mid-transfer, two processes on one GPU.
The tests run one process per GPU where there are two (both on cuda:0 otherwise), with whatever
libfabric is installed: the IPC route needs none of its CUDA support. When CUDA fails it:
tests/test_ipc_faults.py; route choice: tests/test_route_choice.py."""
import os
import signal
import time

import pytest
import torch

import helpers
import peer_helpers as ph
import torch_p2p as p2p
from torch_p2p import _C
from conftest import PEER_GPU, engine_kwargs
from ipc_targets import check_guards, check_landed, fetch_whole, gpu_random, guards_whole, make_cuda_target
from peer import Peer

cuda = pytest.mark.cuda


@pytest.fixture
def ipc_pair():
    """(engine on cuda:0, peer child with an engine on PEER_GPU, its address), on the IPC route."""
    with Peer() as b, p2p.Engine("cuda:0", **engine_kwargs("tcp")) as a:
        address = b.call(helpers.start_engine, "tcp", device=PEER_GPU)
        assert a.route(address) == "ipc"
        yield a, b, address


def source_and_target(a, b, n: int, seed: int):
    """(b's n-byte target "t", a registered random source of n bytes here, its bytes on the host)."""
    remote = p2p.RemoteTensor.from_bytes(b.call(make_cuda_target, "t", (n,)))
    src = gpu_random((n,), torch.uint8, seed)
    a.register(src)
    return remote, src, src.cpu()


@cuda
def test_ipc_copy_engine_bytes_setting(ipc_pair, monkeypatch):
    """TORCH_P2P_IPC_COPY_ENGINE_BYTES: IPC spans of at least this many bytes go to the copy
    engines (cudaMemcpyAsync), shorter ones to the gather kernel (cuda/ipc_memory.cpp). One
    4 MiB span: the kernel's under the default (16 MiB), the copy engines' under 1 MiB. The
    initiator copies, so this process's counters tell."""
    a, b, address = ipc_pair
    n = 4 << 20
    remote, src, want = source_and_target(a, b, n, 11)
    monkeypatch.setenv("TORCH_P2P_IPC_COPY_ENGINE_BYTES", str(1 << 20))
    with p2p.Engine("cuda:0", **engine_kwargs("tcp")) as c:
        assert c.route(address) == "ipc"
        c.register(src)
        for engine, path in ((a, "ipc_kernel_spans"), (c, "ipc_copy_engine_spans")):
            b.call(helpers.put, "t", torch.full((n,), helpers.POISON, dtype=torch.uint8))
            before = _C._counters()
            engine.write_slices([src], [remote]).wait()
            after = _C._counters()
            moved = {k: after[k] - before[k] for k in ("ipc_kernel_spans", "ipc_copy_engine_spans")}
            assert moved == {k: int(k == path) for k in moved}, (engine is a, moved)
            check_landed(b, want)


@cuda
def test_ipc_paged_random_both_sides(ipc_pair):
    a, b, _ = ipc_pair
    blocks, page = 4096, 4096
    remote = p2p.RemoteTensor.from_bytes(b.call(make_cuda_target, "t", (blocks, page)))
    src = gpu_random((blocks, page), torch.uint8, 1)
    a.register(src)
    g = torch.Generator().manual_seed(7)
    sids, dids = torch.randperm(blocks, generator=g)[:3000], torch.randperm(blocks, generator=g)[:3000]
    a.write_slices(p2p.pages(src, sids), p2p.pages(remote, dids)).wait()
    whole = b.call(fetch_whole, "t")
    check_guards(whole)
    expected = torch.full((blocks, page), helpers.POISON, dtype=torch.uint8)
    expected[dids] = src[sids].cpu()
    assert torch.equal(whole[4096:-4096].view(blocks, page), expected)

    back = torch.full((blocks, page), helpers.POISON, dtype=torch.uint8, device="cuda:0")
    a.register(back)
    a.read_slices(p2p.pages(back, dids[:500]), p2p.pages(remote, dids[:500])).wait()
    want = torch.full((blocks, page), helpers.POISON, dtype=torch.uint8)
    want[dids[:500]] = expected[dids[:500]]
    assert torch.equal(back.cpu(), want)


def probe(state, name: str, ids: list) -> tuple:
    """The bytes at `ids` of a uint8 target, how many of its bytes are not poison, and whether
    its guards are whole, without fetching it."""
    t = state[name]
    return t[ids].cpu().tolist(), int((t != helpers.POISON).sum()), guards_whole(state[name + ".whole"])


@cuda
def test_ipc_page_ids_past_32_bits(ipc_pair):
    # The page kernel takes 32-bit ids: a list with a larger one goes as spans, and lands.
    a, b, _ = ipc_pair
    count = (1 << 31) + 64
    remote = p2p.RemoteTensor.from_bytes(b.call(make_cuda_target, "t", (count,)))
    src = torch.arange(1, 9, dtype=torch.uint8, device="cuda:0")
    a.register(src)
    dids = [(1 << 31) + 5, 3, (1 << 31) + 63, (1 << 31) - 1, 1 << 30]
    a.write_slices(p2p.pages(src, [0, 2, 4, 6, 7]), p2p.pages(remote, dids)).wait()
    assert b.call(probe, "t", dids) == ([1, 3, 5, 7, 8], 5, True)
    back = torch.zeros(8, dtype=torch.uint8, device="cuda:0")
    a.register(back)
    a.read_slices(p2p.pages(back, [7, 1, 5]), p2p.pages(remote, dids[:3])).wait()
    assert back.tolist() == [0, 3, 0, 0, 0, 5, 0, 1]


@cuda
def test_ipc_calls_in_flight_together_each_land_whole(ipc_pair):
    # Many calls in flight at once, each its own page set: each lands whole and completes.
    a, b, _ = ipc_pair
    blocks, page, calls, per = 4096, 4096, 64, 48
    remote = p2p.RemoteTensor.from_bytes(b.call(make_cuda_target, "t", (blocks, page)))
    src = gpu_random((blocks, page), torch.uint8, 3)
    a.register(src)
    g = torch.Generator().manual_seed(11)
    dids = torch.randperm(blocks, generator=g)[:calls * per].view(calls, per)
    sids = torch.randint(0, blocks, (calls, per), generator=g)
    for fut in [a.write_slices(p2p.pages(src, sids[i]), p2p.pages(remote, dids[i])) for i in range(calls)]:
        fut.wait()
    whole = b.call(fetch_whole, "t")
    check_guards(whole)
    expected = torch.full((blocks, page), helpers.POISON, dtype=torch.uint8)
    expected[dids.flatten()] = src.cpu()[sids.flatten()]
    assert torch.equal(whole[4096:-4096].view(blocks, page), expected)

    back = torch.full((blocks, page), helpers.POISON, dtype=torch.uint8, device="cuda:0")
    a.register(back)
    odd = dids[1::2]  # every other call's pages, read back in calls in flight together
    for fut in [a.read_slices(p2p.pages(back, ids), p2p.pages(remote, ids)) for ids in odd]:
        fut.wait()
    want = torch.full((blocks, page), helpers.POISON, dtype=torch.uint8)
    want[odd.flatten()] = expected[odd.flatten()]
    assert torch.equal(back.cpu(), want)


@cuda
def test_ipc_a_call_after_a_stream_wait_for_an_earlier_one(ipc_pair):
    # The caller's stream waits (stream_wait) for call B, then a kernel and call A follow on it.
    # The wait must hang on nothing the host does later: a kernel's first launch (CUDA loads
    # modules lazily, PyTorch's default) waits for every stream of the context, and on the GPU
    # machine it held up the worker's CUDA calls too, so a wait that the worker's completion
    # of B released (a host flag) hung here, GIL or no GIL.
    a, b, _ = ipc_pair
    n = 1 << 20
    remote = p2p.RemoteTensor.from_bytes(b.call(make_cuda_target, "t", (2, n)))
    src = gpu_random((2, n), torch.uint8, 5)
    a.register(src)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for i in range(200):
            earlier = a.write_slices([src[0]], [remote[0]], timeout=10)
            a.stream_wait(earlier, stream)
            src[1].add_(1)  # on the stream, after the wait: A must send this
            later = a.write_slices([src[1]], [remote[1]], timeout=10)
            p2p.wait(later, 20)
            p2p.wait(earlier, 20)
    check_landed(b, src.cpu())


@cuda
def test_ipc_stream_wait_holds_later_work_until_the_copy_is_done(ipc_pair):
    """The first call to a peer (its copy may wait for the peer's hello), stream_wait on it,
    then a kernel on the stream that overwrites the source: the peer gets the bytes from
    before the overwrite."""
    a, b, _ = ipc_pair
    remote, src, want = source_and_target(a, b, 64 << 20, 7)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        fut = a.write_slices([src], [remote])
        a.stream_wait(fut, stream)
        src.fill_(1)  # only after the copy has read src
    p2p.wait(fut, 60)
    stream.synchronize()
    check_landed(b, want)


@cuda
def test_ipc_stream_wait_waits_on_the_gpu_not_the_host(ipc_pair):
    """stream_wait on an IPC call whose copy waits behind a second-long kernel returns before
    the call is done (its stream waits on the GPU for an event after the copy; a call it did
    not find would be waited for on the host), and the work after it still follows the copy."""
    a, b, _ = ipc_pair
    remote, src, want = source_and_target(a, b, 1 << 20, 9)
    a.write_slices([src], [remote]).wait()  # the peer is known: nothing waits for its hello
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        torch.cuda._sleep(2_000_000_000)  # about a second of GPU clock
        fut = a.write_slices([src], [remote])
        a.stream_wait(fut, stream)
        done_at_return = fut.done()
        src.fill_(1)  # only after the copy has read src
    p2p.wait(fut, 60)
    stream.synchronize()
    assert not done_at_return, "stream_wait waited on the host"
    check_landed(b, want)


@cuda
def test_ipc_one_call_mixes_page_sizes_and_views(ipc_pair):
    """Page lists of different lengths, pages too long for the page kernel (they go as spans),
    and a plain view, in one write and one read: each launch of the call lands, and the last
    one signals for all."""
    a, b, _ = ipc_pair
    small, big = 4096, 256 << 10
    remote_small = p2p.RemoteTensor.from_bytes(b.call(make_cuda_target, "s", (64, small)))
    remote_big = p2p.RemoteTensor.from_bytes(b.call(make_cuda_target, "b", (8, big)))
    src_small, src_big = gpu_random((64, small), torch.uint8, 5), gpu_random((8, big), torch.uint8, 6)
    a.register(src_small)
    a.register(src_big)
    a.write_slices([p2p.pages(src_small, [3, 9, 1]), p2p.pages(src_small, list(range(40, 60))),
                    p2p.pages(src_big, [7, 0]), src_small[62]],
                   [p2p.pages(remote_small, [0, 5, 6]), p2p.pages(remote_small, list(range(20, 40))),
                    p2p.pages(remote_big, [1, 2]), remote_small[63]]).wait()
    got_small, got_big = b.call(fetch_whole, "s"), b.call(fetch_whole, "b")
    check_guards(got_small)
    check_guards(got_big)
    want_small = torch.full((64, small), helpers.POISON, dtype=torch.uint8)
    want_small[[0, 5, 6]] = src_small[[3, 9, 1]].cpu()
    want_small[20:40] = src_small[40:60].cpu()
    want_small[63] = src_small[62].cpu()
    want_big = torch.full((8, big), helpers.POISON, dtype=torch.uint8)
    want_big[[1, 2]] = src_big[[7, 0]].cpu()
    assert torch.equal(got_small[4096:-4096].view(64, small), want_small)
    assert torch.equal(got_big[4096:-4096].view(8, big), want_big)

    back = torch.full((8, big), helpers.POISON, dtype=torch.uint8, device="cuda:0")
    a.register(back)
    a.read_slices([p2p.pages(back, [4, 5]), back[6, :small]], [p2p.pages(remote_big, [2, 1]), remote_small[0]]).wait()
    want_back = torch.full((8, big), helpers.POISON, dtype=torch.uint8)
    want_back[[4, 5]] = want_big[[2, 1]]
    want_back[6, :small] = want_small[0]
    assert torch.equal(back.cpu(), want_back)


@cuda
def test_ipc_ten_thousand_views_strided_and_mirror(ipc_pair):
    a, b, _ = ipc_pair
    remote = p2p.RemoteTensor.from_bytes(b.call(make_cuda_target, "t", (10000, 6), torch.float32))
    src = gpu_random((10000, 12), torch.float32, 2)
    a.register(src)
    views = [src[i, ::2] for i in range(10000)]  # 10,000 strided views, one call
    a.write_slices(views, [remote[9999 - i] for i in range(10000)]).wait()
    whole = b.call(fetch_whole, "t")
    check_guards(whole)
    got = whole[4096:-4096].view(torch.float32).view(10000, 6)
    assert torch.equal(helpers.bits(got), helpers.bits(src[:, ::2].flip(0).cpu()))

    # Mirror: a view lands at the same element positions in a tensor laid out like ours.
    mirror = p2p.RemoteTensor.from_bytes(b.call(make_cuda_target, "m", (64, 12), torch.float32))
    src2 = gpu_random((64, 12), torch.float32, 3)
    a.register(src2)
    a.write_slices([src2[3:9, 1::4], src2[40]], mirror).wait()
    got = b.call(fetch_whole, "m")[4096:-4096].view(torch.float32).view(64, 12)
    expected = torch.full((64 * 12 * 4,), helpers.POISON, dtype=torch.uint8).view(torch.float32).view(64, 12)
    expected[3:9, 1::4] = src2[3:9, 1::4].cpu()
    expected[40] = src2[40].cpu()
    assert torch.equal(helpers.bits(got), helpers.bits(expected))


@cuda
def test_ipc_kv_like_views(ipc_pair):
    """A vLLM-style [2, blocks, block_size, heads, dim] layer: K and V of scattered blocks,
    and a head slice (a receiver with half the heads)."""
    a, b, _ = ipc_pair
    shape = (2, 64, 16, 8, 128)
    remote = p2p.RemoteTensor.from_bytes(b.call(make_cuda_target, "t", (2, 64, 16, 4, 128), torch.bfloat16))
    src = gpu_random(shape, torch.bfloat16, 4)
    a.register(src)
    sids, dids = [5, 6, 7, 40, 2], [10, 11, 12, 0, 63]
    a.write_slices([p2p.pages(src[0, :, :, 4:], sids), p2p.pages(src[1, :, :, 4:], sids)],
                   [p2p.pages(remote[0], dids), p2p.pages(remote[1], dids)]).wait()
    whole = b.call(fetch_whole, "t")
    check_guards(whole)
    got = whole[4096:-4096].view(torch.bfloat16).view(2, 64, 16, 4, 128)
    assert torch.equal(helpers.bits(got[:, dids]), helpers.bits(src[:, sids, :, 4:].cpu()))
    rest = [i for i in range(64) if i not in dids]
    assert (got[:, rest].view(torch.uint8) == helpers.POISON).all()


@cuda
def test_ipc_follows_the_callers_stream_and_notifies_after_the_bytes(ipc_pair):
    from test_cuda import copied, wait_then_copy  # the receiver's stream-ordered copy

    a, b, _ = ipc_pair
    n = 1 << 22
    remote = p2p.RemoteTensor.from_bytes(b.call(helpers.make_target, "t", (n,), fill=-1.0, device=PEER_GPU))
    src = torch.zeros(n, device="cuda:0")
    a.register(src)
    for value in (1.0, 2.0):
        b.start(wait_then_copy, "t", 5)
        torch.cuda._sleep(200_000_000)  # keeps the stream busy ~0.1 s
        src.fill_(value)                # queued behind the sleep
        a.write_slices(src, remote, notify=5).wait()
        b.result()
        assert (b.call(copied) == value).all()

    dst = torch.zeros(n, device="cuda:0")
    a.register(dst)
    torch.cuda._sleep(200_000_000)
    dst.fill_(9.0)  # queued before the read: the read lands after it
    a.read_slices(dst, remote).wait()
    assert (dst == 2.0).all()


@cuda
def test_ipc_prepared_calls_follow_the_callers_stream(ipc_pair):
    """A prepared paged write, run again after a kernel rewrote its source: every run moves
    what the stream had written by the time of the run."""
    a, b, _ = ipc_pair
    blocks, page = 512, 4096
    remote = p2p.RemoteTensor.from_bytes(b.call(make_cuda_target, "p", (blocks, page)))
    src = torch.zeros((blocks, page), dtype=torch.uint8, device="cuda:0")
    a.register(src)
    g = torch.Generator().manual_seed(9)
    sids, dids = torch.randperm(blocks, generator=g)[:256], torch.randperm(blocks, generator=g)[:256]
    call = a.prepare_write(p2p.pages(src, sids), p2p.pages(remote, dids))
    for value in (1, 2, 3):
        torch.cuda._sleep(50_000_000)  # keeps the stream busy
        src.fill_(value)               # queued behind the sleep
        call.run().wait()
        whole = b.call(fetch_whole, "p")
        check_guards(whole)
        expected = torch.full((blocks, page), helpers.POISON, dtype=torch.uint8)
        expected[dids] = value
        assert torch.equal(whole[4096:-4096].view(blocks, page), expected)


@cuda
def test_ipc_access_is_checked_before_launch(ipc_pair):
    a, b, _ = ipc_pair
    ro = p2p.RemoteTensor.from_bytes(b.call(make_cuda_target, "ro", (1024,), access="r"))
    src = gpu_random((1024,), torch.uint8, 5)
    a.register(src)
    with pytest.raises(ValueError, match="does not accept remote writes"):
        a.write_slices(src, ro)
    with pytest.raises(ValueError, match="beyond the region"):  # such a handle does not even decode
        ph.tampered(ro, nbytes=512, access=3)
    out = torch.zeros(1024, dtype=torch.uint8, device="cuda:0")
    a.register(out)
    a.read_slices(out, ro).wait()
    assert (out == helpers.POISON).all()
    # A handle that claims more bytes than its allocation holds is refused, not mapped.
    big = ph.tampered(ro, nbytes=1 << 31, access=3, shape=[1 << 30])
    large = torch.zeros(1 << 30, dtype=torch.uint8, device="cuda:0")
    a.register(large)
    with pytest.raises(ValueError, match="claims"):
        a.write_slices(large, [big]).wait()
    check_guards(b.call(fetch_whole, "ro"))


def reuse_block(state, name: str) -> dict:
    """Closes `name`, frees it, and allocates a tensor of the same size: the caching allocator
    hands out the same block. Returns whether it did."""
    ptr = state[name].data_ptr()
    state.pop(f"{name}.region").close()
    state.pop(name)
    whole = state.pop(name + ".whole")
    n = whole.numel()
    del whole
    state["reused"] = torch.full((n,), 0x3C, dtype=torch.uint8, device=PEER_GPU)
    torch.cuda.synchronize()
    return {"same_block": state["reused"].data_ptr() + 4096 == ptr}


def reused_untouched(state) -> bool:
    return bool((state["reused"] == 0x3C).all())


@cuda
def test_ipc_region_close_and_block_reuse(ipc_pair):
    """The owner's close waits for our release (we unmap); a write through the stale handle
    then fails and never reaches the block the allocator gave to a new tensor."""
    a, b, _ = ipc_pair
    remote = p2p.RemoteTensor.from_bytes(b.call(make_cuda_target, "t", (1 << 20,)))
    src = gpu_random((1 << 20,), torch.uint8, 6)
    a.register(src)
    a.write_slices(src, remote).wait()
    assert b.call(reuse_block, "t")["same_block"]
    with pytest.raises(p2p.ClosedError, match="deregistered"):
        a.write_slices(src, remote).wait()
    assert b.call(reused_untouched)
    assert a.route(b.call(lambda_address)) == "ipc"  # the peer itself is fine


def lambda_address(state) -> bytes:
    return state["engine"].address


@cuda
def test_ipc_peer_killed_mid_transfer():
    """Writes stream to a peer that is killed: they fail with PeerError within peer_timeout,
    and the engine goes on with another peer."""
    with Peer() as b, Peer() as c, p2p.Engine("cuda:0", **engine_kwargs("tcp", peer_timeout=5)) as a:
        b.call(helpers.start_engine, "tcp", device=PEER_GPU)
        remote = p2p.RemoteTensor.from_bytes(b.call(make_cuda_target, "t", (64 << 20,)))
        src = gpu_random((64 << 20,), torch.uint8, 7)
        a.register(src)
        a.write_slices(src, remote).wait()
        futures = [a.write_slices(src, remote) for _ in range(20)]
        os.kill(b.pid, signal.SIGKILL)
        start = time.monotonic()
        failed = None
        while time.monotonic() - start < 10 and failed is None:
            f = a.write_slices(src, remote)
            try:
                p2p.wait(f, 10)
            except p2p.PeerError as e:
                failed = e
        assert failed is not None and time.monotonic() - start < 6, "writes to a dead peer kept succeeding"
        for f in futures:  # each either landed before the kill or failed
            try:
                p2p.wait(f, 10)
            except p2p.PeerError:
                pass
        c.call(helpers.start_engine, "tcp", device=PEER_GPU)
        other = p2p.RemoteTensor.from_bytes(c.call(make_cuda_target, "t", (1 << 20,)))
        a.write_slices(src[: 1 << 20], [other]).wait()
        assert torch.equal(c.call(fetch_whole, "t")[4096:-4096], src[: 1 << 20].cpu())


def engine_cpu(state):
    return state["engine"].plan.cpu


@cuda
def test_ipc_same_gpu_two_processes():
    with Peer() as b, p2p.Engine("cuda:0", **engine_kwargs("tcp")) as a:
        address = b.call(helpers.start_engine, "tcp", device="cuda:0")
        assert a.route(address) == "ipc"
        # Their busy-polling workers pin different cores (topology.claim_core).
        assert a.plan.cpu is None or b.call(engine_cpu) != a.plan.cpu, a.plan.reason
        remote = p2p.RemoteTensor.from_bytes(b.call(helpers.make_target, "t", (256, 1024), fill=-1.0, device="cuda:0"))
        src = gpu_random((256, 1024), torch.float32, 8)
        a.register(src)
        a.write_slices(p2p.pages(src, range(0, 256, 2)), p2p.pages(remote, range(1, 256, 2))).wait()
        got = b.call(helpers.fetch, "t")
        assert torch.equal(helpers.bits(got[1::2]), helpers.bits(src[::2].cpu()))
        assert (got[::2] == -1.0).all()
