"""TorchP2PConnector: vLLM's KV connector (KVConnectorBase_V1) over torch_p2p.kv, for
disaggregated prefill and decode. The decode side pulls each request's blocks from the prefill
side and tells it to free them, as NixlConnector does, with the same kv_transfer_params.

    --kv-transfer-config '{"kv_connector": "TorchP2PConnector", "kv_role": "kv_producer"}'

A thin class: the scheduler half is scheduler.Scheduler, the worker half worker.Worker, the
bytes move in transfer.KVTransfer (no vLLM there). docs/vllm.md says how to use it.
"""
from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1, KVConnectorRole,
                                                                KVConnectorTransferResults)

from .metadata import TorchP2PConnectorMetadata


class TorchP2PConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        if vllm_config.model_config is not None and vllm_config.model_config.use_mla:
            raise NotImplementedError("TorchP2PConnector does not move MLA caches yet")
        engine_id = vllm_config.kv_transfer_config.engine_id
        self.scheduler = self.worker = None
        if role == KVConnectorRole.SCHEDULER:
            from .scheduler import Scheduler
            self.scheduler = Scheduler(vllm_config, engine_id)
        else:
            from .worker import Worker
            self.worker = Worker(vllm_config, engine_id, kv_cache_config)

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config) -> str | None:
        return "LBHNC"  # a block of a layer is one run of bytes: one read per run of blocks

    # -- scheduler -------------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        self.scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output) -> TorchP2PConnectorMetadata:
        return self.scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output) -> None:
        self.scheduler.update_connector_output(connector_output)

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self.scheduler.request_finished(request, block_ids)

    # -- worker ----------------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict) -> None:
        self.worker.register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context, **kwargs) -> None:
        # vLLM's steps without a forward (only KV transfers to run) pass no attention metadata.
        forward = getattr(forward_context, "attn_metadata", None) is not None
        self.worker.start_load_kv(self._get_connector_metadata(), forward)

    def wait_for_layer_load(self, layer_name: str) -> None:
        pass  # loads finish before their request is scheduled (asynchronous loading)

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs) -> None:
        pass  # the decode side pulls: docs/vllm.md says why there is no push mode

    def wait_for_save(self) -> None:
        pass

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending, results.finished_recving

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        sending, recving, failed = self.worker.results()
        return KVConnectorTransferResults(finished_sending=sending, finished_recving=recving, failed_recving=failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.failed_blocks()

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.shutdown()
