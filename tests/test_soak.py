"""Soak (issue 5, part 4): >= 100k operations of random sizes and layouts between two peers,
every byte checked.

An *operation* here is one (local view, remote view) pair of a write_slices or read_slices
call: one strided copy of between 1 byte and 2 KiB that the engine turns into one or more
RMA ops (a block with a step makes one RMA op per run). Calls carry 1 to 128 operations.

The peer's region is 8 MiB seen as 4096 cells of 32 x 64 bytes. Each call touches distinct
cells, so its result does not depend on arrival order. The initiator keeps a mirror of what
the peer's region must hold; reads are compared with the mirror as they complete, and a CRC32
of the whole region, computed by the peer, is compared with the mirror's every 200 calls and
at the end. TORCH_P2P_SOAK_OPS sets the number of operations.
"""
import os
import random
import time
import zlib

import pytest
import torch

import peer_helpers as ph
import torch_p2p as p2p
from conftest import engine_kwargs
from peer import Peer

CELLS, ROWS, COLS = 4096, 32, 64
OPS = int(os.environ.get("TORCH_P2P_SOAK_OPS", "100000"))


def _spec(rng: random.Random):
    """A random layout inside one cell: an index tuple over (rows, cols) and whether the local
    side should use a transposed buffer."""
    kind = rng.random()
    if kind < 0.45:  # part of one row: 1 to 64 bytes, one run
        r, c0 = rng.randrange(ROWS), rng.randrange(COLS)
        return (r, slice(c0, rng.randint(c0 + 1, COLS))), False
    if kind < 0.7:  # whole rows: 64 B to 2 KiB, one run
        r0 = rng.randrange(ROWS)
        return (slice(r0, rng.randint(r0 + 1, ROWS)),), False
    r0, c0 = rng.randrange(ROWS), rng.randrange(COLS)
    rows = slice(r0, rng.randint(r0 + 1, min(ROWS, r0 + 8)), rng.choice([1, 1, 2, 3]))
    cols = slice(c0, rng.randint(c0 + 1, COLS), rng.choice([1, 1, 1, 2]))
    if kind < 0.9:  # a strided block
        return (rows, cols), False
    # A small block whose local side is laid out transposed: one run per byte.
    cols = slice(c0, min(COLS, c0 + rng.randint(1, 8)), cols.step)
    return (rows, cols), True


class Soak:
    def __init__(self, engine, remote, seed):
        self.e, self.remote = engine, remote
        self.rng = random.Random(seed)
        g = torch.Generator().manual_seed(seed)
        self.mirror = torch.zeros(CELLS, ROWS, COLS, dtype=torch.uint8)
        self.src = torch.randint(0, 256, (CELLS, ROWS, COLS), dtype=torch.uint8, generator=g)
        self.src_t = torch.randint(0, 256, (CELLS, COLS, ROWS), dtype=torch.uint8, generator=g)  # transposed
        self.dst = torch.zeros(CELLS, ROWS, COLS, dtype=torch.uint8)
        self.dst_t = torch.zeros(CELLS, COLS, ROWS, dtype=torch.uint8)
        self.regions = [engine.register(t) for t in (self.src, self.src_t, self.dst, self.dst_t)]
        self.ops = self.calls = self.bytes = 0

    def _local(self, buf, buf_t, cell, index, transposed):
        if not transposed:
            return buf[cell][index]
        rows, cols = index
        return buf_t[cell][cols, rows].t()  # same shape, transposed strides

    def _views(self, buf, buf_t, k):
        """k random remote cells, each paired with a view of the same index in another random
        cell of buf (or of its transposed twin). Returns [(cell, index, local, remote)] and
        the local cells used."""
        cells = self.rng.sample(range(CELLS), k)
        others = self.rng.sample(range(CELLS), k)
        views = []
        for cell, other in zip(cells, others):
            index, transposed = _spec(self.rng)
            local = self._local(buf, buf_t, other, index, transposed)
            views.append((cell, index, local, self.remote[(cell,) + index]))
            self.bytes += local.numel()
        return views, others

    def write(self, k):
        views, sources = self._views(self.src, self.src_t, k)
        p2p.wait(self.e.write_slices([v[2] for v in views], [v[3] for v in views]), 60)
        for cell, index, local, _ in views:
            self.mirror[cell][index] = local
        # Fresh source bytes for the cells just used, so that stale data would show.
        for source in sources[:8]:
            self.src[source].random_(0, 256)
            self.src_t[source].random_(0, 256)
        self.ops += k
        self.calls += 1

    def read(self, k):
        views, _ = self._views(self.dst, self.dst_t, k)
        for _, _, local, _ in views:
            local.fill_(0)
        p2p.wait(self.e.read_slices([v[2] for v in views], [v[3] for v in views]), 60)
        for i, (cell, index, local, _) in enumerate(views):
            assert torch.equal(local, self.mirror[cell][index]), \
                f"call {self.calls}: read view {i} differs from what was written"
        self.ops += k
        self.calls += 1


@pytest.mark.timeout(300)
@pytest.mark.parametrize("provider", ["tcp", "shm"])
def test_soak(provider):
    ops = OPS // 2  # per provider: both together make OPS
    with Peer() as b, p2p.Engine("cpu", **engine_kwargs(provider)) as a:
        b.call(ph.start_engine, provider)
        remote = p2p.RemoteTensor.from_bytes(b.call(ph.target, "soak", CELLS * ROWS * COLS))
        remote3 = ph.tampered(remote, shape=[CELLS, ROWS, COLS], strides=[ROWS * COLS, COLS, 1])
        soak = Soak(a, remote3, seed=7)
        start = time.monotonic()
        while soak.ops < ops:
            k = soak.rng.choice([1, 2, 8, 32, 64, 128, 128])
            if soak.rng.random() < 0.6:
                soak.write(k)
            else:
                soak.read(k)
            if soak.calls % 200 == 0:
                assert b.call(ph.checksum, "soak") == zlib.crc32(soak.mirror.numpy().tobytes())
        took = time.monotonic() - start
        assert b.call(ph.checksum, "soak") == zlib.crc32(soak.mirror.numpy().tobytes())
        print(f"\n{provider}: {soak.ops} operations in {soak.calls} calls, {soak.bytes / 1e6:.1f} MB, "
              f"{took:.1f} s ({soak.ops / took:.0f} operations/s)")
