"""The trainer side of the ``torch_p2p`` weight-transfer backend, without vLLM: a trainer
process needs torch_p2p and `requests` (for HTTPClient), not vLLM.

    vllm = HTTPClient("http://vllm:8000")
    trainer = WeightTrainer(dict(model.named_parameters()), [vllm])
    for step in range(steps):
        train_step(model)             # parameters change in place
        vllm.pause()                  # vLLM's RL protocol: no generation during the update
        trainer.send_weights()        # push, then load in every worker
        vllm.resume()
    trainer.shutdown()

`WeightTrainer` registers the tensors once and leads a torch_p2p.weights push group; each
inference instance is driven through a client with vLLM's five weight-sync methods
(`HTTPClient` here, or vLLM's own `HTTPVLLMWeightSyncClient` / `RayVLLMWeightSyncClient`).
vLLM's factory-built trainer engine (weight_transfer.TorchP2PTrainerWeightTransferEngine) is
a front over this class.

A trainer may die anywhere in an update; the instances stay consistent because the inference
side touches the model only inside one update_weights call, once the whole version has
arrived (docs/vllm.md, "A trainer that dies"). What a dead trainer can leave behind is an
update vLLM still counts as open (started, never finished): vLLM then refuses the next start,
and `_start` finishes that update first.
"""
from __future__ import annotations

import logging
import time
from typing import Mapping

import torch

import torch_p2p
import torch_p2p.weights as pw

log = logging.getLogger("torch_p2p.integrations.vllm")


class HTTPClient:
    """A vLLM OpenAI server's weight-sync routes (which need ``VLLM_SERVER_DEV_MODE=1``), plus
    /pause and /resume, over `requests`. The same methods as vLLM's HTTPVLLMWeightSyncClient."""

    def __init__(self, url: str, timeout: float = 300.0):
        self.url = url.rstrip("/")
        self.timeout = timeout

    def _post(self, route: str, body: dict | None = None) -> None:
        import requests

        r = requests.post(f"{self.url}/{route}", json=body, timeout=self.timeout)
        if r.status_code >= 400:
            raise RuntimeError(f"{self.url}/{route} answered {r.status_code}: {r.text[:500]}")

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self._post("init_weight_transfer_engine", {"init_info": init_info})

    def shutdown_weight_transfer_engine(self) -> None:
        self._post("shutdown_weight_transfer_engine")

    def start_weight_update(self) -> None:
        self._post("start_weight_update")

    def update_weights(self, update_info: dict) -> None:
        self._post("update_weights", {"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._post("finish_weight_update", None if weight_version is None else {"weight_version": weight_version})

    def pause(self) -> None:
        """Stops generation (and clears the prefix cache: its blocks hold the old weights' KV)."""
        self._post("pause")

    def resume(self) -> None:
        self._post("resume")


class WeightTrainer:
    """Pushes `tensors` (name -> tensor, the names the model's load_weights takes: a Hugging
    Face model's named_parameters()) into every instance of `clients`. The tensors are
    registered as they are: send_weights() reads their current contents. Not thread-safe: one
    caller drives it.

    Args:
        timeout: bounds a push and each worker's wait for it.
        join_timeout: bounds a worker's join at init.
        provider: the libfabric provider on both sides (None: automatic).
    """

    def __init__(self, tensors: Mapping[str, torch.Tensor], clients=(), *, timeout: float = 120.0,
                 join_timeout: float = 60.0, provider: str | None = None, chunk_bytes: int = pw.CHUNK_BYTES):
        devices = {t.device for t in tensors.values()}
        if len(devices) != 1:
            raise ValueError(f"the tensors must be on one device, not {sorted(map(str, devices))}")
        self.tensors = {n: t.detach() for n, t in tensors.items()}
        self.timeout = float(timeout)
        self.clients: list = []
        self.version = 0
        self.last_result: pw.PushResult | None = None
        self.push_seconds = 0.0    # the last push, start to every byte at every worker
        self._source = None
        self._engine = torch_p2p.Engine(str(devices.pop()), provider=provider)
        try:
            self._source = pw.WeightSource(self._engine, pw.whole(self.tensors), chunk_bytes=chunk_bytes,
                                           timeout=timeout)
            # TorchP2PInitInfo's fields: what a worker needs to size its buffers and join.
            self.init_info = dict(leader=self._source.address.hex(), layout=pw.Layout.of(self.tensors).to_json(),
                                  timeout=float(join_timeout), provider=provider)
            for client in clients:
                self.connect(client)
        except BaseException:
            self.shutdown()
            raise

    def connect(self, client) -> None:
        """Adds an instance: its workers join now and receive every later send_weights."""
        client.init_weight_transfer_engine(self.init_info)
        self.clients.append(client)

    def send_weights(self, tensors: Mapping[str, torch.Tensor] | None = None) -> int:
        """Pushes the tensors (copying `tensors` into them first, if given) as the next version
        to every worker, then has every instance load it: start, update, finish with
        weight_version = the version. Returns the version."""
        if self._source is None:
            raise RuntimeError("the trainer is shut down")
        start = time.perf_counter()
        if tensors is not None:
            if set(tensors) != set(self.tensors):
                raise ValueError(f"send_weights takes the names registered at init: "
                                 f"{sorted(set(tensors) ^ set(self.tensors))[:5]} differ")
            for name, t in tensors.items():
                if t.data_ptr() != self.tensors[name].data_ptr():
                    self.tensors[name].copy_(t)
        version = self.version + 1
        result = torch_p2p.wait(self._source.push(version), self.timeout)
        if result.dropped:
            raise RuntimeError(f"weights version {version}: workers dropped during the push: {result.dropped}")
        self.push_seconds = time.perf_counter() - start
        for client in self.clients:
            _start(client)
        for client in self.clients:
            client.update_weights({"version": version, "timeout": self.timeout})
        for client in self.clients:
            client.finish_weight_update(weight_version=str(version))
        self.version, self.last_result = version, result
        return version

    def shutdown(self) -> None:
        """Closes the push group; the instances keep the weights they hold."""
        if self._source is not None:
            self._source.close()
        if self._engine is not None:
            self._engine.close()
        self._source = self._engine = None


def _start(client) -> None:
    try:
        client.start_weight_update()
    except Exception as refused:  # noqa: BLE001 - told apart below by whether a finish works
        # vLLM refuses a start while an update is open. Finishing one that a dead trainer
        # left open changes no weight (the backend loads only inside update_weights); if
        # there is none, the finish fails too and the start's own error is the one to see.
        try:
            client.finish_weight_update()
        except Exception:  # noqa: BLE001
            raise refused from None
        log.warning("torch_p2p weights: finished an update that an earlier trainer left open "
                    "(started, never finished): %s", refused)
        client.start_weight_update()
