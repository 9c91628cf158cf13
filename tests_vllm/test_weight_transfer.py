"""The "torch_p2p" weight-transfer backend in a real vLLM server: a trainer (this process)
pushes new weights into a running instance selected by its --weight-transfer-config alone, and
the instance then generates exactly what an instance started from those weights generates: the
same greedy tokens with the same logprobs (bitwise: same kernels, one thread). The logprobs
because a few wrong bytes may leave every greedy token as it was."""
from __future__ import annotations

import os
import time

import pytest

# The weight-transfer API (vLLM >= 0.32).
pytest.importorskip("vllm.distributed.weight_transfer.base")

from tiny_model import make_tiny_llama, prompt  # noqa: E402
from vllm_server import START_TIMEOUT, Server  # noqa: E402

PROMPTS = [prompt(5), prompt(23, offset=3), prompt(60, offset=11)]
MAX_TOKENS = 16


@pytest.fixture
def servers():
    started: list[Server] = []

    def start(*args, **kwargs) -> Server:
        started.append(Server(*args, **kwargs))
        return started[-1]

    yield start
    for s in started:
        s.kill()


def _state_dict(model_dir: str) -> dict:
    from safetensors.torch import load_file

    return load_file(os.path.join(model_dir, "model.safetensors"))


def _served_and_reference(tmp_path, servers, start: str, target: str):
    """An instance of `start` served with the torch_p2p backend and a reference instance of
    `target`, both ready; with the first's tokens and the reference's (which must differ)."""
    served = servers(start, str(tmp_path / "served.log"), weight_backend="torch_p2p")
    reference = servers(target, str(tmp_path / "ref1.log"))
    deadline = time.monotonic() + START_TIMEOUT
    served.wait_ready(deadline)
    reference.wait_ready(deadline)
    before, expected = served.generate(PROMPTS, MAX_TOKENS), reference.generate(PROMPTS, MAX_TOKENS)
    assert [text for text, _ in before] != [text for text, _ in expected], \
        "the two weight sets must give other tokens, or the test proves little"
    return served, reference, before, expected


def _trainer(model_dir: str, dtype, served):
    """The trainer: a model whose parameters change in place, as an optimizer step changes them,
    and its torch_p2p engine (found through the entry point, as in any trainer process)."""
    from transformers import LlamaForCausalLM
    from vllm.distributed.weight_transfer.base import ModuleSource
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
    from vllm.plugins import load_general_plugins

    from torch_p2p.integrations.vllm.weight_transfer import TorchP2PTrainerInitInfo

    load_general_plugins()
    trainer = LlamaForCausalLM.from_pretrained(model_dir, dtype=dtype)
    engine = WeightTransferTrainerFactory.trainer_init(TorchP2PTrainerInitInfo(rank=0, timeout=60.0),
                                                       client=_client(served), source=ModuleSource(trainer))
    return trainer, engine


def _client(server):
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
    return HTTPVLLMWeightSyncClient(server.url, timeout=120)


def _update(servers, engine) -> None:
    for s in servers:
        s.pause()
    engine.send_weights()
    for s in servers:
        s.resume()


@pytest.mark.timeout(1500)
def test_trainer_pushes_two_versions_into_a_running_server(tmp_path, servers):
    import torch

    start, second, third = (make_tiny_llama(str(tmp_path / f"m{seed}"), seed=seed) for seed in (0, 1, 2))
    served, reference, _, expected = _served_and_reference(tmp_path, servers, start, second)
    trainer, engine = _trainer(start, torch.float32, served)
    try:
        total = sum(p.numel() * p.element_size() for p in trainer.parameters())
        with torch.no_grad():
            trainer.load_state_dict(_state_dict(second))
        _update([served], engine)
        assert served.generate(PROMPTS, MAX_TOKENS) == expected
        assert served.weight_version() == "1"
        (worker,) = engine.last_result.received
        assert worker.startswith("vllm-") and engine.last_result.bytes_sent == total

        # A second version; its reference instance starts meanwhile (two instances at most).
        reference.kill()
        reference = servers(third, str(tmp_path / "ref2.log"))
        with torch.no_grad():
            trainer.load_state_dict(_state_dict(third))
        _update([served], engine)
        reference.wait_ready(time.monotonic() + START_TIMEOUT)
        expected = reference.generate(PROMPTS, MAX_TOKENS)
        assert served.generate(PROMPTS, MAX_TOKENS) == expected
        assert served.weight_version() == "2"
        assert engine.last_result.received == [worker] and engine.last_result.version == 2
    finally:
        engine.shutdown()


@pytest.mark.timeout(1500)
def test_bfloat16_trainer_and_a_replica_that_joins_between_updates(tmp_path, servers):
    """A bfloat16 trainer pushes into float32 instances (the source converts on the way); a
    second instance started after the first update joins with connect() and gets the next."""
    import shutil

    import torch
    from safetensors.torch import save_file

    start, second = (make_tiny_llama(str(tmp_path / f"m{seed}"), seed=seed) for seed in (0, 1))
    # What a float32 model holds after a bfloat16 push of `second`: its weights rounded to bfloat16.
    rounded = str(tmp_path / "rounded")
    shutil.copytree(second, rounded)
    save_file({k: v.to(torch.bfloat16).float() for k, v in _state_dict(second).items()},
              os.path.join(rounded, "model.safetensors"), metadata={"format": "pt"})
    served, reference, before, expected = _served_and_reference(tmp_path, servers, start, rounded)
    trainer, engine = _trainer(second, torch.bfloat16, served)
    try:
        assert {str(p.dtype) for p in trainer.parameters()} == {"torch.bfloat16"}
        _update([served], engine)
        assert served.generate(PROMPTS, MAX_TOKENS) == expected
        reference.kill()  # two instances at most at once
        late = servers(start, str(tmp_path / "late.log"), weight_backend="torch_p2p")
        late.wait_ready(time.monotonic() + START_TIMEOUT)
        assert late.generate(PROMPTS, MAX_TOKENS) == before  # started from the first weights
        engine.connect(_client(late))
        _update([served, late], engine)
        assert late.generate(PROMPTS, MAX_TOKENS) == expected == served.generate(PROMPTS, MAX_TOKENS)
        assert late.weight_version() == served.weight_version() == "2"
        assert len(engine.last_result.received) == 2
    finally:
        engine.shutdown()
