"""vLLM tests: real vLLM (the CPU build in CI), each instance a process of its own with a hard
timeout. Skipped where vLLM does not import."""
from __future__ import annotations

import importlib.util
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time

import pytest

def _vllm_installed() -> bool:
    # A vLLM that is installed but broken fails the tests, as it should.
    try:
        return importlib.util.find_spec("vllm.entrypoints") is not None
    except ImportError:
        return False


if not _vllm_installed():
    collect_ignore_glob = ["test_*.py"]

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)  # the checkout
sys.path.insert(0, ROOT)  # the tests import this checkout's torch_p2p, as the instances do
sys.path.append(os.path.join(ROOT, "tests"))
from checkout import checkout_env  # noqa: E402  (tests/checkout.py: what every suite shares)
START_TIMEOUT = 400


class Instance:
    """A vLLM LLM in a subprocess (tests_vllm/instance.py), starting: `ready` waits until it
    serves (start several, then wait: they start side by side). `ask` sends one request and
    waits for its result at most `timeout` seconds; `kill` ends it (SIGKILL: a crash, not a
    shutdown); `log` holds every line it printed."""

    def __init__(self, model: str, env: dict | None = None, **llm_kwargs):
        # Spawned engine processes import this checkout's torch_p2p (and its entry point).
        env = checkout_env(**(env or {}))
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        env.setdefault("OMP_NUM_THREADS", "1")
        self.proc = subprocess.Popen([sys.executable, os.path.join(HERE, "instance.py"), model, json.dumps(llm_kwargs)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, env=env, start_new_session=True)
        self.log: list[str] = []
        self._lines: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._read, daemon=True).start()

    def ready(self) -> "Instance":
        self._expect("READY", START_TIMEOUT)
        return self

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.log.append(line.rstrip("\n"))
            if line.startswith(("READY", "RESULT ")):
                self._lines.put(line)
        self._lines.put(None)

    def _expect(self, prefix: str, timeout: float) -> str:
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            self.kill()
            raise TimeoutError(f"vLLM instance gave no {prefix} in {timeout} s:\n" + self.tail()) from None
        if line is None:
            raise RuntimeError(f"vLLM instance exited ({self.proc.wait()}):\n" + self.tail())
        return line[len(prefix):].strip()

    def ask(self, tokens: list[int], max_tokens: int, kv_transfer_params: dict | None = None,
            timeout: float = 60) -> dict:
        """{"tokens", "logprobs" (of each chosen token), "finish_reason", "kv_transfer_params",
        "seconds"}."""
        self.proc.stdin.write(json.dumps(dict(tokens=tokens, max_tokens=max_tokens,
                                              kv_transfer_params=kv_transfer_params)) + "\n")
        self.proc.stdin.flush()
        return json.loads(self._expect("RESULT ", timeout))

    def grep(self, text: str, *, wait: float = 0) -> list[str]:
        """The lines holding `text`; waits up to `wait` seconds for one."""
        deadline = time.monotonic() + wait
        while True:
            found = [line for line in self.log if text in line]
            if found or time.monotonic() >= deadline:
                return found
            time.sleep(0.05)

    def tail(self, n: int = 40) -> str:
        return "\n".join(self.log[-n:])

    def kill(self) -> None:
        """Kills the instance and every process it started (its session); returns once none of
        them is left (at most 30 s)."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=30)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                os.killpg(self.proc.pid, 0)  # anyone of the group left?
            except ProcessLookupError:
                return
            time.sleep(0.02)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    from tiny_model import make_tiny_llama
    return make_tiny_llama(str(tmp_path_factory.mktemp("tiny-llama")), seed=0)


@pytest.fixture(scope="session")
def sharp_model(tmp_path_factory):
    """The tiny Llama with weights large enough that attention picks positions (near-uniform
    attention would average over moved blocks as over the right ones)."""
    from tiny_model import make_tiny_llama
    return make_tiny_llama(str(tmp_path_factory.mktemp("sharp-llama")), seed=0, init_range=0.5)


def kv_config(role: str, port: int, *, kv_lease_duration: float | None = None, **config) -> dict:
    """LLM arguments naming TorchP2PConnector (found through the entry point) as `role`;
    `config`: more KVTransferConfig fields (kv_load_failure_policy, ...)."""
    extra = dict(side_channel_port=port)
    if kv_lease_duration is not None:
        extra["kv_lease_duration"] = kv_lease_duration
    return dict(kv_transfer_config=dict(kv_connector="TorchP2PConnector", kv_role=role,
                                        kv_connector_extra_config=extra, **config))


@pytest.fixture(scope="module")
def instances():
    """Starts instances (Instance's arguments) and kills them all after the module's tests."""
    started = []

    def start(*args, **kwargs):
        started.append(Instance(*args, **kwargs))
        return started[-1]
    yield start
    for inst in started:
        inst.kill()
