"""The IPC route when CUDA fails it: cuda_faults.c, preloaded into the initiator, makes
cudaHostAlloc or cudaEventRecord fail on demand. A batch without pinned memory fails at once, one
without its closing event completes after its copy, a call whose stream event fails raises and
leaves CUDA's last error clear."""
import contextlib
import os
import shutil
import subprocess
import time

import pytest
import torch

import helpers
import torch_p2p as p2p
from conftest import PEER_GPU
from ipc_targets import check_landed, gpu_random, make_cuda_target
from peer import Peer
cuda = pytest.mark.cuda


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
