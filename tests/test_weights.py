"""torch_p2p.weights (issue 14): resharding plans, pushes to destination processes with relays,
join and leave, a relay killed mid-push, dtype conversion, queued pushes, several source ranks,
double buffering; GPU pushes marked cuda.

Sources run in this process, destinations in Peer children (spawned once per module and
reused: each test starts its destinations under its own keys and closes them).
"""
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

import peer_helpers as ph
import torch_p2p as p2p
import torch_p2p.weights as pw
from conftest import PEER_TIMEOUT, engine_kwargs
from peer import Peer


# A transformer layer in miniature: column-parallel (dim 0), row-parallel (dim 1) and replicated
# tensors, a 0-d one, odd sizes so that shards are uneven.
SHAPES = {"embed": (97, 64), "layers.0.qkv": (48, 64), "layers.0.o": (64, 48), "layers.0.norm": (64,), "step": ()}
TP_DIMS = {"embed": 0, "layers.0.qkv": 0, "layers.0.o": 1, "layers.0.bias": 0}


def model(seed: int, dtype=torch.float32, shapes=SHAPES) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=g).to(dtype) for n, s in shapes.items()}


def owned(shard: pw.Shard) -> pw.Shard:
    """The same slice in memory of its own (a destination allocates its shard)."""
    return pw.Shard(shard.tensor.clone(), shard.shape, shard.offset)


def shards_of(kind: str, tensors: dict) -> dict:
    """A layout: "whole"; "tp0"/"tp1" (TP 2, Megatron-style); "fused" (whole, but every tensor
    a view of one flat buffer, as fused weights are); "fsdp<r>of<n>" (dim-0 shards)."""
    if kind == "whole":
        return pw.whole(tensors)
    if kind.startswith("tp"):
        rank = int(kind[2:])
        return {n: owned(pw.split(t, TP_DIMS[n], rank, 2)) if n in TP_DIMS else owned(pw.Shard(t))
                for n, t in tensors.items()}
    if kind == "fused":
        flat = torch.cat([t.reshape(-1) for t in tensors.values()])
        out, at = {}, 0
        for n, t in tensors.items():
            out[n] = pw.Shard(flat[at:at + t.numel()].view(t.shape))
            at += t.numel()
        return out
    if kind.startswith("fsdp"):
        rank, world = (int(x) for x in kind[4:].split("of"))
        return {n: owned(pw.split(t, 0, rank, world)) if t.dim() else owned(pw.Shard(t)) for n, t in tensors.items()}
    raise ValueError(kind)


def expected(kind: str, full: dict, dtype) -> dict:
    return {n: s.tensor.to(dtype) for n, s in shards_of(kind, full).items()}


def assert_equal(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for n in want:
        assert got[n].dtype == want[n].dtype and torch.equal(got[n], want[n]), n


# -- plans (no processes) ----------------------------------------------------------------------------

def apply_plan(plan, sources: list, dest: dict) -> None:
    """What a push does, locally: every piece copied from its source into the destination."""
    for chunk in plan.chunks:
        for p in chunk.pieces:
            dst = dest[p.name].tensor[tuple(slice(a, b) for a, b in p.dst)]
            dst.copy_(sources[chunk.source][p.name].tensor[tuple(slice(a, b) for a, b in p.src)])


def check_plan(source_kinds: list, dest_kind: str, chunk_bytes: int, dtype=torch.float32):
    full = model(1)
    sources = [shards_of(k, full) for k in source_kinds]
    dest = {n: owned(s) for n, s in shards_of(dest_kind, {n: torch.full_like(t, float("nan"), dtype=dtype)
                                                           for n, t in full.items()}).items()}
    plan = pw.plan(sources, dest, chunk_bytes=chunk_bytes)
    apply_plan(plan, sources, dest)
    assert_equal({n: s.tensor for n, s in dest.items()}, expected(dest_kind, full, dtype))
    return plan


@pytest.mark.parametrize("dest", ["tp0", "tp1", "fused"])
def test_plan_whole_to_tp_rows_and_columns(dest):
    plan = check_plan(["whole"], dest, chunk_bytes=1024)
    assert all(c.nbytes <= 1024 for c in plan.chunks) and plan.unused == []
    names = {p.name for c in plan.chunks for p in c.pieces}
    assert names == set(SHAPES)


@pytest.mark.parametrize("dest", ["tp0", "tp1", "whole"])
def test_plan_fsdp_shards_to_tp(dest):
    plan = check_plan(["fsdp0of3", "fsdp1of3", "fsdp2of3"], dest, chunk_bytes=2048, dtype=torch.bfloat16)
    assert {c.source for c in plan.chunks} == {0, 1, 2}
    assert all(p.convert for c in plan.chunks for p in c.pieces)


def test_plan_replicated_tensors_are_read_once():
    """Tensors two ranks both hold whole (replicated across TP) move once, spread over them."""
    plan = check_plan(["tp0", "tp1"], "whole", chunk_bytes=1 << 20)
    moved = sum(p.nbytes for c in plan.chunks for p in c.pieces)
    assert moved == sum(t.numel() * 4 for t in model(1).values())
    replicated = {p.name: c.source for c in plan.chunks for p in c.pieces if p.name not in TP_DIMS}
    assert set(replicated.values()) == {0, 1}


def test_plan_reports_every_unmatched_name_and_shape():
    full = model(1)
    source = pw.whole({**full, "value_head": torch.zeros(3)})
    dest = pw.whole({**{n: torch.zeros_like(t) for n, t in full.items()}, "lm_head": torch.zeros(4, 4),
                     "layers.0.norm": torch.zeros(65)})
    partial = {"embed": pw.split(full["embed"], 0, 0, 2)}
    with pytest.raises(pw.PlanError) as info:
        pw.plan([source, partial], dest)
    problems = "\n".join(info.value.problems)
    assert "lm_head: no source holds it" in problems
    assert "layers.0.norm: the destination's global shape [65] differs" in problems
    assert "embed: source ranks 0 and 1 hold different overlapping slices" in problems
    with pytest.raises(pw.PlanError, match="hold 3136 of the 6208 elements"):
        pw.plan([{"embed": pw.split(full["embed"], 0, 0, 2)}], {"embed": pw.Shard(torch.zeros(97, 64))})
    plan = pw.plan([source], pw.whole(full))
    assert plan.unused == ["value_head"]


# -- destinations in child processes -----------------------------------------------------------------

def dest_start(state, key, provider, leader, kind, dtype=torch.float32, name=None, shapes=SHAPES, device="cpu",
               ipc=None, dtypes=None, **options):
    """Starts a destination under `key` (engine, zeroed shards of `kind`, WeightDestination) and
    joins; returns its chunk count."""
    engine = p2p.Engine(device, **engine_kwargs(provider, peer_timeout=PEER_TIMEOUT, ipc=ipc))
    dtypes = dtypes or {}
    shards = shards_of(kind, {n: torch.zeros(s, dtype=dtypes.get(n, dtype), device=device) for n, s in shapes.items()})
    dest = pw.WeightDestination(engine, shards, leader, name=name or key, **options)
    seen = []
    dest.on_version(seen.append)
    state[key] = (engine, dest, shards, seen)
    return len(p2p.wait(dest.join(), 30).chunks)


def dest_wait(state, key, version, timeout=60.0):
    return p2p.wait(state[key][1].wait_for(version), timeout)


def dest_fetch(state, key):
    return {n: s.tensor.cpu().clone() for n, s in state[key][2].items()}


def dest_seen(state, key):
    return list(state[key][3])


def dest_apply(state, key):
    return state[key][1].apply()


def dest_leave(state, key):
    return p2p.wait(state[key][1].leave(), 30)


def dest_address(state, key):
    return state[key][0].address


def dest_joined(state, key):
    return state[key][1].joined


def dest_close(state, key):
    engine, dest, _, _ = state.pop(key)
    dest.close()
    engine.close()


def dest_stop_after(state, key, chunks, version=None):
    """Stops this whole process (SIGSTOP) once `chunks` chunks of a version (`version`: of that
    one) have arrived."""
    dest = state[key][1]
    while dest.progress[1] < chunks or version is not None and dest.progress[0] != version:
        time.sleep(0.0005)
    os.kill(os.getpid(), signal.SIGSTOP)


@pytest.fixture(scope="module")
def peers():
    with Peer() as a, Peer() as b, Peer() as c:
        yield [a, b, c]


class Setup:
    """A source here and destinations in peers; closes everything at the end."""

    def __init__(self, provider, kind="whole", dtype=torch.float32, shapes=SHAPES, **options):
        self.provider = provider
        self.engine = p2p.Engine("cpu", **engine_kwargs(provider, peer_timeout=PEER_TIMEOUT))
        self.full = model(1, dtype, shapes)
        self.shards = shards_of(kind, self.full)
        self.source = pw.WeightSource(self.engine, self.shards, **options)
        self.dests: list = []
        self.shapes = shapes

    def add(self, peer, key, kind="whole", dtype=torch.float32, **options):
        options.setdefault("shapes", self.shapes)
        peer.call(dest_start, key, self.provider, self.source.address, kind, dtype, **options)
        self.dests.append((peer, key))

    def load(self, seed):
        """New weights (between pushes), in place as an optimizer step writes them."""
        for n, t in model(seed, next(iter(self.full.values())).dtype, self.shapes).items():
            self.full[n].copy_(t)

    def check(self, peer, key, kind="whole", dtype=torch.float32):
        assert_equal(peer.call(dest_fetch, key), expected(kind, self.full, dtype))

    def close(self):
        for peer, key in self.dests:
            if peer.proc.is_alive():
                peer.call(dest_close, key)
        self.source.close()
        self.engine.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


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


BIG = {"w": (2048, 1024)}  # 8 MiB: 128 chunks of 64 KiB


def _stopped(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "T"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("position", [0, 1], ids=["head", "middle"])
def test_relay_killed_mid_push_is_dropped_and_repaired(peers, position):
    """A chain of three; one stops after two chunks and is killed (kill -9). Its parent (the
    source for the head, the head for the middle) adopts its child, which says what it lacks;
    the others get the version, the result names the dead one, and the next push goes to the
    survivors."""
    _, b, c = peers
    with Peer() as doomed, Setup("tcp", shapes=BIG, chunk_bytes=64 << 10, window=1) as s:
        order = [b, c]
        order.insert(position, doomed)
        for i, peer in enumerate(order):
            s.add(peer, "doomed" if peer is doomed else f"d{i}")
        doomed.start(dest_stop_after, "doomed", 2)
        fut = s.source.push()
        deadline = time.monotonic() + 30
        while not _stopped(doomed.pid):
            assert time.monotonic() < deadline and not fut.done(), "the relay never stopped mid-push"
            time.sleep(0.01)
        doomed.kill()
        result = p2p.wait(fut, 60)
        survivors = sorted(key for peer, key in s.dests if peer is not doomed)
        assert list(result.dropped) == ["doomed"] and "Error" in result.dropped["doomed"], result
        assert sorted(result.received) == survivors
        for peer, key in s.dests:
            if peer is not doomed:
                s.check(peer, key)
        s.load(2)
        result = p2p.wait(s.source.push(), 60)
        assert sorted(result.received) == survivors and result.dropped == {}
        s.check(c, dict((id(p), k) for p, k in s.dests)[id(c)])


def dest_relayed(state, key) -> int:
    """Bytes this destination wrote to its relay children in the last version."""
    fanout = state[key][1]._impl.incoming.fanout
    return 0 if fanout is None else fanout.sent_bytes


@pytest.mark.timeout(120)
@pytest.mark.parametrize("fanout", [1, 2])
def test_relay_tree_follows_fanout(peers, fanout):
    """Three destinations of one layout: a chain (fanout 1) has two of them forward the version
    once each; a tree of fanout 2 has the first forward it to both others. The source writes it
    once either way."""
    a, b, c = peers
    with Setup("tcp", chunk_bytes=2048, fanout=fanout) as s:
        for i, peer in enumerate(peers):
            s.add(peer, f"f{i}")
        result = p2p.wait(s.source.push(), 60)
        assert sorted(result.received) == ["f0", "f1", "f2"] and result.dropped == {}
        whole = sum(t.numel() * 4 for t in s.full.values())
        assert result.bytes_sent == whole
        relayed = sorted(peer.call(dest_relayed, key) for peer, key in s.dests)
        assert relayed == ([0, whole, whole] if fanout == 1 else [0, 0, 2 * whole]), relayed
        for peer, key in s.dests:
            s.check(peer, key)


@pytest.mark.timeout(120)
def test_destination_not_ready_in_ready_timeout_is_dropped(peers):
    """A destination that does not answer the push's `begin` within ready_timeout (stopped,
    here) is dropped with that reason, before the engine's peer_timeout would say it is
    silent; the others get the version."""
    a, b, _ = peers
    with Setup("tcp", chunk_bytes=2048, ready_timeout=0.5) as s:
        s.add(a, "ready")
        s.add(b, "asleep")
        with ph.stopped(b.pid, 30):
            result = p2p.wait(s.source.push(), 20)
        assert result.received == ["ready"] and list(result.dropped) == ["asleep"], result
        assert "not ready within 0.5 s" in result.dropped["asleep"], result
        s.check(a, "ready")


@pytest.mark.timeout(120)
def test_push_longer_than_timeout_drops_who_lacks_it(peers):
    """A destination that stops mid-push is dropped once the push has taken `timeout`, with
    that reason (before peer_timeout); the others get the version."""
    a, _, _ = peers
    with Peer() as slow, Setup("tcp", shapes=BIG, chunk_bytes=64 << 10, window=1, timeout=0.5) as s:
        s.add(a, "fine")
        s.add(slow, "slow")
        slow.start(dest_stop_after, "slow", 2)
        try:
            result = p2p.wait(s.source.push(), 20)
        finally:
            ph.resume(slow.pid)
        slow.result(timeout=30)
        assert result.received == ["fine"] and list(result.dropped) == ["slow"], result
        assert "the push took more than 0.5 s" in result.dropped["slow"], result
        s.check(a, "fine")


def dest_version(state, key):
    return state[key][1].version


def dest_rejoin(state, key) -> int:
    return len(p2p.wait(state[key][1].join(), 30).chunks)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("stalls", ["between versions", "mid-push"])
def test_destination_stalled_past_peer_timeout_learns_it_is_out(peers, stalls):
    """A destination stopped for longer than peer_timeout, before a push or in the middle of
    it, is dropped (the push ends for the others); resumed, it still names the last version
    whose every byte arrived, learns that it is out (rather than waiting as a member for versions
    that never come), joins again and receives the next version bitwise."""
    a, _, _ = peers
    with Peer() as slow, Setup("tcp", shapes=BIG, chunk_bytes=64 << 10, window=1) as s:
        s.add(a, "fine")
        s.add(slow, "slow")
        s.load(1)
        assert sorted(p2p.wait(s.source.push(), 60).received) == ["fine", "slow"]
        s.load(2)
        if stalls == "mid-push":
            slow.start(dest_stop_after, "slow", 2, 2)
        else:
            ph.stop(slow.pid)
        try:
            fut = s.source.push()
            deadline = time.monotonic() + 30
            while not _stopped(slow.pid):
                assert time.monotonic() < deadline and not fut.done(), "the destination never stopped mid-push"
                time.sleep(0.01)
            result = p2p.wait(fut, 30)  # its timeout (600 s) and ready_timeout (30 s) do not drop it
        finally:
            ph.resume(slow.pid)
        if stalls == "mid-push":
            slow.result(timeout=30)
        assert result.received == ["fine"] and list(result.dropped) == ["slow"], result
        assert "peer_timeout" in result.dropped["slow"], result
        s.check(a, "fine")
        assert slow.call(dest_version, "slow") == 1
        deadline = time.monotonic() + 10 * PEER_TIMEOUT
        while slow.call(dest_joined, "slow"):
            assert time.monotonic() < deadline, "the resumed destination never learnt it was dropped"
            time.sleep(0.05)
        slow.call(dest_rejoin, "slow")
        s.load(3)
        result = p2p.wait(s.source.push(), 60)
        assert sorted(result.received) == ["fine", "slow"] and result.dropped == {}, result
        assert slow.call(dest_wait, "slow", 3) == 3
        s.check(slow, "slow")
        s.check(a, "fine")


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
        time.sleep(1.0)
        assert not third.done(), "version 3 must wait until version 2 is applied"
        assert a.call(dest_apply, "db") == 2
        p2p.wait(third, 30)
        assert a.call(dest_apply, "db") == 3
        s.check(a, "db")


# -- the example and the benchmark, end to end ----------------------------------------------------------

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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
    import json

    rows = json.loads(out.read_text())
    assert {(r["system"], r["n"]) for r in rows} == {("torch_p2p", 1), ("torch_p2p", 2), ("gloo broadcast", 1),
                                                      ("gloo broadcast", 2)}
    assert all(r["ok"] for r in rows)


# -- GPUs ------------------------------------------------------------------------------------------

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
            if key in peer.call(_keys):
                peer.call(dest_close, key)
        source.close()
        engine.close()


def _keys(state):
    return list(state)
