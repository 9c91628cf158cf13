"""The cma route to tensors in shared memory (issue 32): where the owner's registered storage
lives in a shared-memory file (torch's share_memory_()), the initiator maps that file once per
region and copies with memcpy instead of the kernel's cross-memory attach, under the same
owner's answer (routes/host_cma/route.cpp). The "mapped" provider of conftest runs the suites
that take every provider (test_transfers, test_views, test_api_errors) this way; a peer killed
mid-copy: tests/test_dead_peers.py.

The first mapping with a peer logs "the cma route maps the shared memory of peer" at info
level, which tells the two copies apart. Calls of at most cma_inline_bytes to mapped regions
are copied on the caller's thread (core/caller_copies.h): the last tests.
"""
import os
import threading
import time

import pytest
import torch

import host_steps as hs
import peer_helpers as ph
import torch_p2p as p2p
from conftest import engine_kwargs
from peer import Peer

MAPS = "the cma route maps the shared memory of peer"
ROWS, ROW = 64, 16 << 10


@pytest.mark.timeout(120)
@pytest.mark.parametrize("memory", ["shared", "private", "shared, map off"])
def test_shared_memory_is_mapped(capfd, memory):
    """Bytes arrive intact either way; only a shared-memory region with the mapping on is
    mapped (logged once), and the route is "cma" in every case."""
    env = {"TORCH_P2P_LOG": "info", **({"TORCH_P2P_CMA_MAP": "0"} if "off" in memory else {})}
    with Peer(env=env) as a, Peer() as b:
        b.call(ph.start_engine, "mapped" if memory.startswith("shared") else "cma")
        a.call(ph.start_engine, "cma")
        remote = b.call(ph.target, "t", ROWS * ROW)
        assert a.call(hs.route_to, remote) == "cma"
        assert a.call(ph.round_trips, remote, 5, ROWS, ROW) == []
        assert torch.equal(b.call(ph.fetch, "t"), ph.after_round_trips(5, ROWS, ROW))
        second = b.call(ph.target, "u", ROWS * ROW)  # a second region of the same peer
        assert a.call(ph.round_trips, second, 6, ROWS, ROW) == []
    said = capfd.readouterr().err.count(MAPS)
    assert said == (1 if memory == "shared" else 0), f"{MAPS!r} logged {said} times"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("path", ["kept", "replaced"])
def test_file_mapped_by_name(capfd, tmp_path, path):
    """A tensor of torch.from_file(path, shared=True), whose file torch closes once mapped (the
    vLLM connector's hold tables): the owner opens the file again by its path and passes it, so
    it is mapped too, unless the path names another file by then (the owner checks its own
    mapping), when the kernel copies. The bytes are the tensor's either way."""
    with Peer(env={"TORCH_P2P_LOG": "info"}) as a, Peer() as b:
        b.call(ph.start_engine, "cma")
        a.call(ph.start_engine, "cma")
        remote = b.call(ph.file_target, "t", str(tmp_path / "table"), ROWS * ROW, 7, path == "replaced")
        assert a.call(ph.round_trips, remote, 5, ROWS, ROW) == []
        assert torch.equal(b.call(ph.fetch, "t"), ph.after_round_trips(5, ROWS, ROW))
    said = capfd.readouterr().err.count(MAPS)
    assert said == (1 if path == "kept" else 0), f"{MAPS!r} logged {said} times"


@pytest.mark.timeout(120)
def test_read_only_shared_region():
    """A region registered with access "r" is mapped read-only: reads move its bytes, and a
    write through a handle forged to allow it is refused by the owner's answer before any byte
    moves; the region is unchanged."""
    with Peer() as b, p2p.Engine("cpu", **engine_kwargs("cma")) as a:
        b.call(ph.start_engine, "mapped")
        remote = p2p.RemoteTensor.from_bytes(b.call(ph.target, "t", 1 << 20, 7, "r"))
        buf = torch.zeros(1 << 20, dtype=torch.uint8)
        with a.register(buf):
            p2p.wait(a.read_slices([buf], [remote]), 30)
            assert (buf == 7).all()
            forged = ph.tampered(remote, access=ph.READ | ph.WRITE)
            error = ph.wait_all([a.write_slices([buf.fill_(1)], [forged])], 30)[0]
        assert isinstance(error, p2p.RemoteError) and "owner" in str(error), error
        assert (b.call(ph.fetch, "t") == 7).all()


def _shmem_kib() -> int:
    """This process's resident shared-memory pages (KiB): a mapping's pages count once they
    are in its page table."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("RssShmem:"))


@pytest.mark.timeout(120)
@pytest.mark.skipif(tuple(int(x) for x in os.uname().release.split(".")[:2] if x.isdigit()) < (5, 14),
                    reason="MADV_POPULATE_READ / WRITE come with Linux 5.14")
@pytest.mark.parametrize("access", ["r", "rw"])
def test_a_mapping_is_faulted_in_ahead_of_its_copies(access):
    """Once a peer's region is mapped, its pages come into this process's page table in the
    background (routes/host_cma/shared_file.h, Populator), not one fault at a time as copies
    first touch them: after one 4 KiB read of a 64 MiB region, the whole region is resident."""
    size = 64 << 20
    with Peer() as b, p2p.Engine("cpu", **engine_kwargs("cma")) as a:
        b.call(ph.start_engine, "mapped")
        remote = p2p.RemoteTensor.from_bytes(b.call(ph.target, "t", size, 7, access))
        buf = torch.zeros(4096, dtype=torch.uint8)
        before = _shmem_kib()
        with a.register(buf):
            p2p.wait(a.read_slices([buf], [remote[:4096]]), 30)
            assert (buf == 7).all()
            deadline = time.monotonic() + 20
            while _shmem_kib() - before < size >> 10 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert _shmem_kib() - before >= size >> 10, f"{_shmem_kib() - before} KiB resident of {size >> 10}"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("op", ["write", "read"])
def test_tampered_handle_refused(op):
    """A handle claiming more than the owner registered is refused by the owner's answer (the
    mapping covers only the registered region), and nothing moves."""
    n = 1 << 16
    with Peer() as b, p2p.Engine("cpu", **engine_kwargs("cma")) as a:
        b.call(ph.start_engine, "mapped")
        remote = p2p.RemoteTensor.from_bytes(b.call(ph.target, "t", n, 0xAB))
        forged = ph.tampered(remote, nbytes=2 * n, shape=[2 * n])[n:]
        buf = torch.full((n,), 0x11, dtype=torch.uint8)
        with a.register(buf):
            call = a.write_slices if op == "write" else a.read_slices
            error = ph.wait_all([call(buf, [forged])], 30)[0]
        assert isinstance(error, p2p.RemoteError) and "owner" in str(error), error
        assert (b.call(ph.fetch, "t") == 0xAB).all()
        assert (buf == 0x11).all()


@pytest.mark.timeout(120)
def test_closed_region_refuses_and_a_new_one_maps():
    """The owner closes a mapped region: the initiator lets go of it (its transfers to it fail
    with ClosedError), and a region registered afterwards is mapped and moves its bytes."""
    with Peer() as b, p2p.Engine("cpu", **engine_kwargs("cma")) as a:
        b.call(ph.start_engine, "mapped")
        old = p2p.RemoteTensor.from_bytes(b.call(ph.target, "t", 1 << 20))
        src = ph.pattern(3, 1 << 20)
        with a.register(src):
            p2p.wait(a.write_slices([src], [old]), 30)
            b.call(ph.close_region, "t")
            error = ph.wait_all([a.write_slices([src], [old])], 30)[0]
            assert isinstance(error, p2p.ClosedError), error
            new = p2p.RemoteTensor.from_bytes(b.call(ph.target, "u", 1 << 20))
            p2p.wait(a.write_slices([src], [new]), 30)
        assert b.call(ph.checksum, "u") == ph.checksum({"s": src}, "s")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("memory", ["mapped", "cma"])
def test_close_does_not_wait_for_a_dead_reader(memory):
    """A peer that reached our region over the cma route (and so must let go of it before the
    registration goes) and then died is seen dead by its process, not after peer_timeout: the
    region's close returns at once, while the peer was never a destination of ours."""
    peer_timeout = 30.0
    with Peer() as b, p2p.Engine("cpu", **engine_kwargs(memory, peer_timeout=peer_timeout)) as a:
        b.call(ph.start_engine, "cma")
        buf = torch.full((ROWS * ROW,), 3, dtype=torch.uint8)
        if memory == "mapped":
            buf.share_memory_()
        region = a.register(buf)
        assert b.call(ph.round_trips, region.remote.to_bytes(), 4, ROWS, ROW) == []
        b.kill()
        start = time.monotonic()
        region.close()
        took = time.monotonic() - start
        assert took < peer_timeout / 3, f"close took {took:.1f} s (peer_timeout {peer_timeout} s)"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("op", ["write", "read"])
def test_small_calls_are_copied_by_the_caller(op, monkeypatch):
    """Once a region is mapped, a call of at most cma_inline_bytes (pages or runs) is copied on
    the calling thread: its future is done when the call returns. Larger calls, and any with
    TORCH_P2P_CMA_INLINE=0, go to the worker; the bytes are right every way. Which thread copied
    is told by the count of caller copies (_C._counters()), not by timing."""
    n = 2 << 20
    a = p2p.Engine("cpu", **engine_kwargs("cma"))
    monkeypatch.setenv("TORCH_P2P_CMA_INLINE", "0")

    def copied_by_the_caller() -> int:
        return p2p._C._counters()["caller_copies"]

    with Peer() as b, a, p2p.Engine("cpu", **engine_kwargs("cma")) as off:
        b.call(ph.start_engine, "mapped")
        remote = p2p.RemoteTensor.from_bytes(b.call(ph.target, "t", n))
        src = ph.pattern(9, n)
        b.call(ph.put, "t", src)
        mine = torch.zeros(n, dtype=torch.uint8) if op == "read" else src.clone()
        if op == "write":
            b.call(ph.put, "t", torch.zeros(n, dtype=torch.uint8))
        call = {"write": "write_slices", "read": "read_slices"}[op]
        with a.register(mine), off.register(mine):
            before = copied_by_the_caller()
            p2p.wait(getattr(a, call)([mine[:64]], [remote[:64]]), 30)  # asks the owner; maps the region
            assert copied_by_the_caller() == before, "the call that maps the region goes to the worker"
            pages = mine.view(-1, 4096)
            futures = [getattr(a, call)(p2p.pages(pages, [i, i + 3]), p2p.pages(remote.view(-1, 4096), [i, i + 3]))
                       for i in range(0, 256, 8)]
            futures.append(getattr(a, call)([mine[256 << 10:512 << 10]], [remote[256 << 10:512 << 10]]))  # the limit
            futures.append(getattr(a, call)([mine[:4096]], [remote[:4096]], timeout=30))
            assert all(f.done() for f in futures), [f.done() for f in futures]
            assert copied_by_the_caller() == before + len(futures)
            assert ph.wait_all(futures, 30) == [None] * len(futures)
            # The worker's calls: 2 MiB (above the limit), 4 KiB with a notification, and 4 KiB
            # with the caller's copy off.
            before = copied_by_the_caller()
            worker = [getattr(a, call)([mine], [remote]) for _ in range(4)]
            if op == "write":
                worker += [a.write_slices([mine[:4096]], [remote[:4096]], notify=7) for _ in range(4)]
            worker += [getattr(off, call)([mine[:4096]], [remote[:4096]]) for _ in range(4)]
            assert ph.wait_all(worker, 30) == [None] * len(worker)
            assert copied_by_the_caller() == before, "a call that the worker copies was copied by the caller"
        there = b.call(ph.fetch, "t")
        assert torch.equal(mine, src) and torch.equal(there, src)


@pytest.mark.timeout(120)
def test_no_caller_copy_after_the_owner_takes_its_region_back():
    """Reads copied by the caller race the owner's close of the region: every read that
    succeeds holds the bytes from before the close, none those the owner writes once close()
    returned, and every read after that fails with ClosedError. The fabric's rule, kept without
    the NICs: the owner's close waits until the reader let go."""
    n = 64 << 10
    with Peer() as b, p2p.Engine("cpu", **engine_kwargs("cma")) as a:
        b.call(ph.start_engine, "mapped")
        remote = p2p.RemoteTensor.from_bytes(b.call(ph.target, "t", n, 1))
        buf = torch.zeros(n, dtype=torch.uint8)
        seen = {"ok": 0, "closed": 0, "other": [], "wrong": 0}
        stop = threading.Event()
        counted = threading.Condition()

        def count(key: str) -> None:
            with counted:
                seen[key] += 1
                counted.notify_all()

        def until(check) -> None:
            with counted:
                assert counted.wait_for(check, 30), seen

        def reader():
            while not stop.is_set():
                buf.zero_()
                try:
                    p2p.wait(a.read_slices([buf], [remote]), 30)
                except p2p.ClosedError:
                    count("closed")
                    continue
                except Exception as e:  # noqa: BLE001 - reported below
                    seen["other"].append(repr(e))
                    return
                seen["wrong"] += int(not bool((buf == 1).all()))
                count("ok")
        with a.register(buf):
            p2p.wait(a.read_slices([buf], [remote]), 30)
            thread = threading.Thread(target=reader)
            thread.start()
            until(lambda: seen["ok"] >= 3)  # reads copied by the caller are under way
            b.call(ph.close_region, "t")
            b.call(ph.put, "t", torch.full((n,), 2, dtype=torch.uint8))
            refused = seen["closed"]
            until(lambda: seen["closed"] > refused)  # a read began after the owner's new bytes
            stop.set()
            thread.join(30)
            error = ph.wait_all([a.read_slices([buf], [remote])], 30)[0]
        assert seen["ok"] > 0 and seen["wrong"] == 0 and not seen["other"], seen
        assert isinstance(error, p2p.ClosedError), error


@pytest.mark.timeout(120)
def test_no_caller_copy_from_a_dead_owner():
    """The owner killed after its region was mapped: the mapping still holds its bytes, but a
    read issued once its process is gone fails with PeerError, whether or not the worker has
    heard of the exit yet; the engine then works with a live peer."""
    with Peer() as b, Peer() as c, p2p.Engine("cpu", **engine_kwargs("cma", peer_timeout=30)) as a:
        b.call(ph.start_engine, "mapped")
        c.call(ph.start_engine, "mapped")
        remote = p2p.RemoteTensor.from_bytes(b.call(ph.target, "t", 4096, 1))
        buf = torch.zeros(4096, dtype=torch.uint8)
        with a.register(buf):
            p2p.wait(a.read_slices([buf], [remote]), 30)
            b.kill()
            error = ph.wait_all([a.read_slices([buf], [remote])], 30)[0]
            assert isinstance(error, p2p.PeerError), error
            other = p2p.RemoteTensor.from_bytes(c.call(ph.target, "t", 4096, 5))
            p2p.wait(a.read_slices([buf], [other]), 30)
            assert (buf == 5).all()
