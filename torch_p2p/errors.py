"""Exceptions raised by torch_p2p, synchronously or through a Future.

Bad arguments raise the builtin ValueError / IndexError / TypeError. Everything else is a
P2PError; its message names the operation, the peer and, where there is one, the libfabric
error.
"""
import builtins


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


# Error kinds as numbered by csrc/common/error.h (ErrorKind).
_BY_KIND = {
    1: P2PError,
    2: ValueError,
    3: IndexError,
    4: PeerError,
    5: TimeoutError,
    6: ClosedError,
    7: CancelledError,
    8: RemoteError,
}


def from_kind(kind: int, message: str) -> Exception:
    return _BY_KIND.get(kind, P2PError)(message)
