"""RemoteTensor: a handle to a view of a tensor registered with some engine.

Its basic indexing gives the views torch gives (same shape, strides and storage offset), its
facts describe the registration, and it survives bytes and pickle round trips, also on its
way to another process, where it still moves real data.
"""
from __future__ import annotations

import pickle
import zlib

import pytest
import torch

import helpers
import torch_p2p as p2p
from conftest import engine_kwargs
from peer import Peer

pytestmark = pytest.mark.timeout(120)

SHAPE = (5, 6, 7, 8)


@pytest.fixture(scope="module")
def engine():
    """Handles of this process's own regions are enough for everything but real transfers."""
    with p2p.Engine("cpu", **engine_kwargs("tcp")) as e:
        yield e


def _strided_4d() -> torch.Tensor:
    """A [5, 6, 7, 8] view with a storage offset and permuted, stepped strides."""
    storage = torch.zeros(8, 14, 12, 7)
    return storage[1:6, 3:11, ::2, :].permute(0, 2, 3, 1)


@pytest.fixture(scope="module", params=["contiguous", "strided"])
def registered(request, engine):
    """(tensor, its region): the tensor is the reference torch indexes next to the handle."""
    t = torch.zeros(SHAPE) if request.param == "contiguous" else _strided_4d()
    assert t.shape == SHAPE
    with engine.register(t) as region:
        yield t, region


def _none_dims(index, ndim: int) -> set[int]:
    """Dimensions of the result that `None` inserted (their strides may differ from torch's)."""
    items = index if isinstance(index, tuple) else (index,)
    consumed = sum(1 for i in items if i is not None and i is not Ellipsis)
    out, dims = 0, set()
    for item in items:
        if item is None:
            dims.add(out)
            out += 1
        elif item is Ellipsis:
            out += ndim - consumed
        elif isinstance(item, slice):
            out += 1
    return dims


def assert_same_view(handle: p2p.RemoteTensor, view: torch.Tensor, index=()) -> None:
    assert handle.shape == view.shape
    assert handle.storage_offset() == view.storage_offset()
    skip = _none_dims(index, len(SHAPE))
    assert [s for d, s in enumerate(handle.stride()) if d not in skip] == \
           [s for d, s in enumerate(view.stride()) if d not in skip]


INDEXES = [
    0, 4, -1, -5, torch.tensor(2),
    slice(None), slice(1, 4), slice(None, None, 2), slice(1, None, 3), slice(-3, None), slice(None, -2),
    slice(2, 100), slice(-100, 2), slice(4, 5), slice(0, 5, 7),
    (1, 2), (-1, -2, -3, -4), (2, slice(1, 5, 2), -1), (slice(None), 3),
    (slice(None), slice(None), slice(None, None, 3)),
    (slice(1, None, 2), slice(None, None, 5), slice(2, 6, 2), slice(-1, None)),
    Ellipsis, (), (..., 2), (..., slice(1, 7, 2)), (1, ..., -1), (0, ..., 0, 0), (..., 0, 0, 0, 0), (3, 2, ...),
    None, (None, 0), (0, None, slice(2, 4)), (..., None), (slice(None, None, 4), None, ..., 3), (None, ..., None),
    (2, None, None, 3), (None, 1, 2, 3, 4, None),
]


@pytest.mark.parametrize("index", INDEXES, ids=repr)
def test_indexing_gives_torchs_view(registered, index):
    t, region = registered
    assert_same_view(region.remote[index], t[index], index)


CHAINS = [
    (slice(1, None), slice(None, None, 2), (..., 3)),
    (1, slice(2, 5), -1, slice(None, None, 3)),
    ((slice(None), slice(1, None, 2)), (slice(None, None, 2), 0), (..., slice(3, None))),
    ((..., slice(1, 7, 3)), (slice(None), slice(None), -1), (-1, slice(None), 1)),
]


@pytest.mark.parametrize("chain", CHAINS, ids=repr)
def test_indexing_a_view_again(registered, chain):
    t, region = registered
    handle, view = region.remote, t
    for index in chain:
        handle, view = handle[index], view[index]
        assert_same_view(handle, view, index)


def test_empty_slices_have_torchs_shape_and_strides(registered):
    t, region = registered
    for index in [slice(3, 3), slice(10, None), (slice(None), slice(6, 6)), (0, 1, slice(5, 2))]:
        handle, view = region.remote[index], t[index]
        assert handle.shape == view.shape and handle.numel() == 0
        assert handle.stride() == view.stride()


def test_empty_slices_have_torchs_storage_offset(registered):
    t, region = registered
    for index in [slice(3, 3), (slice(None), slice(6, 6))]:
        assert region.remote[index].storage_offset() == t[index].storage_offset()


@pytest.mark.parametrize("index", [5, -6, (0, 6), (..., 8), (1, 2, 3, -9), (0, 0, 0, 0, 0),
                                   slice(None, None, -1), slice(None, None, 0), (slice(None), slice(4, 1, -1))],
                         ids=repr)
def test_bad_indexes_raise_what_torch_raises(registered, index):
    t, region = registered
    with pytest.raises(Exception) as torch_error:
        t[index]
    with pytest.raises(torch_error.type):
        region.remote[index]


def test_only_basic_indexing(registered):
    """Views only: what would make torch copy (masks, index lists and tensors) is a TypeError.
    Stricter than torch: one ellipsis at most, as in numpy."""
    _, region = registered
    for index in [True, [0, 1], torch.tensor([0, 1]), torch.ones(5, dtype=torch.bool), 1.5, "0"]:
        with pytest.raises(TypeError, match="basic indexing"):
            region.remote[index]
    with pytest.raises(IndexError, match="single ellipsis"):
        region.remote[..., 0, ...]


# -- What a handle says -----------------------------------------------------------------------

def test_facts_of_a_handle(engine, registered):
    t, region = registered
    handle = region.remote
    assert (handle.shape, handle.size(), handle.size(1)) == (t.shape, t.size(), t.size(1))
    assert handle.size(-1) == t.size(-1)
    assert (handle.stride(), handle.stride(2)) == (t.stride(), t.stride(2))
    assert handle.storage_offset() == t.storage_offset()
    assert (handle.dtype, handle.ndim, handle.dim(), handle.numel()) == (t.dtype, t.ndim, t.dim(), t.numel())
    assert (handle.element_size(), len(handle)) == (t.element_size(), len(t))
    assert handle.owner == engine.address
    assert handle.region_id == region.id
    assert (handle.device, handle.access, handle.staged) == ("cpu", "rw", False)
    # One piece, a key per rail (tcp opens one rail per 4 cores: one here, four on 16 cores).
    assert len(handle.keys) == len(engine.rails) and all(isinstance(k, int) for k in handle.keys)
    with pytest.raises(TypeError, match="len\\(\\) of a 0-d RemoteTensor"):
        len(handle[0, 0, 0, 0])
    assert "RemoteTensor(shape=(5, 6, 7, 8)" in repr(handle)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.complex64, torch.int8, torch.bool],
                         ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("access", ["r", "w", "rw"])
def test_dtype_and_access_of_a_registration(engine, dtype, access):
    t = torch.zeros(3, 4, dtype=dtype)
    with engine.register(t, access=access) as region:
        handle = region.remote
        assert (handle.dtype, handle.element_size(), handle.access) == (dtype, t.element_size(), access)
        assert handle[1].access == access  # views keep the registration's facts


# -- Bytes and pickle -------------------------------------------------------------------------

def facts(h: p2p.RemoteTensor) -> tuple:
    return (h.shape, h.stride(), h.storage_offset(), h.dtype, h.owner, h.keys, h.region_id, h.access,
            h.staged, h.device)


def _views(handle: p2p.RemoteTensor) -> list[p2p.RemoteTensor]:
    return [handle, handle[1:4, ::2], handle[..., 3], handle[None, 2], handle[1, 2, 3, 4], handle[2:2]]


ROUND_TRIPS = {
    "bytes": lambda h: p2p.RemoteTensor.from_bytes(h.to_bytes()),
    "bytearray": lambda h: p2p.RemoteTensor.from_bytes(bytearray(h.to_bytes())),
    "memoryview": lambda h: p2p.RemoteTensor.from_bytes(memoryview(h.to_bytes())),
    "pickle": lambda h: pickle.loads(pickle.dumps(h)),
}


@pytest.mark.parametrize("round_trip", ROUND_TRIPS.values(), ids=ROUND_TRIPS.keys())
def test_round_trips_keep_everything(registered, round_trip):
    _, region = registered
    for view in _views(region.remote):
        back = round_trip(view)
        assert facts(back) == facts(view)
        assert back.to_bytes() == view.to_bytes()
        index = (..., slice(1, None)) if view.ndim else None
        assert facts(back[index]) == facts(view[index])  # and it indexes the same


def _reseal(body: bytes) -> bytes:
    """Handles end in the CRC-32 (zlib's) of what precedes it."""
    return body + zlib.crc32(body).to_bytes(4, "little")


def test_bad_bytes_raise_value_error(engine, registered):
    _, region = registered
    blob = region.remote[1:3].to_bytes()
    assert _reseal(blob[:-4]) == blob
    flipped = bytearray(blob)
    flipped[len(blob) // 2] ^= 0x10
    bad = {
        "empty": b"",
        "truncated by one byte": blob[:-1],
        "the first half": blob[: len(blob) // 2],
        "one byte more": blob + b"\0",
        "one bit flipped": bytes(flipped),
        "an engine address": engine.address,
        "random bytes": bytes(helpers.random_tensor((len(blob),), torch.uint8, 9).tolist()),
        "a pickle of something else": pickle.dumps(3),
    }
    for what, data in bad.items():
        with pytest.raises(ValueError, match="invalid RemoteTensor bytes"):
            p2p.RemoteTensor.from_bytes(data)
    # Well sealed but foreign, or from a future version.
    with pytest.raises(ValueError, match="not a torch_p2p RemoteTensor"):
        p2p.RemoteTensor.from_bytes(_reseal(b"XXXX" + blob[4:-4]))
    with pytest.raises(ValueError, match="unsupported version"):
        p2p.RemoteTensor.from_bytes(_reseal(blob[:4] + bytes([blob[4] + 1]) + blob[5:-4]))
    # A pickled handle carries the bytes: corrupted, it fails to load the same way.
    with pytest.raises(ValueError, match="checksum mismatch"):
        pickle.loads(pickle.dumps(region.remote[1:3]).replace(blob, bytes(flipped)))
    for not_bytes in ["text", None, 7]:
        with pytest.raises(TypeError, match="RemoteTensor.from_bytes takes bytes"):
            p2p.RemoteTensor.from_bytes(not_bytes)


# -- Round-tripped handles move real data -----------------------------------------------------

@pytest.mark.timeout(120)
def test_round_tripped_handles_move_real_data(provider):
    with Peer() as b:
        link = helpers.Link(b, provider)
        try:
            # Theirs: bytes, then pickle, then a view of the result.
            name, remote = link.remote((16, 32))
            handle = pickle.loads(pickle.dumps(p2p.RemoteTensor.from_bytes(remote.to_bytes())))
            src = helpers.random_tensor((16, 32), torch.float32, 1)
            with link.engine.register(src):
                p2p.wait(link.engine.write_slices([src[2:6, ::2]], [handle[10:14, 16:]]), timeout=60)
            expected = helpers.poisoned((16, 32), torch.float32)
            helpers.bits(expected[10:14, 16:]).copy_(helpers.bits(src[2:6, ::2]))
            helpers.assert_same_bits(link.fetch(name), expected)

            # Ours: a view of our handle travels (pickled) to the peer, which writes through it.
            mine = helpers.poisoned((16, 32), torch.float32)
            with link.engine.register(mine) as region:
                b.call(helpers.write_random_into, region.remote[3:9, 1::3], 5, engine=link.key)
            expected = helpers.poisoned((16, 32), torch.float32)
            helpers.bits(expected[3:9, 1::3]).copy_(helpers.bits(helpers.random_tensor((6, 11), torch.float32, 5)))
            helpers.assert_same_bits(mine, expected)
        finally:
            link.close()
