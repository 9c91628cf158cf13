"""The actor the Ray tests drive (its own module, so that Ray's workers import it by name): it
returns tensors through TORCH_P2P and checks the tensors it is given. Its "probe" methods run
on a thread of their own, so they answer while a fetch blocks the actor's other threads.

Ray checks a method's tensor_transport name when the class is defined: the module registers
TORCH_P2P first, in the driver and in every worker that imports it."""
from __future__ import annotations

import hashlib
import math
import os

import ray
import torch

import torch_p2p.integrations.ray as p2p_ray

p2p_ray.register()


def random_tensor(shape, dtype: torch.dtype, generator: torch.Generator) -> torch.Tensor:
    """Random bytes of `shape` and `dtype` (NaN payloads included: compare bytes, not values)."""
    raw = torch.empty(math.prod(shape) * dtype.itemsize, dtype=torch.uint8).random_(generator=generator)
    if dtype is torch.bool:
        raw %= 2
    return raw.view(dtype).reshape(shape)


def sample_tensors(seed: int) -> list[torch.Tensor]:
    """Dtypes, shapes and layouts a transport must carry: a 0-d and an empty tensor, views that
    are not contiguous (transposed, strided with an offset, broadcast), and views of one storage
    in two dtypes."""
    g = torch.Generator().manual_seed(seed)
    shared = random_tensor((64,), torch.uint8, g)
    return [
        random_tensor((3, 5), torch.float32, g),
        random_tensor((7,), torch.float16, g),
        random_tensor((2, 3, 4), torch.bfloat16, g),
        random_tensor((), torch.int64, g),
        random_tensor((17,), torch.bool, g),
        random_tensor((4, 4), torch.complex64, g),
        random_tensor((0, 3), torch.float64, g),
        random_tensor((6, 10), torch.int32, g).t(),
        random_tensor((8, 16), torch.float32, g)[1::3, 2:14:5],
        random_tensor((1, 5), torch.float32, g).expand(3, 5),
        shared[8:40].view(torch.int32),
        shared[::2],
    ]


def digest(t: torch.Tensor) -> str:
    """dtype, shape and every byte of `t`."""
    data = t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return hashlib.sha256(f"{t.dtype}{tuple(t.shape)}".encode() + data).hexdigest()


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@ray.remote(num_cpus=0, enable_tensor_transport=True, concurrency_groups={"probe": 1})
class Node:
    def pid(self) -> int:
        return os.getpid()

    # -- owner -------------------------------------------------------------------------------
    @ray.method(tensor_transport="TORCH_P2P")
    def sample(self, seed: int) -> list[torch.Tensor]:
        return sample_tensors(seed)

    @ray.method(tensor_transport="TORCH_P2P")
    def random(self, nbytes: int, seed: int) -> list[torch.Tensor]:
        return [random_tensor((nbytes // 4,), torch.float32, torch.Generator().manual_seed(seed))]

    @ray.method(tensor_transport="TORCH_P2P")
    def numbered(self, n: int, elems: int) -> torch.Tensor:
        """A new tensor each call (a new storage to register each time), holding n."""
        return torch.full((elems,), n, dtype=torch.int64)

    def digests_of(self, seed: int, nbytes: int = 0) -> list[str]:
        """The digests of what sample(seed) (or random(nbytes, seed)) returns, made here."""
        tensors = sample_tensors(seed) if not nbytes else [
            random_tensor((nbytes // 4,), torch.float32, torch.Generator().manual_seed(seed))]
        return [digest(t) for t in tensors]

    # -- receiver ----------------------------------------------------------------------------
    @ray.method(tensor_transport="TORCH_P2P")
    def relay(self, tensors) -> list[torch.Tensor]:
        """Returns the tensors it received through TORCH_P2P, as they arrived (views of the
        receive pool's buffer): owner -> this relay -> whoever asks."""
        return tensors

    def digests(self, tensors) -> list[str]:
        return [digest(t) for t in (tensors if isinstance(tensors, list) else [tensors])]

    def keep(self, tensors) -> list[str]:
        """Holds on to `tensors` (a fetch's, on the receive pool's buffer) and returns their
        digests; kept_digests() says what they hold later."""
        self._kept = tensors if isinstance(tensors, list) else [tensors]
        return self.kept_digests()

    def kept_digests(self) -> list[str]:
        return [digest(t) for t in self._kept]

    def numbered_check(self, t: torch.Tensor) -> int:
        """n if every element of a numbered() tensor is n, else -1."""
        n = int(t[0])
        return n if bool((t == n).all()) else -1

    # -- probes ------------------------------------------------------------------------------
    @ray.method(concurrency_group="probe")
    def engine_address(self) -> bytes:
        from ray.experimental.rdt.util import get_tensor_transport_manager

        return get_tensor_transport_manager("TORCH_P2P").engine("cpu").address

    @ray.method(concurrency_group="probe")
    def route_to(self, address: bytes) -> str:
        """The route this process's cpu engine takes to the engine at `address`."""
        from ray.experimental.rdt.util import get_tensor_transport_manager

        return get_tensor_transport_manager("TORCH_P2P").engine("cpu").route(address)

    @ray.method(concurrency_group="probe")
    def counts(self) -> dict:
        """The transport's counts in this process (zeros before its first use) and its RSS."""
        from ray.experimental.rdt.util import get_tensor_transport_manager, transport_manager_info

        counts = dict.fromkeys(["storages", "engine_regions", "objects", "fetches", "pool_idle", "pool_idle_bytes",
                                "pool_leased"], 0)
        if "TORCH_P2P" in transport_manager_info:
            counts = get_tensor_transport_manager("TORCH_P2P").counts()
        return dict(counts, rss=rss_bytes())

    @ray.method(concurrency_group="probe")
    def abort(self, obj_id: str) -> None:
        """What Ray's driver does to a receiver when a transfer fails or hangs."""
        from ray.experimental.rdt.util import get_tensor_transport_manager

        get_tensor_transport_manager("TORCH_P2P").abort_transport(obj_id, None)
