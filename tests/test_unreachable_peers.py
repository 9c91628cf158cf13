"""Addresses nobody answers at: an engine that has closed (in another process or in this one), a
loopback port where nothing listens. Calls to them fail with PeerError within peer_timeout
(+ margin), and calls to live peers go on meanwhile.
"""
import time

import pytest
import torch

import host_steps as hs
import peer_helpers as ph
import torch_p2p as p2p
from checkout import free_port
from conftest import FABRIC_PROVIDERS, MARGIN, PEER_TIMEOUT, SHM_2_CRASH, engine_kwargs
from peer import Peer
from torch_p2p import _C


@pytest.mark.timeout(120)
@pytest.mark.parametrize("provider", ["tcp", pytest.param("shm", marks=SHM_2_CRASH)])
def test_nobody_listens(provider):
    """The address and a handle of an engine that has closed (in another process): connect,
    write and send fail with PeerError within peer_timeout (+ margin); the engine is fine
    afterwards."""
    with p2p.Engine("cpu", **engine_kwargs(provider, peer_timeout=PEER_TIMEOUT)) as a, Peer() as g:
        address = g.call(ph.start_engine, provider)
        handle = p2p.RemoteTensor.from_bytes(g.call(ph.target, "t", 64))
        g.call(ph.close_engine)
        buf = torch.zeros(64, dtype=torch.uint8)
        a.register(buf)
        start = time.monotonic()
        errors = ph.wait_all([a.connect(address), a.write_slices(buf, [handle]), a.send(address, b"hi")],
                             PEER_TIMEOUT + MARGIN)
        took = time.monotonic() - start
        assert all(isinstance(e, p2p.PeerError) for e in errors), ph.errors_by_type(errors)
        assert took <= PEER_TIMEOUT + MARGIN
        with p2p.Engine("cpu", **engine_kwargs(provider)) as other:
            p2p.wait(a.connect(other.address), 10)


# shm (libfabric 1.17) reaches an endpoint of its own process through that endpoint's mapping,
# which closing it unmaps, and keeps the stale pointer: fi_av_insert of a closed one's address,
# or progress of one still open after its peer of the process closed, crashed the process. The
# engine parks a closed endpoint while another of the process is open and refuses the address
# of one that has closed (fabric/rail.cpp, OwnEndpoints). Each test runs in a child, so that a
# crash fails it alone.
@pytest.mark.timeout(60)
@pytest.mark.parametrize("open_first", [True, False], ids=["closed-while-another-open", "closed-before"])
def test_connect_to_engine_closed_in_same_process_shm(open_first):
    """Refused at once (not after peer_timeout), whether the closed engine's endpoint is
    parked (another was open) or unmapped (none was)."""
    with Peer() as host:
        if open_first:
            host.call(ph.start_engine, "shm", peer_timeout=PEER_TIMEOUT)
        gone = host.call(hs.closed_engine_address, "shm")
        if not open_first:
            host.call(ph.start_engine, "shm", peer_timeout=PEER_TIMEOUT)
        start = host.call(hs.issue, [("connect", gone)])
        result = host.call(hs.settle, PEER_TIMEOUT + 5)
        assert result["errors"] == ["PeerError"], result
        assert "of this process that has closed" in result["messages"][0]
        assert result["ended"] - start < PEER_TIMEOUT


@pytest.mark.timeout(180)
@pytest.mark.parametrize("provider", FABRIC_PROVIDERS)
def test_two_engines_of_one_process_close_at_once(provider):
    """Each with writes, reads and messages to the other in flight. An shm endpoint closed
    while the other engine still reaches it through its mapping would crash the process
    (SIGSEGV in fi_cq_read under the last engine's goodbye): closed endpoints stay parked."""
    with Peer() as host:
        assert host.call(hs.close_two_at_once, provider, 20) == 0


@pytest.mark.timeout(60)
def test_a_closed_shm_endpoint_stays_mapped_while_another_of_the_process_is_open():
    with Peer() as host:
        assert host.call(hs.own_shm_files) == [2, 2, 0]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("provider", ["tcp", pytest.param("shm", marks=SHM_2_CRASH)])
def test_unreachable_address_does_not_stall_other_peers(provider):
    """While a connect() to an address where nobody listens is pending, messages and writes
    to a live peer complete: before that connect has failed (it fails after peer_timeout)."""
    with p2p.Engine("cpu", **engine_kwargs(provider, peer_timeout=3)) as a, Peer() as b, Peer() as g:
        address = b.call(ph.start_engine, provider)
        rb = p2p.RemoteTensor.from_bytes(b.call(ph.target, "t", 1 << 20))
        if provider == "tcp":
            mine = _C._decode_address(a.address)
            rail = bytearray(mine["rails"][0])
            rail[2:4] = free_port().to_bytes(2, "big")
            dead = _C._encode_address({"provider": mine["provider"], "incarnation": 4242, "rails": [bytes(rail)]})
        else:
            dead = g.call(ph.start_engine, provider)
            g.call(ph.close_engine)
        src = torch.ones(1 << 20, dtype=torch.uint8)
        a.register(src)
        p2p.wait(a.connect(address), 10)
        pending = a.connect(dead)
        ph.taken_by_worker(a)  # the connect has begun
        errors = ph.wait_all([a.send(address, b"x"), a.write_slices(src, [rb])], 5)
        still_pending = not pending.done()
        ph.wait_all([pending], 10)
        assert errors == [None, None], errors
        assert still_pending, "the live peer's operations ended only once the unreachable connect had"


@pytest.mark.timeout(60)
def test_nobody_listens_on_a_loopback_port():
    """tcp: an address naming a loopback port where nothing listens (crafted from our own)."""
    with p2p.Engine("cpu", **engine_kwargs("tcp", peer_timeout=PEER_TIMEOUT)) as a:
        mine = _C._decode_address(a.address)
        rail = bytearray(mine["rails"][0])
        assert rail[:2] == b"\x02\x00" and rail[4:8] == bytes([127, 0, 0, 1])  # sockaddr_in on lo
        rail[2:4] = free_port().to_bytes(2, "big")
        address = _C._encode_address({"provider": mine["provider"], "incarnation": mine["incarnation"] ^ 0x5A5A,
                                      "rails": [bytes(rail)]})
        start = time.monotonic()
        errors = ph.wait_all([a.connect(address), a.send(address, b"hi")], PEER_TIMEOUT + MARGIN)
        assert all(isinstance(e, p2p.PeerError) for e in errors), errors
        assert time.monotonic() - start <= PEER_TIMEOUT + MARGIN
