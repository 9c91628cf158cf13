"""Pages (p2p.pages) on every provider and data path (the `link` fixture): random block tables
on both sides, strided views and other dims, bad pages refused before anything moves, page ids
of a huge tensor checked without a huge table, prepared calls run again and again. The IPC
route's pages: tests/test_ipc.py."""
import pytest
import torch

import helpers
import torch_p2p as p2p
from torch_p2p import _C


def test_random_pages_both_sides(link):
    """Random block tables on both sides, write and read; pages not named keep their poison."""
    pages, page = 64, (4, 33)  # odd sizes: runs that are no multiple of 16 bytes
    name, remote = link.remote((pages, *page))
    src = helpers.random_tensor((pages, *page), torch.float32, 1)
    link.engine.register(src)
    g = torch.Generator().manual_seed(2)

    def table(run: range) -> torch.Tensor:  # 40 distinct ids, with `run` at positions 5 to 8
        rest = [i for i in torch.randperm(pages, generator=g).tolist() if i not in run]
        return torch.tensor(rest[:5] + list(run) + rest[5:36])

    sids, dids = table(range(3, 7)), table(range(20, 24))  # the runs merge on both sides
    p2p.wait(link.engine.write_slices(p2p.pages(src, sids), p2p.pages(remote, dids)), 60)
    expected = helpers.poisoned((pages, *page), torch.float32)
    expected[dids] = src[sids]
    helpers.assert_same_bits(link.fetch(name), expected)

    back = helpers.poisoned((pages, *page), torch.float32)
    link.engine.register(back)
    p2p.wait(link.engine.read_slices([p2p.pages(back, sids)], [p2p.pages(remote, dids)]), 60)
    want = helpers.poisoned((pages, *page), torch.float32)
    want[sids] = src[sids]
    helpers.assert_same_bits(back, want)


def test_pages_of_strided_views_and_other_dims(link):
    """Pages along dim 1 of a [2, blocks, block] K/V layout, of a strided view; mixed with a
    plain view in one call."""
    name, remote = link.remote((2, 16, 8, 6))
    src = helpers.random_tensor((2, 16, 8, 12), torch.float32, 3)[..., ::2]  # non-contiguous pages
    link.engine.register(src)
    ids_s, ids_d = [7, 1, 12], [0, 15, 4]
    extra = helpers.random_tensor((6,), torch.float32, 4)
    link.engine.register(extra)
    p2p.wait(link.engine.write_slices([p2p.pages(src, ids_s, dim=1), extra], [p2p.pages(remote, ids_d, dim=1),
                                                                               remote[1, 2, 3]]), 60)
    expected = helpers.poisoned((2, 16, 8, 6), torch.float32)
    expected[:, ids_d] = src[:, ids_s]
    expected[1, 2, 3] = extra
    helpers.assert_same_bits(link.fetch(name), expected)


def test_bad_pages_raise_before_anything_moves(link):
    name, remote = link.remote((8, 16))
    src = helpers.random_tensor((8, 16), torch.float32, 5)
    link.engine.register(src)
    e = link.engine
    cases = [
        (IndexError, "local page 8 of 8", lambda: e.write_slices(p2p.pages(src, [0, 8]), p2p.pages(remote, [0, 1]))),
        (IndexError, "remote page -1", lambda: e.write_slices(p2p.pages(src, [0]), p2p.pages(remote, [-1]))),
        (ValueError, "named twice", lambda: e.write_slices(p2p.pages(src, [0, 1]), p2p.pages(remote, [3, 3]))),
        # The same ids again in a smaller tensor: a repeated entry is checked against its own bounds.
        (IndexError, "source view 1: page 1 pairs local page 1 of 8 with remote page 4 of 4",
         lambda: e.write_slices([p2p.pages(src, [0, 1]), p2p.pages(src, [0, 1])],
                                [p2p.pages(remote, [3, 4]), p2p.pages(remote[:4], [3, 4])])),
        (ValueError, "has 2 pages but its RemoteTensor has 1",
         lambda: e.write_slices(p2p.pages(src, [0, 1]), p2p.pages(remote, [3]))),
        (ValueError, "pages pair with pages", lambda: e.write_slices(p2p.pages(src, [0]), [remote[0]])),
        (ValueError, "pages pair with pages", lambda: e.write_slices(p2p.pages(src, [0]), remote)),
        (ValueError, "a page has shape", lambda: e.write_slices(p2p.pages(src, [0]), p2p.pages(remote[:, :8], [0]))),
        (ValueError, "one-dimensional", lambda: p2p.pages(src, [[0, 1]])),
        (IndexError, "out of range", lambda: p2p.pages(src, [0], dim=2)),
        (TypeError, r"pages\(\) takes a tensor", lambda: p2p.pages([1, 2], [0])),
    ]
    for kind, text, call in cases:
        with pytest.raises(kind, match=text):
            call()
    # A read may name a source page twice (it is the destination that must not repeat).
    back = torch.zeros(2, 16)
    e.register(back)
    p2p.wait(e.read_slices(p2p.pages(back, [0, 1]), p2p.pages(remote, [2, 2])), 60)
    assert (link.fetch(name) == link.fetch(name)[0, 0]).all()  # untouched by the bad calls
    helpers.assert_same_bits(back, torch.stack([link.fetch(name)[2]] * 2))


def test_page_ids_of_a_huge_tensor_are_checked_without_a_huge_table(link):
    """A few pages of a tensor of millions: repeated destinations are found by sorting (no
    table of a byte per page), the same way for the engine and for KV block tables."""
    count = 3 << 20
    name, remote = link.remote((count,), torch.uint8)
    src = torch.arange(1, 5, dtype=torch.uint8)
    link.engine.register(src)
    with pytest.raises(ValueError, match="destination page 5 is named twice"):
        link.engine.write_slices(p2p.pages(src, [0, 1, 2]), p2p.pages(remote, [5, 2 << 20, 5]))
    p2p.wait(link.engine.write_slices(p2p.pages(src, [0, 1, 2]), p2p.pages(remote, [5, 2 << 20, 7])), 60)
    got = link.fetch(name)
    assert got[[5, 2 << 20, 7]].tolist() == [1, 2, 3]
    assert int((got != helpers.POISON).sum()) == 3
    assert _C.checked_ids([5, 2 << 20, 5], count, True) is None
    assert _C.checked_ids([5, 2 << 20, 5], count, False).tolist() == [5, 2 << 20, 5]
    assert _C.checked_ids((5, 2 << 20, 7), count, True).tolist() == [5, 2 << 20, 7]
    assert _C.checked_ids([1, 1], 8, True) is None  # the table's way
    assert _C.checked_ids([0, count], count, False) is None


def test_prepared_calls_run_again_and_again(link):
    """prepare_write / prepare_read check and decompose a call once. Each run moves what the
    views hold at that moment (many may be in flight), ids changed after prepare change
    nothing, bad calls fail at prepare as the call itself would, and a run after a local region
    of it was deregistered fails with ClosedError."""
    pages, page = 32, (4, 9)
    name, remote = link.remote((pages, *page))
    src = helpers.random_tensor((pages, *page), torch.float32, 1)
    region = link.engine.register(src)
    e, g = link.engine, torch.Generator().manual_seed(4)
    sids, dids = torch.randperm(pages, generator=g)[:12], torch.randperm(pages, generator=g)[:12]
    free = next(i for i in range(pages) if i not in dids.tolist())  # a plain view's destination row
    call = e.prepare_write([p2p.pages(src, sids), src[0, 1]], [p2p.pages(remote, dids), remote[free, 2]])
    kept = sids.clone()
    sids.zero_()  # the ids were copied at prepare
    for seed in (2, 3):
        src.copy_(helpers.random_tensor(src.shape, torch.float32, seed))
        for fut in [call.run() for _ in range(20)]:
            p2p.wait(fut, 60)
        expected = helpers.poisoned((pages, *page), torch.float32)
        expected[dids] = src[kept]
        expected[free, 2] = src[0, 1]
        helpers.assert_same_bits(link.fetch(name), expected)

    back = helpers.poisoned((pages, *page), torch.float32)
    link.engine.register(back)
    read = e.prepare_read(p2p.pages(back, kept), p2p.pages(remote, dids))
    p2p.wait(read.run(), 60)
    want = helpers.poisoned((pages, *page), torch.float32)
    want[kept] = src[kept]
    helpers.assert_same_bits(back, want)

    with pytest.raises(IndexError, match="local page 99 of 32"):
        e.prepare_write(p2p.pages(src, [99]), p2p.pages(remote, [0]))
    with pytest.raises(ValueError, match="notify must be a 32-bit"):
        e.prepare_write(src, remote, notify=-3)
    region.close()
    with pytest.raises(p2p.ClosedError, match="of this prepared call is deregistered"):
        call.run()
    p2p.wait(read.run(), 60)  # its regions are still there
