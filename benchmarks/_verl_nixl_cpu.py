"""verl's nixl checkpoint engine on a machine without CUDA, for benchmarks/verl_sync.py only.

verl 0.9.1's NIXLCheckpointEngine cannot run with a CPU-only torch even with its
engine_kwargs device "cpu": its module imports cupy (a CUDA library) at import time, prepare()
allocates its two buckets with pin_memory=True (torch refuses without an accelerator), and
send/receive call torch.cuda.synchronize() unconditionally (torch raises without CUDA). This
module, named by checkpoint_engine.custom_backend_module, removes those three obstacles, then
imports the engine so that it registers as "nixl":

- `cupy`: an empty module (cupy is used only when device == "cuda");
- pin_memory=True on torch.zeros is dropped where no accelerator exists (pinning is a CUDA
  DMA optimization; the CPU buckets hold the same bytes);
- torch.cuda.synchronize() does nothing where CUDA is absent (there is no CUDA work to wait for).

It also corrects one bug that has nothing to do with CUDA: build_topology gives the rollout
ranks `metadata[-rollout_world_size + 1:] + [None]` as their next agents, which with a single
rollout rank is `metadata[0:] + [None]`, every worker's metadata, so CheckpointEngineManager's
build_process_group fails its length check ("rollout_kwargs[next_agent_metadata] must have
length of 1") whenever the replicas hold one rank in all.
"""
import sys
import types

import torch

if not torch.cuda.is_available():
    sys.modules.setdefault("cupy", types.ModuleType("cupy"))
    _zeros = torch.zeros

    def _zeros_unpinned(*args, pin_memory=False, **kwargs):
        return _zeros(*args, **kwargs)

    torch.zeros = _zeros_unpinned
    torch.cuda.synchronize = lambda device=None: None

from verl.checkpoint_engine.nixl_checkpoint_engine import NIXLCheckpointEngine  # noqa: E402  (registers "nixl")

_build_topology = NIXLCheckpointEngine.build_topology.__func__


def _build_topology_one_rank(cls, actor_wg_world_size: int, rollout_world_size: int, metadata: list):
    """verl's chain (trainer rank 0, then every rollout rank in order); each rollout rank's next
    agent is the rollout rank after it, counted from the start of the list."""
    actor_kwargs, rollout_kwargs = _build_topology(cls, actor_wg_world_size, rollout_world_size, metadata)
    first_rollout = len(metadata) - rollout_world_size
    rollout_kwargs["next_agent_metadata"] = metadata[first_rollout + 1:] + [None]
    return actor_kwargs, rollout_kwargs


NIXLCheckpointEngine.build_topology = classmethod(_build_topology_one_rank)
