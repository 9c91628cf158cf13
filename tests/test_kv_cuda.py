"""torch_p2p.kv on GPUs, one process per GPU where there are two (both on cuda:0 otherwise): on
the same-host IPC route, streamed pushes that follow the caller's stream, head slicing, pulls,
later requests, and the example.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

import helpers
import torch_p2p as p2p
from conftest import PEER_GPU, engine_kwargs
from kv_caches import (Spec, assert_tensors, build, expected, flat, make_cache, peer_cache, peer_expect, peer_outcome,
                       peer_tensors, run_example, table, wait)
from peer import Peer
from torch_p2p import kv

pytestmark = pytest.mark.timeout(240)


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
