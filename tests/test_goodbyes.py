"""A peer that leaves says goodbye: one that closes its engine, or that we disconnect from,
fails the calls that involve it at once ("left", "closed") instead of after peer_timeout.
"""
import time

import pytest
import torch

import peer_helpers as ph
import torch_p2p as p2p
from conftest import FABRIC_PROVIDERS, PEER_TIMEOUT, engine_kwargs
from peer import Peer


@pytest.mark.timeout(120)
@pytest.mark.parametrize("provider", FABRIC_PROVIDERS)
def test_peer_closing_fails_our_transfers_promptly(provider):
    """A peer that closes its engine says goodbye: our next transfers fail with PeerError at
    once (not after peer_timeout)."""
    with p2p.Engine("cpu", **engine_kwargs(provider, peer_timeout=30)) as a, Peer() as b:
        address = b.call(ph.start_engine, provider)
        rb = p2p.RemoteTensor.from_bytes(b.call(ph.target, "t", 4096))
        buf = torch.zeros(4096, dtype=torch.uint8)
        a.register(buf)
        p2p.wait(a.write_slices(buf, [rb]), 10)
        b.call(ph.close_engine)
        # b's close() returns once its goodbye was delivered, not once our worker took it, and
        # the engine shows no peer's state: a call made meanwhile would reach b's closed
        # endpoint, which is not the case under test. 0.5 s is many times the goodbye's trip.
        time.sleep(0.5)
        errors = ph.wait_all([a.write_slices(buf, [rb]), a.send(address, b"?")], 10)
        # "left" is the goodbye's error: a silent peer would fail as such after peer_timeout (30 s).
        assert all(isinstance(e, p2p.PeerError) for e in errors), errors
        assert "left" in str(errors[0])


@pytest.mark.timeout(120)
@pytest.mark.parametrize("provider", FABRIC_PROVIDERS)
def test_disconnect_tells_the_peer(provider):
    """After our disconnect, b learns that we left: its sends to us fail with PeerError. Until
    the goodbye reaches it, a send of b's is delivered (never lost silently)."""
    with p2p.Engine("cpu", **engine_kwargs(provider)) as a, Peer() as b:
        address = b.call(ph.start_engine, provider)
        p2p.wait(a.connect(address), 10)
        p2p.wait(a.disconnect(address), 10)
        deadline, delivered = time.monotonic() + 10, 0
        while (sent := b.call(ph.send_result, a.address, b"after the goodbye", 10)) is None:
            delivered += 1
            assert time.monotonic() < deadline, "b's sends still succeed 10 s after our goodbye"
        assert sent.startswith("PeerError") and "left" in sent, sent
        assert ph.wait_all([a.recv(timeout=3) for _ in range(delivered)], 10) == [None] * delivered


@pytest.mark.timeout(120)
@pytest.mark.parametrize("provider", FABRIC_PROVIDERS)
def test_peer_closed_after_disconnect_is_not_contacted(provider):
    """We disconnect from c, then c closes: c still says goodbye, so a later write to c's
    handle or connect() to it fails at once instead of sending c a HELLO. On shm (libfabric
    1.17) that HELLO goes unanswered and stalls our endpoint: b, which is fine, would then be
    declared dead after peer_timeout."""
    with p2p.Engine("cpu", **engine_kwargs(provider, peer_timeout=PEER_TIMEOUT)) as a, \
            Peer() as b, Peer() as c:
        b.call(ph.start_engine, provider)
        c_address = c.call(ph.start_engine, provider)
        rb = p2p.RemoteTensor.from_bytes(b.call(ph.target, "t", 1 << 20))
        rc = p2p.RemoteTensor.from_bytes(c.call(ph.target, "t", 1 << 20))
        buf = torch.ones(1 << 20, dtype=torch.uint8)
        a.register(buf)
        ph.wait_all([a.write_slices(buf, [rb]), a.write_slices(buf, [rc])], 10)
        p2p.wait(a.disconnect(c_address), 10)
        # As in test_peer_closing_fails_our_transfers_promptly, no state shows when a goodbye
        # was taken: each pause is many times its trip.
        time.sleep(0.3)  # c takes our goodbye
        c.call(ph.close_engine)
        time.sleep(0.3)  # and we take c's
        errors = ph.wait_all([a.write_slices(buf, [rc]), a.connect(c_address)], 10)
        # "closed": known closed, refused without contacting c (a HELLO would end as "silent").
        assert all(isinstance(e, p2p.PeerError) and "closed" in str(e) for e in errors), errors
        assert ph.wait_all([a.write_slices(buf, [rb]) for _ in range(5)], 10) == [None] * 5
