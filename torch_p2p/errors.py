"""Exceptions raised by torch_p2p, synchronously or through a Future.

Bad arguments raise the builtin ValueError / IndexError / TypeError. Everything else is a
P2PError; its message names the operation, the peer and, where there is one, the libfabric
error.
"""
import builtins

import torch  # noqa: F401  (loads libtorch, which _C links against, before _C)

from . import _C


class P2PError(RuntimeError):
    """An operation failed."""


class PeerError(P2PError):
    """The peer is dead, left, restarted, or cannot be reached."""


class TimeoutError(P2PError, builtins.TimeoutError):
    """An operation did not finish within its timeout."""


class ClosedError(P2PError):
    """The engine or region was closed."""


class CancelledError(P2PError):
    """The operation was cancelled."""


class RemoteError(P2PError):
    """The peer refused the operation (access, bounds, or a deregistered region)."""


# Error kinds as csrc/common/error.h numbers them (P2P_ERROR_KINDS), each naming its exception:
# one of the classes above, or a builtin.
_BY_KIND = {kind: globals().get(name) or getattr(builtins, name) for kind, name in _C.error_kinds.items()}


def from_kind(kind: int, message: str) -> Exception:
    return _BY_KIND.get(kind, P2PError)(message)
