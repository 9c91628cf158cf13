"""torch_p2p inside vLLM: a KV connector for disaggregated serving (``TorchP2PConnector``) and
a weight-transfer backend for RL (``"torch_p2p"``).

vLLM runs ``register`` from the ``vllm.general_plugins`` entry point in every process it starts
(API server, EngineCore, workers), so a user needs only the configuration:

    --kv-transfer-config '{"kv_connector": "TorchP2PConnector", "kv_role": "kv_producer"}'
    --weight-transfer-config '{"backend": "torch_p2p"}'
"""
from __future__ import annotations

CONNECTOR = "TorchP2PConnector"
WEIGHT_BACKEND = "torch_p2p"


def register() -> None:
    """Registers the connector and the weight-transfer engine with vLLM's factories (lazily:
    vLLM imports the classes when a configuration names them). Safe to call more than once."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if CONNECTOR not in KVConnectorFactory._registry:
        KVConnectorFactory.register_connector(
            CONNECTOR, "torch_p2p.integrations.vllm.connector", "TorchP2PConnector")
    if WEIGHT_BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(
            WEIGHT_BACKEND, "torch_p2p.integrations.vllm.weight_transfer",
            "TorchP2PWeightTransferEngine")
