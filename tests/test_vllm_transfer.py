"""torch_p2p.integrations.vllm.transfer, the part of TorchP2PConnector that moves bytes, without
vLLM: caches laid out as vLLM's attention backends hold them, a prefill worker in a child
process, the decode worker here. On CPU (the CPU backend's layout) and on CUDA (the CUDA
backends' layout, block-major and token-major strides)."""
from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from peer import Peer
from torch_p2p.integrations.vllm.tp_mapping import Sources, sources
from torch_p2p.integrations.vllm.transfer import KVTransfer, Pulled, fetch, tag

PEER_GPU = "cuda:1" if torch.cuda.device_count() > 1 else "cuda:0"
LAYERS, BLOCKS, HEADS, TOKENS, DIM = 3, 24, 4, 16, 64
NAMES = [f"model.layers.{i}.self_attn.attn" for i in (0, 1, 10)]  # model order is not string order


def vllm_caches(device: str, token_major: bool, seed: int | None) -> dict:
    """Per layer a [blocks, heads, tokens, 2 x dim] cache, as vLLM hands them to a connector;
    `token_major`: stored [blocks, tokens, heads, 2 x dim] (vLLM's LBNHC layout)."""
    g = torch.Generator().manual_seed(seed or 0)
    out = {}
    for name in NAMES:
        shape = (BLOCKS, TOKENS, HEADS, 2 * DIM) if token_major else (BLOCKS, HEADS, TOKENS, 2 * DIM)
        t = (torch.randn(shape, generator=g) if seed is not None else torch.full(shape, -1.0)).to(device)
        out[name] = t.transpose(1, 2) if token_major else t
    return out


# -- the prefill worker (a Peer child) -----------------------------------------------------------

def prefill_worker(state, device: str, layout: str, token_major: bool) -> int:
    state["caches"] = vllm_caches(device, token_major, seed=1)
    state["transfer"] = KVTransfer(state["caches"], layout, engine_id="prefill", port=0)
    return state["transfer"].side_channel.port


def hold(state, request_id: str, lease: float) -> None:
    state["transfer"].hold(request_id, lease)


def freed(state, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, _ = state["transfer"].poll()
        if done:
            return done
        time.sleep(0.01)
    return {}


def blocks_of(state, ids: list[int]) -> list[torch.Tensor]:
    return [state["caches"][n][ids].cpu() for n in NAMES]


# -- the decode worker (here) ----------------------------------------------------------------------

def loaded(transfer: KVTransfer, timeout: float = 30) -> Pulled:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        _, done = transfer.poll()
        if done:
            assert len(done) == 1
            return done[0]
        time.sleep(0.005)
    raise TimeoutError(f"no load finished in {timeout} s")


CASES = [pytest.param("cpu", "cpu", False, id="cpu"),
         pytest.param("cuda:0", "cuda", False, id="cuda-block-major", marks=pytest.mark.cuda),
         pytest.param("cuda:0", "cuda", True, id="cuda-token-major", marks=pytest.mark.cuda)]


@pytest.mark.parametrize("device,layout,token_major", CASES)
def test_pull_frees_the_prefill_blocks(device, layout, token_major):
    peer_device = PEER_GPU if device != "cpu" else "cpu"
    with Peer() as p:
        port = p.call(prefill_worker, peer_device, layout, token_major)
        caches = vllm_caches(device, token_major, seed=None)
        transfer = KVTransfer(caches, layout, engine_id="decode")
        try:
            remote, local = [3, 4, 5, 9, 17, 2], [0, 7, 8, 20]  # the first two are in "our prefix cache"
            p.call(hold, "req-1", 30.0)
            transfer.load("d-1", "req-1", [("127.0.0.1", port)], "prefill", remote, local)
            got = loaded(transfer)
            assert got.error is None and got.blocks == 4, got
            assert got.bytes == 4 * LAYERS * HEADS * TOKENS * 2 * DIM * 4
            assert p.call(freed, 10) == {"req-1": True}  # the pull's notification freed them
            want = p.call(blocks_of, remote[2:])
            for name, w in zip(NAMES, want):
                assert torch.equal(caches[name][local].cpu(), w), name
            untouched = [i for i in range(BLOCKS) if i not in local]
            assert all((caches[n][untouched] == -1).all() for n in NAMES)

            # A second request reuses the handshake; nobody pulls a third: its lease runs out.
            p.call(hold, "req-2", 30.0)
            p.call(hold, "req-3", 0.3)
            transfer.load("d-2", "req-2", [("127.0.0.1", port)], "prefill", [1], [1])
            assert loaded(transfer).handshake_seconds == 0
            assert p.call(freed, 10) == {"req-2": True}
            assert p.call(freed, 10) == {"req-3": False}
        finally:
            transfer.close()


def test_dead_prefill_worker_fails_the_load_promptly():
    caches = vllm_caches("cpu", False, seed=None)
    transfer = KVTransfer(caches, "cpu", engine_id="decode", timeout=10)
    try:
        with Peer() as p:
            port = p.call(prefill_worker, "cpu", "cpu", False)
            transfer.load("d-1", "req-1", [("127.0.0.1", port)], "prefill", [1], [1])
            assert loaded(transfer).error is None
            os.kill(p.proc.pid, signal.SIGKILL)
            p.proc.join(10)
            killed = time.monotonic()
            transfer.load("d-2", "req-2", [("127.0.0.1", port)], "prefill", [2, 3], [2, 3])
            got = loaded(transfer)
            assert got.error is not None and time.monotonic() - killed < 1.0, got
        # No one listens there any more: the handshake of a new engine fails at once too.
        transfer.load("d-3", "req-3", [("127.0.0.1", port)], "another", [1], [1])
        got = loaded(transfer, timeout=5)
        assert isinstance(got.error, OSError), got
    finally:
        transfer.close()


def test_wrong_engine_and_layers_are_refused():
    with Peer() as p:
        port = p.call(prefill_worker, "cpu", "cpu", False)
        caches = vllm_caches("cpu", False, seed=None)
        fewer = {n: caches[n] for n in NAMES[:2]}
        for mine, engine, words in [(caches, "someone-else", "serves engine prefill"),
                                    (fewer, "prefill", "has layers")]:
            transfer = KVTransfer(mine, "cpu", engine_id="decode")
            try:
                transfer.load("d", "r", [("127.0.0.1", port)], engine, [1], [1])
                got = loaded(transfer)
                assert isinstance(got.error, ValueError) and words in str(got.error), got
            finally:
                transfer.close()
        transfer = KVTransfer(caches, "cpu", engine_id="decode")
        try:
            with pytest.raises(ValueError, match="2 blocks to fill from 1 remote blocks"):
                transfer.load("d", "r", [("127.0.0.1", port)], "prefill", [1], [1, 2])
        finally:
            transfer.close()


def test_side_channel_and_tags():
    assert tag("req-1") == tag("req-1") != tag("req-2") and 0 <= tag("x") < 1 << 32
    assert tag("req-1", readers=2) != tag("req-1")  # a prefill worker read by two decode workers
    with pytest.raises(OSError):
        from peer_helpers import free_port
        fetch("127.0.0.1", free_port(), timeout=2)


def test_side_channel_port_taken():
    caches = vllm_caches("cpu", False, seed=None)
    first = KVTransfer(caches, "cpu", engine_id="a", port=0)
    try:
        with pytest.raises(OSError, match=f"cannot listen on 127.0.0.1:{first.side_channel.port}"):
            KVTransfer(caches, "cpu", engine_id="b", port=first.side_channel.port)
    finally:
        first.close()


# -- tensor parallelism of other degrees (heads sliced) --------------------------------------------

def prefill_rank(state, lo: int, hi: int) -> int:
    """A prefill worker holding KV heads [lo, hi) of vllm_caches(seed=1), in shared memory."""
    state["caches"] = {n: t[:, lo:hi].contiguous() for n, t in vllm_caches("cpu", False, seed=1).items()}
    state["transfer"] = KVTransfer(state["caches"], "cpu", engine_id="prefill", first_head=lo, port=0, share=True)
    return state["transfer"].side_channel.port


def test_tp_mapping():
    assert sources(0, 1, 2, 4) == Sources([0, 1], 1)  # one decode worker pulls both halves
    assert sources(1, 2, 4, 8) == Sources([2, 3], 1)
    assert sources(1, 2, 1, 4) == Sources([0], 2)  # both decode workers read the one prefill worker
    assert sources(3, 4, 2, 8) == Sources([1], 2)
    assert sources(1, 2, 2, 4) == Sources([1], 1)
    with pytest.raises(ValueError, match="one must divide the other"):
        sources(0, 2, 3, 6)
    with pytest.raises(ValueError, match="replicated"):
        sources(0, 4, 1, 2)


def test_decode_tp1_pulls_from_two_prefill_workers():
    """Prefill TP 2, decode TP 1: the decode worker pulls each half of its heads from the
    prefill worker that holds it, and both free their blocks."""
    with Peer() as p0, Peer() as p1:
        ports = [p0.call(prefill_rank, 0, HEADS // 2), p1.call(prefill_rank, HEADS // 2, HEADS)]
        src = sources(0, 1, 2, HEADS)
        caches = vllm_caches("cpu", False, seed=None)
        transfer = KVTransfer(caches, "cpu", engine_id="decode")
        try:
            for p in (p0, p1):
                p.call(hold, "req-1", 30.0)
            transfer.load("d-1", "req-1", [("127.0.0.1", ports[r]) for r in src.ranks], "prefill", [3, 4, 5],
                          [7, 1, 9], readers=src.readers)
            got = loaded(transfer)
            assert got.error is None, got
            want = vllm_caches("cpu", False, seed=1)
            for n in NAMES:
                assert torch.equal(caches[n][[7, 1, 9]], want[n][[3, 4, 5]]), n
            assert p0.call(freed, 10) == {"req-1": True} and p1.call(freed, 10) == {"req-1": True}
        finally:
            transfer.close()


def test_two_decode_workers_pull_from_one_prefill_worker():
    """Prefill TP 1, decode TP 2: each decode worker pulls its half of the heads; the prefill
    worker frees the blocks only when both have."""
    with Peer() as p:
        port = p.call(prefill_rank, 0, HEADS)
        p.call(hold, "req-1", 30.0)
        want = vllm_caches("cpu", False, seed=1)
        half = HEADS // 2
        for rank in (0, 1):
            src = sources(rank, 2, 1, HEADS)
            caches = {n: torch.full((BLOCKS, half, TOKENS, 2 * DIM), -1.0) for n in NAMES}
            transfer = KVTransfer(caches, "cpu", engine_id=f"decode-{rank}", first_head=rank * half)
            try:
                transfer.load("d-1", "req-1", [("127.0.0.1", port) for _ in src.ranks], "prefill", [3, 4], [5, 6],
                              readers=src.readers)
                assert loaded(transfer).error is None
                for n in NAMES:
                    assert torch.equal(caches[n][[5, 6]], want[n][[3, 4], rank * half:(rank + 1) * half]), n
            finally:
                transfer.close()
            assert p.call(freed, 10 if rank else 0.5) == ({"req-1": True} if rank else {})
