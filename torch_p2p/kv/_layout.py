"""Layouts of paged KV caches: naming the axes, cutting token pools into blocks,
registering shared storages once, and pairing one side's stores with the other's.

A side holds, per layer, a list of stores (label, tensor or RemoteTensor), all with the same
axes. Labels: "kv" (a block holds its K and V: a kv axis inside the block), "kvflat" (K of
block b is page b and V is page num_blocks + b of one axis), "k", "v", or "latent" (MLA).
Layouts whose kv axis lies outside the block (vLLM's FlashAttention one) become "kvflat" where
the strides allow, so that a layer is one pages entry whose pages are single runs, else "k"
and "v".
"""
from __future__ import annotations

import torch

from .. import _C
from .._shared import by_storage

LAYOUTS = {
    "flash_attn": "kv blocks tokens heads dim",  # vLLM's FlashAttention backend, one tensor per layer
    "flashinfer": "blocks kv tokens heads dim",  # vLLM's FlashInfer backend
    "mla": "blocks tokens dim",                  # one latent per token (DeepSeek MLA)
    "sglang": "tokens heads dim",                # SGLang's token pool: a (K, V) pair per layer, a page size
}
AXES = ("layers", "kv", "blocks", "tokens", "heads", "dim")
_ALL = slice(None)


def parse_layout(layout: str) -> tuple:
    if not isinstance(layout, str):
        raise TypeError(f"a layout is a string, not {type(layout).__name__}")
    axes = tuple(LAYOUTS.get(layout, layout).split())
    for a in axes:
        if a not in AXES:
            raise ValueError(f"unknown axis {a!r} in layout {layout!r}: use {', '.join(AXES)} "
                             f"or one of the layouts {sorted(LAYOUTS)}")
    if len(set(axes)) != len(axes) or "tokens" not in axes or "dim" not in axes:
        raise ValueError(f"layout {layout!r} must name 'tokens' and 'dim', and each axis once")
    return axes


def normalize(layers, axes: tuple, block_size: int | None) -> tuple[list, tuple]:
    """The user's tensors as stores per layer, and their axes (see the module's docstring)."""
    stores, axes = _per_layer(layers, axes)
    stores, axes = _blocked(stores, axes, block_size)
    return _fold_kv(stores, axes)


def _per_layer(layers, axes: tuple) -> tuple[list, tuple]:
    if isinstance(layers, torch.Tensor):
        if "layers" not in axes:
            if layers.dim() != len(axes) + 1:
                raise ValueError(f"a stacked cache has a layers axis before [{' '.join(axes)}]: expected "
                                 f"{len(axes) + 1} dimensions, got shape {tuple(layers.shape)}")
            axes = ("layers",) + axes
        d = axes.index("layers")
        layers = list(layers.unbind(d))
        axes = axes[:d] + axes[d + 1:]
    elif "layers" in axes:
        raise ValueError("a layout with a layers axis takes one stacked tensor")
    stores = []
    for i, layer in enumerate(layers):
        if isinstance(layer, torch.Tensor):
            stores.append([("kv" if "kv" in axes else "latent", layer)])
        elif isinstance(layer, (tuple, list)) and len(layer) == 2 and "kv" not in axes:
            stores.append([("k", layer[0]), ("v", layer[1])])
        else:
            raise TypeError(f"layer {i}: expected a tensor" + ("" if "kv" in axes else " or a (K, V) pair"))
        for label, x in stores[-1]:
            if not isinstance(x, torch.Tensor) or x.dim() != len(axes):
                raise ValueError(f"layer {i} ({label}): expected a tensor of {len(axes)} dimensions "
                                 f"[{' '.join(axes)}], got {getattr(x, 'shape', type(x).__name__)}")
    if not stores:
        raise ValueError("a KV cache needs at least one layer")
    first = stores[0][0][1]
    for i, layer in enumerate(stores):
        for label, x in layer:
            if x.shape != first.shape or x.dtype != first.dtype:
                raise ValueError(f"layer {i} ({label}) is {tuple(x.shape)} {x.dtype}, layer 0 {tuple(first.shape)} "
                                 f"{first.dtype}: every store must be alike")
    return stores, axes


def _blocked(stores: list, axes: tuple, block_size: int | None) -> tuple[list, tuple]:
    """Token-granular stores cut into blocks of `block_size` tokens (a view)."""
    t = axes.index("tokens")
    tokens = stores[0][0][1].shape[t]
    if "blocks" in axes:
        if block_size is not None and block_size != tokens:
            raise ValueError(f"block_size {block_size}, but the tokens axis has {tokens}")
        return stores, axes
    if not block_size or block_size < 1:
        raise ValueError(f"layout [{' '.join(axes)}] is token-granular: give block_size (the page size)")
    n = tokens // block_size
    out = [[(label, x.narrow(t, 0, n * block_size).unflatten(t, (n, block_size))) for label, x in layer]
           for layer in stores]
    return out, axes[:t] + ("blocks",) + axes[t:]


def _fold_kv(stores: list, axes: tuple) -> tuple[list, tuple]:
    if "kv" not in axes or axes.index("kv") > axes.index("blocks"):
        return stores, axes
    kv, b = axes.index("kv"), axes.index("blocks")
    rest = axes[:kv] + axes[kv + 1:]
    xs = [x for layer in stores for _, x in layer]
    if b == kv + 1 and all(x.size(kv) == 2 and x.stride(kv) == x.size(b) * x.stride(b) for x in xs):
        return [[("kvflat", x.flatten(kv, b)) for _, x in layer] for layer in stores], rest
    return [[kv_half for _, x in layer for kv_half in (("k", x.select(kv, 0)), ("v", x.select(kv, 1)))]
            for layer in stores], rest


def stack_by_storage(stores: list) -> tuple[list, list]:
    """(bases to register, refs): refs[layer] = [(label, base, k)], the store being bases[base]
    (k < 0) or bases[base][k]. Stores sharing a storage become one evenly spaced stack, as the
    engine registers a storage once."""
    groups = by_storage(((i, j), x) for i, layer in enumerate(stores) for j, (_, x) in enumerate(layer))
    bases, where = [], {}
    for group in groups.values():
        members = sorted(((x.storage_offset(), i, j, x) for (i, j), x in group), key=lambda m: m[0])
        start, x0 = members[0][0], members[0][3]
        if len(members) == 1:
            where[members[0][1:3]] = (len(bases), -1)
            bases.append(x0)
            continue
        step = members[1][0] - start
        for k, (offset, i, j, x) in enumerate(members):
            if step <= 0 or offset != start + k * step or x.shape != x0.shape or x.stride() != x0.stride():
                raise ValueError(f"layer {i} shares a storage with other stores but is not one of evenly "
                                 "spaced views of one shape: give each layer its own tensor, or views of one")
            where[(i, j)] = (len(bases), k)
        bases.append(x0.as_strided((len(members), *x0.shape), (step, *x0.stride()), start))
    refs = [[(label, *where[(i, j)]) for j, (label, _) in enumerate(layer)] for i, layer in enumerate(stores)]
    return bases, refs


def derive(bases: list, refs: list) -> list:
    return [[(label, bases[b] if k < 0 else bases[b][k]) for label, b, k in layer] for layer in refs]


def describe(axes: tuple, layers: list, what: str) -> dict:
    """num_blocks, block_size, head_dim, heads (a count or None), dtype; checks that every
    layer holds the same stores."""
    labels = [label for label, _ in layers[0]]
    if labels not in (["kv"], ["kvflat"], ["k", "v"], ["latent"]) or (labels == ["kv"]) != ("kv" in axes):
        raise ValueError(f"{what}: a layer of [{' '.join(axes)}] cannot hold the stores {labels}")
    first = layers[0][0][1]
    for i, stores in enumerate(layers):
        if [label for label, _ in stores] != labels:
            raise ValueError(f"{what}: layer {i} holds {[s for s, _ in stores]}, layer 0 {labels}")
        for label, x in stores:
            if tuple(x.shape) != tuple(first.shape) or x.dtype != first.dtype:
                raise ValueError(f"{what}: layer {i} ({label}) is {tuple(x.shape)} {x.dtype}, layer 0 "
                                 f"{tuple(first.shape)} {first.dtype}: every store must be alike")
    size = dict(zip(axes, first.shape))
    if len(size) != len(first.shape) or size.get("kv", 2) != 2 or (labels[0] == "kvflat" and size["blocks"] % 2):
        raise ValueError(f"{what}: stores of shape {tuple(first.shape)} do not fit [{' '.join(axes)}]")
    return dict(num_blocks=size["blocks"] // (2 if labels[0] == "kvflat" else 1), block_size=size["tokens"],
                head_dim=size["dim"], heads=size.get("heads"), dtype=first.dtype)


def check_compatible(mine, peer) -> None:
    holds = [_holds(c) for c in (mine, peer)]
    if holds[0] != holds[1]:
        raise ValueError(f"the caches do not match: this one holds {holds[0]}, the peer's {holds[1]}")
    facts = [("dtype", mine.dtype, peer.dtype), ("layer count", mine.num_layers, peer.num_layers),
             ("block size", mine.block_size, peer.block_size), ("head dim", mine.head_dim, peer.head_dim),
             ("heads axis", mine.heads is not None, peer.heads is not None)]
    for what, a, b in facts:
        if a != b:
            raise ValueError(f"the caches do not match: {what} {a} here, {b} in the peer's")
    if mine.heads and max(mine.heads[0], peer.heads[0]) >= min(mine.heads[1], peer.heads[1]):
        raise ValueError(f"the caches share no KV heads: heads {mine.heads} here, {peer.heads} in the peer's")


def _holds(side) -> str:
    return "one latent per token (MLA)" if side.layers[0][0][0] == "latent" else "K and V"


def pair(mine, peer, layer: int) -> list:
    """(local view, remote view, block dim, kvflat on both sides) for one layer. Stores
    pair whole where both sides hold them alike; otherwise K pairs with K and V with V, the
    local view permuted to the peer's axis order. Both views are sliced to the KV heads both
    sides hold."""
    local, remote = mine.layers[layer], peer.layers[layer]
    if mine.axes == peer.axes and [s for s, _ in local] == [s for s, _ in remote]:
        pairs = [(x, rx, mine.axes, s == "kvflat") for (s, x), (_, rx) in zip(local, remote)]
    else:
        lc = dict(_components(local, mine.axes, mine.num_blocks))
        pairs = []
        for label, (rx, raxes) in _components(remote, peer.axes, peer.num_blocks):
            x, laxes = lc[label]
            pairs.append((x.permute([laxes.index(a) for a in raxes]), rx, raxes, False))
    out = []
    for x, rx, axes, flat in pairs:
        if mine.heads != peer.heads:
            (a, b), (c, d) = mine.heads, peer.heads
            lo, hi = max(a, c), min(b, d)
            h = (_ALL,) * axes.index("heads")
            x, rx = x[h + (slice(lo - a, hi - a),)], rx[h + (slice(lo - c, hi - c),)]
        out.append((x, rx, axes.index("blocks"), flat))
    return out


def _components(stores, axes, num_blocks):
    """(label, (view, axes)) per K, V or latent component of a layer's stores."""
    for label, x in stores:
        if label == "kv":
            d = axes.index("kv")
            rest = axes[:d] + axes[d + 1:]
            yield "k", (x[(_ALL,) * d + (0,)], rest)
            yield "v", (x[(_ALL,) * d + (1,)], rest)
        elif label == "kvflat":
            b = (_ALL,) * axes.index("blocks")
            yield "k", (x[b + (slice(0, num_blocks),)], axes)
            yield "v", (x[b + (slice(num_blocks, 2 * num_blocks),)], axes)
        else:
            yield label, (x, axes)


def block_ids(ids, count: int, what: str, unique: bool = False) -> torch.Tensor:
    """Block ids as a 1-D int64 CPU tensor, checked against a cache of `count` blocks."""
    # NOTE: this runs twice per request, on its critical path: a list of good ids takes the
    # native check (1-2 us for 256 ids, against 15 in Python and 25 for torch.as_tensor). What
    # it refuses comes here and is checked again, to name the problem.
    if isinstance(ids, (list, tuple)):
        fast = _C.checked_ids(ids, count, unique)
        if fast is not None:
            return fast
        if ids and set(map(type, ids)) == {int}:  # ints it refused: out of range (or past int64), or repeated
            if min(ids) < 0 or max(ids) >= count:
                _out_of_range(next(i for i in ids if not 0 <= i < count), count, what)
            _twice(ids, what)
    t = torch.arange(ids.start, ids.stop, ids.step) if isinstance(ids, range) else torch.as_tensor(ids)
    if t.numel() and (t.dtype == torch.bool or t.dtype.is_floating_point or t.dtype.is_complex):
        raise TypeError(f"{what} block ids must be integers, not {t.dtype}")
    t = t.to(device="cpu", dtype=torch.int64).contiguous()
    if t.dim() != 1:
        raise ValueError(f"{what} block ids must be one-dimensional, not of shape {tuple(t.shape)}")
    if t.numel():
        lo, hi = torch.aminmax(t)
        if lo < 0 or hi >= count:
            _out_of_range(int(t[(t < 0) | (t >= count)][0]), count, what)
        if unique and torch.unique(t).numel() != t.numel():
            _twice(t.tolist(), what)
    return t


def _out_of_range(block: int, count: int, what: str):
    raise IndexError(f"{what} block {block} is out of range for a cache of {count} blocks")


def _twice(ids: list, what: str):
    seen = set()
    twice = next(i for i in ids if i in seen or seen.add(i))
    raise ValueError(f"{what} block {twice} is named twice")
