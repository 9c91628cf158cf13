"""torch_p2p.integrations.vllm.transfer, the part of TorchP2PConnector that moves bytes, without
vLLM: caches laid out as vLLM's attention backends hold them, a prefill worker in a child
process, the decode worker here. On CPU (the CPU backend's layout) and on CUDA (the CUDA
backends' layout, block-major and token-major strides). A prefill worker's hold table is a
plain tensor here (the scheduler that writes it in vLLM is this test)."""
from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from peer import Peer
from torch_p2p.integrations.vllm import holds
from torch_p2p.integrations.vllm.tp_mapping import Sources, sources
from torch_p2p.integrations.vllm.side_channel import fetch
from torch_p2p.integrations.vllm.transfer import KVTransfer, Pulled, StaleBlocks, compat_differences

PEER_GPU = "cuda:1" if torch.cuda.device_count() > 1 else "cuda:0"
LAYERS, BLOCKS, HEADS, TOKENS, DIM = 3, 24, 4, 16, 64
NAMES = [f"model.layers.{i}.self_attn.attn" for i in (0, 1, 10)]  # model order is not string order
SLOTS = 8
COMPAT = dict(model="tiny", dtype="torch.float32", block_size=TOKENS)


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

def prefill_worker(state, device: str, layout: str, token_major: bool, with_holds: bool = True) -> int:
    state["caches"] = vllm_caches(device, token_major, seed=1)
    state["holds"] = torch.zeros(SLOTS, 1, dtype=torch.int64) if with_holds else None
    state["transfer"] = KVTransfer(state["caches"], layout, engine_id="prefill", port=0, hold_table=state["holds"],
                                   compat=COMPAT)
    return state["transfer"].side_channel.port


def hold(state, request_id: str, lease: float, slot: int = 0, token: int = 0) -> tuple[int, int]:
    """What vLLM's scheduler and worker do for a finished prefill request: a hold slot and
    token, then the lease."""
    state["holds"][slot] = token
    state["transfer"].start_lease(request_id, lease)
    return slot, token


def end_hold(state, slot: int) -> None:
    state["holds"][slot] = 0


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
        transfer = KVTransfer(caches, layout, engine_id="decode", compat=COMPAT)
        try:
            remote, local = [3, 4, 5, 9, 17, 2], [0, 7, 8, 20]  # the first two are in "our prefix cache"
            held = p.call(hold, "req-1", 30.0, 3, 1001)
            transfer.load("d-1", "req-1", [("127.0.0.1", port)], "prefill", remote, local, hold=held)
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
            held = p.call(hold, "req-2", 30.0, 4, 1002)
            p.call(hold, "req-3", 0.3, 5, 1003)
            transfer.load("d-2", "req-2", [("127.0.0.1", port)], "prefill", [1], [1], hold=held)
            assert loaded(transfer).handshake_seconds == 0
            assert p.call(freed, 10) == {"req-2": True}
            assert p.call(freed, 10) == {"req-3": False}
        finally:
            transfer.close()


def test_dead_prefill_worker_fails_the_load_promptly():
    caches = vllm_caches("cpu", False, seed=None)
    transfer = KVTransfer(caches, "cpu", engine_id="decode", timeout=10, compat=COMPAT)
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
            transfer = KVTransfer(mine, "cpu", engine_id="decode", compat=COMPAT)
            try:
                transfer.load("d", "r", [("127.0.0.1", port)], engine, [1], [1])
                got = loaded(transfer)
                assert isinstance(got.error, ValueError) and words in str(got.error), got
            finally:
                transfer.close()
        transfer = KVTransfer(caches, "cpu", engine_id="decode", compat=COMPAT)
        try:
            transfer.load("d", "r", [("127.0.0.1", port)], "prefill", [1], [1, 2])
            got = loaded(transfer)
            assert isinstance(got.error, ValueError) and "2 blocks to fill from 1 remote blocks" in str(got.error)
        finally:
            transfer.close()


def test_a_pull_of_blocks_no_longer_held_fails():
    """The prefill side ended the request's hold (its lease ran out, the blocks may hold another
    request's KV by now) or restarted (a fresh table): the load fails, whatever it read."""
    with Peer() as p:
        port = p.call(prefill_worker, "cpu", "cpu", False)
        transfer = KVTransfer(vllm_caches("cpu", False, seed=None), "cpu", engine_id="decode", compat=COMPAT)
        try:
            held = p.call(hold, "req-1", 30.0, 1, 41)
            p.call(end_hold, 1)
            transfer.load("d-1", "req-1", [("127.0.0.1", port)], "prefill", [3, 4], [5, 6], hold=held)
            got = loaded(transfer)
            assert isinstance(got.error, StaleBlocks) and "hold slot 1 holds 0, not 41" in str(got.error), got
            # The slot went to a newer request meanwhile: still not ours.
            p.call(hold, "req-2", 30.0, 1, 42)
            transfer.load("d-1b", "req-1", [("127.0.0.1", port)], "prefill", [3, 4], [5, 6], hold=held)
            assert isinstance(loaded(transfer).error, StaleBlocks)
            # A token of an earlier instance: this one's table never held it.
            transfer.load("d-2", "req-0", [("127.0.0.1", port)], "prefill", [3], [5], hold=(2, 7))
            assert isinstance(loaded(transfer).error, StaleBlocks)
            # The request's own hold, though the worker's lease began after the pull (vLLM tells the
            # worker a step later): kept, and freed once the lease begins.
            p.call(hold, "req-3", 30.0, 3, 43)
            transfer.load("d-3", "req-3", [("127.0.0.1", port)], "prefill", [3], [5], hold=(3, 43))
            assert loaded(transfer).error is None
            assert p.call(freed, 10) == {"req-3": True}
            with pytest.raises(ValueError, match="hold slot 99 is outside"):
                transfer.load("d-4", "req-4", [("127.0.0.1", port)], "prefill", [3], [5], hold=(99, 1))
                raise loaded(transfer).error
        finally:
            transfer.close()


def test_incompatible_peers_are_refused():
    """A peer of another block size (dtype, model, ...), another tensor parallelism than the
    request names, or no hold table: the load fails naming the difference, nothing is read."""
    with Peer() as p, Peer() as bare:
        port = p.call(prefill_worker, "cpu", "cpu", False)
        bare_port = bare.call(prefill_worker, "cpu", "cpu", False, with_holds=False)
        cases = [(dict(COMPAT, block_size=32), port, {}, "block_size 32 here, 16 there"),
                 (dict(COMPAT, dtype="torch.bfloat16", model="other"), port, {},
                  "dtype 'torch.bfloat16' here, 'torch.float32' there; model 'other' here, 'tiny' there"),
                 (COMPAT, port, dict(remote_tp=2), "tensor parallelism 2; engine prefill runs 1"),
                 (COMPAT, bare_port, {}, "serves no hold table")]
        for compat, where, extra, words in cases:
            caches = vllm_caches("cpu", False, seed=None)
            transfer = KVTransfer(caches, "cpu", engine_id="decode", compat=compat)
            try:
                transfer.load("d", "r", [("127.0.0.1", where)], "prefill", [1], [1], hold=(0, 5), **extra)
                got = loaded(transfer)
                assert isinstance(got.error, ValueError) and words in str(got.error), got
                assert (caches[NAMES[0]] == -1).all()
            finally:
                transfer.close()
    assert compat_differences({"a": 1}, {"a": 1}) == []


def test_wait_then_close_lets_the_release_out():
    """wait() returns once the pulls are done, so one poll() reports them; close() right after
    still sends the release notice (the prefill side frees the blocks then, not at the lease)."""
    with Peer() as p:
        port = p.call(prefill_worker, "cpu", "cpu", False)
        transfer = KVTransfer(vllm_caches("cpu", False, seed=None), "cpu", engine_id="decode", compat=COMPAT)
        closed = False
        try:
            transfer.wait(0.01)  # nothing in flight: returns at once
            held = p.call(hold, "req-1", 30.0, 0, 9)
            transfer.load("d-1", "req-1", [("127.0.0.1", port)], "prefill", [1, 2], [3, 4], hold=held)
            transfer.wait(10)
            _, done = transfer.poll()
            assert [d.error for d in done] == [None]
            transfer.close()
            closed = True
            assert p.call(freed, 10) == {"req-1": True}
        finally:
            if not closed:
                transfer.close()


class _Config:
    def __init__(self, **extra):
        self.extra = extra

    def get_from_extra_config(self, key, default):
        return self.extra.get(key, default)


def test_settings(monkeypatch):
    from torch_p2p.integrations.vllm.config import setting
    assert setting(_Config(), "kv_lease_duration") == 30.0
    monkeypatch.setenv("TORCH_P2P_KV_LEASE", "2.5")
    assert setting(_Config(), "kv_lease_duration") == 2.5
    assert setting(_Config(kv_lease_duration=4), "kv_lease_duration") == 4.0  # the config wins
    monkeypatch.setenv("TORCH_P2P_SHARE_CPU_CACHE", "false")
    assert setting(_Config(), "share_cpu_cache") is False
    with pytest.raises(ValueError, match=r"share_cpu_cache .*\$TORCH_P2P_SHARE_CPU_CACHE.* must be a bool, not 'maybe'"):
        setting(_Config(share_cpu_cache="maybe"), "share_cpu_cache")
    with pytest.raises(ValueError, match="transfer_timeout .* must be a float, not 'soon'"):
        setting(_Config(transfer_timeout="soon"), "transfer_timeout")


def test_side_channel_refused():
    with pytest.raises(OSError):
        from checkout import free_port
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
    state["holds"] = torch.zeros(SLOTS, 1, dtype=torch.int64)
    state["transfer"] = KVTransfer(state["caches"], "cpu", engine_id="prefill", first_head=lo, port=0, share=True,
                                   hold_table=state["holds"], tp_size=2 if hi - lo < HEADS else 1)
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
                held = p.call(hold, "req-1", 30.0, 2, 77)
            transfer.load("d-1", "req-1", [("127.0.0.1", ports[r]) for r in src.ranks], "prefill", [3, 4, 5],
                          [7, 1, 9], readers=src.readers, hold=held, remote_tp=2)
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
        held = p.call(hold, "req-1", 30.0, 1, 55)
        want = vllm_caches("cpu", False, seed=1)
        half = HEADS // 2
        for rank in (0, 1):
            src = sources(rank, 2, 1, HEADS)
            caches = {n: torch.full((BLOCKS, half, TOKENS, 2 * DIM), -1.0) for n in NAMES}
            transfer = KVTransfer(caches, "cpu", engine_id=f"decode-{rank}", first_head=rank * half)
            try:
                transfer.load("d-1", "req-1", [("127.0.0.1", port) for _ in src.ranks], "prefill", [3, 4], [5, 6],
                              readers=src.readers, hold=held, remote_tp=1)
                assert loaded(transfer).error is None
                for n in NAMES:
                    assert torch.equal(caches[n][[5, 6]], want[n][[3, 4], rank * half:(rank + 1) * half]), n
            finally:
                transfer.close()
            assert p.call(freed, 10 if rank else 0.5) == ({"req-1": True} if rank else {})


def _make_table(port: int) -> None:  # in a child that is then killed
    holds.create(port, 4)
    time.sleep(600)


def test_hold_tables_of_dead_processes_are_removed():
    """A prefill worker killed before it removed its hold table leaves the file; the next start
    on this host removes it (any port) and replaces its own port's; the scheduler finds the
    live table of a port and never a dead process's."""
    import multiprocessing as mp

    dead_port, port = 29917, 29918
    child = mp.get_context("spawn").Process(target=_make_table, args=(dead_port,), daemon=True)
    child.start()
    deadline = time.monotonic() + 60
    while not os.path.exists(holds.table_path(dead_port, child.pid)) and time.monotonic() < deadline:
        time.sleep(0.05)
    left = holds.table_path(dead_port, child.pid)
    assert os.path.exists(left)
    os.kill(child.pid, signal.SIGKILL)
    child.join(10)
    with pytest.raises(FileNotFoundError):
        holds.find(dead_port)  # a dead process's table is never the live one
    try:
        table = holds.create(port, 4)
        assert not os.path.exists(left)
        assert holds.find(port) == holds.table_path(port) and table.shape == (4, 1)
        holds.create(port, 8)  # a restart on the port: one table, the new one
        assert [p for p, _, _ in holds._tables()].count(port) == 1 and os.path.getsize(holds.find(port)) == 64
    finally:
        holds.remove(port)
    assert not os.path.exists(holds.table_path(port))
