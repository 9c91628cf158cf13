"""Security (issue 5, part 5): access modes, bounds and keys are enforced by the target's
provider, not only by the initiator's local checks.

To show that, handles are tampered with (tests/peer_helpers.py re-encodes RemoteTensor bytes
with every CRC recomputed) so that the initiator's checks pass; then the target's memory is
compared byte for byte, including guard bytes around the registered region that belong to the
same buffer but were never registered.

The staged path (data_path="staged": the owner copies through its slots) enforces the same
rules in the owner's engine; it is covered here too. So does the cma route (same host, host
memory), from the owner's answer for each region (core/grants.h); its mapped copies of
shared-memory tensors: tests/test_cma_mapped.py.
"""

import pytest
import torch

import peer_helpers as ph
import torch_p2p as p2p
from torch_p2p import _C
from checkout import free_port
from conftest import PEER_TIMEOUT, SHM_1, engine_kwargs
from peer import Peer

PROVIDERS = ["tcp", "shm", "cma"]
N, GUARD = 4096, 4096


@pytest.fixture(scope="module", params=PROVIDERS)
def target(request):
    """A child peer with an engine: (provider, peer)."""
    with Peer() as b:
        b.call(ph.start_engine, request.param, peer_timeout=PEER_TIMEOUT)
        yield request.param, b


@pytest.fixture(params=PROVIDERS)
def fresh_target(request):
    """As `target`, a child of the test's own: on shm (libfabric 1.17) the refusals of earlier
    tests can leave the module's target unanswering (SHM_REFUSAL)."""
    with Peer() as b:
        b.call(ph.start_engine, request.param, peer_timeout=PEER_TIMEOUT)
        yield request.param, b


class NotRefused(AssertionError):
    """The target did not refuse the operation the way it is documented to."""


SHM_REFUSAL = ("BUG (shm provider, libfabric 1.17, prov/shm/src/smr_progress.c smr_progress_cmd_rma): when "
               "ofi_mr_map_verify() refuses an RMA the target discards the command without writing the "
               "initiator's response, so the refused operation never completes and, responses being read in "
               "order, nothing after it to that peer does: the peer is declared dead after peer_timeout "
               "(PeerError, not RemoteError). The target's memory is safe: each test checks it first")
# The handle tests on each provider: shm on libfabric 1.x cannot say it refused.
REFUSING = ["tcp", pytest.param("shm", marks=pytest.mark.xfail(SHM_1, strict=True, raises=NotRefused,
                                                               reason=SHM_REFUSAL)), "cma"]


def _initiator(provider, **kwargs):
    # A fresh engine per attempt: a refused operation may cost the initiator its connection
    # to the target (see test_refused_write_fails_alone).
    return p2p.Engine("cpu", **engine_kwargs(provider, peer_timeout=PEER_TIMEOUT, **kwargs))


def _attempt(provider, write: bool, remote, nbytes: int, fill: int = 0x11):
    """Writes `fill` bytes to (or reads from) `remote`; returns (exception or None, the local
    buffer). The bound only keeps a hang from lasting: a refusal comes at once, a peer
    timeout after PEER_TIMEOUT, and _assert_refused tells them apart by the error."""
    with _initiator(provider) as a:
        buf = torch.full((nbytes,), fill, dtype=torch.uint8)
        a.register(buf)
        call = a.write_slices if write else a.read_slices
        error = ph.wait_all([call(buf, [remote])], PEER_TIMEOUT + 10)[0]
        return error, buf.clone()


def _guarded(b, name, access="rw", fill=0xAB):
    remote = p2p.RemoteTensor.from_bytes(b.call(ph.guarded_target, name, N, GUARD, access, fill))
    return remote, b.call(ph.buffer_bytes, name)


def _assert_refused(provider, error, deregistered: bool = False):
    """The error the owner is documented to give (README, Security and Closing): ClosedError
    for a region it deregistered (it tells the peers that know it, a new one on connecting),
    RemoteError for a handle it refuses (its provider's refusal; on the cma route its answer;
    on tcp the refusal is a dropped connection, told from a dead peer by the check that
    follows it). Checked after the target's memory, so that a provider that cannot say it refused (shm on
    libfabric 1.x: SHM_REFUSAL) still has its memory checked."""
    expected = p2p.ClosedError if deregistered else p2p.RemoteError
    if not isinstance(error, expected):
        raise NotRefused(f"{expected.__name__} expected on {provider}, got {error!r}")


# -- access modes -------------------------------------------------------------------------------------

def test_access_checked_locally(target):
    provider, b = target
    ro, _ = _guarded(b, "lro", access="r")
    wo, _ = _guarded(b, "lwo", access="w")
    assert (ro.access, wo.access) == ("r", "w")
    with _initiator(provider) as a:
        buf = torch.zeros(N, dtype=torch.uint8)
        a.register(buf)
        with pytest.raises(ValueError, match="does not accept remote writes"):
            a.write_slices(buf, [ro])
        with pytest.raises(ValueError, match="does not accept remote reads"):
            a.read_slices(buf, [wo])
        p2p.wait(a.read_slices(buf, [ro]), 10)
        p2p.wait(a.write_slices(buf, [wo]), 10)


@pytest.mark.parametrize("target", REFUSING, indirect=True)
def test_read_only_region_refuses_a_tampered_write(target):
    provider, b = target
    ro, before = _guarded(b, "ro", access="r")
    forged = ph.tampered(ro, access=ph.READ | ph.WRITE)
    assert forged.access == "rw"
    error, _ = _attempt(provider, True, forged, N)
    assert b.call(ph.buffer_bytes, "ro") == before
    _assert_refused(provider, error)


@pytest.mark.parametrize("target", REFUSING, indirect=True)
def test_write_only_region_refuses_a_tampered_read(target):
    provider, b = target
    wo, before = _guarded(b, "wo", access="w", fill=0x5E)
    forged = ph.tampered(wo, access=ph.READ | ph.WRITE)
    error, got = _attempt(provider, False, forged, N, fill=0)
    assert not (got == 0x5E).any(), "bytes of a write-only region reached the reader"
    assert b.call(ph.buffer_bytes, "wo") == before
    _assert_refused(provider, error)


# -- bounds and keys ----------------------------------------------------------------------------------

def test_bounds_checked_locally(target):
    provider, b = target
    remote, _ = _guarded(b, "lb")
    with _initiator(provider) as a:
        big = torch.zeros(2 * N, dtype=torch.uint8)
        a.register(big)
        with pytest.raises(IndexError):
            remote[N]
        assert remote[N - 16:N + 16].shape == (16,)  # slices clamp, as for tensors
        with pytest.raises(ValueError, match="shape"):
            a.write_slices(big, [remote])
        wide = p2p.RemoteTensor.from_bytes(b.call(ph.target, "lb.f32", N)).__getitem__(slice(None))
        with pytest.raises(ValueError):
            a.write_slices(big[:N], [wide.__class__.from_bytes(wide.to_bytes())[: N // 2]])
        # A view that would reach past the region cannot even be built from bytes.
        with pytest.raises(ValueError, match="beyond"):
            ph.tampered(remote, offset=1)
        with pytest.raises(ValueError, match="beyond"):
            ph.tampered(remote, offset=0, shape=[N + 1])
        # Mirror mode: the remote must be laid out like the local registered tensor.
        with pytest.raises(ValueError, match="mirror"):
            a.write_slices(big[:N], remote)


CASES = {
    # what the forged handle claims -> (changes, which slice of the forged view to write)
    "larger-size": (lambda t: dict(nbytes=N + GUARD, shape=[N + GUARD]), slice(N, N + GUARD)),
    "base-before-start": (lambda t: dict(entries=[((base - GUARD) % 2 ** 64, key) for base, key in t["region"]["entries"]],
                                         nbytes=N + GUARD, shape=[N + GUARD]), slice(0, GUARD)),
    "whole-buffer": (lambda t: dict(entries=[((base - GUARD) % 2 ** 64, key) for base, key in t["region"]["entries"]],
                                    nbytes=N + 2 * GUARD, shape=[N + 2 * GUARD]), slice(None)),
    "random-key": (lambda t: dict(entries=[(base, key ^ 0x9E3779B97F4A7C15) for base, key in t["region"]["entries"]]),
                   slice(None)),
}


@pytest.mark.parametrize("target", REFUSING, indirect=True)
@pytest.mark.parametrize("op", ["write", "read"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_tampered_handle_is_refused_and_memory_outside_untouched(target, case, op):
    """A handle claiming more than was registered, or naming another key: the initiator's own
    checks pass, the target's provider refuses, no byte of the buffer changes (neither the
    registered region nor the unregistered guard bytes around it) and, for reads, none of its
    bytes reaches the reader."""
    provider, b = target
    name = f"tb-{case}-{op}"
    remote, before = _guarded(b, name, fill=0xAB)  # guard bytes are 0x5A
    changes, where = CASES[case]
    forged = ph.tampered(remote, **changes(_C._decode_remote(remote.to_bytes())))[where]
    error, got = _attempt(provider, op == "write", forged, forged.numel(), fill=0x11)
    assert b.call(ph.buffer_bytes, name) == before
    if op == "read":
        assert not ((got == 0xAB) | (got == 0x5A)).any(), "the target's bytes reached the reader"
    _assert_refused(provider, error)


def test_deregistered_region_cannot_be_read(fresh_target):
    provider, b = fresh_target
    remote, _ = _guarded(b, "drr", fill=0xAB)
    b.call(ph.close_region, "drr")
    error, got = _attempt(provider, False, remote, N, fill=0)
    assert not (got == 0xAB).any()
    _assert_refused(provider, error, deregistered=True)


def test_deregistered_region_cannot_be_written(fresh_target):
    provider, b = fresh_target
    remote, _ = _guarded(b, "dr")
    with _initiator(provider) as a:
        data = torch.full((N,), 0x77, dtype=torch.uint8)
        a.register(data)
        p2p.wait(a.write_slices(data, [remote]), 10)
    b.call(ph.close_region, "dr")
    after_valid = b.call(ph.buffer_bytes, "dr")
    assert after_valid[GUARD:GUARD + N] == bytes([0x77]) * N
    error, _ = _attempt(provider, True, remote, N, fill=0x22)
    assert b.call(ph.buffer_bytes, "dr") == after_valid
    _assert_refused(provider, error, deregistered=True)


@pytest.mark.parametrize("provider", ["tcp", pytest.param("shm", marks=pytest.mark.xfail(
    SHM_1, strict=True, raises=AssertionError, reason=SHM_REFUSAL))])
def test_refused_write_fails_alone(provider):
    """A write the target's provider refuses (a forged key) fails with RemoteError, and
    transfers to the same peer keep working on the same engine."""
    with Peer() as b, _initiator(provider) as a:
        b.call(ph.start_engine, provider, peer_timeout=PEER_TIMEOUT)
        good, _ = _guarded(b, "good")
        target, before = _guarded(b, "target")
        entries = _C._decode_remote(target.to_bytes())["region"]["entries"]
        forged = ph.tampered(target, entries=[(base, key ^ 0x9E3779B97F4A7C15) for base, key in entries])
        data = torch.full((N,), 0x33, dtype=torch.uint8)
        a.register(data)
        p2p.wait(a.write_slices(data, [good]), 10)
        errors = ph.wait_all([a.write_slices(data, [forged])], PEER_TIMEOUT + 10)
        later = ph.wait_all([a.write_slices(data, [good]), a.read_slices(data, [good])], PEER_TIMEOUT + 10)
        assert isinstance(errors[0], p2p.RemoteError), errors
        assert later == [None, None], later
        assert b.call(ph.buffer_bytes, "target") == before


# -- keys ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("provider", PROVIDERS)
def test_keys_are_unpredictable(provider):
    """tcp and shm let the engine choose keys: registering the same tensor in fresh engines
    gives different keys, and keys look random (no counter, about half their bits set)."""
    t = torch.zeros(1024)
    keys = []
    for _ in range(6):
        with p2p.Engine("cpu", **engine_kwargs(provider)) as e:
            keys += e.register(t).remote.keys
    with p2p.Engine("cpu", **engine_kwargs(provider)) as e:
        for i in range(6):
            keys += e.register(torch.zeros(256)).remote.keys
    assert len(set(keys)) == len(keys), keys
    assert all(k > 1 << 32 for k in keys) or sum(k > 1 << 32 for k in keys) >= len(keys) - 1, keys
    diffs = {b - a for a, b in zip(keys, keys[1:])}
    assert len(diffs) == len(keys) - 1, "keys follow a pattern"
    bits = sum(bin(k).count("1") for k in keys) / len(keys)
    assert 20 <= bits <= 44, f"{bits:.1f} bits set on average out of 64"


# -- the staged path: the owner's engine checks ------------------------------------------------------

@pytest.fixture(scope="module")
def staged_target():
    with Peer() as b:
        b.call(ph.start_engine, "tcp", peer_timeout=PEER_TIMEOUT, data_path="staged")
        yield b


@pytest.mark.parametrize("case", ["access", "larger-size", "deregistered"])
def test_staged_owner_refuses(staged_target, case):
    """A staged region's owner checks access, bounds and registration itself: RemoteError at
    once, memory untouched, and the peer stays usable."""
    b = staged_target
    name = "st-" + case
    remote, before = _guarded(b, name, access="r" if case == "access" else "rw")
    assert remote.staged
    if case == "access":
        forged = ph.tampered(remote, access=ph.READ | ph.WRITE)
    elif case == "larger-size":
        forged = ph.tampered(remote, nbytes=N + GUARD, shape=[N + GUARD])[N:]
    else:
        b.call(ph.close_region, name)
        forged = remote
    with _initiator("tcp") as a:
        buf = torch.full((forged.numel(),), 0x11, dtype=torch.uint8)
        a.register(buf)
        errors = ph.wait_all([a.write_slices(buf, [forged])], 10)
        # A deregistered region may be known as such on connecting (the owner's census). The
        # owner's refusal, not a peer timeout (PeerError after PEER_TIMEOUT), is what is asserted.
        refusal = (p2p.RemoteError, p2p.ClosedError) if case == "deregistered" else p2p.RemoteError
        assert isinstance(errors[0], refusal), errors
        assert b.call(ph.buffer_bytes, name) == before
        good = p2p.RemoteTensor.from_bytes(b.call(ph.target, name + ".ok", 64))
        p2p.wait(a.write_slices(buf[:64], [good]), 10)


# -- peer identity --------------------------------------------------------------------------------

@pytest.mark.parametrize("provider", PROVIDERS)
def test_forged_address_of_a_known_incarnation_does_not_hijack_the_peer(provider):
    """An incarnation is public (it is in the address). A forged address naming b's incarnation
    at other endpoints, used first, must not make b unreachable; used once b has answered, it is
    refused with a ValueError and b is not disturbed; a handle whose owner is forged likewise."""
    with _initiator(provider) as a, Peer() as b:
        address = b.call(ph.start_engine, provider)
        fields = _C._decode_address(address)
        if engine_kwargs(provider)["provider"] == "tcp":
            rail = bytearray(fields["rails"][0])
            rail[2:4] = free_port().to_bytes(2, "big")  # loopback, nobody listens
            fields["rails"] = [bytes(rail)]
        else:
            fields["rails"] = [b"fi_shm://999999999:0:0\x00"]
        forged = _C._encode_address(fields)
        ph.wait_all([a.connect(forged)], PEER_TIMEOUT + 5)  # fails, as it should
        errors = ph.wait_all([a.connect(address), a.send(address, b"the real one")], PEER_TIMEOUT + 5)
        assert errors == [None, None], errors
        assert b.call(ph.recv, 5)[1] == b"the real one"
        # b has answered from its endpoints: the forgery is now refused outright.
        with pytest.raises(ValueError, match="other endpoints"):
            p2p.wait(a.connect(forged), 5)
        real = p2p.RemoteTensor.from_bytes(b.call(ph.target, "t", 64))
        buf = torch.arange(64, dtype=torch.uint8)
        a.register(buf)
        with pytest.raises(ValueError, match="other endpoints"):
            p2p.wait(a.write_slices(buf, [ph.tampered(real, owner=forged)]), 5)
        p2p.wait(a.write_slices(buf, [real]), 10)
        assert b.call(ph.checksum, "t") == ph.zlib.crc32(bytes(range(64)))
        p2p.wait(a.send(address, b"still the real one"), 10)
        assert b.call(ph.recv, 5)[1] == b"still the real one"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("fast", [False, True], ids=["checked", "fast"])
def test_shm_fast_rma_setting(monkeypatch, fast):
    """TORCH_P2P_SHM_FAST=1 turns shm's unchecked fast RMA back on: the initiator copies into
    the target with CMA, so a write to a stopped target completes (README, Security). Off (the
    default), the target's provider serves each RMA, so a stopped target holds the write.
    The fast write needs nothing of the target, so it is done at once; its 20 s bound only keeps
    a hang short on a loaded machine. The checked write would be held for as long as the target
    stays stopped: 3 s of it show that.
    The target is stopped with none of our control messages unread: shm (libfabric 1.17) moves
    them with delivery-complete by its SAR protocol, one at a time per peer, and every op to the
    peer waits (-FI_EAGAIN) until the target has taken it. Stopped right after the first write
    (the HELLO exchange of the first contact just over), the fast write stayed pending for all
    of 20 s in about half the runs and completed the moment the target ran again; after a
    send(), whose future completes once the target's engine has it, it never did."""
    env = {"TORCH_P2P_SHM_FAST": "1" if fast else "0"}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with Peer(env=env) as b, p2p.Engine("cpu", **engine_kwargs("shm", peer_timeout=60)) as a:
        address = b.call(ph.start_engine, "shm")
        remote = p2p.RemoteTensor.from_bytes(b.call(ph.target, "t", 1 << 20))
        src = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8)
        a.register(src)
        p2p.wait(a.write_slices(src[:16], [remote[:16]]), 10)
        p2p.wait(a.send(address, b"nothing of ours unread"), 10)
        with ph.stopped(b.pid, 30):
            fut = a.write_slices(src, [remote])
            done = ph.outcomes([fut], 20 if fast else 3)[0]
        assert done is None if fast else done == "pending", done
        p2p.wait(fut, 20)
        assert b.call(ph.checksum, "t") == ph.zlib.crc32(src.numpy().tobytes())
