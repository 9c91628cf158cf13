"""Lists of views as write_slices / read_slices take them: pairs of one local storage and one
remote region with one shape, strides and dtype are taken as pages (ids and a stride) natively;
anything else is taken view by view. Either way the bytes moved must be exactly those of the
views (compared bit for bit, every other byte still poison), and a call refused must be refused
with the message that names the view at fault, as a call taken view by view does.
"""
from __future__ import annotations

import contextlib

import pytest
import torch

import helpers
import torch_p2p as p2p

pytestmark = pytest.mark.timeout(240)

ROWS, COLS = 64, 32  # each base: 64 pages of 32 float32 (128 bytes)


def _rows(n: int, seed: int, out_of: int = ROWS) -> list[int]:
    return torch.randperm(out_of, generator=torch.Generator().manual_seed(seed))[:n].tolist()


MINE, THEIRS = _rows(24, 1), _rows(24, 2)


def _move(link, write: bool, pairs, locals_=1, remotes=1, local_shape=(ROWS, COLS), remote_shape=(ROWS, COLS),
          tuples=False, prepared=False):
    """Runs `pairs(local_bases, remote_bases) -> (local views, remote views)` as one call over
    `locals_` registered local tensors and `remotes` regions of the peer, then compares every
    byte of the destinations with what torch computes for the same views."""
    seed = 10
    if write:
        bases = [helpers.random_tensor(local_shape, torch.float32, seed + k) for k in range(locals_)]
        named = [link.remote(remote_shape) for _ in range(remotes)]
    else:
        bases = [helpers.poisoned(local_shape, torch.float32) for _ in range(locals_)]
        named = [link.remote(remote_shape, seed=seed + 100 + k) for k in range(remotes)]
    regions = [link.engine.register(b) for b in bases]
    try:
        local, remote = pairs(bases, [handle for _, handle in named])
        if tuples:
            local, remote = tuple(local), tuple(remote)
        if prepared:
            call = (link.engine.prepare_write if write else link.engine.prepare_read)(local, remote)
            futures = [call.run(), call.run()]
        else:
            futures = [(link.engine.write_slices if write else link.engine.read_slices)(local, remote)]
        for f in futures:
            p2p.wait(f, timeout=60)
        got_remote = [link.fetch(name) for name, _ in named]
        # The same pairs applied to poisoned copies of the destination side, view by view.
        shape, count = (remote_shape, remotes) if write else (local_shape, locals_)
        expected = [helpers.poisoned(shape, torch.float32) for _ in range(count)]
        for mine, theirs in zip(*(pairs(bases, expected) if write else pairs(expected, got_remote))):
            dst, src = (theirs, mine) if write else (mine, theirs)
            helpers.bits(dst).copy_(helpers.bits(src))
        for got, want in zip(got_remote if write else bases, expected):
            helpers.assert_same_bits(got, want)
    finally:
        for r in regions:
            r.close()
        for name, _ in named:
            link.drop(name)


def _pages(L, R):
    return [L[0][i] for i in MINE], [R[0][j] for j in THEIRS]


@pytest.mark.parametrize("write", [True, False], ids=["write", "read"])
def test_views_that_are_pages(link, write):
    _move(link, write, _pages)


@pytest.mark.parametrize("form", ["tuples", "prepared"])
def test_views_that_are_pages_other_forms(link, form):
    _move(link, True, _pages, tuples=form == "tuples", prepared=form == "prepared")
    _move(link, False, _pages, tuples=form == "tuples", prepared=form == "prepared")


def test_prepared_call_runs_on_other_pages(link):
    """run_pages: a prepared call whose entries share one list of page ids (a KV cache's
    layers) moves other pages, of any count, checked as a call checks them, both ways; a call
    of another shape refuses it."""
    seed = 70
    bases = [helpers.random_tensor((ROWS, COLS), torch.float32, seed + k) for k in range(2)]
    named = [link.remote((ROWS, COLS)) for _ in range(2)]
    regions = [link.engine.register(b) for b in bases]
    try:
        mine, theirs = torch.tensor(MINE), torch.tensor(THEIRS)
        local = [p2p.pages(b, mine) for b in bases]
        call = link.engine.prepare_write(local, [p2p.pages(h, theirs) for _, h in named])
        assert call.takes_pages
        src, dst = _rows(5, 3), _rows(5, 4)
        p2p.wait(call.run_pages(torch.tensor(src), torch.tensor(dst)), timeout=60)
        for b, (name, _) in zip(bases, named):
            want = helpers.poisoned((ROWS, COLS), torch.float32)
            want[dst] = b[src]
            helpers.assert_same_bits(link.fetch(name), want)
        for kind, text, (lids, rids) in [
                (IndexError, "remote page 64 of 64", ([0], [64])),
                (ValueError, "destination page 3 is named twice", ([0, 1], [3, 3])),
                (ValueError, "2 local page ids but 1 remote", ([0, 1], [2])),
                (ValueError, "no page ids", ([], []))]:
            with pytest.raises(kind, match=text):
                call.run_pages(torch.tensor(lids, dtype=torch.int64), torch.tensor(rids, dtype=torch.int64))
        with pytest.raises(ValueError, match="1-d contiguous int64"):
            call.run_pages(torch.tensor([0], dtype=torch.int32), torch.tensor([1]))
        with pytest.raises(TypeError, match="1-d contiguous int64"):
            call.run_pages(torch.tensor([0]), [1])
        read = link.engine.prepare_read(local, [p2p.pages(h, theirs) for _, h in named])
        with pytest.raises(ValueError, match="destination page 1 is named twice"):
            read.run_pages(torch.tensor([1, 1]), torch.tensor([0, 2]))
        p2p.wait(read.run_pages(torch.tensor([7, 9]), torch.tensor(dst[:2])), timeout=60)
        for b, (name, _) in zip(bases, named):
            helpers.assert_same_bits(b[[7, 9]], link.fetch(name)[dst[:2]])
        crossed = link.engine.prepare_write(local, [p2p.pages(named[0][1], theirs), p2p.pages(named[1][1], mine)])
        assert not crossed.takes_pages
        with pytest.raises(ValueError, match="takes no other page ids"):
            crossed.run_pages(torch.tensor(src), torch.tensor(dst))
    finally:
        for r in regions:
            r.close()
        for name, _ in named:
            link.drop(name)


def test_views_match_pages(link):
    """The list of views and p2p.pages of the same ids move the same bytes."""
    def as_pages(L, R):
        if isinstance(R[0], p2p.RemoteTensor):
            return [p2p.pages(L[0], MINE)], [p2p.pages(R[0], THEIRS)]
        return _pages(L, R)  # torch's expectation

    for write in (True, False):
        _move(link, write, as_pages)


def _cases():
    half = COLS // 2
    return {
        # Local views of two storages, alternating, and in runs.
        "different bases": (lambda L, R: ([L[k % 2][i] for k, i in enumerate(MINE)], [R[0][j] for j in THEIRS]),
                             2, 1),
        "bases in runs": (lambda L, R: ([L[k // 8 % 2][i] for k, i in enumerate(MINE)], [R[0][j] for j in THEIRS]),
                          2, 1),
        # One shape, different strides: half rows, contiguous or every other element.
        "different strides": (lambda L, R: ([L[0][i, :half] if k % 3 else L[0][i, ::2] for k, i in enumerate(MINE)],
                                            [R[0][j, :half] for j in THEIRS]), 1, 1),
        # Sources that share elements: windows half a page apart.
        "overlapping sources": (lambda L, R: ([L[0].view(-1)[k * half:k * half + COLS] for k in range(24)],
                                              [R[0][j] for j in THEIRS]), 1, 1),
        # Offsets that are no multiple of a page, on both sides.
        "uneven offsets": (lambda L, R: ([L[0].view(-1)[i * COLS + i % 5:i * COLS + i % 5 + 20] for i in MINE],
                                         [R[0].view(-1)[j * COLS + 3 * (j % 4):j * COLS + 3 * (j % 4) + 20]
                                          for j in THEIRS]), 1, 1),
        # Views evenly spaced by an odd multiple of a power of two (96 and 48 elements).
        "odd spacing": (lambda L, R: ([L[0].view(-1)[96 * k:96 * k + 20] for k in _rows(16, 3, 21)],
                                      [R[0].view(-1)[48 * k:48 * k + 20] for k in _rows(16, 4, 42)]), 1, 1),
        # Remote views of two regions.
        "different regions": (lambda L, R: ([L[0][i] for i in MINE], [R[k % 2][j] for k, j in enumerate(THEIRS)]),
                              1, 2),
        # Pages of several rows, transposed pages, and empty views among pages.
        "multi-row pages": (lambda L, R: ([L[0][i // 4 * 4:i // 4 * 4 + 4] for i in MINE[:10]],
                                          [R[0][j // 4 * 4:j // 4 * 4 + 4] for j in dict.fromkeys(THEIRS[:10])]),
                            1, 1),
        "strided pages": (lambda L, R: ([L[0][i, ::4] for i in MINE], [R[0][j, 1::4] for j in THEIRS]), 1, 1),
        "empty views among pages": (lambda L, R: ([L[0][i, :0] if k == 5 else L[0][i] for k, i in enumerate(MINE)],
                                                  [R[0][j, :0] if k == 5 else R[0][j] for k, j in enumerate(THEIRS)]),
                                    1, 1),
        # One source page written to one place twice: separate views may do that (same bytes).
        "a destination twice": (lambda L, R: ([L[0][3], L[0][3], L[0][9]], [R[0][7], R[0][7], R[0][8]]), 1, 1),
        # Scalars: 0-d views.
        "scalars": (lambda L, R: ([L[0][i, 3] for i in MINE], [R[0][j, 5] for j in THEIRS]), 1, 1),
    }


@pytest.mark.parametrize("write", [True, False], ids=["write", "read"])
@pytest.mark.parametrize("case", list(_cases()))
def test_views_that_look_like_pages_but_are_not(link, case, write):
    pairs, locals_, remotes = _cases()[case]
    if case == "multi-row pages":
        pairs = _distinct_multirow
    if case == "a destination twice" and not write:
        # Read into one local page twice: the same bytes either way.
        pairs = lambda L, R: ([L[0][7], L[0][7], L[0][8]], [R[0][3], R[0][3], R[0][9]])  # noqa: E731
    _move(link, write, pairs, locals_, remotes)


def _distinct_multirow(L, R):
    """Blocks of 4 rows; distinct destination blocks (sources may repeat)."""
    mine = [i // 4 for i in MINE[:12]]
    theirs = list(dict.fromkeys(j // 4 for j in THEIRS))[:len(mine)]
    mine = mine[:len(theirs)]
    return [L[0][4 * i:4 * i + 4] for i in mine], [R[0][4 * j:4 * j + 4] for j in theirs]


# -- refusals: the message names the view at fault ----------------------------------------------

@contextlib.contextmanager
def registered_source(link, access="rw"):
    """A registered random [ROWS, COLS] source and a remote target of that shape."""
    _, remote = link.remote((ROWS, COLS), access=access)
    src = helpers.random_tensor((ROWS, COLS), torch.float32, 1)
    with link.engine.register(src):
        yield src, remote


def test_dtype_mismatch_names_the_view(link):
    with registered_source(link) as (src, remote):
        ints = src.view(torch.int32)
        views = [src[i] if k != 5 else ints[i] for k, i in enumerate(MINE)]
        with pytest.raises(ValueError, match="^source view 5 is Int but its RemoteTensor is Float$"):
            link.engine.write_slices(views, [remote[j] for j in THEIRS])
        with pytest.raises(ValueError, match="^source view 0 is Int but its RemoteTensor is Float$"):
            link.engine.write_slices([ints[i] for i in MINE], [remote[j] for j in THEIRS])
        with pytest.raises(ValueError, match="^destination view 0 is Int but its RemoteTensor is Float$"):
            link.engine.read_slices([ints[i] for i in MINE], [remote[j] for j in THEIRS])


def test_shape_mismatch_names_the_view(link):
    with registered_source(link) as (src, remote):
        with pytest.raises(ValueError, match=r"^source view 0 has shape \[32\] but its RemoteTensor has shape \[16\]$"):
            link.engine.write_slices([src[i] for i in MINE], [remote[j, :16] for j in THEIRS])
        with pytest.raises(ValueError, match=r"^source view 7 has shape \[16\] but its RemoteTensor has shape \[32\]$"):
            link.engine.write_slices([src[i, :16] if k == 7 else src[i] for k, i in enumerate(MINE)],
                                     [remote[j] for j in THEIRS])


def test_unregistered_view_among_pages_names_it(link):
    _, remote = link.remote((ROWS, COLS))
    src = helpers.random_tensor((ROWS, COLS), torch.float32, 1)
    loose = helpers.random_tensor((ROWS, COLS), torch.float32, 2)
    with link.engine.register(src):
        views = [loose[i] if k == 9 else src[i] for k, i in enumerate(MINE)]
        with pytest.raises(ValueError, match="^source view 9 is not inside a tensor registered with this engine"):
            link.engine.write_slices(views, [remote[j] for j in THEIRS])
        with pytest.raises(ValueError, match="^source view 0 is not inside a tensor registered"):
            link.engine.write_slices([loose[i] for i in MINE], [remote[j] for j in THEIRS])


def test_overlapping_destination_elements_refused(link):
    _, expanded = link.expanded(ROWS, COLS)  # every row is one row of storage
    src = helpers.random_tensor((ROWS, COLS), torch.float32, 1)
    with link.engine.register(src):
        with pytest.raises(ValueError, match="^source view 0: the destination has overlapping elements"):
            link.engine.write_slices([src[i:i + 2] for i in range(4)], [expanded[j:j + 2] for j in range(4)])


def test_access_refused_for_pages_of_views(link):
    with registered_source(link, access="r") as (src, remote):
        with pytest.raises(ValueError, match="does not accept remote writes"):
            link.engine.write_slices([src[i] for i in MINE], [remote[j] for j in THEIRS])


def test_bad_items_raise_as_before(link):
    with registered_source(link) as (src, remote):
        with pytest.raises(TypeError, match="^local view 3 is a int, not a tensor$"):
            link.engine.write_slices([src[0], src[1], src[2], 7], [remote[j] for j in range(4)])
        with pytest.raises(TypeError, match="^remote 2 is a Tensor, not a RemoteTensor$"):
            link.engine.write_slices([src[i] for i in range(4)], [remote[0], remote[1], src[2], remote[3]])
        with pytest.raises(ValueError, match="expected one RemoteTensor per local view"):
            link.engine.write_slices([src[i] for i in range(4)], [remote[j] for j in range(3)])


# -- RemoteTensor.view ------------------------------------------------------------------------------

@pytest.mark.parametrize("shape", [(-1,), (8, -1), (2, 4, 2, 64), ((4, 256),), (torch.Size([1024]),)], ids=repr)
def test_remote_view_reshapes_as_torch(link, shape):
    t = torch.zeros(16, 64)
    with link.engine.register(t) as region:
        for handle, view in [(region.remote, t), (region.remote[4:8], t[4:8]), (region.remote[:, 32:], t[:, 32:])]:
            try:
                want = view.view(*shape)
            except RuntimeError:
                with pytest.raises(ValueError):
                    handle.view(*shape)
                continue
            got = handle.view(*shape)
            assert (tuple(got.shape), got.stride(), got.storage_offset()) == \
                   (tuple(want.shape), want.stride(), want.storage_offset())


def test_remote_view_refusals(link):
    with link.engine.register(torch.zeros(16, 64)) as region:
        with pytest.raises(ValueError, match="invalid"):
            region.remote.view(7, -1)
        with pytest.raises(ValueError, match="only one dimension can be inferred"):
            region.remote.view(-1, -1)
        with pytest.raises(ValueError, match="not compatible"):
            region.remote[:, :32].view(-1)
        with pytest.raises(TypeError, match="takes a shape"):
            region.remote.view(torch.float16)


def test_pages_entries_among_views(link):
    """A p2p.pages entry in a list of views: pages, then views (grouped), then a view alone."""
    name, remote = link.remote((ROWS, COLS))
    src = helpers.random_tensor((ROWS, COLS), torch.float32, 3)
    with link.engine.register(src):
        local = [p2p.pages(src, MINE[:8])] + [src[i] for i in MINE[8:20]] + [src[MINE[20], :7]]
        remotes = [p2p.pages(remote, THEIRS[:8])] + [remote[j] for j in THEIRS[8:20]] + [remote[THEIRS[20], 3:10]]
        p2p.wait(link.engine.write_slices(local, remotes), timeout=60)
    expected = helpers.poisoned((ROWS, COLS), torch.float32)
    for i, j in zip(MINE[:20], THEIRS[:20]):
        helpers.bits(expected[j]).copy_(helpers.bits(src[i]))
    helpers.bits(expected[THEIRS[20], 3:10]).copy_(helpers.bits(src[MINE[20], :7]))
    helpers.assert_same_bits(link.fetch(name), expected)
    link.drop(name)
