"""KV-cache migration (torch_p2p.kv) between two processes, on tcp and shm, and on GPUs.

Every case fills the source caches with seeded random bits and every byte of the destination
caches with poison (helpers.POISON). After a push or pull the whole destination tensors must
equal, bit for bit, what torch computes for the same blocks: the named blocks of the named
layers (and heads) hold the source's bits, every other byte keeps the poison.
"""
from __future__ import annotations

import dataclasses
import os
import pickle
import signal
import subprocess
import sys
import time

import pytest
import torch

import helpers
import peer_helpers as ph
import torch_p2p as p2p
from conftest import PEER_GPU, ROOT, ROUTES, engine_kwargs
from peer import Peer
from torch_p2p import kv

pytestmark = pytest.mark.timeout(240)


# -- caches as serving systems hold them (both processes build them alike) ----------------------

@dataclasses.dataclass(frozen=True)
class Spec:
    layout: str  # a key of kv.LAYOUTS or an axes string
    layers: int = 3
    blocks: int = 12
    block: int = 4  # tokens per block
    heads: int = 4
    dim: int = 8
    first_head: int | None = None
    stacked: bool = False  # one tensor with a leading layers axis
    dtype: torch.dtype = torch.bfloat16
    device: str = "cpu"

    @property
    def shape(self) -> tuple:
        b, t, h, d = self.blocks, self.block, self.heads, self.dim
        return {"flash_attn": (2, b, t, h, d), "flashinfer": (b, 2, t, h, d), "mla": (b, t, d),
                "sglang": (b * t + t + 3, h, d),  # a padding page and a partial one, as SGLang's pool
                "blocks heads tokens dim": (b, h, t, d)}[self.layout]

    @property
    def paired(self) -> bool:  # a (K, V) pair of tensors per layer
        return self.layout in ("sglang", "blocks heads tokens dim")


def build(spec: Spec, seed: int | None):
    """The `layers` argument of KVCache: seeded random bits, or poison when seed is None."""
    def make(shape, i):
        if seed is None:
            return helpers.poisoned(shape, spec.dtype).to(spec.device)
        return helpers.random_tensor(shape, spec.dtype, seed * 1000 + i).to(spec.device)

    if spec.stacked:
        return make((spec.layers, *spec.shape), 0)
    if spec.paired:
        return [(make(spec.shape, 2 * i), make(spec.shape, 2 * i + 1)) for i in range(spec.layers)]
    return [make(spec.shape, i) for i in range(spec.layers)]


def flat(layers) -> list:
    """Every tensor of a `layers` argument: what the comparisons cover."""
    if isinstance(layers, torch.Tensor):
        return [layers]
    return [t for layer in layers for t in (layer if isinstance(layer, tuple) else (layer,))]


def canon(spec: Spec, layers) -> list[dict]:
    """Per layer, views [blocks, tokens, heads, dim] of K and V (or [blocks, tokens, dim] of the
    latent) into the tensors of `layers`."""
    per_layer = list(layers.unbind(0)) if spec.stacked else list(layers)
    out = []
    for x in per_layer:
        if spec.layout == "flash_attn":
            out.append({"k": x[0], "v": x[1]})
        elif spec.layout == "flashinfer":
            out.append({"k": x[:, 0], "v": x[:, 1]})
        elif spec.layout == "mla":
            out.append({"latent": x})
        elif spec.layout == "sglang":
            n = spec.blocks * spec.block
            out.append({name: t[:n].view(spec.blocks, spec.block, spec.heads, spec.dim) for name, t in zip("kv", x)})
        else:
            out.append({name: t.transpose(1, 2) for name, t in zip("kv", x)})
    return out


def make_cache(engine, spec: Spec, seed: int | None):
    layers = build(spec, seed)
    cache = kv.KVCache(engine, layers, spec.layout, block_size=spec.block if spec.layout == "sglang" else None,
                       first_head=spec.first_head)
    return layers, cache


def expected(dst: Spec, src: Spec, src_seed: int, moves: list) -> list:
    """The destination's tensors after `moves`: (source ids, destination ids, layers) each, into
    a destination that started poisoned."""
    out, source = build(dst, None), build(src, src_seed)
    d_views, s_views = canon(dst, out), canon(src, source)
    for s_ids, d_ids, layers in moves:
        for layer in layers:
            for name, d in d_views[layer].items():
                s = s_views[layer][name]
                if "heads" in kv.LAYOUTS.get(dst.layout, dst.layout):
                    (a, b), (c, e) = _heads(dst), _heads(src)
                    lo, hi = max(a, c), min(b, e)
                    d, s = d[:, :, lo - a:hi - a], s[:, :, lo - c:hi - c]
                d[torch.tensor(d_ids)] = s[torch.tensor(s_ids)].to(d.device)
    return [t.cpu() for t in flat(out)]


def _heads(spec: Spec) -> tuple:
    start = spec.first_head or 0
    return start, start + spec.heads


def assert_tensors(got: list, want: list) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        helpers.assert_same_bits(g.cpu(), w)


def table(blocks: int, n: int, seed: int, run_at: int) -> list[int]:
    """n distinct block ids out of `blocks` in a random order, with a run of 4 consecutive ids
    (from run_at) at positions 2 to 5: the engine merges such runs."""
    run = list(range(run_at, run_at + 4))
    rest = [i for i in torch.randperm(blocks, generator=torch.Generator().manual_seed(seed)).tolist() if i not in run]
    return rest[:2] + run + rest[2:n - 4]


# -- the peer's side (functions run in the child: each takes `state` first) ----------------------

def peer_cache(state, engine: str, name: str, spec: Spec, seed: int | None = None) -> bytes:
    state[name] = make_cache(state[engine], spec, seed)
    return state[name][1].handle.to_bytes()


def peer_tensors(state, name: str) -> list:
    return [t.cpu().clone() for t in flat(state[name][0])]


def peer_close(state, name: str) -> None:
    state.pop(name)[1].close()


def peer_expect(state, name: str, tag: int, count: int = 1, timeout: float | None = None) -> None:
    state[name + ".expect"] = state[name][1].notification(tag, count, timeout=timeout)


def peer_expect_done(state, name: str) -> bool:
    return state[name + ".expect"].done()


def peer_outcome(state, name: str, timeout: float = 30) -> str:
    try:
        p2p.wait(state.pop(name + ".expect"), timeout)
        return "ok"
    except Exception as e:  # noqa: BLE001 - the kind is the answer
        return type(e).__name__


# -- fixtures ------------------------------------------------------------------------------------

@pytest.fixture(scope="module", params=["tcp", "shm"])
def pair(request, peer):
    """An engine here and one in the module's peer child, for each provider."""
    link = helpers.Link(peer, request.param)
    yield link
    link.close()


class Caches:
    """Caches made in a test, here and in the peer, closed at its end."""

    def __init__(self, link):
        self.link, self.here, self.there = link, [], []

    def local(self, spec: Spec, seed: int | None = None):
        layers, cache = make_cache(self.link.engine, spec, seed)
        self.here.append(cache)
        return layers, cache

    def remote(self, spec: Spec, seed: int | None = None) -> tuple[str, kv.KVCacheHandle]:
        name = f"kv{len(self.there)}"
        blob = self.link.peer.call(peer_cache, self.link.key, name, spec, seed)
        self.there.append(name)
        handle = kv.KVCacheHandle.from_bytes(blob)
        # The path the bytes of every case here take: the provider's, not a fallback.
        assert self.link.engine.route(handle.mailbox) == ROUTES[self.link.provider]
        return name, handle

    def tensors(self, name: str) -> list:
        return self.link.peer.call(peer_tensors, name)

    def close(self):
        for cache in self.here:
            cache.close()
        for name in self.there:
            self.link.peer.call(peer_close, name)


@pytest.fixture
def caches(pair):
    c = Caches(pair)
    yield c
    c.close()


def wait(fut, timeout: float = 60):
    return p2p.wait(fut, timeout)


# -- moving blocks ---------------------------------------------------------------------------------

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


# -- errors ----------------------------------------------------------------------------------------

def test_bad_inputs_raise_and_write_nothing(caches):
    spec = Spec("flash_attn")
    layers, mine = caches.local(spec, seed=14)
    name, theirs = caches.remote(spec)
    e = caches.link.engine

    def other(**changes):
        return make_cache(e, dataclasses.replace(spec, **changes), None)[1]

    mismatched = {"dtype": other(dtype=torch.float16), "block size": other(block=8), "head dim": other(dim=16),
                  "layer count": other(layers=2), "share no KV heads": other(heads=2, first_head=4),
                  "holds K and V, the peer's one latent per token": other(layout="mla")}
    cases = [
        (IndexError, "source block 12 is out of range for a cache of 12", lambda: mine.push(theirs, [0, 12], [0, 1])),
        (IndexError, "destination block -1", lambda: mine.push(theirs, [0], [-1])),
        (IndexError, "source block 99", lambda: mine.pull(theirs, [99], [0])),
        (ValueError, "destination block 3 is named twice", lambda: mine.push(theirs, [0, 1], [3, 3])),
        (ValueError, "destination block 2 is named twice", lambda: mine.pull(theirs, [0, 1], [2, 2])),
        (ValueError, "2 source blocks but 1 destination", lambda: mine.push(theirs, [0, 1], [3])),
        (TypeError, "must be integers", lambda: mine.push(theirs, [0.5], [1])),
        (ValueError, "one-dimensional", lambda: mine.push(theirs, [[0]], [[1]])),
        (IndexError, "layer 3 is out of range", lambda: mine.push(theirs, [0], [1], layers=[3])),
        (ValueError, "named twice", lambda: mine.push(theirs, [0], [1], layers=[1, 1])),
        (TypeError, "KVCacheHandle", lambda: mine.push(b"handle", [0], [1])),
        (ValueError, "notify", lambda: mine.push(theirs, [0], [1], notify=-1)),
    ] + [(ValueError, text, lambda c=c: mine.push(c.handle, [0], [0])) for text, c in mismatched.items()]
    for kind, text, call in cases:
        with pytest.raises(kind, match=text):
            call()
    # The peer's cache is untouched, and a good push still works afterwards.
    assert_tensors(caches.tensors(name), [t.cpu() for t in flat(build(spec, None))])
    wait(mine.push(theirs, [4], [5]))
    assert_tensors(caches.tensors(name), expected(spec, spec, 14, [([4], [5], range(3))]))
    for cache in mismatched.values():
        cache.close()


def test_bad_caches_and_handles_raise(caches):
    e = caches.link.engine
    with pytest.raises(ValueError, match="unknown axis 'rows'"):
        kv.KVCache(e, [torch.zeros(2, 4, 4, 2, 8)], "kv rows tokens heads dim")
    with pytest.raises(ValueError, match="token-granular: give block_size"):
        kv.KVCache(e, [(torch.zeros(64, 2, 8), torch.zeros(64, 2, 8))], "sglang")
    with pytest.raises(ValueError, match="expected a tensor of 5 dimensions"):
        kv.KVCache(e, [torch.zeros(4, 4, 2, 8)], "flash_attn")
    with pytest.raises(ValueError, match="layer 1 .* is .*every store must be alike"):
        kv.KVCache(e, [torch.zeros(2, 4, 4, 2, 8), torch.zeros(2, 5, 4, 2, 8)], "flash_attn")
    with pytest.raises(ValueError, match="no heads axis"):
        kv.KVCache(e, [torch.zeros(4, 4, 16)], "mla", first_head=1)
    buf = torch.zeros(100, 2, 8)
    with pytest.raises(ValueError, match="not one of evenly spaced views"):
        kv.KVCache(e, [(buf[0:20], buf[20:40]), (buf[45:65], buf[70:90])], "sglang", block_size=4)
    good = kv.KVCache(e, [torch.zeros(4, 4, 16)], "mla")
    blob = good.handle.to_bytes()
    for bad in (b"", b"P2PKV", b"P2PKV\x02{}", blob[:-9], blob.replace(b'"refs":[[', b'"refs":[[["latent",5,-1],'),
                blob.replace(b'"latent"', b'"bogus"')):
        with pytest.raises(ValueError):
            kv.KVCacheHandle.from_bytes(bad)
    again = pickle.loads(pickle.dumps(good.handle))
    assert (again.num_layers, again.num_blocks, again.block_size, again.head_dim, again.dtype, again.heads) == \
        (1, 4, 4, 16, torch.float32, None)
    assert again.to_bytes() == blob
    good.close()


@pytest.mark.timeout(120)
def test_peer_killed_mid_migration():
    """The receiver is killed with pushes in flight (stopped first, so they surely are): they
    fail with PeerError, none hangs, and the engine keeps serving another peer. tcp only: on
    libfabric 1.17's shm a peer killed mid-transfer wedges the endpoint (see test_failures)."""
    spec = Spec("flash_attn", layers=4, blocks=64, block=16, heads=8, dim=128)  # 4 MiB per layer
    with p2p.Engine("cpu", **engine_kwargs("tcp", peer_timeout=2)) as e, Peer() as victim, Peer() as other:
        for child in (victim, other):
            child.call(helpers.start_engine, "tcp", peer_timeout=2)
        theirs = kv.KVCacheHandle.from_bytes(victim.call(peer_cache, "engine", "c", spec))
        alive = kv.KVCacheHandle.from_bytes(other.call(peer_cache, "engine", "c", spec))
        _, mine = make_cache(e, spec, 15)
        ids = list(range(64))
        wait(mine.push(theirs, ids, ids))
        ph.stop(victim.pid)
        stream = mine.stream(theirs, ids, ids, notify=3)
        doomed = [stream.push(layer) for layer in range(spec.layers)]
        time.sleep(0.3)
        os.kill(victim.pid, signal.SIGKILL)
        start = time.monotonic()
        outcomes = []
        for fut in doomed + [mine.push(theirs, [0], [0])]:
            try:
                wait(fut, 15)
                outcomes.append("ok")
            except p2p.P2PError as exc:
                outcomes.append(type(exc).__name__)
        assert set(outcomes) == {"PeerError"}, outcomes
        assert time.monotonic() - start < 10
        wait(mine.push(alive, ids[:8], ids[8:16]))
        assert_tensors(other.call(peer_tensors, "c"), expected(spec, spec, 15, [(ids[:8], ids[8:16], range(4))]))
        mine.close()


# -- the example -------------------------------------------------------------------------------------

def run_example(*args: str) -> str:
    """examples/kv_migration.py's output; it must exit 0 and warn of nothing (transformers'
    deprecations included: it passes the cache as the installed version names it)."""
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "kv_migration.py"), *args],
                          capture_output=True, text=True, timeout=150, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "warn" not in proc.stderr.lower() and "deprecat" not in proc.stderr.lower(), proc.stderr
    return proc.stdout


@pytest.mark.timeout(180)
def test_example_on_a_real_transformer():
    pytest.importorskip("transformers")
    out = run_example("--provider", "tcp")
    assert "push: tokens match" in out and "pull: tokens match" in out, out


# -- GPUs (one process per GPU where there are two, both on cuda:0 otherwise) ------------------------

@pytest.mark.cuda
def test_cuda_streamed_push_head_slicing_and_pull():
    """On the same-host IPC route: layers pushed from a side stream right after the kernel
    that writes them (no synchronize), into a cache of half the heads; then a pull back."""
    src = Spec("flash_attn", layers=4, blocks=64, block=16, heads=8, dim=128, device="cuda:0")
    dst = dataclasses.replace(src, heads=4, first_head=4, blocks=80, device=PEER_GPU)
    with Peer() as b, p2p.Engine("cuda:0", **engine_kwargs("tcp")) as e:
        b.call(helpers.start_engine, "tcp", device=PEER_GPU)
        theirs = kv.KVCacheHandle.from_bytes(b.call(peer_cache, "engine", "c", dst))
        layers, mine = make_cache(e, src, None)
        assert e.route(theirs.mailbox) == "ipc"
        source = build(src, 16)
        s_ids, d_ids = table(64, 40, 5, 10), table(80, 40, 6, 60)
        b.call(peer_expect, "c", 5, src.layers)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            stream = mine.stream(theirs, s_ids, d_ids, notify=5)
            for i in range(src.layers):
                torch.cuda._sleep(1_000_000)  # a slow "forward" that the push must wait for
                layers[i].copy_(source[i])
                stream.push(i)
        wait(stream.future())
        assert b.call(peer_outcome, "c") == "ok"
        assert_tensors(b.call(peer_tensors, "c"), expected(dst, src, 16, [(s_ids, d_ids, range(4))]))

        back_layers, back = make_cache(e, dataclasses.replace(dst, device="cuda:0"), None)
        b.call(peer_expect, "c", 6)
        wait(back.pull(theirs, d_ids, s_ids, notify=6))
        assert b.call(peer_outcome, "c") == "ok"
        want = [t.cpu() for t in flat(build(dst, None))]
        moved = expected(dst, src, 16, [(s_ids, d_ids, range(4))])
        got = [t.cpu() for t in flat(back_layers)]
        for g, w, m in zip(got, want, moved):
            w.view(2, 80, -1)[:, s_ids] = m.view(2, 80, -1)[:, d_ids]
            helpers.assert_same_bits(g, w)
        mine.close()
        back.close()


@pytest.mark.cuda
def test_cuda_later_requests_move_their_own_blocks():
    """On the IPC route: requests after the first (a prepared call run on new block ids) move
    exactly their blocks, pushed and pulled."""
    spec = Spec("flash_attn", layers=4, blocks=64, block=16, heads=8, dim=128, device="cuda:0")
    there = dataclasses.replace(spec, device=PEER_GPU)
    with Peer() as b, p2p.Engine("cuda:0", **engine_kwargs("tcp")) as e:
        b.call(helpers.start_engine, "tcp", device=PEER_GPU)
        theirs = kv.KVCacheHandle.from_bytes(b.call(peer_cache, "engine", "c", there))
        _, mine = make_cache(e, spec, 17)
        assert e.route(theirs.mailbox) == "ipc"
        moves = []
        for k, n in enumerate((40, 9, 50)):
            s_ids, d_ids = table(64, n, 70 + k, k), table(64, n, 80 + k, 30 - k)
            wait(mine.push(theirs, s_ids, d_ids))
            moves.append((s_ids, d_ids, range(spec.layers)))
            assert_tensors(b.call(peer_tensors, "c"), expected(there, spec, 17, moves))
        back_layers, back = make_cache(e, spec, None)
        owner = kv.KVCacheHandle.from_bytes(b.call(peer_cache, "engine", "d", there, 18))
        moves = []
        for k, n in enumerate((33, 7)):
            s_ids, d_ids = table(64, n, 90 + k, k), table(64, n, 95 + k, 20 + k)
            wait(back.pull(owner, s_ids, d_ids))
            moves.append((s_ids, d_ids, range(spec.layers)))
            assert_tensors(flat(back_layers), expected(spec, there, 18, moves))
        mine.close()
        back.close()


@pytest.mark.cuda
@pytest.mark.timeout(240)
def test_cuda_example():
    pytest.importorskip("transformers")
    out = run_example("--device", "cuda:0", "--peer-device", PEER_GPU)
    assert "push: tokens match" in out and "pull: tokens match" in out, out


@pytest.mark.parametrize("access", ["r", "w"])
def test_cache_access_limits_what_peers_may_do(access):
    """KVCache(access=): a read-only cache can be pulled from, not pushed into; a write-only
    one the other way round. The refusal comes before anything moves."""
    with p2p.Engine("cpu", **engine_kwargs("tcp")) as a, p2p.Engine("cpu", **engine_kwargs("tcp")) as b:
        theirs = torch.arange(2 * 4 * 4 * 2 * 8, dtype=torch.float32).view(2, 4, 4, 2, 8)
        before = theirs.clone()
        limited = kv.KVCache(b, [theirs], "flash_attn", access=access)
        ours = torch.full((2, 4, 4, 2, 8), -1.0)
        mine = kv.KVCache(a, [ours], "flash_attn")
        allowed, refused = (mine.pull, mine.push) if access == "r" else (mine.push, mine.pull)
        with pytest.raises(ValueError, match="does not accept remote " + ("writes" if access == "r" else "reads")):
            refused(limited.handle, [0], [1])
        assert torch.equal(theirs, before)
        p2p.wait(allowed(limited.handle, [1], [2]), 30)  # block 1 of the one side into block 2 of the other
        if access == "r":
            assert torch.equal(ours[:, 2], before[:, 1])
        else:
            assert torch.equal(theirs[:, 2], ours[:, 1]) and torch.equal(theirs[:, :2], before[:, :2])
        mine.close()
        limited.close()
