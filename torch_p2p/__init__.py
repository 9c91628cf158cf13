"""torch_p2p: point-to-point tensor transfers between GPUs (and hosts) over libfabric.

    import torch_p2p as p2p
    with p2p.Engine("cuda:0") as engine:
        region = engine.register(cache)                 # once
        blob = region.remote.to_bytes()                 # give it to a peer
        fut = engine.write_slices(views, remote)        # -> torch.futures.Future
"""
from . import errors, topology
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

