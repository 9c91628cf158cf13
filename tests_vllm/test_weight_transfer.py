"""The "torch_p2p" weight-transfer backend in a real vLLM server: a trainer (this process, or one
of its own that dies) pushes new weights into a running instance selected by its
--weight-transfer-config alone, and the instance then generates exactly what vLLM generates
from those weights loaded its own way (reload_weights from the safetensors file): the same
greedy tokens with the same logprobs (bitwise: same kernels, one thread). The logprobs because
a few wrong bytes may leave every greedy token as it was.

The servers live for the module (a start costs tens of seconds on 2 cores): one reference
server that reloads each weight set from disk, one served by the backend whose weights the
tests move from set to set (`Served.state`), and a replica started by the last test."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

# The weight-transfer API (vLLM >= 0.32).
pytest.importorskip("vllm.distributed.weight_transfer.base")

from tiny_model import make_tiny_llama, prompt  # noqa: E402
from checkout import checkout_env  # noqa: E402
from vllm_server import START_TIMEOUT, Server  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
PROMPTS = [prompt(5), prompt(23, offset=3), prompt(60, offset=11)]
MAX_TOKENS = 16
# The trainer-side engine's peer_timeout: how long a destination closed before its engine
# would wait for a dead leader's answer when a new trainer replaces it.
PEER_TIMEOUT = 10.0


def _state_dict(model_dir: str) -> dict:
    from safetensors.torch import load_file

    return load_file(os.path.join(model_dir, "model.safetensors"))


class Served:
    """The backend's server and the weight set it holds."""

    def __init__(self, server: Server, state: str):
        self.server, self.state = server, state

    def update(self, trainer, *others: Server) -> None:
        """vLLM's RL protocol: pause (which also clears the prefix cache: its blocks hold the
        old weights' KV), update, resume."""
        for s in (self.server, *others):
            s.pause()
        trainer.send_weights()
        for s in (self.server, *others):
            s.resume()


@pytest.fixture(scope="module")
def weight_sets(tmp_path_factory):
    """Model directories: seeds 0, 1, 2, and seed 1 rounded to bfloat16 (what a float32
    model holds after a bfloat16 push of seed 1)."""
    import torch
    from safetensors.torch import save_file

    root = tmp_path_factory.mktemp("weights")
    sets = {seed: make_tiny_llama(str(root / f"m{seed}"), seed=seed) for seed in (0, 1, 2)}
    rounded = str(root / "rounded")
    shutil.copytree(sets[1], rounded)
    save_file({k: v.to(torch.bfloat16).float() for k, v in _state_dict(sets[1]).items()},
              os.path.join(rounded, "model.safetensors"), metadata={"format": "pt"})
    sets["rounded"] = rounded
    return sets


@pytest.fixture(scope="module")
def servers(tmp_path_factory, weight_sets):
    """(Served on seed 0, {weight set: generations}). The reference generations come from a
    plain server that loads each set with vLLM's own reload_weights."""
    logs = tmp_path_factory.mktemp("logs")
    served = Server(weight_sets[0], str(logs / "served.log"), weight_backend="torch_p2p")
    reference = Server(weight_sets[0], str(logs / "reference.log"))
    try:
        deadline = time.monotonic() + START_TIMEOUT
        reference.wait_ready(deadline)
        expected = {}
        for key, path in weight_sets.items():
            reference.pause()  # also clears the prefix cache, which holds the previous weights' KV
            reference.collective_rpc("reload_weights", weights_path=path)
            reference.resume()
            expected[key] = reference.generate(PROMPTS, MAX_TOKENS)
        reference.kill()  # two servers at most at once
        texts = {tuple(text for text, _ in expected[seed]) for seed in (0, 1, 2)}
        assert len(texts) == 3, "the weight sets must give other tokens, or the tests prove little"
        served.wait_ready(deadline)
        assert served.generate(PROMPTS, MAX_TOKENS) == expected[0]
        yield Served(served, 0), expected
    finally:
        reference.kill()
        served.kill()


def _vllm_trainer(model_dir: str, dtype, client):
    """The trainer through vLLM's trainer-side API: a model whose parameters change in place,
    as an optimizer step changes them, and the engine vLLM's factory builds (found through the
    entry point, as in any trainer process)."""
    from transformers import LlamaForCausalLM
    from vllm.distributed.weight_transfer.base import ModuleSource
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
    from vllm.plugins import load_general_plugins

    from torch_p2p.integrations.vllm.weight_transfer import TorchP2PTrainerInitInfo

    load_general_plugins()
    trainer = LlamaForCausalLM.from_pretrained(model_dir, dtype=dtype)
    engine = WeightTransferTrainerFactory.trainer_init(TorchP2PTrainerInitInfo(rank=0, timeout=60.0),
                                                       client=client, source=ModuleSource(trainer))
    return trainer, engine


def _vllm_client(server):
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
    return HTTPVLLMWeightSyncClient(server.url, timeout=120)


@pytest.mark.timeout(900)
def test_trainer_pushes_two_versions_into_a_running_server(servers, weight_sets):
    import torch

    served, expected = servers
    trainer, engine = _vllm_trainer(weight_sets[served.state], torch.float32, _vllm_client(served.server))
    try:
        total = sum(p.numel() * p.element_size() for p in trainer.parameters())
        for version, seed in enumerate((1, 2), start=1):
            with torch.no_grad():
                trainer.load_state_dict(_state_dict(weight_sets[seed]))
            served.update(engine)
            served.state = seed
            assert served.server.generate(PROMPTS, MAX_TOKENS) == expected[seed]
            assert served.server.weight_version() == str(version)
            (worker,) = engine.last_result.received
            assert worker.startswith("vllm-") and engine.last_result.bytes_sent == total
            assert engine.last_result.version == version
    finally:
        engine.shutdown()


@pytest.mark.timeout(600)
@pytest.mark.parametrize("point", ["push", "start", "update"])
def test_a_trainer_killed_inside_an_update(point, servers, weight_sets):
    """A trainer SIGKILLed mid-push, after start_weight_update or after update_weights (before
    finish) leaves the server on the old weights (push, start) or the new ones (update), never
    a mix or a dead engine; a new trainer (vLLM-free API) then connects at once and updates it."""
    from torch_p2p.integrations.vllm.weight_trainer import HTTPClient, WeightTrainer

    served, expected = servers
    old = served.state
    new, after = (s for s in (0, 1, 2) if s != old)
    proc = subprocess.run([sys.executable, os.path.join(HERE, "trainer_process.py"), served.server.url,
                           weight_sets[new], point], env=checkout_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stdout + proc.stderr
    served.server.resume()  # the dead trainer had paused it
    assert served.server.generate(PROMPTS, MAX_TOKENS) == expected[new if point == "update" else old]

    start = time.monotonic()
    trainer = WeightTrainer(_state_dict(weight_sets[after]), [HTTPClient(served.server.url)])
    init_seconds = time.monotonic() - start
    try:
        # The workers replace the dead trainer's destination without waiting on its leader.
        assert init_seconds < PEER_TIMEOUT / 2, f"trainer init took {init_seconds:.1f} s"
        served.update(trainer)
        served.state = after
        assert served.server.generate(PROMPTS, MAX_TOKENS) == expected[after]
        assert served.server.weight_version() == "1"
    finally:
        trainer.shutdown()


@pytest.mark.timeout(900)
def test_bfloat16_trainer_and_a_replica_that_joins_between_updates(servers, weight_sets, tmp_path):
    """A bfloat16 trainer pushes into float32 instances (the source converts on the way); a
    second instance started after the first update joins with connect() and gets the next."""
    import torch

    served, expected = servers
    trainer, engine = _vllm_trainer(weight_sets[1], torch.bfloat16, _vllm_client(served.server))
    late = None
    try:
        assert {str(p.dtype) for p in trainer.parameters()} == {"torch.bfloat16"}
        served.update(engine)
        served.state = "rounded"
        assert served.server.generate(PROMPTS, MAX_TOKENS) == expected["rounded"]
        late = Server(weight_sets[0], str(tmp_path / "late.log"), weight_backend="torch_p2p")
        late.wait_ready(time.monotonic() + START_TIMEOUT)
        assert late.generate(PROMPTS, MAX_TOKENS) == expected[0]  # started from seed 0
        engine.connect(_vllm_client(late))
        served.update(engine, late)
        assert late.generate(PROMPTS, MAX_TOKENS) == expected["rounded"] == served.server.generate(PROMPTS, MAX_TOKENS)
        assert late.weight_version() == served.server.weight_version() == "2"
        assert len(engine.last_result.received) == 2
    finally:
        engine.shutdown()
        if late is not None:
            late.kill()
