"""verl's ``torch_p2p`` checkpoint engine (torch_p2p.integrations.verl.engine).

Importing this package registers the backend in verl's CheckpointEngineRegistry; verl imports
it in every worker when ``checkpoint_engine.custom_backend_module`` names it:

    actor_rollout_ref.rollout.checkpoint_engine.backend=torch_p2p
    actor_rollout_ref.rollout.checkpoint_engine.custom_backend_module=torch_p2p.integrations.verl

verl is imported here and in engine.py only; share.py, rendezvous.py and waiting.py need
torch_p2p alone.
"""
from .engine import BACKEND, TorchP2PCheckpointEngine

__all__ = ["BACKEND", "TorchP2PCheckpointEngine"]
