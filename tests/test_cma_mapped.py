"""The cma route to tensors in shared memory (issue 32): where the owner's registered storage
lives in a shared-memory file (torch's share_memory_()), the initiator maps that file once per
region and copies with memcpy instead of the kernel's cross-memory attach, under the same
owner's answer (routes/host_cma/route.cpp). The "mapped" provider of conftest runs the suites
that take every provider (test_transfers, test_views, test_api_errors) this way; a peer killed
mid-copy: tests/test_failures.py.

The first mapping with a peer logs "the cma route maps the shared memory of peer" at info
level, which tells the two copies apart.
"""
import time

import pytest
import torch

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
        assert a.call(ph.route_to, remote) == "cma"
        assert a.call(ph.round_trips, remote, 5, ROWS, ROW) == []
        assert torch.equal(b.call(ph.fetch, "t"), ph.after_round_trips(5, ROWS, ROW))
        second = b.call(ph.target, "u", ROWS * ROW)  # a second region of the same peer
        assert a.call(ph.round_trips, second, 6, ROWS, ROW) == []
    said = capfd.readouterr().err.count(MAPS)
    assert said == (1 if memory == "shared" else 0), f"{MAPS!r} logged {said} times"


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
