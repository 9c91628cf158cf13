"""Trainer weights into an SGLang worker: WeightTrainer pushes, SGLang's own WeightUpdater runs
the torch_p2p custom weight loader (weight_rank.py). A version loads exactly; a version that
never arrives (the trainer died) fails within its timeout and the model keeps what it had."""
from __future__ import annotations

import json

import pytest
import torch

from torch_p2p.integrations.sglang.weights import SGLangClient, WeightTrainer


class _Server:
    """update_weights_from_tensor as sglang.Engine has it, forwarded to the worker process."""

    def __init__(self, rank):
        self.rank = rank

    def update_weights_from_tensor(self, named_tensors, load_format):
        (name, t), = named_tensors
        reply = self.rank.call("update", text=bytes(t.numpy()).decode())
        if "failed" in reply:
            raise RuntimeError(reply["failed"])
        return reply["ok"], reply["message"]


def _sums(tensors):
    return {n: t.double().sum().item() for n, t in tensors.items()}


def test_versions_load_and_a_dead_trainer_leaves_the_old_weights(ranks):
    worker = ranks(None, script="weight_rank.py")
    torch.manual_seed(1)
    tensors = {"up.weight": torch.randn(128, 64), "up.bias": torch.randn(128),
               "down.weight": torch.randn(64, 128), "down.bias": torch.randn(64)}
    before = worker.call("params")
    trainer = WeightTrainer(tensors, [SGLangClient(_Server(worker))], timeout=20)
    try:
        assert trainer.send_weights() == 1
        assert worker.call("params") == pytest.approx(_sums(tensors))
        for t in tensors.values():
            t.mul_(-2)  # a training step
        assert trainer.send_weights() == 2
        v2 = worker.call("params")
        assert v2 == pytest.approx(_sums(tensors)) and v2 != before
    finally:
        trainer.shutdown()
    # The trainer is gone before version 3: the load fails within its timeout, the model keeps v2.
    reply = worker.call("update", text=json.dumps(dict(op="load", version=3, timeout=3)), timeout=30)
    assert "failed" in reply or not reply["ok"], reply
    assert worker.call("params") == v2
