"""TorchP2PConnector's scheduler half: which requests load KV from a prefill engine, which
finished prefill requests keep their blocks for a decode engine, and the kv_transfer_params
that link the two (NixlConnector's keys, so vLLM's disaggregation proxy works unchanged, plus
the hold's slot and token that a decode worker checks after its pull: holds.py)."""
from __future__ import annotations

import time
from typing import Any

from vllm.logger import init_logger
from vllm.v1.request import RequestStatus

from .config import engine_port, setting
from .holds import HoldTables
from .metadata import Load, TorchP2PConnectorMetadata

logger = init_logger("vllm.torch_p2p")  # under "vllm": the logger vLLM configures
_REMOTE_KEYS = ("remote_engine_id", "remote_request_id", "remote_host", "remote_port", "remote_block_ids",
                "torch_p2p_hold")


class Scheduler:
    def __init__(self, vllm_config, engine_id: str):
        config = vllm_config.kv_transfer_config
        parallel = vllm_config.parallel_config
        self.engine_id = engine_id
        self.host = setting(config, "side_channel_host")
        self.port = engine_port(vllm_config)
        self.lease = setting(config, "kv_lease_duration")
        self.tp_size = parallel.tensor_parallel_size
        self.pp_size = parallel.pipeline_parallel_size
        self.dcp_size = parallel.decode_context_parallel_size
        self.hold_tables = HoldTables([self.port + r for r in range(self.tp_size)]) if config.is_kv_producer else None
        self._meta = TorchP2PConnectorMetadata()
        self._loads: dict[str, Load | None] = {}  # decode requests: the load their params ask for

    # -- decode side -------------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        """A request that names a prefill engine (do_remote_prefill) loads the rest of its
        prompt, asynchronously; one this connector cannot serve is computed here."""
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_prefill"):
            return 0, False
        if request.request_id not in self._loads:  # vLLM asks again when it could not allocate
            self._loads[request.request_id] = _load_of(request, params)
        count = len(request.prompt_token_ids or ()) - num_computed_tokens
        if self._loads[request.request_id] is None or count <= 0:
            return 0, False
        return count, True

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_prefill"):
            return
        params["do_remote_prefill"] = False  # one load per request
        load = self._loads.pop(request.request_id, None)
        if load is None:
            return
        load.local_blocks = [int(b) for b in blocks.get_unhashed_block_ids()] if num_external_tokens > 0 else []
        self._meta.loads.append(load)  # without blocks to fill: only tells the prefill side to free them

    def build_connector_meta(self, scheduler_output) -> TorchP2PConnectorMetadata:
        meta, self._meta = self._meta, TorchP2PConnectorMetadata()
        return meta

    # -- both --------------------------------------------------------------------------------------
    def update_connector_output(self, connector_output) -> None:
        """vLLM calls this before it frees the blocks of the requests in finished_sending: their
        holds end first, so no decode worker keeps what it reads of those blocks from now on."""
        if self.hold_tables is not None:
            for request_id in connector_output.finished_sending or ():
                self.hold_tables.end(request_id)

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        params = request.kv_transfer_params
        if not params:
            return False, None
        if params.get("do_remote_prefill"):
            # Aborted before its blocks were allocated: still tell the prefill engine to free its own.
            params["do_remote_prefill"] = False
            load = self._loads.pop(request.request_id, None) or _load_of(request, params, quiet=True)
            if load is not None:
                self._meta.loads.append(load)
            return False, None
        self._loads.pop(request.request_id, None)
        if not params.get("do_remote_decode") or self.hold_tables is None:
            return False, None
        if request.status not in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED):
            return False, None  # aborted: nothing for a decode engine to pull
        if not block_ids:
            return False, None
        try:
            hold = self.hold_tables.begin(request.request_id)
        except RuntimeError as e:
            logger.error("TorchP2PConnector: request %s offers no remote decode: %s", request.request_id, e)
            return False, None
        if hold is None:
            logger.warning("TorchP2PConnector: %d holds are given out already, every slot of the hold table: "
                           "request %s offers no remote decode", self.hold_tables.active, request.request_id)
            return False, None
        self._meta.leases[request.request_id] = self.lease
        return True, dict(do_remote_prefill=True, do_remote_decode=False, remote_block_ids=[list(block_ids)],
                          remote_engine_id=self.engine_id, remote_request_id=request.request_id,
                          remote_host=self.host, remote_port=self.port, tp_size=self.tp_size,
                          pp_size=self.pp_size, dcp_size=self.dcp_size, remote_num_tokens=request.num_computed_tokens,
                          # Wall clock: a decode host compares it with its own (clocks in sync).
                          remote_blocks_expiry_time=time.time() + self.lease, transfer_mode="pull",
                          torch_p2p_hold=list(hold))


def _load_of(request, params: dict, quiet: bool = False) -> Load | None:
    """The load a decode request's kv_transfer_params ask for, or None (logged) when this
    connector cannot serve it: the request is then computed here."""
    why = _unservable(params)
    if why is None:
        try:
            remote = params["remote_block_ids"]
            if remote and isinstance(remote[0], (list, tuple)):  # one list per KV cache group, as NixlConnector sends
                if len(remote) != 1:
                    raise ValueError(f"{len(remote)} KV cache groups; TorchP2PConnector moves one")
                remote = remote[0]
            slot, token = params["torch_p2p_hold"]
            return Load(request.request_id, str(params["remote_request_id"]), str(params["remote_engine_id"]),
                        str(params["remote_host"]), int(params["remote_port"]), [int(b) for b in remote], [],
                        int(params.get("tp_size", 1)), (int(slot), int(token)))
        except (TypeError, ValueError, KeyError) as e:
            why = f"bad kv_transfer_params ({type(e).__name__}: {e})"
    if not quiet:
        logger.warning("TorchP2PConnector: request %s is computed here: %s", request.request_id, why)
    return None


def _unservable(params: dict) -> str | None:
    missing = [k for k in _REMOTE_KEYS if params.get(k) is None]
    if missing:
        return f"its kv_transfer_params name no TorchP2PConnector prefill engine ({', '.join(missing)} missing)"
    if params.get("transfer_mode", "pull") != "pull":
        return f"transfer_mode {params['transfer_mode']!r}; TorchP2PConnector pulls"
    if int(params.get("pp_size", 1)) != 1 or int(params.get("dcp_size", 1)) != 1:
        return "the prefill engine runs pipeline or decode-context parallelism, which TorchP2PConnector does not move"
    expiry = params.get("remote_blocks_expiry_time")
    if expiry is not None and time.time() >= float(expiry):
        return f"the prefill engine's lease on its blocks ended {time.time() - float(expiry):.1f} s ago"
    return None
