"""torch_p2p.kv refusing what it cannot do: bad inputs, caches and handles raise before anything
moves, a cache's access limits what peers may do, and a receiver killed mid-migration fails
the pushes to it with PeerError while the engine serves another peer.
"""
from __future__ import annotations

import dataclasses
import os
import pickle
import signal
import time

import pytest
import torch

import helpers
import peer_helpers as ph
import torch_p2p as p2p
from conftest import engine_kwargs
from kv_caches import (Spec, assert_tensors, build, caches, expected, flat, make_cache, pair,  # noqa: F401 - fixtures
                       peer_cache, peer_tensors, wait)
from peer import Peer
from torch_p2p import kv

pytestmark = pytest.mark.timeout(240)


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
    libfabric 1.17's shm a peer killed mid-transfer wedges the endpoint (see test_dead_peers)."""
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
        ph.taken_by_worker(e)
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
