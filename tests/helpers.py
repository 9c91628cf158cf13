"""Functions that run inside Peer children (see peer.py): each takes `state` first."""
from __future__ import annotations

import torch

import torch_p2p as p2p
from conftest import engine_kwargs, shares_memory


def start_engine(state, provider: str, *, key: str = "engine", device: str = "cpu", **kwargs) -> bytes:
    """Creates state[key] (several engines per child: one key each); returns its address.
    Host tensors registered for it go to shared memory first where `provider` says so
    (conftest.shares_memory)."""
    state[key] = p2p.Engine(device, **engine_kwargs(provider, **kwargs))
    state[key + ".shared"] = shares_memory(provider)
    return state[key].address


def close_engine(state, key: str = "engine") -> None:
    state.pop(key).close()
    state.pop(key + ".shared", None)


def _shared(state, t: torch.Tensor, engine: str = "engine") -> torch.Tensor:
    if state.get(engine + ".shared") and t.device.type == "cpu":
        t.share_memory_()
    return t


def make_target(state, name: str, shape, dtype=torch.float32, fill: float = -1.0, access: str = "rw",
                device: str = "cpu") -> bytes:
    """Registers a tensor filled with `fill` under `name`; returns its RemoteTensor bytes."""
    t = _shared(state, torch.full(shape, fill, dtype=dtype, device=device))
    state[name] = t
    state[f"{name}.region"] = state["engine"].register(t, access=access)
    return state[f"{name}.region"].remote.to_bytes()


def target(state, name: str, nbytes: int, fill: int = 0, access: str = "rw") -> bytes:
    """make_target of `nbytes` bytes."""
    return make_target(state, name, (nbytes,), torch.uint8, fill, access)


def fetch(state, name: str) -> torch.Tensor:
    return state[name].cpu().clone()


def put(state, name: str, value: torch.Tensor) -> None:
    state[name].copy_(value)


def close_region(state, name: str) -> None:
    state[f"{name}.region"].close()


# -- Seeded data, poison and bitwise comparison (both sides) -----------------------------------

POISON = 0xA5  # every byte of a destination before a transfer: untouched bytes must keep it

_SAME_SIZE_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def random_tensor(shape, dtype, seed: int) -> torch.Tensor:
    """Seeded random contents, the same in every process. Floating and complex dtypes get
    random bit patterns (NaNs and infinities included, hence bitwise comparisons); bool gets 0
    and 1."""
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g, dtype=torch.bool)
    nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    return torch.randint(0, 256, (nbytes,), generator=g, dtype=torch.uint8).view(dtype).reshape(shape)


def poisoned(shape, dtype) -> torch.Tensor:
    t = torch.empty(shape, dtype=dtype)
    t.untyped_storage().fill_(POISON)
    return t


def bits(t: torch.Tensor) -> torch.Tensor:
    """The same elements as integers of the same size: exact copies and comparisons, where
    float comparison says NaN != NaN."""
    return t.view(_SAME_SIZE_INT[t.element_size()])


def assert_same_bits(got: torch.Tensor, expected: torch.Tensor) -> None:
    assert got.shape == expected.shape and got.dtype == expected.dtype
    wrong = (bits(got) != bits(expected)).nonzero()
    assert len(wrong) == 0, (f"{len(wrong)} of {got.numel()} elements differ, the first at "
                             f"{wrong[0].tolist()}")


# -- Regions of named engines ------------------------------------------------------------------

def make_region(state, name: str, shape, dtype=torch.float32, seed: int | None = None, access: str = "rw",
                transpose: bool = False, engine: str = "engine") -> bytes:
    """Registers a contiguous tensor of `shape` under `name`: seeded random contents, or poison
    when seed is None. With transpose the registered tensor (so the handle) is its 2-D
    transpose. Returns the RemoteTensor bytes."""
    t = _shared(state, poisoned(shape, dtype) if seed is None else random_tensor(shape, dtype, seed), engine)
    state[name] = t
    state[f"{name}.region"] = state[engine].register(t.t() if transpose else t, access=access)
    return state[f"{name}.region"].remote.to_bytes()


def make_expanded(state, name: str, rows: int, cols: int, engine: str = "engine") -> bytes:
    """Registers a [rows, cols] float32 tensor whose rows all share one row of storage
    (stride 0): a handle with overlapping elements."""
    t = _shared(state, poisoned((cols,), torch.float32), engine)
    state[name] = t
    state[f"{name}.region"] = state[engine].register(t.expand(rows, cols))
    return state[f"{name}.region"].remote.to_bytes()


def drop(state, name: str) -> None:
    """Deregisters and forgets `name`, so that a long-lived peer does not pile up memory."""
    state.pop(f"{name}.region").close()
    state.pop(name)


def write_random_into(state, dst: p2p.RemoteTensor, seed: int, engine: str = "engine") -> None:
    """Writes seeded random data shaped like `dst` into it, from a freshly registered tensor.
    `dst` arrives pickled, as any handle sent to another process would."""
    src = random_tensor(tuple(dst.shape), dst.dtype, seed)
    with state[engine].register(src):
        p2p.wait(state[engine].write_slices([src], [dst]), timeout=60)


# -- The parent's side of a two-process test ---------------------------------------------------

class Link:
    """An engine in this process and one in a peer child, both for `provider`.

    `options` go to both engines, `remote_options` override them in the peer. Each Link keeps
    its child engine under its own key, so several Links can share one (slow to start) child.
    """

    _started = 0

    def __init__(self, peer, provider: str, *, remote_options: dict | None = None, **options):
        self.peer = peer
        self.provider = provider
        Link._started += 1
        self.key = f"engine-{Link._started}"
        self._regions = 0
        peer.call(start_engine, provider, key=self.key, **{**options, **(remote_options or {})})
        try:
            self.engine = p2p.Engine("cpu", **engine_kwargs(provider, **options))
        except BaseException:
            peer.call(close_engine, self.key)
            raise

    def remote(self, shape, dtype=torch.float32, *, seed: int | None = None, access: str = "rw",
               transpose: bool = False) -> tuple[str, p2p.RemoteTensor]:
        """Registers a tensor in the peer (see make_region); returns its name and handle."""
        name = self._new_name()
        blob = self.peer.call(make_region, name, shape, dtype, seed=seed, access=access, transpose=transpose,
                              engine=self.key)
        return name, p2p.RemoteTensor.from_bytes(blob)

    def expanded(self, rows: int, cols: int) -> tuple[str, p2p.RemoteTensor]:
        name = self._new_name()
        return name, p2p.RemoteTensor.from_bytes(self.peer.call(make_expanded, name, rows, cols, engine=self.key))

    def fetch(self, name: str) -> torch.Tensor:
        """The peer's tensor `name` (its contiguous base, also for transposed registrations)."""
        return self.peer.call(fetch, name)

    def drop(self, name: str) -> None:
        self.peer.call(drop, name)

    def close(self) -> None:
        self.engine.close()
        self.peer.call(close_engine, self.key)

    def _new_name(self) -> str:
        self._regions += 1
        return f"{self.key}/t{self._regions}"
