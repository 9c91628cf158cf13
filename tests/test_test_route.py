"""The loopback route (csrc/routes/loopback/): a route for the tests only, the example of
docs/design.md, "Adding a route". With TORCH_P2P_TEST_ROUTE=1 two engines of one process move
host memory with a memmove on the initiator's worker, no fabric; without it no engine takes it.

Its index in routes/registry.cpp is 3: it is offered after cma (index 1), so the engines here
turn cma off (engine_kwargs("tcp")) except where a test shows that order.

The cases are those of test_transfers.py and test_views.py (bytes compared bit for bit, every
other byte poison), run against an owner engine in this process instead of a peer child.
"""
from __future__ import annotations

import time

import pytest
import torch

import helpers
import peer_helpers as ph
import test_security
import test_transfers
import test_views
import torch_p2p as p2p
from conftest import engine_kwargs
from peer import Peer
from torch_p2p import _C

pytestmark = pytest.mark.timeout(240)

ON = {"TORCH_P2P_TEST_ROUTE": "1"}
BIT = {"ipc": 0, "cma": 1, "loopback": 3}  # the address's flags byte: the registry's indices
N, GUARD = test_security.N, test_security.GUARD


def _engine(monkeypatch, on: bool = True, provider: str = "tcp", **kwargs) -> p2p.Engine:
    """A host engine, the route on or off (its variable is read once, at start)."""
    if on:
        monkeypatch.setenv("TORCH_P2P_TEST_ROUTE", "1")
    else:
        monkeypatch.delenv("TORCH_P2P_TEST_ROUTE", raising=False)
    return p2p.Engine("cpu", **engine_kwargs(provider, **kwargs))


def _flags(engine: p2p.Engine) -> set[str]:
    routes = _C._decode_address(engine.address)["routes"]
    return {name for name, bit in BIT.items() if routes >> bit & 1}


class InProcessLink:
    """helpers.Link's interface with the owner engine in this process: `engine` initiates,
    `owner` registers the remote tensors."""

    def __init__(self, engine: p2p.Engine, owner: p2p.Engine):
        self.engine, self.owner = engine, owner
        self.state = {"owner": owner}
        self._regions = 0

    def remote(self, shape, dtype=torch.float32, *, seed: int | None = None, access: str = "rw",
               transpose: bool = False) -> tuple[str, p2p.RemoteTensor]:
        self._regions += 1
        name = f"t{self._regions}"
        blob = helpers.make_region(self.state, name, shape, dtype, seed=seed, access=access, transpose=transpose,
                                   engine="owner")
        return name, p2p.RemoteTensor.from_bytes(blob)

    def fetch(self, name: str) -> torch.Tensor:
        return helpers.fetch(self.state, name)

    def drop(self, name: str) -> None:
        helpers.drop(self.state, name)


@pytest.fixture(scope="module")
def link():
    with pytest.MonkeyPatch.context() as mp:
        a, b = _engine(mp), _engine(mp)
    yield InProcessLink(a, b)
    a.close()
    b.close()


# -- which engines take it ---------------------------------------------------------------------------

def test_engines_of_one_process_take_it(link):
    assert link.engine.route(link.owner.address) == "loopback"
    assert link.owner.route(link.engine.address) == "loopback"
    name, remote = link.remote((4, 4))
    try:
        assert link.engine.route(remote) == "loopback"
    finally:
        link.drop(name)
    # Bit 3 of the flags byte; bits 0 (ipc) and 1 (cma) keep their meaning.
    assert _flags(link.engine) == {"loopback"}


def test_cma_is_offered_first(monkeypatch):
    """The registry offers routes in index order: with cma on at both ends, cma takes the pair."""
    with _engine(monkeypatch, provider="cma") as a, _engine(monkeypatch, provider="cma") as b:
        assert _flags(a) == {"cma", "loopback"}
        assert a.route(b.address) == "cma"


def test_both_ends_must_have_it(monkeypatch):
    with _engine(monkeypatch) as a, _engine(monkeypatch, on=False) as b:
        assert _flags(b) == set()
        assert a.route(b.address) == "direct" and b.route(a.address) == "direct"
        _round_trip(a, b)


@pytest.mark.parametrize("value", [None, "0"])
def test_off_unless_turned_on(monkeypatch, value):
    if value is None:
        monkeypatch.delenv("TORCH_P2P_TEST_ROUTE", raising=False)
    else:
        monkeypatch.setenv("TORCH_P2P_TEST_ROUTE", value)
    assert dict((k, d) for k, _, d in _C.settings())["test_route"] == "0"
    with p2p.Engine("cpu", **engine_kwargs("tcp")) as a, p2p.Engine("cpu", **engine_kwargs("tcp")) as b:
        assert _flags(a) == set()
        assert a.route(b.address) == "direct"
        _round_trip(a, b)
    with p2p.Engine("cpu", **engine_kwargs("cma")) as a, p2p.Engine("cpu", **engine_kwargs("cma")) as b:
        assert a.route(b.address) == "cma"


def test_an_address_of_another_process_is_not_taken(link):
    forged = _C._decode_address(link.owner.address)
    forged["pid"] += 1
    assert link.engine.route(_C._encode_address(forged)) == "direct"


@pytest.mark.parametrize("cma", [False, True], ids=["fabric", "cma"])
def test_a_peer_in_another_process_takes_cma_or_the_fabric(monkeypatch, cma):
    """The child has the route on too: only the pid keeps it off."""
    provider = "cma" if cma else "tcp"
    with Peer(env=ON) as child, _engine(monkeypatch, provider=provider) as a:
        address = child.call(helpers.start_engine, provider)
        assert _C._decode_address(address)["routes"] >> BIT["loopback"] & 1
        assert a.route(address) == ("cma" if cma else "direct")
        remote = p2p.RemoteTensor.from_bytes(child.call(helpers.make_region, "t", (64, 32), seed=None))
        assert a.route(remote) == ("cma" if cma else "direct")
        src = helpers.random_tensor((64, 32), torch.float32, 5)
        back = helpers.poisoned((64, 32), torch.float32)
        with a.register(src), a.register(back):
            p2p.wait(a.write_slices(src, remote), 30)
            p2p.wait(a.read_slices(back, remote), 30)
        helpers.assert_same_bits(child.call(helpers.fetch, "t"), src)
        helpers.assert_same_bits(back, src)


def _round_trip(a: p2p.Engine, b: p2p.Engine) -> None:
    """A write from a into b's memory and a read back: bytes exact."""
    src = helpers.random_tensor((64, 32), torch.float32, 1)
    dst = helpers.poisoned((64, 32), torch.float32)
    back = helpers.poisoned((64, 32), torch.float32)
    with a.register(src), a.register(back), b.register(dst) as region:
        p2p.wait(a.write_slices(src, region.remote), 30)
        p2p.wait(a.read_slices(back, region.remote), 30)
    helpers.assert_same_bits(dst, src)
    helpers.assert_same_bits(back, src)


# -- bytes: the cases of test_transfers.py and test_views.py -------------------------------------------

DIRECTIONS = test_transfers.DIRECTIONS


@pytest.mark.parametrize("write", DIRECTIONS)
@pytest.mark.parametrize("case", test_transfers._case_params(mirror=False))
def test_explicit_views(link, case, write):
    test_transfers.check_transfer(link, case, write=write, mirror=False)


@pytest.mark.parametrize("write", DIRECTIONS)
@pytest.mark.parametrize("case", test_transfers._case_params(mirror=True))
def test_mirror(link, case, write):
    test_transfers.check_transfer(link, case, write=write, mirror=True)


@pytest.mark.parametrize("write", DIRECTIONS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.int8, torch.bool], ids=str)
def test_dtypes(link, dtype, write):
    test_transfers.check_transfer(link, test_transfers.CASES["stepped"], write=write, mirror=False, dtype=dtype)


@pytest.mark.parametrize("write", DIRECTIONS)
def test_pages(link, write):
    """p2p.pages entries, two regions on each side whose entries share the ids (a KV cache's
    layers), as the list of views they stand for."""
    mine, theirs = test_views.MINE, test_views.THEIRS

    def pages(L, R):
        if isinstance(R[0], p2p.RemoteTensor):
            return [p2p.pages(L[0], mine), p2p.pages(L[1], mine)], [p2p.pages(R[0], theirs), p2p.pages(R[1], theirs)]
        return [L[0][i] for i in mine] + [L[1][i] for i in mine], [R[0][j] for j in theirs] + [R[1][j] for j in theirs]

    test_views._move(link, write, pages, locals_=2, remotes=2)


@pytest.mark.parametrize("form", ["views", "prepared"])
@pytest.mark.parametrize("write", DIRECTIONS)
def test_views_taken_as_pages(link, write, form):
    test_views._move(link, write, test_views._pages, prepared=form == "prepared")


@pytest.mark.parametrize("write", DIRECTIONS)
def test_views_of_several_regions(link, write):
    test_views._move(link, write, lambda L, R: ([L[0][1], L[1][2:5], L[0][7, 3:9]], [R[1][0], R[0][9:12], R[1][5, :6]]),
                     locals_=2, remotes=2)


# -- access and bounds, as on the fabric (test_security.py) ----------------------------------------

def _guarded(link, name, access="rw", fill=0xAB):
    link.state["engine"] = link.owner  # guarded_target registers with state["engine"]
    remote = p2p.RemoteTensor.from_bytes(ph.guarded_target(link.state, name, N, GUARD, access, fill))
    assert link.engine.route(remote) == "loopback"
    return remote, ph.buffer_bytes(link.state, name)


def _attempt(link, write: bool, remote, nbytes: int, fill: int = 0x11):
    buf = torch.full((nbytes,), fill, dtype=torch.uint8)
    with link.engine.register(buf):
        call = link.engine.write_slices if write else link.engine.read_slices
        error = ph.wait_all([call(buf, [remote])], 30)[0]
    return error, buf


def _assert_refused_by_the_route(error):
    assert isinstance(error, p2p.RemoteError), error
    assert "owner" in str(error), error  # the owner's answer refused it, not the fabric


def test_access_checked_locally(link):
    ro, _ = _guarded(link, "lro", access="r")
    wo, _ = _guarded(link, "lwo", access="w")
    buf = torch.zeros(N, dtype=torch.uint8)
    with link.engine.register(buf):
        with pytest.raises(ValueError, match="does not accept remote writes"):
            link.engine.write_slices(buf, [ro])
        with pytest.raises(ValueError, match="does not accept remote reads"):
            link.engine.read_slices(buf, [wo])
        p2p.wait(link.engine.read_slices(buf, [ro]), 10)
        p2p.wait(link.engine.write_slices(buf, [wo]), 10)


@pytest.mark.parametrize("access, write", [("r", True), ("w", False)], ids=["write-to-read-only", "read-of-write-only"])
def test_tampered_access_is_refused(link, access, write):
    """The handle claims "rw"; the owner's answer says otherwise: RemoteError, nothing moves."""
    remote, before = _guarded(link, f"ta-{access}", access=access, fill=0x5E)
    forged = ph.tampered(remote, access=ph.READ | ph.WRITE)
    error, got = _attempt(link, write, forged, N, fill=0)
    _assert_refused_by_the_route(error)
    assert ph.buffer_bytes(link.state, f"ta-{access}") == before
    assert not (got == 0x5E).any()


@pytest.mark.parametrize("op", ["write", "read"])
@pytest.mark.parametrize("case", sorted(test_security.CASES))
def test_tampered_handle_is_refused_and_memory_outside_untouched(link, case, op):
    """A handle claiming more bytes than registered, another base or another key: refused with
    RemoteError before any byte moves; neither the region nor the guard bytes around it
    change, and a read gets none of them."""
    name = f"tb-{case}-{op}"
    remote, before = _guarded(link, name)  # guard bytes are 0x5A
    changes, where = test_security.CASES[case]
    forged = ph.tampered(remote, **changes(_C._decode_remote(remote.to_bytes())))[where]
    error, got = _attempt(link, op == "write", forged, forged.numel())
    _assert_refused_by_the_route(error)
    assert ph.buffer_bytes(link.state, name) == before
    if op == "read":
        assert not ((got == 0xAB) | (got == 0x5A)).any(), "the owner's bytes reached the reader"


def test_bounds_checked_locally(link):
    remote, _ = _guarded(link, "lb")
    big = torch.zeros(2 * N, dtype=torch.uint8)
    with link.engine.register(big):
        with pytest.raises(ValueError, match="shape"):
            link.engine.write_slices(big, [remote])
        with pytest.raises(ValueError, match="beyond"):
            ph.tampered(remote, offset=0, shape=[N + 1])


def test_closed_region_is_released_and_refused(link):
    """The owner's close() waits for our release, which comes at once when nothing flows; a
    stale handle then fails with ClosedError."""
    name, remote = link.remote((16, 16))
    src = torch.ones(16, 16)
    with link.engine.register(src):
        p2p.wait(link.engine.write_slices(src, remote), 10)
        start = time.monotonic()
        link.drop(name)
        # No hang: a close() left waiting for our release would wait out peer_timeout (10 s).
        assert time.monotonic() - start < 8
        with pytest.raises(p2p.ClosedError):
            p2p.wait(link.engine.write_slices(src, remote), 10)
