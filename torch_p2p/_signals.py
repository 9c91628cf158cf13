"""The signal handlers a process had before torch_p2p's native module loaded, kept.

Debian's libfabric links the PSM providers' libraries, and libinfinipath's constructor
installs handlers for SIGILL, SIGABRT, SIGBUS, SIGSEGV and SIGTERM as it loads: they replace
whatever the process had (Python's default, Ray's or vLLM's SIGTERM handler, faulthandler's),
and a SIGTERM then ends the process with exit() from inside the handler, C's exit handlers and
destructors running while other threads still work (Ray's workers crashed there at shutdown).
Every handler is put back as it was around the load.
"""
from __future__ import annotations

import contextlib
import ctypes
import signal

_libc = ctypes.CDLL(None, use_errno=True)
# struct sigaction, saved and restored whole without being read: 152 bytes on x86_64 and
# aarch64 glibc, so 256 holds it on any of them.
_SIGACTION_BYTES = 256


@contextlib.contextmanager
def kept_handlers():
    """Restores, on leaving, the disposition every signal had on entering."""
    saved = {}
    for sig in signal.valid_signals():
        action = ctypes.create_string_buffer(_SIGACTION_BYTES)
        if _libc.sigaction(int(sig), None, action) == 0:  # glibc refuses its own (32, 33)
            saved[int(sig)] = action
    try:
        yield
    finally:
        for sig, action in saved.items():
            _libc.sigaction(sig, action, None)
