"""The staged route's host hop between processes of one host (issue 32): where the cma route
reaches the peer, the slot jobs' RMA steps are cross-memory copies (routes/staged/host_hop.cpp),
else fabric RMA as before. Host memory with data_path="staged" takes the staged route, so these
run on any machine.

Two shapes of the hop: the initiator's slots into a directly registered region of the owner
(RmaRuns: only the initiator staged), and the owner's slot to the requester's (RmaSlot: the
owner staged). The first copy with a peer logs "the cma route reaches peer" at info level,
which tells the two hops apart. Peer deaths mid-transfer: tests/test_dead_peers.py.
"""
import pytest
import torch

import host_steps as hs
import peer_helpers as ph
import torch_p2p as p2p
from conftest import STAGED, engine_kwargs
from peer import Peer

ROWS, ROW = 64, 64 << 10  # 4 MiB: 32 slots of the tests' 128 KiB
LOG = {"TORCH_P2P_LOG": "info"}
REACHES = "the cma route reaches peer"
HOPS = ["cma", "fabric"]
OWNERS = {"direct": {}, "staged": STAGED}  # RmaRuns, RmaSlot


def _start(state, hop: str, staged: bool) -> bytes:
    return ph.start_engine(state, "cma" if hop == "cma" else "tcp", **(STAGED if staged else {}))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("owner", sorted(OWNERS))
@pytest.mark.parametrize("hop", HOPS)
def test_bytes_right_over_either_hop(capfd, hop, owner):
    """Staged writes and reads, small, larger than a slot and paged, arrive intact; the hop is
    the cma route's copies where cma is on at both ends, else the fabric's RMA."""
    with Peer(env=LOG) as a, Peer(env=LOG) as b:
        b.call(_start, hop, owner == "staged")
        a.call(_start, hop, True)
        remote = b.call(ph.target, "t", ROWS * ROW)
        assert a.call(hs.route_to, remote) == "staged"
        assert a.call(ph.round_trips, remote, 7, ROWS, ROW) == []
        assert torch.equal(b.call(ph.fetch, "t"), ph.after_round_trips(7, ROWS, ROW))
    said = capfd.readouterr().err.count(REACHES)
    assert said == (1 if hop == "cma" else 0), f"{REACHES!r} logged {said} times"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("op", ["write", "read"])
def test_tampered_handle_refused_by_the_owner(op):
    """RmaRuns by cma copies into the owner's process, so the owner answers for the region
    first and the call is checked against the answer: a handle claiming more than was
    registered is refused before any byte moves (the owner's registration, as the NICs would
    refuse it), and the bytes around the region stay as they were."""
    n, guard = 4096, 4096
    with Peer() as b, p2p.Engine("cpu", **engine_kwargs("cma", **STAGED)) as a:
        b.call(ph.start_engine, "cma")
        remote = p2p.RemoteTensor.from_bytes(b.call(ph.guarded_target, "g", n, guard, "rw", 0xAB))
        before = b.call(ph.buffer_bytes, "g")
        forged = ph.tampered(remote, nbytes=n + guard, shape=[n + guard])[n:]
        buf = torch.full((guard,), 0x11, dtype=torch.uint8)
        with a.register(buf):
            call = a.write_slices if op == "write" else a.read_slices
            error = ph.wait_all([call(buf, [forged])], 30)[0]
        assert isinstance(error, p2p.RemoteError), error
        assert "owner" in str(error), error  # the owner's answer refused it
        assert b.call(ph.buffer_bytes, "g") == before
        assert (buf == 0x11).all()
