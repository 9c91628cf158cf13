"""Layouts and plans of weight updates (torch_p2p.weights): which part of which source shard
lands where in a destination, cut into chunks.

A plan is a pure function of the sources' layouts (by rank), the destination's layout and the
chunk size, so every process that needs it (each source, the destination) computes the same
one from the layouts alone; chunk ids travel in notification tags.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math

import torch

Box = tuple  # ((start, stop), ...) per dimension; () for a 0-d tensor

# Pieces of a staged chunk start at multiples of this in a staging slot (dtype alignment).
ALIGN = 64
MAX_CHUNKS = 1 << 20  # chunk ids share a 32-bit notification tag with the version


class PlanError(ValueError):
    """The two sides' tensors cannot be matched; `problems` lists every reason."""

    def __init__(self, problems: list[str]):
        super().__init__("cannot plan the weight update:\n  " + "\n  ".join(problems))
        self.problems = problems


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """What one side holds of one named tensor: the global shape, its slice, its dtype."""
    shape: tuple
    box: Box
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return volume(self.box) * _elem(self.dtype)


def dtype_name(dtype: torch.dtype) -> str:
    """How layouts name a dtype on the wire: "float32", "bfloat16", ..."""
    return str(dtype).removeprefix("torch.")


def parse_dtype(name) -> torch.dtype:
    """The dtype `dtype_name` names ("torch.float32" too); ValueError for anything else."""
    dtype = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype name {name!r} (expected e.g. 'float32', 'bfloat16')")
    return dtype


class Layout:
    """Name -> TensorSpec, in a fixed order. `key` identifies equal layouts (relay groups).
    `to_json()` is the one wire form of a layout: [[name, shape, box, dtype name], ...]."""

    def __init__(self, specs: dict[str, TensorSpec]):
        self.specs = dict(specs)
        self.key = hashlib.sha1(json.dumps(self.to_json()).encode()).hexdigest()[:16]

    def to_json(self) -> list:
        return [[name, list(s.shape), [list(b) for b in s.box], dtype_name(s.dtype)] for name, s in self.specs.items()]

    @classmethod
    def from_json(cls, data) -> "Layout":
        specs = {}
        try:
            for name, shape, box, dtype in data:
                if str(name) in specs:
                    raise ValueError(f"the layout names tensor {str(name)!r} twice")
                specs[str(name)] = TensorSpec(tuple(int(x) for x in shape), tuple((int(a), int(b)) for a, b in box),
                                              parse_dtype(dtype))
        except (TypeError, ValueError) as e:
            raise ValueError(f"not a layout ([[name, shape, box, dtype], ...]): {e}") from None
        for name, s in specs.items():
            if len(s.box) != len(s.shape) or any(not 0 <= a <= b <= n for (a, b), n in zip(s.box, s.shape)):
                raise ValueError(f"{name!r}: box {list(s.box)} is not a slice of shape {list(s.shape)}")
        return cls(specs)

    @classmethod
    def of(cls, tensors: dict) -> "Layout":
        """The layout of whole tensors (name -> tensor)."""
        return cls({name: TensorSpec(tuple(t.shape), tuple((0, n) for n in t.shape), t.dtype)
                    for name, t in tensors.items()})

    def whole(self) -> bool:
        """Whether every tensor is held whole (each box its full shape)."""
        return all(s.box == tuple((0, n) for n in s.shape) for s in self.specs.values())

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.specs.values())


@dataclasses.dataclass(frozen=True)
class Piece:
    """One slice moving from a source shard to a destination shard (boxes in each side's own
    tensor coordinates)."""
    name: str
    src: Box
    dst: Box
    nbytes: int      # at the destination's dtype
    dtype: torch.dtype  # the destination's
    convert: bool    # the dtypes differ: the bytes go through the source's staging buffer


@dataclasses.dataclass(frozen=True)
class Chunk:
    """What one write with one notification moves: pieces of one source rank."""
    id: int
    source: int
    pieces: tuple
    nbytes: int
    staged_bytes: int  # room it takes in a staging slot (converted pieces, aligned)


@dataclasses.dataclass
class Plan:
    chunks: list
    unused: list     # source names the destination does not take
    nbytes: int

    def of_source(self, rank: int) -> list:
        return [c for c in self.chunks if c.source == rank]


def volume(box: Box) -> int:
    return math.prod(stop - start for start, stop in box)


def _elem(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _intersect(a: Box, b: Box):
    """The common part of two boxes, or None."""
    out = tuple((max(a0, b0), min(a1, b1)) for (a0, a1), (b0, b1) in zip(a, b))
    return out if all(s < e for s, e in out) else None


def _shift(box: Box, origin: Box) -> Box:
    return tuple((s - o, e - o) for (s, e), (o, _) in zip(box, origin))


def _split(box: Box, elem: int, limit: int):
    """Cuts a box along its outermost dimensions into boxes of at most `limit` bytes."""
    if volume(box) * elem <= limit or not box:
        yield box
        return
    d = next(i for i, (s, e) in enumerate(box) if e - s > 1)
    s, e = box[d]
    slab = volume(box[d + 1:]) * elem  # bytes of one index along d
    if slab > limit:
        for i in range(s, e):
            yield from _split(box[:d] + ((i, i + 1),) + box[d + 1:], elem, limit)
        return
    step = limit // slab
    for i in range(s, e, step):
        yield box[:d] + ((i, min(e, i + step)),) + box[d + 1:]


def _chosen_shards(index: int, holders: list) -> list:
    """The source shards one destination tensor reads from: each distinct slice once, from one
    of the ranks holding it (spread over them by tensor), checked to be disjoint."""
    by_box: dict = {}
    for rank, box in holders:
        by_box.setdefault(box, []).append(rank)
    chosen = sorted((box, ranks[index % len(ranks)]) for box, ranks in by_box.items())
    return [(rank, box) for box, rank in chosen]


def _overlap(shards: list):
    """A pair of overlapping shards, or None. Sorted by start, only neighbours along dim 0
    need comparing (cheap for dim-0 shards of many ranks)."""
    if len(shards) < 2 or not shards[0][1]:  # 0-d tensors have one slice
        return None
    for i, (ra, a) in enumerate(shards):
        for rb, b in shards[i + 1:]:
            if b[0][0] >= a[0][1]:
                break
            if _intersect(a, b) is not None:
                return (ra, a), (rb, b)
    return None


def make_plan(sources: list[Layout], dest: Layout, chunk_bytes: int) -> Plan:
    """Every destination slice's source parts, cut into chunks of at most `chunk_bytes` (a
    piece larger than that is cut along its outer dimensions). Raises PlanError naming every
    tensor that cannot be matched, before anything moves."""
    if chunk_bytes < ALIGN:
        raise ValueError(f"chunk_bytes must be at least {ALIGN}, not {chunk_bytes}")
    problems: list[str] = []
    pieces: dict[int, list] = {r: [] for r in range(len(sources))}
    for index, (name, d) in enumerate(dest.specs.items()):
        holders = []
        for rank, layout in enumerate(sources):
            s = layout.specs.get(name)
            if s is None:
                continue
            if s.shape != d.shape:
                problems.append(f"{name}: the destination's global shape {list(d.shape)} differs from "
                                f"source rank {rank}'s {list(s.shape)}")
                continue
            holders.append((rank, s.box))
        if not holders:
            if not any(p.startswith(f"{name}:") for p in problems):
                problems.append(f"{name}: no source holds it")
            continue
        shards = _chosen_shards(index, holders)
        if pair := _overlap(shards):
            (ra, a), (rb, b) = sorted(pair)
            problems.append(f"{name}: source ranks {ra} and {rb} hold different overlapping slices "
                            f"{[list(x) for x in a]} and {[list(x) for x in b]}")
            continue
        covered = 0
        elem = _elem(d.dtype)
        for rank, box in shards:
            part = _intersect(box, d.box)
            if part is None:
                continue
            covered += volume(part)
            convert = sources[rank].specs[name].dtype != d.dtype
            # A converted piece takes its size rounded up to ALIGN in a slot of chunk_bytes.
            limit = chunk_bytes // ALIGN * ALIGN if convert else chunk_bytes
            for sub in _split(part, elem, limit):
                pieces[rank].append(Piece(name, _shift(sub, box), _shift(sub, d.box), volume(sub) * elem, d.dtype,
                                          convert))
        if covered != volume(d.box):
            problems.append(f"{name}: the sources hold {covered} of the {volume(d.box)} elements of the "
                            f"destination's slice {[list(x) for x in d.box]}")
    if problems:
        raise PlanError(problems)
    chunks = _pack(pieces, chunk_bytes)
    if len(chunks) > MAX_CHUNKS:
        raise PlanError([f"{len(chunks)} chunks is more than {MAX_CHUNKS}: raise chunk_bytes"])
    unused = sorted({n for layout in sources for n in layout.specs} - set(dest.specs))
    return Plan(chunks, unused, sum(c.nbytes for c in chunks))


def _pack(pieces: dict[int, list], chunk_bytes: int) -> list:
    """Consecutive pieces of each source rank, packed into chunks of at most chunk_bytes."""
    chunks: list = []
    for rank in sorted(pieces):
        group: list = []
        size = staged = 0
        for p in pieces[rank]:
            room = -(-p.nbytes // ALIGN) * ALIGN if p.convert else 0
            if group and (size + p.nbytes > chunk_bytes or staged + room > chunk_bytes):
                chunks.append(Chunk(len(chunks), rank, tuple(group), size, staged))
                group, size, staged = [], 0, 0
            group.append(p)
            size += p.nbytes
            staged += room
        if group:
            chunks.append(Chunk(len(chunks), rank, tuple(group), size, staged))
    return chunks
