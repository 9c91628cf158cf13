"""TorchP2PConnector's worker half: registers the worker's caches (transfer.KVTransfer), starts
the step's loads and leases, and reports what finished or failed to vLLM."""
from __future__ import annotations

from vllm.logger import init_logger

from . import holds
from .config import engine_port, setting
from .metadata import TorchP2PConnectorMetadata
from .tp_mapping import sources
from .cache_layout import expand_blocks
from .transfer import KVTransfer

logger = init_logger("vllm.torch_p2p")  # under "vllm": the logger vLLM configures


class Worker:
    def __init__(self, vllm_config, engine_id: str, kv_cache_config):
        self.config = vllm_config.kv_transfer_config
        self.engine_id = engine_id
        self.num_blocks = kv_cache_config.num_blocks
        self.tp_rank = _tp_rank()
        self.tp_size = vllm_config.parallel_config.tensor_parallel_size
        self.kv_heads = vllm_config.model_config.get_total_num_kv_heads()
        model, cache = vllm_config.model_config, vllm_config.cache_config
        # What a peer must share for our blocks to mean the same there (the handshake compares).
        self.compat = dict(model=model.model, dtype=str(model.dtype), cache_dtype=str(cache.cache_dtype),
                           block_size=cache.block_size, kv_heads=self.kv_heads, head_size=model.get_head_size(),
                           layers=model.get_total_num_hidden_layers())
        self.port = engine_port(vllm_config) + self.tp_rank
        self.transfer: KVTransfer | None = None
        self._per_block = 1
        self._loading: dict[str, list[int]] = {}  # request -> its local blocks
        self._failed: set[str] = set()
        self._failed_blocks: set[int] = set()
        self._idle_wait = setting(self.config, "idle_load_wait")
        self._wait_now = False  # this step started loads and runs no forward

    def register_kv_caches(self, kv_caches: dict) -> None:
        first = next(iter(kv_caches.values()))
        if first.shape[0] % self.num_blocks:
            raise ValueError(f"TorchP2PConnector: caches of {first.shape[0]} blocks for {self.num_blocks} "
                             "scheduler blocks")
        # vLLM splits a scheduler block into kernel blocks where the attention kernel wants smaller ones.
        self._per_block = first.shape[0] // self.num_blocks
        heads = first.shape[1]
        if heads * self.tp_size != self.kv_heads:
            raise NotImplementedError(f"TorchP2PConnector: {self.kv_heads} KV heads over tensor parallelism "
                                      f"{self.tp_size} are replicated ({heads} a worker); not supported")
        serve = self.config.is_kv_producer
        layout = "cpu" if first.device.type == "cpu" else "cuda"
        # Every hold keeps a block; more slots than blocks leave room for holds sharing blocks.
        table = holds.create(self.port, max(4 * self.num_blocks, 1024)) if serve else None
        self.transfer = KVTransfer(
            kv_caches, layout, engine_id=self.engine_id, first_head=self.tp_rank * heads,
            host=setting(self.config, "side_channel_host"), port=self.port if serve else None,
            timeout=setting(self.config, "transfer_timeout"), lease=setting(self.config, "kv_lease_duration"),
            share=serve and setting(self.config, "share_cpu_cache"), hold_table=table,
            compat=dict(self.compat, layout=layout), tp_size=self.tp_size)
        logger.info("TorchP2PConnector: %d layers registered (%s, %s)%s", len(kv_caches), self.transfer.cache,
                    self.transfer.engine.provider, f", side channel on port {self.port}" if serve else "")

    def start_load_kv(self, meta: TorchP2PConnectorMetadata, forward: bool) -> None:
        """Starts the step's loads; `forward`: whether the step runs the model."""
        assert self.transfer is not None, "register_kv_caches comes first"
        self._wait_now = bool(meta.loads) and not forward
        for load in meta.loads:
            local = expand_blocks(load.local_blocks, self._per_block)
            if load.local_blocks:
                self._loading[load.request_id] = load.local_blocks
            try:
                src = sources(self.tp_rank, self.tp_size, load.remote_tp_size, self.kv_heads)
                self.transfer.load(load.request_id, load.remote_request_id,
                                   [(load.remote_host, load.remote_port + q) for q in src.ranks], load.remote_engine_id,
                                   expand_blocks(load.remote_blocks, self._per_block), local, readers=src.readers,
                                   hold=load.hold, remote_tp=load.remote_tp_size)
            except Exception as e:
                self._fail(load.request_id, e)
        for request_id, seconds in meta.leases.items():
            self.transfer.start_lease(request_id, seconds)

    def results(self) -> tuple[set[str], set[str], set[str]]:
        """(prefill requests whose blocks may be freed, decode requests whose load ended, those of
        them whose load failed)."""
        if self.transfer is None:
            return set(), set(), set()
        if self._wait_now:
            # Nothing else to run this step: its loads are reported now rather than a step later.
            self._wait_now = False
            self.transfer.wait(self._idle_wait)
        freed, loaded = self.transfer.poll()
        for request_id, pulled in freed.items():
            if pulled:
                logger.info("TorchP2PConnector: request %s's blocks freed: a decode engine pulled them", request_id)
            else:
                logger.warning("TorchP2PConnector: no decode engine pulled request %s's blocks within the "
                               "lease: freed", request_id)
        done = set()
        for p in loaded:
            if p.error is not None:
                self._fail(p.request_id, p.error)
                continue
            if self._loading.pop(p.request_id, None) is None:
                continue  # notify-only: nothing was waiting for it
            done.add(p.request_id)
            logger.info("TorchP2PConnector: pulled %d blocks (%d bytes) of request %s in %.3f ms "
                        "(hold check %.3f ms, handshake %.3f ms)", p.blocks, p.bytes, p.request_id, p.seconds * 1e3,
                        p.check_seconds * 1e3, p.handshake_seconds * 1e3)
        failed, self._failed = self._failed, set()
        return set(freed), done | failed, failed

    def failed_blocks(self) -> set[int]:
        """The blocks of the loads that failed since the last call."""
        blocks, self._failed_blocks = self._failed_blocks, set()
        return blocks

    def _fail(self, request_id: str, error: BaseException) -> None:
        blocks = self._loading.pop(request_id, None)
        logger.error("TorchP2PConnector: loading request %s failed: %s: %s", request_id, type(error).__name__, error)
        if blocks is not None:  # a notify-only load has nothing to redo
            self._failed.add(request_id)
            self._failed_blocks.update(blocks)

    def shutdown(self) -> None:
        if self.transfer is not None:
            self.transfer.close()
            self.transfer = None
            if self.config.is_kv_producer:
                holds.remove(self.port)


def _tp_rank() -> int:
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank
    return get_tensor_model_parallel_rank()
