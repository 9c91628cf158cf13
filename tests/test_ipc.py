"""Pages (p2p.pages) on every provider, route choice, and the same-host CUDA IPC route
(csrc/routes/cuda_ipc). The GPU tests run one process per GPU where there are two (both on cuda:0
otherwise), with whatever libfabric is installed: the IPC route needs none of its CUDA support."""
import contextlib
import errno
import os
import shutil
import signal
import subprocess
import time

import pytest
import torch

import helpers
import peer_helpers as ph
import torch_p2p as p2p
from torch_p2p import _C
from conftest import PEER_GPU, ROUTES, engine_kwargs, shares_memory
from peer import Peer
cuda = pytest.mark.cuda


# -- Host identity and route choice (no GPU needed) -------------------------------------------

def test_address_names_the_host_and_process():
    with p2p.Engine("cpu", **engine_kwargs("tcp")) as e:
        a = _C._decode_address(e.address)
        assert a["pid"] == os.getpid()
        boot = open("/proc/sys/kernel/random/boot_id").read().strip()
        assert a["host"].decode().startswith(boot + "/")
        assert a["routes"] & 1 == 0  # a host engine maps nothing (route 0 is the IPC route)


def test_host_engines_take_the_fabric_or_cma(provider):
    """Host memory never takes the IPC route: the fabric, or on one host the cma route where it
    is on; data_path="staged" keeps the staged path."""
    expected = ROUTES[provider]
    with p2p.Engine("cpu", **engine_kwargs(provider)) as a, p2p.Engine("cpu", **engine_kwargs(provider)) as b:
        t = torch.zeros(16)
        if shares_memory(provider):
            t.share_memory_()
        region = b.register(t)
        assert a.route(b.address) == expected
        assert a.route(region.remote) == expected
        with p2p.Engine("cpu", **engine_kwargs(provider, data_path="staged")) as c:
            assert c.route(b.address) == "staged"
        with pytest.raises(ValueError, match="invalid engine address"):
            a.route(b"x" * 40)
        with pytest.raises(TypeError):
            a.route(7)


def test_cma_copies_past_the_kernels_limit_per_call():
    """The kernel moves at most about 2 GiB per process_vm_writev / readv and returns a short
    count past that: the cma route's copy goes on where a call stopped. Five spans of the same
    512 MiB (2.5 GiB in all, into this process) move every byte; a span that runs past the end
    of a mapping is a fault, not a hang."""
    src = torch.arange(1 << 27, dtype=torch.int32)  # 512 MiB
    dst = torch.zeros_like(src)
    nbytes = src.numel() * 4
    spans = [(src.data_ptr(), dst.data_ptr(), nbytes)] * 5
    assert _C._cma_copy(os.getpid(), spans, True) == 0
    assert torch.equal(dst, src)
    dst.zero_()
    assert _C._cma_copy(os.getpid(), [(dst.data_ptr(), src.data_ptr(), 0)] + spans, False) == 0
    assert torch.equal(dst, src)
    small = torch.zeros(1024, dtype=torch.uint8)
    assert _C._cma_copy(os.getpid(), [(small.data_ptr(), 4096, 1024)], True) == errno.EFAULT


def test_ipc_setting_is_checked(monkeypatch):
    monkeypatch.setenv("TORCH_P2P_IPC", "yes")
    with pytest.raises(ValueError, match="TORCH_P2P_IPC must be 0 or 1"):
        p2p.Engine("cpu", **engine_kwargs("tcp"))


# -- Pages on the fabric (CPU CI) --------------------------------------------------------------

def test_random_pages_both_sides(link):
    """Random block tables on both sides, write and read; pages not named keep their poison."""
    pages, page = 64, (4, 33)  # odd sizes: runs that are no multiple of 16 bytes
    name, remote = link.remote((pages, *page))
    src = helpers.random_tensor((pages, *page), torch.float32, 1)
    link.engine.register(src)
    g = torch.Generator().manual_seed(2)

    def table(run: range) -> torch.Tensor:  # 40 distinct ids, with `run` at positions 5 to 8
        rest = [i for i in torch.randperm(pages, generator=g).tolist() if i not in run]
        return torch.tensor(rest[:5] + list(run) + rest[5:36])

    sids, dids = table(range(3, 7)), table(range(20, 24))  # the runs merge on both sides
    p2p.wait(link.engine.write_slices(p2p.pages(src, sids), p2p.pages(remote, dids)), 60)
    expected = helpers.poisoned((pages, *page), torch.float32)
    expected[dids] = src[sids]
    helpers.assert_same_bits(link.fetch(name), expected)

    back = helpers.poisoned((pages, *page), torch.float32)
    link.engine.register(back)
    p2p.wait(link.engine.read_slices([p2p.pages(back, sids)], [p2p.pages(remote, dids)]), 60)
    want = helpers.poisoned((pages, *page), torch.float32)
    want[sids] = src[sids]
    helpers.assert_same_bits(back, want)


def test_pages_of_strided_views_and_other_dims(link):
    """Pages along dim 1 of a [2, blocks, block] K/V layout, of a strided view; mixed with a
    plain view in one call."""
    name, remote = link.remote((2, 16, 8, 6))
    src = helpers.random_tensor((2, 16, 8, 12), torch.float32, 3)[..., ::2]  # non-contiguous pages
    link.engine.register(src)
    ids_s, ids_d = [7, 1, 12], [0, 15, 4]
    extra = helpers.random_tensor((6,), torch.float32, 4)
    link.engine.register(extra)
    p2p.wait(link.engine.write_slices([p2p.pages(src, ids_s, dim=1), extra], [p2p.pages(remote, ids_d, dim=1),
                                                                               remote[1, 2, 3]]), 60)
    expected = helpers.poisoned((2, 16, 8, 6), torch.float32)
    expected[:, ids_d] = src[:, ids_s]
    expected[1, 2, 3] = extra
    helpers.assert_same_bits(link.fetch(name), expected)


def test_bad_pages_raise_before_anything_moves(link):
    name, remote = link.remote((8, 16))
    src = helpers.random_tensor((8, 16), torch.float32, 5)
    link.engine.register(src)
    e = link.engine
    cases = [
        (IndexError, "local page 8 of 8", lambda: e.write_slices(p2p.pages(src, [0, 8]), p2p.pages(remote, [0, 1]))),
        (IndexError, "remote page -1", lambda: e.write_slices(p2p.pages(src, [0]), p2p.pages(remote, [-1]))),
        (ValueError, "named twice", lambda: e.write_slices(p2p.pages(src, [0, 1]), p2p.pages(remote, [3, 3]))),
        # The same ids again in a smaller tensor: a repeated entry is checked against its own bounds.
        (IndexError, "source view 1: page 1 pairs local page 1 of 8 with remote page 4 of 4",
         lambda: e.write_slices([p2p.pages(src, [0, 1]), p2p.pages(src, [0, 1])],
                                [p2p.pages(remote, [3, 4]), p2p.pages(remote[:4], [3, 4])])),
        (ValueError, "has 2 pages but its RemoteTensor has 1",
         lambda: e.write_slices(p2p.pages(src, [0, 1]), p2p.pages(remote, [3]))),
        (ValueError, "pages pair with pages", lambda: e.write_slices(p2p.pages(src, [0]), [remote[0]])),
        (ValueError, "pages pair with pages", lambda: e.write_slices(p2p.pages(src, [0]), remote)),
        (ValueError, "a page has shape", lambda: e.write_slices(p2p.pages(src, [0]), p2p.pages(remote[:, :8], [0]))),
        (ValueError, "one-dimensional", lambda: p2p.pages(src, [[0, 1]])),
        (IndexError, "out of range", lambda: p2p.pages(src, [0], dim=2)),
        (TypeError, r"pages\(\) takes a tensor", lambda: p2p.pages([1, 2], [0])),
    ]
    for kind, text, call in cases:
        with pytest.raises(kind, match=text):
            call()
    # A read may name a source page twice (it is the destination that must not repeat).
    back = torch.zeros(2, 16)
    e.register(back)
    p2p.wait(e.read_slices(p2p.pages(back, [0, 1]), p2p.pages(remote, [2, 2])), 60)
    assert (link.fetch(name) == link.fetch(name)[0, 0]).all()  # untouched by the bad calls
    helpers.assert_same_bits(back, torch.stack([link.fetch(name)[2]] * 2))


def test_page_ids_of_a_huge_tensor_are_checked_without_a_huge_table(link):
    """A few pages of a tensor of millions: repeated destinations are found by sorting (no
    table of a byte per page), the same way for the engine and for KV block tables."""
    count = 3 << 20
    name, remote = link.remote((count,), torch.uint8)
    src = torch.arange(1, 5, dtype=torch.uint8)
    link.engine.register(src)
    with pytest.raises(ValueError, match="destination page 5 is named twice"):
        link.engine.write_slices(p2p.pages(src, [0, 1, 2]), p2p.pages(remote, [5, 2 << 20, 5]))
    p2p.wait(link.engine.write_slices(p2p.pages(src, [0, 1, 2]), p2p.pages(remote, [5, 2 << 20, 7])), 60)
    got = link.fetch(name)
    assert got[[5, 2 << 20, 7]].tolist() == [1, 2, 3]
    assert int((got != helpers.POISON).sum()) == 3
    assert _C.checked_ids([5, 2 << 20, 5], count, True) is None
    assert _C.checked_ids([5, 2 << 20, 5], count, False).tolist() == [5, 2 << 20, 5]
    assert _C.checked_ids((5, 2 << 20, 7), count, True).tolist() == [5, 2 << 20, 7]
    assert _C.checked_ids([1, 1], 8, True) is None  # the table's way
    assert _C.checked_ids([0, count], count, False) is None


def test_prepared_calls_run_again_and_again(link):
    """prepare_write / prepare_read check and decompose a call once. Each run moves what the
    views hold at that moment (many may be in flight), ids changed after prepare change
    nothing, bad calls fail at prepare as the call itself would, and a run after a local region
    of it was deregistered fails with ClosedError."""
    pages, page = 32, (4, 9)
    name, remote = link.remote((pages, *page))
    src = helpers.random_tensor((pages, *page), torch.float32, 1)
    region = link.engine.register(src)
    e, g = link.engine, torch.Generator().manual_seed(4)
    sids, dids = torch.randperm(pages, generator=g)[:12], torch.randperm(pages, generator=g)[:12]
    free = next(i for i in range(pages) if i not in dids.tolist())  # a plain view's destination row
    call = e.prepare_write([p2p.pages(src, sids), src[0, 1]], [p2p.pages(remote, dids), remote[free, 2]])
    kept = sids.clone()
    sids.zero_()  # the ids were copied at prepare
    for seed in (2, 3):
        src.copy_(helpers.random_tensor(src.shape, torch.float32, seed))
        for fut in [call.run() for _ in range(20)]:
            p2p.wait(fut, 60)
        expected = helpers.poisoned((pages, *page), torch.float32)
        expected[dids] = src[kept]
        expected[free, 2] = src[0, 1]
        helpers.assert_same_bits(link.fetch(name), expected)

    back = helpers.poisoned((pages, *page), torch.float32)
    link.engine.register(back)
    read = e.prepare_read(p2p.pages(back, kept), p2p.pages(remote, dids))
    p2p.wait(read.run(), 60)
    want = helpers.poisoned((pages, *page), torch.float32)
    want[kept] = src[kept]
    helpers.assert_same_bits(back, want)

    with pytest.raises(IndexError, match="local page 99 of 32"):
        e.prepare_write(p2p.pages(src, [99]), p2p.pages(remote, [0]))
    with pytest.raises(ValueError, match="notify must be a 32-bit"):
        e.prepare_write(src, remote, notify=-3)
    region.close()
    with pytest.raises(p2p.ClosedError, match="of this prepared call is deregistered"):
        call.run()
    p2p.wait(read.run(), 60)  # its regions are still there


# -- The IPC route (GPU machine) -----------------------------------------------------------------

@pytest.fixture
def ipc_pair():
    """(engine on cuda:0, peer child with an engine on PEER_GPU, its address), on the IPC route."""
    with Peer() as b, p2p.Engine("cuda:0", **engine_kwargs("tcp")) as a:
        address = b.call(helpers.start_engine, "tcp", device=PEER_GPU)
        assert a.route(address) == "ipc"
        yield a, b, address


def make_cuda_target(state, name: str, shape, dtype=torch.uint8, access: str = "rw") -> bytes:
    """A poisoned CUDA tensor registered under `name`, with 4 KiB of guard bytes on each side
    (unregistered, in the same allocation); returns the handle of the middle."""
    n = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    whole = torch.full((n + 8192,), helpers.POISON, dtype=torch.uint8, device=PEER_GPU)
    state[name + ".whole"] = whole
    t = whole[4096:4096 + n].view(dtype).view(shape)
    state[name] = t
    state[f"{name}.region"] = state["engine"].register(t, access=access)
    return state[f"{name}.region"].remote.to_bytes()


def fetch_whole(state, name: str) -> torch.Tensor:
    return state[name + ".whole"].cpu()


def gpu_random(shape, dtype, seed):
    return helpers.random_tensor(shape, dtype, seed).to("cuda:0")


def source_and_target(a, b, n: int, seed: int):
    """(b's n-byte target "t", a registered random source of n bytes here, its bytes on the host)."""
    remote = p2p.RemoteTensor.from_bytes(b.call(make_cuda_target, "t", (n,)))
    src = gpu_random((n,), torch.uint8, seed)
    a.register(src)
    return remote, src, src.cpu()


def guards_whole(whole: torch.Tensor) -> bool:
    return bool((whole[:4096] == helpers.POISON).all() and (whole[-4096:] == helpers.POISON).all())


def check_guards(whole: torch.Tensor):
    assert guards_whole(whole), "guard bytes hit"


def check_landed(b, want: torch.Tensor, name: str = "t"):
    """Peer b's target `name` (make_cuda_target) holds exactly the bytes of `want` (uint8, in
    its shape), its guard bytes untouched."""
    whole = b.call(fetch_whole, name)
    check_guards(whole)
    assert torch.equal(whole[4096:-4096].view(want.shape), want)


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


@pytest.fixture(scope="module")
def cuda_faults(tmp_path_factory) -> str:
    """cuda_faults.c built as a library to preload: cudaHostAlloc fails while
    P2P_TEST_FAIL_HOST_ALLOC is set, cudaEventRecord off the default stream while
    P2P_TEST_FAIL_EVENT_RECORD is."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler to build cuda_faults.c")
    so = tmp_path_factory.mktemp("preload") / "cuda_faults.so"
    source = os.path.join(os.path.dirname(__file__), "cuda_faults.c")
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(so), source, "-ldl"], check=True)
    return str(so)


def route_to(state, address: bytes) -> str:
    return state["engine"].route(address)


@contextlib.contextmanager
def faulty_initiator(cuda_faults: str, pages: int):
    """Peer b with a poisoned target "t" of `pages` 4 KiB pages, and peer c, with cuda_faults
    preloaded, whose engine reaches it by IPC: yields (b, c, the target's handle)."""
    with Peer() as b, Peer(env={"LD_PRELOAD": cuda_faults}) as c:
        address = b.call(helpers.start_engine, "tcp", device=PEER_GPU)
        remote = b.call(make_cuda_target, "t", (pages, 4096))
        c.call(helpers.start_engine, "tcp", device="cuda:0")
        assert c.call(route_to, address) == "ipc"
        yield b, c, remote


def registered_source(state, remote_bytes: bytes, pages: int, seed: int):
    """In faulty_initiator's peer c: its engine, the target, and a registered random source of
    `pages` 4 KiB pages (kept in the peer's state)."""
    e = state["engine"]
    src = gpu_random((pages, 4096), torch.uint8, seed)
    state["src"] = src
    e.register(src)
    return e, p2p.RemoteTensor.from_bytes(remote_bytes), src


def error_of(call) -> str | None:
    """None if call() raises nothing, else the exception as "Type: message"."""
    try:
        call()
    except Exception as ex:  # noqa: BLE001 - reported to the test
        return f"{type(ex).__name__}: {ex}"
    return None


def write_with_and_without_pinned_memory(state, remote_bytes: bytes, pages: int):
    """Runs in faulty_initiator's peer c: a contiguous and a paged write of 4 KiB pages while no
    pinned memory can be had (the first descriptor blocks are taken then), and again after.
    Returns (name, failing, error or None, seconds) per write, and the source."""
    e, remote, src = registered_source(state, remote_bytes, pages, 11)
    ids = torch.randperm(pages, generator=torch.Generator().manual_seed(3))
    calls = {"contiguous": lambda: e.write_slices([src[:256]], [remote[:256]]),
             "paged": lambda: e.write_slices(p2p.pages(src, ids), p2p.pages(remote, ids))}
    out = []
    for failing in (True, False):
        os.environ["P2P_TEST_FAIL_HOST_ALLOC"] = "1" if failing else ""
        for name, call in calls.items():
            start = time.monotonic()
            error = error_of(lambda: p2p.wait(call(), 30))
            out.append((name, failing, error, time.monotonic() - start))
    return out, src.cpu()


@cuda
def test_ipc_no_pinned_memory_fails_the_batch_at_once(cuda_faults):
    """A copy whose descriptors find no pinned memory fails its future at once (not at the
    transfer timeout), and the route works again once memory can be had."""
    pages = 8192  # their packed ids (64 KiB) need a pinned block of their own
    with faulty_initiator(cuda_faults, pages) as (b, c, remote):
        outcomes, src = c.call(write_with_and_without_pinned_memory, remote, pages)
        for name, failing, error, seconds in outcomes:
            if failing:
                assert error and "allocating pinned memory" in error, (name, error)
                assert seconds < 10, f"{name}: failed after {seconds:.1f} s"
            else:
                assert error is None, (name, error)
        check_landed(b, src)


def write_behind_a_sleep_without_events(state, remote_bytes: bytes, pages: int):
    """Runs in faulty_initiator's peer c: a contiguous write large enough for the copy engines
    (so its batch ends with an event, not the kernel's flag), queued behind a second of sleep
    on the caller's stream while no event can be recorded on the IPC stream. Returns (error or
    None, whether the sleep was over when the future completed, seconds), for it and for the
    same write once events work, and the source."""
    e, remote, src = registered_source(state, remote_bytes, pages, 12)
    out = []
    for failing in (True, False):
        torch.cuda.synchronize()
        torch.cuda._sleep(2_000_000_000)  # about a second of GPU clock
        slept = torch.cuda.Event()
        slept.record()
        os.environ["P2P_TEST_FAIL_EVENT_RECORD"] = "1" if failing else ""
        start = time.monotonic()
        error = error_of(lambda: p2p.wait(e.write_slices([src], [remote]), 30))
        out.append((error, slept.query(), time.monotonic() - start))
        os.environ["P2P_TEST_FAIL_EVENT_RECORD"] = ""
    return out, src.cpu()


@cuda
def test_ipc_batch_without_its_event_completes_after_its_copy(cuda_faults):
    """A batch whose closing event cannot be recorded completes when its copy has (the stream
    says so), not at once: an event never recorded reads as done."""
    pages = 8192  # 32 MiB, above the copy engines' threshold (16 MiB)
    with faulty_initiator(cuda_faults, pages) as (b, c, remote):
        outcomes, src = c.call(write_behind_a_sleep_without_events, remote, pages)
        for failing, (error, after_sleep, seconds) in zip((True, False), outcomes):
            assert after_sleep, f"completed after {seconds:.3f} s, before the copy it waited for ({failing=}, {error=})"
            assert error is None, (failing, error)
        check_landed(b, src)


def write_from_a_busy_side_stream(state, remote_bytes: bytes, pages: int):
    """Runs in faulty_initiator's peer c: a write from a busy side stream whose event cannot be
    recorded, then a torch kernel on that stream, then the write again with events working.
    Returns (the write's error, the kernel's error or None), and the source."""
    e, remote, src = registered_source(state, remote_bytes, pages, 13)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.cuda._sleep(200_000_000)  # busy: the call must record an event on `side`
        os.environ["P2P_TEST_FAIL_EVENT_RECORD"] = "1"
        error = error_of(lambda: e.write_slices([src], [remote]))
        os.environ["P2P_TEST_FAIL_EVENT_RECORD"] = ""

        def torch_kernel():
            torch.cuda._sleep(1)  # torch's launch check reads CUDA's last error
            torch.cuda.synchronize()

        later = error_of(torch_kernel)
        p2p.wait(e.write_slices([src], [remote]), 30)
    return error, later, src.cpu()


@cuda
def test_ipc_failed_stream_event_raises_and_leaves_no_cuda_error(cuda_faults):
    """A call whose stream event cannot be recorded raises, and leaves CUDA's last error clear
    (else the caller's next torch kernel would fail with it); the engine goes on working."""
    with faulty_initiator(cuda_faults, 256) as (b, c, remote):
        error, later, src = c.call(write_from_a_busy_side_stream, remote, 256)
        assert error and "cudaEventRecord" in error, error
        assert later is None, later
        check_landed(b, src)


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


@cuda
def test_ipc_off_takes_the_fabric():
    with Peer() as b, p2p.Engine("cuda:0", **engine_kwargs("tcp", ipc=False)) as a:
        address = b.call(helpers.start_engine, "tcp", device=PEER_GPU)
        assert a.route(address) == "staged"
    with Peer(env={"TORCH_P2P_IPC": "0"}) as b, p2p.Engine("cuda:0", **engine_kwargs("tcp")) as a:
        address = b.call(helpers.start_engine, "tcp", device=PEER_GPU)
        assert a.route(address) == "staged"  # the peer maps nothing, so exports nothing either
