"""What the torch_p2p.weights tests share: a miniature model and its layouts (whole, TP, fused,
FSDP), the destination steps that run in Peer children (each takes `state` first), and Setup:
a source in this process and destinations in peers."""
import os
import signal
import time

import torch

import torch_p2p as p2p
import torch_p2p.weights as pw
from conftest import PEER_TIMEOUT, engine_kwargs


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


BIG = {"w": (2048, 1024)}  # 8 MiB: 128 chunks of 64 KiB


def dest_relayed(state, key) -> int:
    """Bytes this destination wrote to its relay children in the last version."""
    fanout = state[key][1]._impl.incoming.fanout
    return 0 if fanout is None else fanout.sent_bytes


def dest_version(state, key):
    return state[key][1].version


def dest_rejoin(state, key) -> int:
    return len(p2p.wait(state[key][1].join(), 30).chunks)


def keys(state) -> list:
    """The keys of what this child holds."""
    return list(state)
