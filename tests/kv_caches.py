"""What the torch_p2p.kv tests share: caches as serving systems hold them (both processes build
them alike, from a Spec and a seed), what torch computes a move into them must give, the steps
that run in the peer child (each takes `state` first), and the `pair` and `caches` fixtures.
"""
from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest
import torch

import helpers
import torch_p2p as p2p
from checkout import ROOT
from conftest import ROUTES
from torch_p2p import kv


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


def run_example(*args: str) -> str:
    """examples/kv_migration.py's output; it must exit 0 and warn of nothing (transformers'
    deprecations included: it passes the cache as the installed version names it)."""
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "kv_migration.py"), *args],
                          capture_output=True, text=True, timeout=150, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "warn" not in proc.stderr.lower() and "deprecat" not in proc.stderr.lower(), proc.stderr
    return proc.stdout
