"""verl pieces for the torch_p2p checkpoint engine's tests and benchmark: a trainer worker that
does what verl's actor worker does around its checkpoint engine, a server adapter that loads
what the rollout side receives into a model of its own, and a rollout replica without inference servers.

The rollout side is verl's own CheckpointEngineWorker (the Ray actor verl runs beside each
inference rank), its own RayWorkerGroup and its own CheckpointEngineManager; only the model
and the inference server are stand-ins.
"""
from __future__ import annotations

import itertools
import os
import time

import ray
import torch
from verl.checkpoint_engine.base import CheckpointEngineManager, CheckpointEngineRegistry, CheckpointEngineWorker
from verl.single_controller.base import Worker
from verl.single_controller.base.decorator import Dispatch, register
from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
from verl.utils.import_utils import import_external_libs
from verl.workers.config import CheckpointEngineConfig, RolloutConfig
from verl.workers.rollout.replica import RolloutReplica

from ray_actors import digest  # noqa: F401 - the tests' and the benchmark's digest, as the Ray tests'

MODULE = "torch_p2p.integrations.verl"
_groups = itertools.count()  # worker groups of one process get names of their own


def state_dict(step: int, scale: int = 1, contiguous: bool = False) -> dict[str, torch.Tensor]:
    """The model's weights at a step: different bytes every step, several dtypes and shapes;
    `scale` multiplies the sizes (scale 1: about 0.6 MB). lm_head.weight is a transposed view
    unless `contiguous` (verl's own engines flatten each tensor with view(-1), which only a
    contiguous tensor allows; a trainer's gathered full tensors are contiguous)."""
    g = torch.Generator().manual_seed(1000 + step)
    sd = {}
    for i in range(6):
        sd[f"layers.{i}.attn.qkv.weight"] = torch.randn(96 * scale, 128, generator=g).to(torch.bfloat16)
        sd[f"layers.{i}.mlp.up.weight"] = torch.randn(256 * scale, 128, generator=g)
        sd[f"layers.{i}.norm.weight"] = torch.rand(128, generator=g, dtype=torch.float64)
    sd["embed_tokens.weight"] = torch.randn(200 * scale, 128, generator=g).to(torch.float16)
    sd["position_ids"] = torch.randint(0, 1 << 40, (7, 3), generator=g)
    sd["lm_head.weight"] = torch.randn(128, 200 * scale, generator=g).t()
    if contiguous:
        sd["lm_head.weight"] = sd["lm_head.weight"].contiguous()
    return sd


def config(backend: str = "torch_p2p", module: str = MODULE, tp: int = 2, bucket_mib: int = 2048,
           **engine_kwargs) -> RolloutConfig:
    ce = CheckpointEngineConfig(backend=backend, custom_backend_module=module, update_weights_bucket_megabytes=bucket_mib,
                                engine_kwargs={backend: {"device": "cpu", **engine_kwargs}})
    return RolloutConfig(name="vllm", tensor_model_parallel_size=tp, checkpoint_engine=ce)


class TrainerWorker(Worker):
    """What verl's actor worker does with its checkpoint engine (engine_workers.py): builds it
    with is_master on rank 0 and, per update, sends its per-tensor generator.

    scale 1: the weights of step s are state_dict(s). Larger scales (benchmarks) make
    state_dict(0, scale) once and add 1 to every element per step (changed bytes, no cost of
    drawing random numbers inside the timed update)."""

    def __init__(self, rollout_config: RolloutConfig, scale: int = 1, delay_s: float = 0.0,
                 contiguous: bool = False):
        super().__init__()
        ce = rollout_config.checkpoint_engine
        import_external_libs(ce.custom_backend_module)
        self.checkpoint_engine = CheckpointEngineRegistry.new(
            ce.backend, is_master=int(os.environ["RANK"]) == 0, bucket_size=ce.update_weights_bucket_megabytes << 20,
            **ce.engine_kwargs.get(ce.backend, {}))
        self.scale, self.delay_s, self.contiguous = scale, delay_s, contiguous
        self.step, self.sd = None, None
        self.started_file = None  # created once an update's generator has yielded its first tensor

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def make_weights(self, step: int) -> None:
        if self.step == step:
            return
        if self.scale == 1 or self.sd is None:
            self.sd = state_dict(step, self.scale, self.contiguous)
        else:
            for t in self.sd.values():
                t.add_(1)
        self.step = step

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def weight_digests(self) -> dict[str, str]:
        return {name: digest(t) for name, t in self.sd.items()}

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    async def update_weights(self, global_steps: int = None, mode: str = "auto"):
        self.make_weights(global_steps)

        def per_tensor_param():
            for i, (name, t) in enumerate(self.sd.items()):
                if i == 1 and self.started_file:
                    open(self.started_file, "w").close()
                time.sleep(self.delay_s)  # a trainer gathering its next tensor
                yield name, t

        return await self.checkpoint_engine.send_weights(per_tensor_param(), global_steps=global_steps)

    @register(dispatch_mode=Dispatch.DP_COMPUTE, blocking=False)
    def execute_checkpoint_engine(self, method: str, *args, **kwargs):
        return getattr(self.checkpoint_engine, method)(*args, **kwargs)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def set_delay(self, delay_s: float, started_file: str | None = None):
        self.delay_s, self.started_file = delay_s, started_file


class LoadingAdapter:
    """The server adapter's place: loads what receive_weights yields into its own copy of the
    model (a copy per tensor, as an inference engine's load does) and records the
    global_steps of each update."""

    replica_rank = 0
    is_leader_rank = True

    def __init__(self):
        self.model: dict[str, torch.Tensor] = {}
        self.steps: list = []

    async def update_weights(self, weights, global_steps=None, wire_format="named_tensors"):
        assert wire_format == "named_tensors"
        loaded = set()
        async for name, t in weights:
            if name not in self.model:
                self.model[name] = torch.empty_like(t)
            self.model[name].copy_(t)
            loaded.add(name)
        assert loaded == set(self.model), "an update that did not carry every tensor"
        self.steps.append(global_steps)

    def digests(self) -> dict[str, str]:
        return {name: digest(t) for name, t in self.model.items()}


class Replica(RolloutReplica):
    """A rollout replica of verl's CheckpointEngineWorkers and no inference server (its
    abort/release/resume calls go to no server)."""

    def __init__(self, replica_rank: int, rollout_config: RolloutConfig):
        super().__init__(replica_rank, rollout_config, model_config=None, gpus_per_node=8)
        self.pool = pool = RayResourcePool([self.world_size], use_gpu=False, max_colocate_count=1)
        group = RayWorkerGroup(resource_pool=pool, name_prefix=f"rollout{replica_rank}_{os.getpid()}_{next(_groups)}",
                               ray_cls_with_init=RayClassWithInitArgs(
                                   cls=ray.remote(CheckpointEngineWorker), rollout_config=rollout_config,
                                   model_config=None, server_adapter=LoadingAdapter()))
        self.workers = group.workers

    async def launch_servers(self):
        pass

    def steps(self) -> list:
        """Per worker: the global_steps of every update it loaded."""
        return ray.get([w.__ray_call__.remote(lambda self: self.server_adapter.steps) for w in self.workers])

    def digests(self) -> list:
        """Per worker: {name: digest} of the model it holds."""
        return ray.get([w.__ray_call__.remote(lambda self: self.server_adapter.digests()) for w in self.workers])

    def engines(self, attr: str) -> list:
        return ray.get([w.__ray_call__.remote(lambda self, a=attr: getattr(self.checkpoint_engine, a))
                        for w in self.workers])


def trainer_group(rollout_config: RolloutConfig, world: int = 2, **kwargs) -> RayWorkerGroup:
    pool = RayResourcePool([world], use_gpu=False, max_colocate_count=1)
    group = RayWorkerGroup(resource_pool=pool, name_prefix=f"trainer_{os.getpid()}_{next(_groups)}",
                           ray_cls_with_init=RayClassWithInitArgs(cls=ray.remote(TrainerWorker),
                                                                  rollout_config=rollout_config, **kwargs))
    group.pool = pool  # for release()
    return group


def release(group, pool: RayResourcePool) -> None:
    """Closes each worker's checkpoint engine (what a process's exit does too), then frees the
    workers and their pool's reserved CPUs (removing a placement group ends its actors)."""
    from ray.util.placement_group import remove_placement_group

    closes = [w.__ray_call__.remote(lambda self: self.checkpoint_engine.close()) for w in group]
    ray.wait(closes, num_returns=len(closes), timeout=60)
    for pg in pool.pgs or []:
        remove_placement_group(pg)


def manager(rollout_config: RolloutConfig, trainers: RayWorkerGroup, replicas: list) -> CheckpointEngineManager:
    return CheckpointEngineManager(rollout_config.checkpoint_engine, trainers, list(replicas))
