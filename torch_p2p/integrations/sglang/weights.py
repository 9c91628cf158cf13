"""Trainer weights pushed into a running SGLang server by torch_p2p.weights, through SGLang's
custom weight loader: start the server with

    --custom-weight-loader torch_p2p.integrations.sglang.weights.load

and drive it from the trainer with ``WeightTrainer`` (the one vLLM's backend uses) over an
``SGLangClient``:

    trainer = WeightTrainer(dict(model.named_parameters()), [SGLangClient(engine)])
    trainer.send_weights()        # push the next version, then every TP worker loads it

Why a custom weight loader and not a ``WeightUpdater`` hook: it is SGLang's public way in (a
flag, and the ``update_weights_from_tensor`` call and HTTP route that RL frameworks already
use), SGLang runs it in every TP worker on the scheduler thread with the model in hand, between
batches, and its own pause/continue protocol applies; a hook would patch a private frozen
dataclass that changes between releases. ``update_weights_from_tensor`` carries one small tensor,
a JSON command (``command``): join the trainer's push group, load a version, or leave.

Each worker receives pushes into buffers of its own (one per trainer tensor), never into the
model: ``load`` of a version waits until every byte of it is there, then hands the buffers to
the model's ``load_weights`` (SGLang's models fuse, shard for TP and quantize there). A trainer
that dies mid-push fails that wait within its timeout and the model keeps the weights it had.

Thread model: ``load`` runs on SGLang's scheduler thread; the WeightDestination's own thread
receives pushes meanwhile.
"""
from __future__ import annotations

import json
import os

import torch

import torch_p2p
import torch_p2p.weights as pw

# WeightTrainer and its init info are vLLM-free (weight_trainer.py); weight_transfer.py is not.
from ..vllm.weight_trainer import WeightTrainer

LOADER = "torch_p2p.integrations.sglang.weights.load"
_NAME = "torch_p2p"
__all__ = ["LOADER", "load", "command", "SGLangClient", "WeightTrainer"]


def command(op: str, **fields) -> list[tuple[str, torch.Tensor]]:
    """The named_tensors of an ``update_weights_from_tensor`` call that asks `load` for `op`."""
    data = json.dumps(dict(op=op, **fields)).encode()
    return [(_NAME, torch.frombuffer(bytearray(data), dtype=torch.uint8))]


class _Receiver:
    """One worker's destination (torch_p2p.weights.ReceiveBuffers, as vLLM's backend has)."""

    def __init__(self, model, leader: str, layout: list, timeout: float = 60.0, provider: str | None = None):
        """The fields of WeightTrainer.init_info."""
        param = next(model.parameters())
        # Floating tensors arrive in the model's dtype: the source converts on the way.
        self.receiving = pw.ReceiveBuffers(pw.Layout.from_json(layout), bytes.fromhex(leader), device=param.device,
                                           provider=provider, name=f"sglang-{os.getpid()}", floating_dtype=param.dtype)
        try:
            torch_p2p.wait(self.receiving.join(), timeout)
        except BaseException:
            self.close()
            raise

    def load(self, model, version: int, timeout: float = 120.0) -> None:
        # Until every byte of the version is here the model is not touched.
        self.receiving.version_ready(version, timeout)
        model.load_weights(list(self.receiving.buffers.items()))

    def close(self) -> None:
        self.receiving.close()


_receiver: _Receiver | None = None


def load(model, named_tensors) -> None:
    """SGLang's custom weight loader: runs the command that `named_tensors` carries."""
    global _receiver
    if len(named_tensors) != 1 or named_tensors[0][0] != _NAME:
        raise ValueError(f"{LOADER} takes one tensor named {_NAME!r} (torch_p2p.integrations.sglang.weights."
                         f"command), not {[n for n, _ in named_tensors][:3]}")
    cmd = json.loads(bytes(named_tensors[0][1].cpu().numpy()))
    op = cmd.pop("op")
    if op == "join":
        if _receiver is not None:
            _receiver.close()  # a new trainer replaces the old one
            _receiver = None
        _receiver = _Receiver(model, **cmd)
    elif op == "load":
        if _receiver is None:
            raise RuntimeError("torch_p2p weights: load before join (the trainer's WeightTrainer joins first)")
        _receiver.load(model, **cmd)
    elif op == "leave":
        if _receiver is not None:
            _receiver.close()
        _receiver = None
    else:
        raise ValueError(f"torch_p2p weights: unknown command {op!r} (join, load, leave)")


class SGLangClient:
    """What WeightTrainer drives, over anything with SGLang's ``update_weights_from_tensor(
    named_tensors, load_format)`` (``sglang.Engine``, its HTTP adapter). An update is one call:
    the start and finish that vLLM's protocol has are no-ops here."""

    def __init__(self, server):
        self.server = server

    def _run(self, op: str, **fields) -> None:
        result = self.server.update_weights_from_tensor(named_tensors=command(op, **fields), load_format=LOADER)
        ok, message = result[:2] if isinstance(result, tuple) else (True, "")
        if not ok:
            raise RuntimeError(f"SGLang refused the torch_p2p weights command {op!r}: {message}")

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self._run("join", **init_info)

    def start_weight_update(self) -> None:
        pass

    def update_weights(self, update_info: dict) -> None:
        self._run("load", **update_info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        pass

    def shutdown_weight_transfer_engine(self) -> None:
        self._run("leave")
