"""TorchP2PConnector's settings: kv_connector_extra_config keys, then environment variables,
then defaults."""
from __future__ import annotations

import os

DEFAULTS = {
    # The prefill side's side channel: decode workers fetch its cache handle there once.
    "side_channel_host": ("TORCH_P2P_SIDE_CHANNEL_HOST", "127.0.0.1"),
    "side_channel_port": ("TORCH_P2P_SIDE_CHANNEL_PORT", 5610),
    # Seconds a finished prefill request's blocks wait for a pull before they are freed.
    "kv_lease_duration": ("TORCH_P2P_KV_LEASE", 30.0),
    # Seconds a handshake or a pull may take before the request's load fails.
    "transfer_timeout": ("TORCH_P2P_TRANSFER_TIMEOUT", 10.0),
    # Prefill side, CPU caches: move them into shared memory so that decode workers of the same
    # host copy them with memcpy rather than the kernel's cross-memory copy.
    "share_cpu_cache": ("TORCH_P2P_SHARE_CPU_CACHE", True),
    # Seconds a step that runs no forward waits for the loads it started, so that they are
    # reported in that step rather than the next one.
    "idle_load_wait": ("TORCH_P2P_IDLE_LOAD_WAIT", 0.02),
}


def setting(kv_transfer_config, key: str):
    env, default = DEFAULTS[key]
    value = kv_transfer_config.get_from_extra_config(key, None)
    if value is None:
        value = os.environ.get(env, default)
    try:
        if isinstance(default, bool) and isinstance(value, str):
            if value.lower() not in ("0", "1", "true", "false"):
                raise ValueError(value)
            return value.lower() in ("1", "true")
        return type(default)(value)
    except (TypeError, ValueError):
        raise ValueError(f"TorchP2PConnector: {key} (kv_connector_extra_config, or ${env}) must be a "
                         f"{type(default).__name__}, not {value!r}") from None


def engine_port(vllm_config) -> int:
    """The first side-channel port of this engine; its tensor-parallel worker r serves port +
    r (data-parallel engines get ranges of their own)."""
    parallel = vllm_config.parallel_config
    base = setting(vllm_config.kv_transfer_config, "side_channel_port")
    return base + parallel.data_parallel_index * parallel.tensor_parallel_size
