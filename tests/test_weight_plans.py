"""torch_p2p.weights plans, with no processes: every piece a plan names, copied locally, makes
the destination's layout (whole, TP rows and columns, fused, FSDP shards) bitwise; replicated
tensors are read once; unmatched names and shapes are all reported."""
import pytest
import torch

import torch_p2p.weights as pw
from weight_setup import SHAPES, TP_DIMS, assert_equal, expected, model, owned, shards_of


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


def test_a_layout_that_names_a_tensor_twice_is_refused():
    """Layout.from_json (what every receiver reads from the trainer) refuses a name given twice."""
    entry = ["w", [4], [[0, 4]], "float32"]
    assert list(pw.Layout.from_json([entry]).specs) == ["w"]
    with pytest.raises(ValueError, match="names tensor 'w' twice"):
        pw.Layout.from_json([entry, entry])
