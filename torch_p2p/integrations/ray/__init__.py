"""torch_p2p as a Ray Direct Transport: ``@ray.method(tensor_transport="TORCH_P2P")``.

One call before the actor classes are defined, in every process that defines or creates them
(``@ray.method`` checks the transport's name; Ray copies the registrations of the process that
creates an actor to that actor): at the top of the module that defines the actors (docs/ray.md):

    import torch_p2p.integrations.ray as p2p_ray
    p2p_ray.register()

    @ray.remote(enable_tensor_transport=True)
    class Trainer:
        @ray.method(tensor_transport="TORCH_P2P")
        def weights(self):
            return self.model.state_dict()

The transport is one-sided: the owner registers the returned tensors' storages with its
engine and hands out RemoteTensor handles; the receiver reads them with ``read_slices``. Each
process (driver or actor) makes its engines on first use, one per device.
"""
from __future__ import annotations

NAME = "TORCH_P2P"


def register() -> None:
    """Registers ``TORCH_P2P`` with Ray in this process, for cpu and cuda tensors. Call it before
    defining the classes whose methods name it; calling it again does nothing."""
    import torch
    from ray.experimental import register_tensor_transport

    from .transport import TorchP2PTransport

    try:
        register_tensor_transport(NAME, ["cpu", "cuda"], TorchP2PTransport, torch.Tensor)
    except ValueError as e:
        # Ray's registry is private; what it promises is this error on a second registration.
        if "already registered" not in str(e):
            raise
