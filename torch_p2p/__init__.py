"""torch_p2p: point-to-point tensor transfers between GPUs (and hosts) over libfabric.

    import torch_p2p as p2p
    with p2p.Engine("cuda:0") as engine:
        region = engine.register(cache)                 # once
        blob = region.remote.to_bytes()                 # give it to a peer
        fut = engine.write_slices(views, remote)        # -> torch.futures.Future
"""
import torch  # noqa: F401  (loads libtorch, which _C links against, before _C)

from ._signals import kept_handlers

with kept_handlers():  # libfabric's PSM libraries install signal handlers as they load
    from . import _C  # noqa: F401
from . import errors, topology  # noqa: E402
from .engine import Engine, Pages, PreparedCall, Region, pages
from ._shared import wait
from .errors import CancelledError, ClosedError, P2PError, PeerError, RemoteError, TimeoutError
from .remote import RemoteTensor

__version__ = "0.1.0"

__all__ = [
    "Engine",
    "Region",
    "Pages",
    "pages",
    "PreparedCall",
    "RemoteTensor",
    "P2PError",
    "PeerError",
    "TimeoutError",
    "ClosedError",
    "CancelledError",
    "RemoteError",
    "errors",
    "topology",
    "wait",
]

