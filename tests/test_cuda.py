"""GPU tensors on both ends: one process per GPU, staged over tcp, direct over a CUDA-enabled
shm where the libfabric in use has one, and the same-host CUDA IPC route (tests/test_ipc.py has
its own tests). Skipped without CUDA."""
import os
import signal

import pytest
import torch

import helpers
import torch_p2p as p2p
from torch_p2p import _C
from conftest import PEER_GPU, engine_kwargs
from peer import Peer

pytestmark = [pytest.mark.cuda, pytest.mark.timeout(300)]

POISON = -7.0


def shm_has_hmem() -> bool:
    """Whether this libfabric offers FI_HMEM for shm (the engine still probes that it works)."""
    return torch.cuda.is_available() and p2p._C.list_nics("shm", True)[1]


# (provider, the route expected between the two engines); the fabric routes with IPC off.
PATHS = [
    pytest.param(("tcp", "staged"), id="tcp-staged"),
    pytest.param(("shm", "direct"), id="shm-direct",
                 marks=pytest.mark.skipif(not shm_has_hmem(), reason="this libfabric has no CUDA support for shm")),
    pytest.param(("tcp", "ipc"), id="ipc"),
]


@pytest.fixture(params=PATHS)
def path(request):
    return request.param


@pytest.fixture
def pair(path):
    """(local engine on cuda:0, peer child with an engine on PEER_GPU, provider)."""
    provider, expected = path
    ipc = expected == "ipc"
    with Peer() as b, p2p.Engine("cuda:0", **engine_kwargs(provider, ipc=ipc)) as a:
        if expected == "direct" and a.data_path != "direct":
            pytest.skip(f"{a.provider} offers FI_HMEM but cannot register CUDA memory here")
        if not ipc:
            assert a.data_path == expected
        address = b.call(helpers.start_engine, provider, device=PEER_GPU, ipc=ipc)
        assert a.route(address) == expected
        yield a, b, provider


def random_like(shape, device, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(device)


def test_gpu_to_gpu_views(pair):
    a, b, _ = pair
    remote = p2p.RemoteTensor.from_bytes(b.call(helpers.make_target, "t", (64, 512), fill=POISON, device=PEER_GPU))
    src = random_like((512, 64), "cuda:0", 1).t()  # transposed: non-contiguous
    a.register(src)
    rows = [3, 17, 40]
    a.write_slices([src[r] for r in rows], [remote[r + 1] for r in rows]).wait()
    a.write_slices([src[5, ::3]], [remote[0, 1::3][: src[5, ::3].numel()]]).wait()
    expected = torch.full((64, 512), POISON)
    for r in rows:
        expected[r + 1] = src[r].cpu()
    expected[0, 1::3][: src[5, ::3].numel()] = src[5, ::3].cpu()
    assert torch.equal(b.call(helpers.fetch, "t"), expected)  # every element: those written and the poison

    out = torch.full((3, 512), POISON, device="cuda:0")
    a.register(out)
    a.read_slices([out[i] for i in range(3)], [remote[r + 1] for r in rows]).wait()
    assert torch.equal(out.cpu(), torch.stack([src[r].cpu() for r in rows]))


def test_host_and_gpu_mixes(pair):
    a, b, _ = pair
    gpu_remote = p2p.RemoteTensor.from_bytes(b.call(helpers.make_target, "g", (8, 1024), fill=POISON, device=PEER_GPU))
    cpu_remote = p2p.RemoteTensor.from_bytes(b.call(helpers.make_target, "c", (8, 1024), fill=POISON))
    host_src = random_like((8, 1024), "cpu", 2)
    gpu_src = random_like((8, 1024), "cuda:0", 3)
    a.register(host_src)
    a.register(gpu_src)
    a.write_slices([host_src[1], host_src[2]], [gpu_remote[1], gpu_remote[2]]).wait()  # host -> GPU
    a.write_slices([gpu_src[4]], [cpu_remote[4]]).wait()                                # GPU -> host
    expected_g, expected_c = torch.full((8, 1024), POISON), torch.full((8, 1024), POISON)
    expected_g[1:3] = host_src[1:3]
    expected_c[4] = gpu_src[4].cpu()
    assert torch.equal(b.call(helpers.fetch, "g"), expected_g)
    assert torch.equal(b.call(helpers.fetch, "c"), expected_c)

    host_out = torch.zeros(1024)
    gpu_out = torch.zeros(1024, device="cuda:0")
    a.register(host_out)
    a.register(gpu_out)
    a.read_slices(host_out, [gpu_remote[1]]).wait()  # GPU -> host, by read
    a.read_slices(gpu_out, [cpu_remote[4]]).wait()   # host -> GPU, by read
    assert torch.equal(host_out, host_src[1])
    assert torch.equal(gpu_out.cpu(), gpu_src[4].cpu())


def test_write_follows_the_callers_stream(pair):
    """A kernel writes the source just before the call; the peer must get its output."""
    a, b, _ = pair
    remote = p2p.RemoteTensor.from_bytes(b.call(helpers.make_target, "t", (1 << 20,), fill=POISON, device=PEER_GPU))
    src = torch.zeros(1 << 20, device="cuda:0")
    a.register(src)
    for value in (1.0, 2.0, 3.0):
        torch.cuda._sleep(200_000_000)  # keeps the stream busy ~0.1 s
        src.fill_(value)                # queued behind the sleep
        a.write_slices(src, remote).wait()
        assert (b.call(helpers.fetch, "t") == value).all()


def test_read_follows_the_callers_stream(pair):
    """A read into GPU memory lands after the work queued before the call (it would be
    overwritten by that work otherwise)."""
    a, b, _ = pair
    remote = p2p.RemoteTensor.from_bytes(b.call(helpers.make_target, "t", (1 << 20,), fill=5.0, device=PEER_GPU))
    dst = torch.zeros(1 << 20, device="cuda:0")
    a.register(dst)
    torch.cuda._sleep(200_000_000)
    dst.fill_(9.0)  # queued before the read: the read must land after it
    a.read_slices(dst, remote).wait()
    assert (dst == 5.0).all()


def fill_target(state, name: str, value: float) -> None:
    state[name].fill_(value)
    torch.cuda.synchronize()


def target_equals(state, name: str, value: float) -> bool:
    return bool((state[name] == value).all())


def test_completion_means_the_bytes_are_in_place(pair):
    """A read's bytes are in place when its future completes, and a writer may reuse its
    buffer at once: shm's CUDA IPC copies finish after the RMA completes (the engine fences
    them; without the fence a quarter to a half of each 256 MiB had landed)."""
    a, b, _ = pair
    n = 64 << 20
    remote = p2p.RemoteTensor.from_bytes(b.call(helpers.make_target, "t", (n,), fill=0.0, device=PEER_GPU))
    out = torch.zeros(n, device="cuda:0")
    src = torch.zeros(n, device="cuda:0")
    a.register(out)
    a.register(src)
    for k in (1.0, 2.0, 3.0):
        b.call(fill_target, "t", k)
        a.read_slices(out, remote).wait()
        assert (out == k).all()  # on this process's stream, right after completion
        src.fill_(-k)
        a.write_slices(src, remote).wait()
        src.fill_(0.0)  # reused at once
        assert b.call(target_equals, "t", -k)


def test_staging_pool_much_smaller_than_the_transfer():
    with Peer() as b, p2p.Engine("cuda:0", **engine_kwargs("tcp", staging_bytes=512 << 10,
                                                        staging_slot_bytes=256 << 10)) as a:
        b.call(helpers.start_engine, "tcp", device=PEER_GPU, staging_bytes=512 << 10, staging_slot_bytes=256 << 10)
        n = 16 << 20  # 64 MiB of float32 through two 256 KiB slots on each side
        remote = p2p.RemoteTensor.from_bytes(b.call(helpers.make_target, "t", (n,), fill=POISON, device=PEER_GPU))
        src = random_like((n,), "cuda:0", 4)
        a.register(src)
        a.write_slices(src, remote).wait()
        assert torch.equal(b.call(helpers.fetch, "t"), src.cpu())
        back = torch.zeros(n, device="cuda:0")
        a.register(back)
        a.read_slices(back, [remote]).wait()
        assert torch.equal(back, src)


def wait_then_copy(state, name: str, tag: int) -> None:
    """Receiver: order a stream after the notification, then copy the target on the GPU.
    Returns once the notification is in (stream_wait waits on the host for it): start it."""
    engine, t = state["engine"], state[name]
    state["copy"] = torch.empty_like(t)
    state["note"] = engine.notification(tag, timeout=60)
    state["stream"] = torch.cuda.Stream(t.device)
    with torch.cuda.stream(state["stream"]):
        engine.stream_wait(state["note"])
        state["copy"].copy_(t)  # queued behind the wait


def copied(state) -> torch.Tensor:
    state["note"].wait()
    state["stream"].synchronize()
    return state["copy"].cpu()


def test_receiver_orders_its_stream_after_arrival(pair):
    a, b, _ = pair
    remote = p2p.RemoteTensor.from_bytes(b.call(helpers.make_target, "t", (1 << 18,), fill=POISON, device=PEER_GPU))
    b.start(wait_then_copy, "t", 77)
    src = random_like((1 << 18,), "cuda:0", 5)
    a.register(src)
    a.write_slices(src, remote, notify=77).wait()
    b.result()
    assert torch.equal(b.call(copied), src.cpu())


def test_a_stream_follows_a_read_and_a_failed_call(pair):
    """stream_wait on a read: a kernel queued after the wait sees the bytes. On a call that
    fails (the peer stopped, so a fabric call times out) stream_wait returns once it has failed,
    and the stream is not held."""
    a, b, provider = pair
    n = 1 << 24  # 64 MiB: long enough that a missing wait would read the poison
    remote = p2p.RemoteTensor.from_bytes(b.call(helpers.make_target, "t", (n,), fill=3.0, device=PEER_GPU))
    dst = torch.full((n,), POISON, device="cuda:0")
    a.register(dst)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for _ in range(3):
            dst.fill_(POISON)
            fut = a.read_slices(dst, remote)
            a.stream_wait(fut, stream)
            doubled = dst * 2
            stream.synchronize()
            fut.wait()
            assert (doubled == 6.0).all()

    os.kill(b.pid, signal.SIGSTOP)
    try:
        with torch.cuda.stream(stream):
            fut = a.read_slices([dst[:1024]], [remote[:1024]], timeout=1)
            a.stream_wait(fut, stream)
            after = dst[:1024] + 1
        stream.synchronize()
        if a.route(remote) == "ipc":  # needs nothing of the stopped peer
            fut.wait()
            assert (after == 4.0).all()
        else:
            assert fut.done()
            with pytest.raises(p2p.P2PError):
                fut.wait()
    finally:
        os.kill(b.pid, signal.SIGCONT)


def register_vmm(state) -> str:
    """With expandable segments the caching allocator hands out VMM memory."""
    t = torch.ones(1 << 20, device="cuda:0")
    try:
        state["vmm"] = state["engine"].register(t)
    except ValueError as e:
        return str(e)
    return "registered"


def test_vmm_memory_registers_on_the_staged_path():
    """The staged path registers only its pinned slots with the provider, so VMM memory
    (expandable segments) registers there whatever the provider can take."""
    with Peer(env={"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}) as b:
        b.call(helpers.start_engine, "tcp", device="cuda:0", data_path="staged")
        assert b.call(register_vmm) == "registered"


@pytest.mark.skipif(not shm_has_hmem(), reason="this libfabric has no CUDA support for shm")
def test_vmm_memory_on_the_direct_path_registers_or_says_what_to_change():
    """A provider with FI_HMEM may or may not register VMM memory (older ones cannot; which one
    this is, only the attempt tells): where it cannot, the ValueError says what to change."""
    with Peer(env={"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}) as b:
        b.call(helpers.start_engine, "shm", device="cuda:0", data_path="direct")
        outcome = b.call(register_vmm)
        assert outcome == "registered" or "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False" in outcome, outcome


@pytest.mark.skipif(not shm_has_hmem(), reason="this libfabric has no CUDA support for shm")
@pytest.mark.parametrize("first", ["staged", "direct"])
def test_target_with_a_second_engine_takes_host_writes_into_gpu(first):
    """benchmarks/remote_gpu.py's server: an engine closed, another opened in the same process,
    then host memory written into its GPU memory over shm."""
    with Peer() as b, p2p.Engine("cuda:0", **engine_kwargs("shm")) as a:
        if a.data_path != "direct":
            pytest.skip(f"{a.provider} offers FI_HMEM but cannot register CUDA memory here")
        b.call(helpers.start_engine, "shm", device=PEER_GPU, data_path=first)
        old = p2p.RemoteTensor.from_bytes(b.call(helpers.make_target, "old", (1 << 14,), fill=POISON, device=PEER_GPU))
        src = random_like((1 << 14,), "cpu", 8)
        a.register(src)
        a.write_slices(src, old).wait()
        b.call(helpers.close_engine)
        b.call(helpers.start_engine, "shm", device=PEER_GPU)
        remote = p2p.RemoteTensor.from_bytes(b.call(helpers.make_target, "t", (1 << 14,), fill=POISON, device=PEER_GPU))
        a.write_slices(src, remote).wait()
        assert torch.equal(b.call(helpers.fetch, "t"), src)


@pytest.mark.skipif(not shm_has_hmem(), reason="this libfabric has no CUDA support for shm")
@pytest.mark.parametrize("device_only", ["1", "0"])
def test_hmem_device_only_setting(monkeypatch, device_only):
    """TORCH_P2P_HMEM_DEVICE_ONLY (shm, GPU memory): on (the default) shm moves GPU memory by
    CUDA IPC, whose RMA completes before the copy lands, so a transfer of GPU memory ends with
    one Fence (routes/fabric/route.cpp confirms()); 0: shm's host bounce buffers, no Fence.
    Every byte lands either way."""
    monkeypatch.setenv("TORCH_P2P_HMEM_DEVICE_ONLY", device_only)
    env = {"TORCH_P2P_HMEM_DEVICE_ONLY": device_only}
    with Peer(env=env) as b, p2p.Engine("cuda:0", **engine_kwargs("shm", ipc=False)) as a:
        if a.data_path != "direct":
            pytest.skip(f"{a.provider} offers FI_HMEM but cannot register CUDA memory here")
        address = b.call(helpers.start_engine, "shm", device=PEER_GPU, ipc=False)
        assert a.route(address) == "direct"
        assert a.rails[0]["cuda_ipc"] == (device_only == "1")
        n = 4 << 20
        remote = p2p.RemoteTensor.from_bytes(b.call(helpers.make_target, "t", (n,), fill=0.0, device=PEER_GPU))
        src = random_like((n,), "cuda:0", 5)
        a.register(src)
        before = _C._counters()["fences"]
        a.write_slices(src, remote).wait()
        assert _C._counters()["fences"] - before == (1 if device_only == "1" else 0)
        assert torch.equal(b.call(helpers.fetch, "t"), src.cpu())
