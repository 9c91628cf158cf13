"""The ``torch_p2p`` weight-transfer backend of vLLM (``weight_transfer_config={"backend":
"torch_p2p"}``): trainer weights pushed into running vLLM workers by torch_p2p.weights.

Inference side (``TorchP2PWeightTransferEngine``, one per vLLM worker): at
``init_weight_transfer_engine`` the worker allocates one receive buffer per trainer tensor (HF
names and shapes, in the model's dtype), registers them once and joins the trainer's leader,
whose address rides the init info; the plan is computed then, once. Every update is one push
into those buffers followed by vLLM's own ``load_weights`` inside a layerwise reload: vLLM fuses
q/k/v and gate/up, pads vocabularies, slices for tensor parallelism and (on CPU) prepacks the
linear weights after loading, so its loader is the one exact way into the parameters.

Trainer side (``TorchP2PTrainerWeightTransferEngine``, built by vLLM's
``WeightTransferTrainerFactory.trainer_init``): rank 0 registers the tensors its WeightSource
yields and leads; each ``send_weights`` pushes them as the next version, then drives
start/update/finish through the client. Replicas started later join with ``connect(client)``.
"""
from __future__ import annotations

import dataclasses
import os
import time
from typing import Any, ClassVar

import torch
from vllm.distributed.weight_transfer.base import (TrainerInitInfo, TrainerWeightTransferEngine,
                                                   WeightTransferEngine, WeightTransferInitInfo,
                                                   WeightTransferUpdateInfo)

import torch_p2p
import torch_p2p.weights as pw

BACKEND = "torch_p2p"


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype name {name!r} (expected e.g. 'float32', 'bfloat16')")
    return dtype


def _positive(what: str, value) -> float:
    if not isinstance(value, (int, float)) or value <= 0:
        raise ValueError(f"{what} must be a positive number of seconds, not {value!r}")
    return float(value)


@dataclasses.dataclass
class TorchP2PInitInfo(WeightTransferInitInfo):
    """What a worker needs to join: the leader's engine address (hex) and the trainer's tensors
    (HF names, wire dtypes, shapes), from which it sizes its receive buffers."""

    leader: str
    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    timeout: float = 60.0      # for joining the leader
    provider: str | None = None

    def __post_init__(self):
        try:
            self.leader_address = bytes.fromhex(self.leader)
        except (TypeError, ValueError):
            raise ValueError(f"leader must be the hex of the trainer's engine address, not {self.leader!r}") from None
        if not len(self.names) == len(self.dtype_names) == len(self.shapes):
            raise ValueError(f"names, dtype_names and shapes must be of one length: got {len(self.names)}, "
                             f"{len(self.dtype_names)} and {len(self.shapes)}")
        if len(set(self.names)) != len(self.names):
            raise ValueError("names must be distinct")
        self.dtypes = [_dtype(d) for d in self.dtype_names]
        for name, shape in zip(self.names, self.shapes):
            if not all(isinstance(s, int) and s >= 0 for s in shape):
                raise ValueError(f"{name!r}: shape {shape!r} is not a list of sizes")
        self.timeout = _positive("timeout", self.timeout)


@dataclasses.dataclass
class TorchP2PUpdateInfo(WeightTransferUpdateInfo):
    """Load `version` once it is here (waiting up to `timeout` for its last byte)."""

    version: int
    timeout: float = 120.0

    def __post_init__(self):
        if not isinstance(self.version, int) or self.version < 1:
            raise ValueError(f"version must be an integer >= 1, not {self.version!r}")
        self.timeout = _positive("timeout", self.timeout)


class TorchP2PWeightTransferEngine(WeightTransferEngine[TorchP2PInitInfo, TorchP2PUpdateInfo]):
    """A vLLM worker's destination. Owned by the worker's thread (vLLM calls it from its RPC
    loop); the WeightDestination's own thread receives pushes into the buffers meanwhile."""

    init_info_cls = TorchP2PInitInfo
    update_info_cls = TorchP2PUpdateInfo
    supports_draft_weight_update = False  # the buffers are the target model's tensors

    def __init__(self, config, vllm_config, device, model):
        super().__init__(config, vllm_config, device, model)
        self._engine: torch_p2p.Engine | None = None
        self._dest: pw.WeightDestination | None = None
        self._buffers: dict[str, torch.Tensor] = {}
        self.loaded_version: int | None = None
        self.bytes_received = 0  # buffer bytes of every version loaded

    def init_transfer_engine(self, init_info: TorchP2PInitInfo) -> None:
        self.shutdown()  # a second init (a new trainer) replaces the first
        model_dtype = self.model_config.dtype
        # Floating tensors arrive in the model's dtype: the source converts on the way (half
        # the bytes for an fp32 trainer and a bf16 model), as loading a checkpoint would.
        self._buffers = {
            name: torch.empty(shape, dtype=model_dtype if dtype.is_floating_point else dtype, device=self.device)
            for name, dtype, shape in zip(init_info.names, init_info.dtypes, init_info.shapes)}
        self._engine = torch_p2p.Engine(str(self.device), provider=init_info.provider)
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        self._dest = pw.WeightDestination(self._engine, pw.whole(self._buffers), init_info.leader_address,
                                          name=f"vllm-{os.getpid()}/rank{rank}")
        try:
            torch_p2p.wait(self._dest.join(), init_info.timeout)
        except BaseException:
            self.shutdown()
            raise

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        self._require_init()
        initialize_layerwise_reload(self.model)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # The base class ends with torch.accelerator.synchronize(), which raises on CPU.
        self.receive_weights(self.parse_update_info(update_info))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def receive_weights(self, update_info: TorchP2PUpdateInfo) -> None:
        dest = self._require_init()
        version = torch_p2p.wait(dest.wait_for(update_info.version), update_info.timeout)
        if version != update_info.version:
            # The buffers hold a later push: loading them would not be the version asked for.
            raise RuntimeError(f"asked to load version {update_info.version}, but version {version} has "
                               f"arrived since: the trainer pushes again before each update ends")
        self.model.load_weights(self._buffers.items())
        self.loaded_version = version
        self.bytes_received += sum(t.numel() * t.element_size() for t in self._buffers.values())

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)

    def shutdown(self) -> None:
        if self._dest is not None:
            self._dest.close()
        if self._engine is not None:
            self._engine.close()
        self._dest, self._engine, self._buffers = None, None, {}

    def _require_init(self) -> pw.WeightDestination:
        if self._dest is None:
            raise RuntimeError("the torch_p2p weight transfer is not initialized: call "
                               "init_weight_transfer_engine (the trainer engine's trainer_init) first")
        return self._dest


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
    """Rank 0 (the sender) owns an Engine and the leading WeightSource over the tensors the
    source yields; other ranks only iterate the source each round, so that collectives inside
    it (FSDP's full_tensor) stay in step. Not thread-safe: one caller drives it."""

    init_info_cls = TorchP2PTrainerInitInfo

    def __init__(self, init_info: TorchP2PTrainerInitInfo, *, client, source):
        super().__init__(client=client, source=source, is_sender=init_info.is_sender)
        self.info = init_info
        self.clients = [client]
        self.version = 0
        self.last_result: pw.PushResult | None = None
        self.push_seconds = 0.0  # the last push, start to every byte at every worker
        self._engine = self._source = None
        tensors = self._materialize()
        if not self.is_sender:
            return
        devices = {t.device for t in tensors.values()}
        if len(devices) != 1:
            raise ValueError(f"the source's tensors must be on one device, not {sorted(map(str, devices))}")
        # The tensors the source yields are registered as they are: a source over live
        # parameters (vLLM's ModuleSource) costs no copy; a source that materializes new
        # tensors each round (FSDP) is copied into the first round's ones (_materialize).
        self._tensors = {n: t.detach() for n, t in tensors.items()}
        self._engine = torch_p2p.Engine(str(devices.pop()), provider=init_info.provider)
        try:
            self._source = pw.WeightSource(self._engine, pw.whole(self._tensors), chunk_bytes=init_info.chunk_bytes,
                                           timeout=init_info.timeout)
            self.init_info_for_workers = dataclasses.asdict(TorchP2PInitInfo(
                leader=self._source.address.hex(), names=list(self._tensors),
                dtype_names=[str(t.dtype).removeprefix("torch.") for t in self._tensors.values()],
                shapes=[list(t.shape) for t in self._tensors.values()], timeout=init_info.join_timeout,
                provider=init_info.provider))
            client.init_weight_transfer_engine(self.init_info_for_workers)
        except BaseException:
            self.shutdown()
            raise

    @classmethod
    def trainer_init(cls, init_info: TorchP2PTrainerInitInfo, *, client, source=None):
        if source is None:
            raise ValueError("the torch_p2p trainer engine pushes a vLLM WeightSource (e.g. ModuleSource(model))")
        return cls(init_info, client=client, source=source)

    def connect(self, client) -> None:
        """Adds a vLLM instance started after trainer_init: its workers join now and receive
        every later send_weights. Sender only."""
        self._require_sender()
        client.init_weight_transfer_engine(self.init_info_for_workers)
        self.clients.append(client)

    def send_weights(self) -> None:
        """Pushes the source's current tensors as the next version to every worker, then has
        every instance load it (start, update, finish; weight_version = the version)."""
        tensors = self._materialize()
        if not self.is_sender:
            return
        for name, t in tensors.items():
            if t.data_ptr() != self._tensors[name].data_ptr():
                self._tensors[name].copy_(t)
        version = self.version + 1
        start = time.perf_counter()
        result = torch_p2p.wait(self._source.push(version), self.info.timeout)
        if result.dropped:
            raise RuntimeError(f"weights version {version}: workers dropped during the push: {result.dropped}")
        self.push_seconds = time.perf_counter() - start
        for client in self.clients:
            client.start_weight_update()
        for client in self.clients:
            client.update_weights({"version": version, "timeout": self.info.timeout})
        for client in self.clients:
            client.finish_weight_update(weight_version=str(version))
        self.version, self.last_result = version, result

    def shutdown(self) -> None:
        if self._source is not None:
            self._source.close()
        if self._engine is not None:
            self._engine.close()
        self._source = self._engine = None

    def _materialize(self) -> dict[str, torch.Tensor]:
        """One pass over the source, on every rank, checked against its metadata()."""
        tensors = dict(iter(self.source))
        expected = [m.name for m in self.source.metadata()]
        if list(tensors) != expected:
            raise ValueError(f"the WeightSource yielded {len(tensors)} tensors that differ from its metadata() "
                             f"({len(expected)}): {sorted(set(tensors) ^ set(expected))[:5]}")
        if self.is_sender and self._source is not None and set(tensors) != set(self._tensors):
            raise ValueError("the WeightSource yields other names than at trainer_init")
        return tensors

    def _require_sender(self) -> None:
        if not self.is_sender or self._source is None:
            raise RuntimeError("only the sender (rank 0) after trainer_init drives the workers")
