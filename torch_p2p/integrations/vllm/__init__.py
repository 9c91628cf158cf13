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
    """Registers the connector and the weight-transfer engines (inference and trainer side)
    with vLLM's factories, lazily: vLLM imports a class when a configuration names it. Safe to
    call more than once (vLLM runs plugins in every process, sometimes twice in one)."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.weight_transfer.factory import (WeightTransferEngineFactory,
                                                          WeightTransferTrainerFactory)

    module = "torch_p2p.integrations.vllm."
    _once(KVConnectorFactory.register_connector, CONNECTOR, module + "connector", "TorchP2PConnector")
    _once(WeightTransferEngineFactory.register_engine, WEIGHT_BACKEND, module + "weight_transfer",
          "TorchP2PWeightTransferEngine")
    _once(WeightTransferTrainerFactory.register_engine, WEIGHT_BACKEND, module + "weight_transfer",
          "TorchP2PTrainerWeightTransferEngine")


def _once(register_fn, *args) -> None:
    # The factories' registries are private; what they promise is this error on a second
    # registration of a name.
    try:
        register_fn(*args)
    except ValueError as e:
        if "already registered" not in str(e):
            raise
