"""What the cma route asks of the OS (issue 48). A tensor in shared memory reaches a peer as
its file's descriptor, which the owner passes over a Unix socket (routes/host_cma/descriptors.h):
no ptrace access to the owner at all. Private memory is copied by the kernel
(process_vm_readv/writev), which needs ptrace access; where Yama wants the owner's consent
(ptrace_scope 1) the owner gives it to one peer, not to every process of the user
(routes/host_cma/ptrace_consent.h).

Each test's processes lack CAP_SYS_PTRACE (root's passes every check), and the owner is not
dumpable where a test needs ptrace refused even without Yama.
"""
import errno

import pytest
import torch

import host_steps as hs
import peer_helpers as ph
from peer import Peer
from torch_p2p import doctor

MAPS = "the cma route maps the shared memory of peer"
ROWS, ROW = 64, 16 << 10


def _fetch(state, name: str) -> torch.Tensor:
    return state[name].clone()


def _shared_target(state, name: str, nbytes: int) -> bytes:
    state["engine.shared"] = True
    return ph.target(state, name, nbytes)


def _writes_private(owner: Peer, private: bytes, *initiators: Peer) -> None:
    """Each initiator starts an engine and writes its own bytes into the owner's region, which
    then holds them."""
    for seed, x in enumerate(initiators, 3):
        x.call(ph.start_engine, "cma")
        x.call(hs.local, "src", 1 << 20, seed)
        x.call(hs.write, "src", private, 20)
        assert owner.call(ph.checksum, "t") == x.call(ph.checksum, "src")


@pytest.mark.timeout(120)
def test_shared_memory_needs_no_ptrace(capfd):
    """The owner b is not dumpable and the initiator a lacks CAP_SYS_PTRACE: the OS refuses a
    every ptrace access to b (process_vm_readv, pidfd_getfd, /proc/<pid>/mem). b's tensor in
    shared memory still takes the cma route, mapped from the descriptor b passed, both ways,
    with its bytes intact; nothing of b is copied by the kernel, so nothing is refused."""
    with Peer(env={"TORCH_P2P_LOG": "info"}) as a, Peer() as b:
        b.call(ph.forbid_ptrace)
        b.call(ph.start_engine, "mapped")
        a.call(ph.drop_ptrace_capability)
        assert a.call(ph.ptrace_errno, b.pid) == errno.EPERM
        a.call(ph.start_engine, "cma")
        remote = b.call(ph.target, "t", ROWS * ROW)
        assert a.call(ph.round_trips, remote, 5, ROWS, ROW) == []
        assert torch.equal(b.call(_fetch, "t"), ph.after_round_trips(5, ROWS, ROW))
        assert a.call(hs.route_to, remote) == "cma"
    err = capfd.readouterr().err
    assert err.count(MAPS) == 1 and "is not allowed" not in err, err


@pytest.mark.timeout(120)
@pytest.mark.skipif(doctor.ptrace_scope() != 0, reason="Yama's scope 1 lets one peer copy: the test below")
def test_private_memory_to_two_peers():
    """Without Yama (or at scope 0) the kernel copies a private tensor of b for each of its
    peers a and c: both stay on the cma route, bytes intact."""
    with Peer() as a, Peer() as b, Peer() as c:
        b.call(ph.start_engine, "cma")
        private = b.call(ph.target, "t", 1 << 20)
        _writes_private(b, private, a, c)
        assert a.call(hs.route_to, private) == "cma" and c.call(hs.route_to, private) == "cma"


@pytest.mark.timeout(180)
@pytest.mark.skipif(doctor.ptrace_scope() != 1, reason="needs Yama's kernel.yama.ptrace_scope 1 (Ubuntu's default)")
def test_yama_consent_goes_to_one_peer(capfd):
    """Yama scope 1, default settings. Before any peer, no other process may read the owner b.
    b consents to a, the first peer it answers for private memory: a copies it on the cma
    route. A second peer c is refused by the OS (logged on both sides with the fix) and its
    transfers take the fabric, bytes intact; b's tensor in shared memory still reaches c on the
    cma route. d, no peer of b, can read b neither before nor after."""
    with Peer() as a, Peer() as b, Peer() as c, Peer() as d:
        for x in (a, b, c, d):
            x.call(ph.drop_ptrace_capability)
        b.call(ph.start_engine, "cma")
        assert d.call(ph.ptrace_errno, b.pid) == errno.EPERM
        assert a.call(ph.ptrace_errno, b.pid) == errno.EPERM
        private = b.call(ph.target, "t", 1 << 20)
        shared = b.call(_shared_target, "s", 1 << 20)
        _writes_private(b, private, a, c)
        assert a.call(hs.route_to, private) == "cma"
        assert a.call(ph.ptrace_errno, b.pid) == errno.EFAULT  # access: only the address is bad
        assert c.call(hs.route_to, private) == "direct"
        c.call(hs.write, "src", shared, 20)
        assert b.call(ph.checksum, "s") == c.call(ph.checksum, "src")
        assert c.call(hs.route_to, shared) == "cma"
        assert d.call(ph.ptrace_errno, b.pid) == errno.EPERM
        assert c.call(ph.ptrace_errno, b.pid) == errno.EPERM
    err = capfd.readouterr().err
    assert err.count("is not allowed") == 1 and err.count("cannot let peer") == 1, err
