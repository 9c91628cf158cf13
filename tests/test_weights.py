"""torch_p2p.weights (issue 14): pushes to destination processes with relays, join and leave,
dtype conversion, queued pushes, several source ranks, double buffering, the example and the
benchmark end to end; GPU pushes marked cuda. Plans: tests/test_weight_plans.py; destinations
that fail a push: tests/test_weight_drops.py.

Sources run in this process, destinations in Peer children (spawned once per module and
reused: each test starts its destinations under its own keys and closes them).
"""
import json
import os
import subprocess
import sys
import time

import pytest
import torch

import torch_p2p as p2p
import torch_p2p.weights as pw
from checkout import ROOT
from conftest import PEER_TIMEOUT, engine_kwargs
from weight_setup import (BIG, SHAPES, Setup, assert_equal, dest_address, dest_apply, dest_close, dest_fetch,
                          dest_joined, dest_leave, dest_seen, dest_start, dest_wait, expected, keys, model, shards_of)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("provider", ["tcp", "shm"])
def test_push_to_three_processes(peers, provider):
    """Two whole-tensor destinations (one relay chain) and a TP shard; two versions, bitwise."""
    a, b, c = peers
    with Setup(provider, chunk_bytes=2048) as s:
        s.add(a, "w0")
        s.add(b, "w1")
        s.add(c, "tp1", "tp1")
        for version in (1, 2):
            s.load(version)
            result = p2p.wait(s.source.push(), 60)
            assert result.version == version and sorted(result.received) == ["tp1", "w0", "w1"]
            assert result.dropped == {}
            for peer, key in s.dests:
                assert peer.call(dest_wait, key, version) == version
                s.check(peer, key, "tp1" if key == "tp1" else "whole")
        # The source wrote the whole-tensor layout once (the relay made the second copy).
        whole = sum(t.numel() * 4 for t in s.full.values())
        tp = sum(t.numel() * 4 for t in expected("tp1", s.full, torch.float32).values())
        assert result.bytes_sent == whole + tp


@pytest.mark.timeout(120)
def test_empty_tensors_and_empty_shards_move_nothing_and_complete(peers):
    """An empty tensor in the state dict, and a 1-row tensor split over TP 2 (rank 1's shard
    is empty) are valid: they move nothing and the push completes."""
    a, b, _ = peers
    shapes = {**SHAPES, "layers.0.empty": (0, 64), "layers.0.bias": (1,)}
    with Setup("tcp", shapes=shapes, chunk_bytes=2048) as s:
        s.add(a, "w0")
        s.add(b, "tp1", "tp1")
        s.load(1)
        result = p2p.wait(s.source.push(), 60)
        assert sorted(result.received) == ["tp1", "w0"] and result.dropped == {}
        s.check(a, "w0")
        s.check(b, "tp1", "tp1")


@pytest.mark.timeout(120)
def test_shared_storages_non_contiguous_and_unusual_dtypes(peers):
    """Tied weights (one tensor under two names), views into one flat buffer, transposed trainer
    tensors and dtypes beyond floats (bool, complex, float8, int8) all move bitwise."""
    a, _, _ = peers
    flat = torch.randn(40)
    tied = torch.randn(4, 6)
    sources = {"tied.a": tied, "tied.b": tied, "flat.a": flat[:16].view(4, 4), "flat.b": flat[16:],
               "transposed": torch.randn(6, 4).t(), "mask": torch.rand(5) > 0.5,
               "complex": torch.randn(3, dtype=torch.complex64), "fp8": torch.randn(8).to(torch.float8_e4m3fn),
               "int8": torch.randint(-100, 100, (7,), dtype=torch.int8)}
    engine = p2p.Engine("cpu", **engine_kwargs("tcp", peer_timeout=PEER_TIMEOUT))
    source = pw.WeightSource(engine, pw.whole(sources))
    try:
        shapes = {n: tuple(t.shape) for n, t in sources.items()}
        a.call(dest_start, "odd", "tcp", source.address, "whole", shapes=shapes, dtypes={n: t.dtype for n, t in sources.items()})
        version = p2p.wait(source.push(), 60).version
        assert a.call(dest_wait, "odd", version) == version
        got = a.call(dest_fetch, "odd")
        for n, t in sources.items():
            assert got[n].dtype == t.dtype and torch.equal(got[n].view(torch.uint8), t.contiguous().view(torch.uint8)), n
    finally:
        a.call(dest_close, "odd")
        source.close()
        engine.close()


def test_tensors_the_wire_cannot_carry_are_refused():
    quantized = torch.quantize_per_tensor(torch.randn(4), 0.1, 0, torch.qint8)
    with pytest.raises(TypeError, match="not a quantized tensor"):
        pw.Shard(quantized)
    with pytest.raises(TypeError, match="not a sparse_coo tensor"):
        pw.whole({"w": torch.eye(3).to_sparse()})


@pytest.mark.timeout(120)
def test_join_leave_and_remove_between_versions(peers):
    a, b, c = peers
    with Setup("tcp", chunk_bytes=4096) as s:
        s.add(a, "stays")
        s.add(b, "leaves")
        s.load(1)
        assert sorted(p2p.wait(s.source.push(), 60).received) == ["leaves", "stays"]
        assert b.call(dest_leave, "leaves") == 1
        s.add(c, "joins", "tp0")
        s.load(2)
        result = p2p.wait(s.source.push(), 60)
        assert sorted(result.received) == ["joins", "stays"] and result.dropped == {}
        s.check(a, "stays")
        s.check(c, "joins", "tp0")  # the whole of version 2, though it missed version 1
        assert c.call(dest_seen, "joins") == [2]
        # The one that left kept version 1.
        assert_equal(b.call(dest_fetch, "leaves"), expected("whole", model(1), torch.float32))
        # One the source removes gets no more versions and knows it is out.
        s.source.remove([a.call(dest_address, "stays")])
        s.load(3)
        result = p2p.wait(s.source.push(), 60)
        assert result.received == ["joins"] and result.dropped == {}
        assert a.call(dest_seen, "stays") == [1, 2] and not a.call(dest_joined, "stays")
        assert c.call(dest_joined, "joins")


@pytest.mark.timeout(120)
def test_dtype_conversion_through_bounded_staging(peers):
    """fp32 training weights into bf16 destinations (a chain and a TP shard) through two staging
    slots of one chunk each, bitwise equal to .to(bfloat16)."""
    a, b, c = peers
    with Setup("tcp", chunk_bytes=1024, staging_slots=2) as s:
        s.add(a, "bf0", dtype=torch.bfloat16)
        s.add(b, "bf1", dtype=torch.bfloat16)
        s.add(c, "tp", "tp0", dtype=torch.bfloat16)
        for version in (1, 2):
            s.load(version)
            assert len(p2p.wait(s.source.push(), 60).received) == 3
            s.check(a, "bf0", dtype=torch.bfloat16)
            s.check(b, "bf1", dtype=torch.bfloat16)
            s.check(c, "tp", "tp0", torch.bfloat16)
        staging = s.source._impl.staging.buffer
        assert staging.numel() == 2 * 1024  # the source's whole overhead: slots x chunk_bytes


@pytest.mark.timeout(120)
def test_push_while_one_is_in_flight_is_queued(peers):
    """push() returns at once; a second push called before the first completed starts when it
    completed, in call order; versions must increase."""
    a, b, _ = peers
    with Setup("tcp", shapes=BIG, chunk_bytes=256 << 10) as s:
        s.add(a, "q0")
        s.add(b, "q1")
        first = s.source.push()
        second = s.source.push()
        assert not second.done()
        with pytest.raises(ValueError, match="not above"):
            s.source.push(2)
        r2 = p2p.wait(second, 60)
        assert first.done() and p2p.wait(first, 1).version == 1 and r2.version == 2
        assert sorted(r2.received) == ["q0", "q1"]
        assert a.call(dest_seen, "q0") == [1, 2] and b.call(dest_seen, "q1") == [1, 2]
        assert p2p.wait(s.source.push(7), 60).version == 7
        s.check(b, "q1")


@pytest.mark.timeout(120)
def test_two_source_ranks_fsdp_to_tp_and_fused(peers):
    """Two trainer ranks with FSDP dim-0 shards; destinations: the two ranks of a TP 2 replica
    and a replica whose tensors share one flat buffer."""
    a, b, c = peers
    full = model(3)
    engines = [p2p.Engine("cpu", **engine_kwargs("tcp", peer_timeout=PEER_TIMEOUT)) for _ in range(2)]
    shards = [shards_of(f"fsdp{r}of2", full) for r in range(2)]
    leader = pw.WeightSource(engines[0], shards[0], world=2, chunk_bytes=2048)
    follower = pw.WeightSource(engines[1], shards[1], rank=1, world=2, leader=leader.address, chunk_bytes=2048)
    keys = [(a, "tp0", "tp0"), (b, "tp1", "tp1"), (c, "fused", "fused")]
    try:
        for peer, key, kind in keys:
            peer.call(dest_start, key, "tcp", leader.address, kind)
        futs = [leader.push(), follower.push()]
        results = [p2p.wait(f, 60) for f in futs]
        assert sorted(results[0].received) == sorted(results[1].received) == ["fused", "tp0", "tp1"]
        assert results[0].bytes_sent > 0 and results[1].bytes_sent > 0
        for peer, key, kind in keys:
            assert_equal(peer.call(dest_fetch, key), expected(kind, full, torch.float32))
    finally:
        for peer, key, _ in keys:
            peer.call(dest_close, key)
        follower.close()
        leader.close()
        for e in engines:
            e.close()


@pytest.mark.timeout(60)
def test_unmatched_destination_is_refused_before_anything_moves(peers):
    a = peers[0]
    with Setup("tcp") as s:
        with pytest.raises(Exception, match="layers.1.mlp: no source holds it"):
            s.add(a, "odd", shapes={**SHAPES, "layers.1.mlp": (4, 4)})
        a.call(dest_close, "odd")
        s.dests.clear()
        result = p2p.wait(s.source.push(), 30)
        assert result.received == [] and result.bytes_sent == 0


@pytest.mark.timeout(60)
def test_double_buffer_serves_the_old_version_until_apply(peers):
    a = peers[0]
    with Setup("tcp", chunk_bytes=2048) as s:
        s.add(a, "db", double_buffer=True)
        s.load(1)
        p2p.wait(s.source.push(), 30)
        assert_equal(a.call(dest_fetch, "db"), {n: torch.zeros(t.shape) for n, t in s.full.items()})
        assert a.call(dest_apply, "db") == 1
        s.check(a, "db")
        p2p.wait(s.source.push(), 30)
        s.load(3)
        third = s.source.push()
        time.sleep(1.0)  # the scenario: a second in which version 3 must not complete
        assert not third.done(), "version 3 must wait until version 2 is applied"
        assert a.call(dest_apply, "db") == 2
        p2p.wait(third, 30)
        assert a.call(dest_apply, "db") == 3
        s.check(a, "db")


@pytest.mark.timeout(240)
def test_example_runs():
    """examples/weight_update.py: a transformers model, four versions to fp32, TP 2 and bf16
    processes, one leaving and one joining, outputs bitwise equal to the trainer's."""
    pytest.importorskip("transformers")
    run = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "weight_update.py")],
                         capture_output=True, text=True, timeout=220)
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    assert run.stdout.count("bitwise equal") == 12 and "DIFFER" not in run.stdout


@pytest.mark.timeout(180)
def test_benchmark_runs(tmp_path):
    out = tmp_path / "rows.json"
    run = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "weights.py"), "--model", "tiny",
                          "--dests", "1", "2", "--updates", "1", "--device", "cpu", "--source-dtype", "float32",
                          "--json", str(out)], capture_output=True, text=True, timeout=160)
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    rows = json.loads(out.read_text())
    assert {(r["system"], r["n"]) for r in rows} == {("torch_p2p", 1), ("torch_p2p", 2), ("gloo broadcast", 1),
                                                      ("gloo broadcast", 2)}
    assert all(r["ok"] for r in rows)


def _gpu(i: int) -> str:
    return f"cuda:{i % torch.cuda.device_count()}" if torch.cuda.is_available() else "cpu"


@pytest.mark.cuda
@pytest.mark.timeout(180)
@pytest.mark.parametrize("ipc", [True, False], ids=["ipc", "tcp-staged"])
def test_gpu_push_with_conversion_and_relay(peers, ipc):
    """fp32 CUDA weights into bf16 CUDA destinations (a chain of two and a TP shard), one process
    per GPU where there are enough (sharing GPUs otherwise)."""
    a, b, c = peers
    engine = p2p.Engine(_gpu(0), **engine_kwargs("tcp", peer_timeout=PEER_TIMEOUT, ipc=ipc))
    full = {n: t.to(_gpu(0)) for n, t in model(5).items()}
    source = pw.WeightSource(engine, pw.whole(full), chunk_bytes=4096)
    keys = [(a, "g0", "whole", 1), (b, "g1", "whole", 2), (c, "g2", "tp1", 3)]
    try:
        for peer, key, kind, gpu in keys:
            peer.call(dest_start, key, "tcp", source.address, kind, torch.bfloat16, device=_gpu(gpu), ipc=ipc)
        for version in (1, 2):
            with torch.no_grad():
                for n, t in model(version).items():
                    full[n].copy_(t.to(_gpu(0)), non_blocking=True)  # queued work push() must follow
            assert len(p2p.wait(source.push(), 60).received) == 3
            want = {n: t.cpu() for n, t in full.items()}
            for peer, key, kind, _ in keys:
                assert_equal(peer.call(dest_fetch, key), expected(kind, want, torch.bfloat16))
    finally:
        for peer, key, _, _ in keys:
            if key in peer.call(keys):
                peer.call(dest_close, key)
        source.close()
        engine.close()
