"""What TorchP2PConnector's scheduler half tells its worker half each step."""
from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata


@dataclass
class Load:
    """A decode request's blocks to pull from a prefill engine (`local_blocks` empty: only tell
    it to free them, our prefix cache holds them or the request was aborted)."""
    request_id: str
    remote_request_id: str
    remote_engine_id: str
    remote_host: str
    remote_port: int
    remote_blocks: list[int]
    local_blocks: list[int]
    remote_tp_size: int
    hold: tuple[int, int]  # (slot, token) in the prefill workers' hold tables: holds.py


@dataclass
class TorchP2PConnectorMetadata(KVConnectorMetadata):
    loads: list[Load] = field(default_factory=list)
    # Finished prefill requests whose blocks wait for a decode worker's pull: id -> lease (s).
    leases: dict[str, float] = field(default_factory=dict)
