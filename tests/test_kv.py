"""KV-cache migration (torch_p2p.kv) between two processes, on tcp and shm. Errors:
tests/test_kv_errors.py; GPUs: tests/test_kv_cuda.py.

Every case fills the source caches with seeded random bits and every byte of the destination
caches with poison (helpers.POISON). After a push or pull the whole destination tensors must
equal, bit for bit, what torch computes for the same blocks: the named blocks of the named
layers (and heads) hold the source's bits, every other byte keeps the poison.
"""
from __future__ import annotations

import dataclasses

import pytest

from kv_caches import (Spec, assert_tensors, build, caches, expected, flat, make_cache, pair,  # noqa: F401 - fixtures
                       peer_expect, peer_expect_done, peer_outcome, run_example, table, wait)

pytestmark = pytest.mark.timeout(240)


pytestmark = pytest.mark.timeout(240)


LAYOUT_CASES = {
    "flash_attn": Spec("flash_attn"),
    "flashinfer": Spec("flashinfer"),
    "mla": Spec("mla", dim=36),
    "sglang": Spec("sglang"),
    "stacked": Spec("flash_attn", stacked=True),
}


@pytest.mark.parametrize("case", sorted(LAYOUT_CASES))
def test_push_and_pull_every_layout(caches, case):
    """Random block tables of different sizes on both sides; the push notifies the receiver,
    the pull tells the owner it may free its blocks."""
    src = LAYOUT_CASES[case]
    dst = dataclasses.replace(src, blocks=20)
    s_ids, d_ids = table(src.blocks, 9, 1, 3), table(dst.blocks, 9, 2, 11)
    _, mine = caches.local(src, seed=1)
    name, theirs = caches.remote(dst)
    caches.link.peer.call(peer_expect, name, 7)
    wait(mine.push(theirs, s_ids, d_ids, notify=7))
    assert caches.link.peer.call(peer_outcome, name) == "ok"
    assert_tensors(caches.tensors(name), expected(dst, src, 1, [(s_ids, d_ids, range(src.layers))]))

    back_layers, back = caches.local(src)
    name2, owner = caches.remote(dst, seed=2)
    caches.link.peer.call(peer_expect, name2, 8)
    wait(back.pull(owner, d_ids, s_ids, notify=8))
    assert caches.link.peer.call(peer_outcome, name2) == "ok"
    assert_tensors(flat(back_layers), expected(src, dst, 2, [(d_ids, s_ids, range(src.layers))]))


def test_different_layouts_on_each_side(caches):
    """K pairs with K and V with V whatever the layouts: vLLM's FlashAttention into SGLang's
    pool and FlashInfer's, a heads-before-tokens layout (local axes permuted) both ways."""
    fa = Spec("flash_attn")
    s_ids, d_ids = table(12, 7, 3, 0), table(12, 7, 4, 6)
    _, mine = caches.local(fa, seed=3)
    for other in (Spec("sglang"), Spec("flashinfer", stacked=True), Spec("blocks heads tokens dim")):
        name, theirs = caches.remote(other)
        wait(mine.push(theirs, s_ids, d_ids))
        assert_tensors(caches.tensors(name), expected(other, fa, 3, [(s_ids, d_ids, range(3))]))
    odd = Spec("blocks heads tokens dim")
    _, mine = caches.local(odd, seed=4)
    name, theirs = caches.remote(fa)
    wait(mine.push(theirs, s_ids, d_ids))
    assert_tensors(caches.tensors(name), expected(fa, odd, 4, [(s_ids, d_ids, range(3))]))
    back_layers, back = caches.local(odd)
    _, owner = caches.remote(Spec("sglang"), seed=5)
    wait(back.pull(owner, s_ids, d_ids))
    assert_tensors(flat(back_layers), expected(odd, Spec("sglang"), 5, [(s_ids, d_ids, range(3))]))


def test_layer_subsets(caches):
    spec = Spec("flash_attn", layers=4)
    _, mine = caches.local(spec, seed=6)
    name, theirs = caches.remote(spec)
    wait(mine.push(theirs, [0, 5], [9, 1], layers=[3, 1]))
    wait(mine.push(theirs, [2], [2], layers=0))
    moves = [([0, 5], [9, 1], [3, 1]), ([2], [2], [0])]
    assert_tensors(caches.tensors(name), expected(spec, spec, 6, moves))
    back_layers, back = caches.local(spec)
    _, owner = caches.remote(spec, seed=7)
    wait(back.pull(owner, [4, 5, 6], [0, 1, 2], layers=range(2, 4)))
    assert_tensors(flat(back_layers), expected(spec, spec, 7, [([4, 5, 6], [0, 1, 2], [2, 3])]))


@pytest.mark.parametrize("case", ["flash_attn", "mla", "sglang", "stacked"])
def test_later_requests_move_their_own_blocks(caches, case):
    """The first request to a peer (per direction and layers) is prepared; later ones run it on
    their own block ids: each moves exactly its blocks, whatever its size, with its own tag."""
    spec = LAYOUT_CASES[case]
    _, mine = caches.local(spec, seed=15)
    name, theirs = caches.remote(spec)
    moves = []
    for k, (n, layers) in enumerate([(9, None), (6, None), (12, None), (7, [2, 0]), (8, [2, 0])]):
        s_ids, d_ids = table(spec.blocks, n, 30 + k, k), table(spec.blocks, n, 40 + k, 8 - k)
        caches.link.peer.call(peer_expect, name, 20 + k)
        wait(mine.push(theirs, s_ids, d_ids, layers=layers, notify=20 + k))
        assert caches.link.peer.call(peer_outcome, name) == "ok"
        moves.append((s_ids, d_ids, range(spec.layers) if layers is None else layers))
        assert_tensors(caches.tensors(name), expected(spec, spec, 15, moves))
    back_layers, back = caches.local(spec)
    _, owner = caches.remote(spec, seed=16)
    moves = []
    for k, n in enumerate((10, 6, 11)):
        s_ids, d_ids = table(spec.blocks, n, 50 + k, k), table(spec.blocks, n, 60 + k, 7 - k)
        wait(back.pull(owner, s_ids, d_ids))
        moves.append((s_ids, d_ids, range(spec.layers)))
        assert_tensors(flat(back_layers), expected(spec, spec, 16, moves))


def test_head_slicing_between_tensor_parallel_degrees(caches):
    """A sender with 4 KV heads feeds two receivers of 2 heads each (first heads 0 and 2); a
    receiver of 2 heads pulls its half from 4; a sender of 2 heads writes its half into 4."""
    full = Spec("flash_attn", heads=4)
    halves = [Spec("flash_attn", heads=2, first_head=h) for h in (0, 2)]
    s_ids, d_ids = [1, 2, 3, 8], [4, 0, 7, 6]
    _, mine = caches.local(full, seed=8)
    for half in halves:
        name, theirs = caches.remote(half)
        wait(mine.push(theirs, s_ids, d_ids))
        assert_tensors(caches.tensors(name), expected(half, full, 8, [(s_ids, d_ids, range(3))]))
    back_layers, back = caches.local(halves[1])
    _, owner = caches.remote(full, seed=9)
    wait(back.pull(owner, s_ids, d_ids))
    assert_tensors(flat(back_layers), expected(halves[1], full, 9, [(s_ids, d_ids, range(3))]))
    _, part = caches.local(Spec("sglang", heads=2, first_head=2), seed=10)
    name, theirs = caches.remote(Spec("flashinfer", heads=4))
    wait(part.push(theirs, s_ids, d_ids))
    assert_tensors(caches.tensors(name), expected(Spec("flashinfer", heads=4), Spec("sglang", heads=2, first_head=2),
                                                  10, [(s_ids, d_ids, range(3))]))


def test_streamed_push_notifies_after_all_layers(caches):
    """One push per layer with one tag: the receiver's notification(tag, layers) completes
    after the last layer, not before."""
    spec = Spec("flash_attn", layers=4)
    _, mine = caches.local(spec, seed=11)
    name, theirs = caches.remote(spec)
    peer = caches.link.peer
    peer.call(peer_expect, name, 21, spec.layers)
    stream = mine.stream(theirs, [0, 1, 2, 3, 9], [5, 6, 7, 8, 2], notify=21)
    for layer in (2, 0, 3):
        wait(stream.push(layer))  # done once the peer has counted its notification
    assert not peer.call(peer_expect_done, name), "notified before the last layer"
    with pytest.raises(ValueError, match=r"layers \[0\] were pushed already"):
        stream.push([1, 0])
    stream.push(1)
    wait(stream.future())
    assert stream.calls == 4
    assert peer.call(peer_outcome, name) == "ok"
    assert_tensors(caches.tensors(name), expected(spec, spec, 11, [([0, 1, 2, 3, 9], [5, 6, 7, 8, 2], range(4))]))


def test_notification_times_out_when_the_sender_stops(caches):
    spec = Spec("mla", dim=16)
    _, mine = caches.local(spec, seed=12)
    name, theirs = caches.remote(spec)
    caches.link.peer.call(peer_expect, name, 31, 2, 1.0)
    wait(mine.push(theirs, [1], [1], notify=31))
    assert caches.link.peer.call(peer_outcome, name) == "TimeoutError"


def test_empty_requests_still_notify(caches):
    spec = Spec("flashinfer")
    _, mine = caches.local(spec, seed=13)
    name, theirs = caches.remote(spec)
    caches.link.peer.call(peer_expect, name, 41, 2)
    wait(mine.push(theirs, [], [], notify=41))
    wait(mine.pull(theirs, [1], [1], layers=[], notify=41))
    assert caches.link.peer.call(peer_outcome, name) == "ok"
    assert_tensors(caches.tensors(name), [t.cpu() for t in flat(build(spec, None))])


@pytest.mark.timeout(180)
def test_example_on_a_real_transformer():
    pytest.importorskip("transformers")
    out = run_example("--provider", "tcp")
    assert "push: tokens match" in out and "pull: tokens match" in out, out
