"""TorchP2PConnector's scheduler half: which requests load KV from a prefill engine, which
finished prefill requests hold their blocks for a decode engine, and the kv_transfer_params
that link the two (NixlConnector's keys, so vLLM's disaggregation proxy works unchanged)."""
from __future__ import annotations

from typing import Any

from vllm.logger import init_logger
from vllm.v1.request import RequestStatus

from .config import engine_port, setting
from .metadata import Load, TorchP2PMetadata

logger = init_logger("vllm.torch_p2p")  # under "vllm": the logger vLLM configures
_REMOTE_KEYS = ("remote_engine_id", "remote_request_id", "remote_host", "remote_port")


class Scheduler:
    def __init__(self, vllm_config, engine_id: str):
        config = vllm_config.kv_transfer_config
        self.engine_id = engine_id
        self.host = setting(config, "side_channel_host")
        self.port = engine_port(vllm_config)
        self.lease = setting(config, "kv_lease_duration")
        self.tp_size = vllm_config.parallel_config.tensor_parallel_size
        self._meta = TorchP2PMetadata()

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        """A request that names a prefill engine (do_remote_prefill) loads its whole prompt,
        asynchronously."""
        params = request.kv_transfer_params
        if params and params.get("do_remote_prefill"):
            count = len(request.prompt_token_ids or ()) - num_computed_tokens
            if count > 0:
                return count, True
        return 0, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_prefill"):
            return
        params["do_remote_prefill"] = False  # one load per request
        missing = [k for k in _REMOTE_KEYS + ("remote_block_ids",) if params.get(k) is None]
        if missing:
            logger.warning("TorchP2PConnector: request %s names no prefill engine (%s missing): computed here",
                           request.request_id, ", ".join(missing))
            return
        local = blocks.get_unhashed_block_ids() if num_external_tokens > 0 else []
        self._meta.loads.append(_load(request.request_id, params, local))

    def build_connector_meta(self, scheduler_output) -> TorchP2PMetadata:
        meta, self._meta = self._meta, TorchP2PMetadata()
        return meta

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        params = request.kv_transfer_params
        if not params:
            return False, None
        if params.get("do_remote_prefill"):
            # Aborted before its blocks were allocated: still tell the prefill engine to free its own.
            params["do_remote_prefill"] = False
            if all(params.get(k) is not None for k in _REMOTE_KEYS + ("remote_block_ids",)):
                self._meta.loads.append(_load(request.request_id, params, []))
            return False, None
        if not params.get("do_remote_decode"):
            return False, None
        if request.status not in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED):
            return False, None  # aborted: nothing for a decode engine to pull
        hold = len(block_ids) > 0
        if hold:
            self._meta.holds[request.request_id] = self.lease
        return hold, dict(do_remote_prefill=True, do_remote_decode=False, remote_block_ids=[list(block_ids)],
                          remote_engine_id=self.engine_id, remote_request_id=request.request_id,
                          remote_host=self.host, remote_port=self.port, tp_size=self.tp_size,
                          remote_num_tokens=request.num_computed_tokens)


def _load(request_id: str, params: dict, local_blocks) -> Load:
    remote = params["remote_block_ids"]
    if remote and isinstance(remote[0], (list, tuple)):  # one list per KV cache group, as NixlConnector sends
        if len(remote) != 1:
            raise ValueError(f"request {request_id}: {len(remote)} KV cache groups; TorchP2PConnector moves one")
        remote = remote[0]
    return Load(request_id, str(params["remote_request_id"]), str(params["remote_engine_id"]),
                str(params["remote_host"]), int(params["remote_port"]), [int(b) for b in remote],
                [int(b) for b in local_blocks], int(params.get("tp_size", 1)))
