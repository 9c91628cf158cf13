"""verl's nixl checkpoint engine on a machine without CUDA, for benchmarks/verl_sync.py only.

verl 0.9.1's NIXLCheckpointEngine cannot run with a CPU-only torch even with its
engine_kwargs device "cpu": its module imports cupy (a CUDA library) at import time, prepare()
allocates its two buckets with pin_memory=True (torch refuses without an accelerator), and
send/receive call torch.cuda.synchronize() unconditionally (torch raises without CUDA). This
module, named by checkpoint_engine.custom_backend_module, removes those three obstacles and
nothing else, then imports the engine so that it registers as "nixl":

- `cupy`: an empty module (cupy is used only when device == "cuda");
- pin_memory=True on torch.zeros is dropped where no accelerator exists (pinning is a CUDA
  DMA optimization; the CPU buckets hold the same bytes);
- torch.cuda.synchronize() does nothing where CUDA is absent (there is no CUDA work to wait for).
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

import verl.checkpoint_engine.nixl_checkpoint_engine  # noqa: E402,F401  (registers "nixl")
