"""The trainer side of the vLLM weight backend (WeightTrainer) without vLLM: the calls it makes,
against a stand-in for a vLLM instance whose worker receives as the real backend does
(pw.ReceiveBuffers, its version check included) and refuses a start while an update is open,
as vLLM's worker does. Real vLLM: tests_vllm."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import torch_p2p as p2p
import torch_p2p.weights as pw
from torch_p2p.integrations.vllm.weight_trainer import WeightTrainer


class Instance:
    """vLLM's five weight-sync calls as one worker answers them."""

    def __init__(self):
        self.calls: list[str] = []
        self.open = False    # vLLM's worker: an update started and not finished
        self.reachable = True
        self.receiving: pw.ReceiveBuffers | None = None

    def _call(self, name: str) -> None:
        self.calls.append(name)
        if not self.reachable:
            raise ConnectionError("the server cannot be reached")

    def init_weight_transfer_engine(self, info: dict) -> None:
        self._call("init")
        self.receiving = pw.ReceiveBuffers(pw.Layout.from_json(info["layout"]), bytes.fromhex(info["leader"]),
                                           provider=info["provider"])
        p2p.wait(self.receiving.join(), 30)

    def start_weight_update(self) -> None:
        self._call("start")
        if self.open:
            raise RuntimeError("start_weight_update called while a weight update is already active")
        self.open = True

    def update_weights(self, info: dict) -> None:
        self._call("update")
        self.receiving.version_ready(info["version"], 30)

    def finish_weight_update(self, weight_version=None) -> None:
        self._call("finish")
        if not self.open:
            raise RuntimeError("finish_weight_update called without a matching start_weight_update")
        self.open = False

    def close(self) -> None:
        if self.receiving is not None:
            self.receiving.close()


@pytest.fixture
def instance():
    inst = Instance()
    yield inst
    inst.close()


@pytest.mark.timeout(120)
def test_the_trainer_imports_no_vllm_and_sends_versions(instance):
    # In a process of its own: other tests of the session may have imported vLLM.
    check = "import sys, torch_p2p.integrations.vllm.weight_trainer; assert 'vllm' not in sys.modules"
    subprocess.run([sys.executable, "-c", check], check=True, timeout=60)
    tensors = {"a": torch.arange(1000, dtype=torch.float32), "b": torch.ones(3, 5, dtype=torch.int64)}
    trainer = WeightTrainer(tensors, [instance], provider="tcp")
    try:
        for version in (1, 2):
            tensors["a"].add_(1)
            assert trainer.send_weights() == version
            assert torch.equal(instance.receiving.buffers["a"], tensors["a"]) and torch.equal(instance.receiving.buffers["b"], tensors["b"])
        assert instance.calls == ["init"] + ["start", "update", "finish"] * 2
        with pytest.raises(ValueError, match="names registered at init"):
            trainer.send_weights({"a": tensors["a"]})
    finally:
        trainer.shutdown()


@pytest.mark.timeout(120)
def test_an_update_a_dead_trainer_left_open_is_finished_first(instance):
    instance.open = True  # a trainer died between start and finish
    trainer = WeightTrainer({"a": torch.ones(10)}, [instance], provider="tcp")
    try:
        trainer.send_weights()
        assert instance.calls == ["init", "start", "finish", "start", "update", "finish"]
        assert not instance.open
    finally:
        trainer.shutdown()


@pytest.mark.timeout(120)
def test_a_start_that_fails_otherwise_raises_its_own_error(instance):
    trainer = WeightTrainer({"a": torch.ones(10)}, [instance], provider="tcp")
    try:
        instance.reachable = False
        with pytest.raises(ConnectionError, match="cannot be reached"):
            trainer.send_weights()
        assert instance.calls[-2:] == ["start", "finish"]  # the finish failed too: the start's error is the one
    finally:
        trainer.shutdown()
