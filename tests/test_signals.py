"""Importing torch_p2p leaves the process's signal handlers as they were: Debian's libfabric
links libinfinipath, whose constructor installs handlers for SIGILL, SIGABRT, SIGBUS, SIGSEGV
and SIGTERM that end the process with exit() from inside the handler."""
import signal
import subprocess
import sys
import textwrap

from checkout import checkout_env


def run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=checkout_env(), capture_output=True,
                          text=True, timeout=120)


def test_import_keeps_every_signal_handler():
    out = run("""
        import torch

        def caught():
            for line in open("/proc/self/status"):
                if line.startswith("SigCgt:"):
                    return int(line.split()[1], 16)

        before = caught()
        import torch_p2p
        print(before, caught())
    """)
    assert out.returncode == 0, out.stderr
    before, after = map(int, out.stdout.split())
    changed = [s for s in range(1, 65) if (before ^ after) >> (s - 1) & 1]
    assert not changed, f"importing torch_p2p changed the handlers of signals {changed}"


def test_sigterm_ends_a_process_with_an_engine_as_python_would():
    """The default action (killed by SIGTERM), and a handler set from Python before the import
    still runs after it."""
    plain = run("""
        import os, signal, time
        import torch_p2p
        engine = torch_p2p.Engine("cpu")
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(30)
    """)
    assert plain.returncode == -signal.SIGTERM, (plain.returncode, plain.stderr)
    handled = run("""
        import os, signal, sys, time
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(7))
        import torch_p2p
        engine = torch_p2p.Engine("cpu")
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(30)
    """)
    assert handled.returncode == 7, (handled.returncode, handled.stderr)
