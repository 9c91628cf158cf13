"""The ``torch_p2p`` weight-transfer backend of vLLM (``weight_transfer_config={"backend":
"torch_p2p"}``): trainer weights pushed into running vLLM workers by torch_p2p.weights.

Inference side (``TorchP2PWeightTransferEngine``, one per vLLM worker): at
``init_weight_transfer_engine`` the worker allocates one receive buffer per trainer tensor (HF
names and shapes; floating tensors in the model's dtype), registers them once and joins the trainer's leader,
whose address rides the init info; the plan is computed then, once. Pushes land in those
buffers, never in the model. ``update_weights`` waits until the version asked for has fully
arrived (RuntimeError, the model untouched, if the buffers hold another or a later push is
arriving), then loads it with vLLM's own ``load_weights`` inside a layerwise reload that it opens
and closes itself: vLLM fuses q/k/v and gate/up, pads vocabularies, slices for tensor
parallelism and (on CPU) prepacks the linear weights after loading, so its loader is the one
exact way into the parameters. ``start_weight_update`` and ``finish_weight_update`` touch
nothing: the model changes only inside one worker call, which a trainer's death cannot cut
(docs/vllm.md, "A trainer that dies").

Trainer side: ``TorchP2PTrainerWeightTransferEngine`` (built by vLLM's
``WeightTransferTrainerFactory.trainer_init``) is a front over weight_trainer.WeightTrainer,
which a trainer without vLLM uses directly.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any, ClassVar

import torch
from vllm.distributed.weight_transfer.base import (TrainerInitInfo, TrainerWeightTransferEngine,
                                                   WeightTransferEngine, WeightTransferInitInfo,
                                                   WeightTransferUpdateInfo)

import torch_p2p
import torch_p2p.weights as pw

from .weight_trainer import WeightTrainer

BACKEND = "torch_p2p"


@dataclasses.dataclass
class TorchP2PInitInfo(WeightTransferInitInfo):
    """What a worker needs to join: the leader's engine address (hex) and the trainer's tensors
    (HF names, dtypes, shapes) as a torch_p2p.weights layout (``Layout.to_json``), from which
    it sizes its receive buffers."""

    leader: str
    layout: list
    timeout: float = 60.0      # for joining the leader
    provider: str | None = None

    def __post_init__(self):
        try:
            self.leader_address = bytes.fromhex(self.leader)
        except (TypeError, ValueError):
            raise ValueError(f"leader must be the hex of the trainer's engine address, not {self.leader!r}") from None
        self.tensors = pw.Layout.from_json(self.layout)
        if not self.tensors.whole():
            raise ValueError("the trainer's layout must hold whole tensors")
        self.timeout = pw.positive_seconds(self.timeout, "timeout")


@dataclasses.dataclass
class TorchP2PUpdateInfo(WeightTransferUpdateInfo):
    """Load `version` once it is here (waiting up to `timeout` for its last byte)."""

    version: int
    timeout: float = 120.0

    def __post_init__(self):
        if not isinstance(self.version, int) or self.version < 1:
            raise ValueError(f"version must be an integer >= 1, not {self.version!r}")
        self.timeout = pw.positive_seconds(self.timeout, "timeout")


class TorchP2PWeightTransferEngine(WeightTransferEngine[TorchP2PInitInfo, TorchP2PUpdateInfo]):
    """A vLLM worker's destination. Owned by the worker's thread (vLLM calls it from its RPC
    loop); the WeightDestination's own thread receives pushes into the buffers meanwhile."""

    init_info_cls = TorchP2PInitInfo
    update_info_cls = TorchP2PUpdateInfo
    supports_draft_weight_update = False  # the buffers are the target model's tensors

    def __init__(self, config, vllm_config, device, model):
        super().__init__(config, vllm_config, device, model)
        self._receiving: pw.ReceiveBuffers | None = None

    def init_transfer_engine(self, init_info: TorchP2PInitInfo) -> None:
        self.shutdown()  # a second init (a new trainer) replaces the first
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        # Floating tensors arrive in the model's dtype: the source converts on the way (half
        # the bytes for an fp32 trainer and a bf16 model), as loading a checkpoint would.
        self._receiving = pw.ReceiveBuffers(init_info.tensors, init_info.leader_address, device=self.device,
                                            provider=init_info.provider, name=f"vllm-{os.getpid()}/rank{rank}",
                                            floating_dtype=self.model_config.dtype)
        try:
            torch_p2p.wait(self._receiving.join(), init_info.timeout)
        except BaseException:
            self.shutdown()
            raise

    def start_weight_update(self) -> None:
        # Nothing to open: a reload opened here would leave the model's parameters on the meta
        # device until finish, and a trainer that dies in between never calls finish.
        self._require_init()

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # The base class ends with torch.accelerator.synchronize(), which raises on CPU.
        self.receive_weights(self.parse_update_info(update_info))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def receive_weights(self, update_info: TorchP2PUpdateInfo) -> None:
        from vllm.model_executor.model_loader.reload import (finalize_layerwise_reload,
                                                             initialize_layerwise_reload)

        receiving = self._require_init()
        # Until every byte of the version is here the model is not touched: a trainer that
        # dies mid-push fails this wait (its timeout), and the model keeps the old weights.
        receiving.version_ready(update_info.version, update_info.timeout)
        initialize_layerwise_reload(self.model)
        try:
            self.model.load_weights(receiving.buffers.items())
        finally:
            finalize_layerwise_reload(self.model, self.model_config)

    def finish_weight_update(self) -> None:
        pass  # update_weights closed its reload already

    def shutdown(self) -> None:
        # Its own engine closes first (ReceiveBuffers.close): a dead leader cannot hold up the
        # next trainer's init.
        if self._receiving is not None:
            self._receiving.close()
        self._receiving = None

    def _require_init(self) -> pw.ReceiveBuffers:
        if self._receiving is None:
            raise RuntimeError("the torch_p2p weight transfer is not initialized: call "
                               "init_weight_transfer_engine (the trainer engine's trainer_init) first")
        return self._receiving


@dataclasses.dataclass
class TorchP2PTrainerInitInfo(TrainerInitInfo):
    """Trainer side. `timeout` bounds a push and each worker's wait for it; `join_timeout` a
    worker's join; `provider` picks the libfabric provider on both sides (None: automatic)."""

    backend: ClassVar[str] = BACKEND
    timeout: float = 120.0
    join_timeout: float = 60.0
    provider: str | None = None
    chunk_bytes: int = pw.CHUNK_BYTES


class TorchP2PTrainerWeightTransferEngine(TrainerWeightTransferEngine[TorchP2PTrainerInitInfo]):
    """vLLM's trainer-side API over WeightTrainer. Rank 0 (the sender) owns the WeightTrainer
    over the tensors the source yields; other ranks only iterate the source each round, so
    that collectives inside it (FSDP's full_tensor) stay in step. Not thread-safe."""

    init_info_cls = TorchP2PTrainerInitInfo

    def __init__(self, init_info: TorchP2PTrainerInitInfo, *, client, source):
        super().__init__(client=client, source=source, is_sender=init_info.is_sender)
        self.trainer: WeightTrainer | None = None
        tensors = self._materialize()
        if self.is_sender:
            # The tensors the source yields are registered as they are: a source over live
            # parameters (vLLM's ModuleSource) costs no copy; a source that materializes new
            # tensors each round (FSDP) is copied into the first round's ones (send_weights).
            self.trainer = WeightTrainer(tensors, [client], timeout=init_info.timeout,
                                         join_timeout=init_info.join_timeout, provider=init_info.provider,
                                         chunk_bytes=init_info.chunk_bytes)

    @classmethod
    def trainer_init(cls, init_info: TorchP2PTrainerInitInfo, *, client, source=None):
        if source is None:
            raise ValueError("the torch_p2p trainer engine pushes a vLLM WeightSource (e.g. ModuleSource(model))")
        return cls(init_info, client=client, source=source)

    def connect(self, client) -> None:
        """Adds a vLLM instance started after trainer_init: its workers join now and receive
        every later send_weights. Sender only."""
        self._require_sender().connect(client)

    def send_weights(self) -> None:
        """Pushes the source's current tensors as the next version to every worker, then has
        every instance load it (start, update, finish; weight_version = the version)."""
        tensors = self._materialize()
        if self.is_sender:
            self._require_sender().send_weights(tensors)

    @property
    def version(self) -> int:
        return self.trainer.version if self.trainer is not None else 0

    @property
    def last_result(self) -> pw.PushResult | None:
        return self.trainer.last_result if self.trainer is not None else None

    @property
    def push_seconds(self) -> float:
        return self.trainer.push_seconds if self.trainer is not None else 0.0

    def shutdown(self) -> None:
        if self.trainer is not None:
            self.trainer.shutdown()

    def _materialize(self) -> dict[str, torch.Tensor]:
        """One pass over the source, on every rank, checked against its metadata()."""
        tensors = dict(iter(self.source))
        expected = [m.name for m in self.source.metadata()]
        if list(tensors) != expected:
            raise ValueError(f"the WeightSource yielded {len(tensors)} tensors that differ from its metadata() "
                             f"({len(expected)}): {sorted(set(tensors) ^ set(expected))[:5]}")
        return tensors

    def _require_sender(self) -> WeightTrainer:
        if self.trainer is None:
            raise RuntimeError("only the sender (rank 0) after trainer_init drives the workers")
        return self.trainer
