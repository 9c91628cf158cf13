"""verl's ``torch_p2p`` checkpoint engine under verl's own CheckpointEngineManager, on a local
Ray cluster: 2 trainer ranks, rollout replicas of 2 ranks (verl's CheckpointEngineWorker
actors). Each test builds its own trainers, replicas and manager (the cluster is the
module's), so any one runs alone or in any order."""
from __future__ import annotations

import os
import time

import pytest

ray = pytest.importorskip("ray")
pytest.importorskip("verl")

from verl.checkpoint_engine.base import _worker_cls  # noqa: E402
from verl.single_controller.ray import RayClassWithInitArgs, RayWorkerGroup  # noqa: E402

import verl_helpers as vh  # noqa: E402
from conftest import eventually, start_ray  # noqa: E402

pytestmark = pytest.mark.timeout(600)

KILL_BOUND_S = 20.0  # the engine's peer_timeout (10 s) finds the dead trainer, plus slack for a loaded box


@pytest.fixture(scope="module")
def ray_started():
    start_ray(16)  # logical CPUs: verl's resource pools reserve one per worker
    try:
        yield
    finally:
        ray.shutdown()


@pytest.fixture
def cluster(ray_started):
    """Fresh trainers (2 ranks), 2 replicas and their manager; released after the test, each
    checkpoint engine closed first."""
    config = vh.config(timeout=60.0, join_timeout=60.0)
    trainers = vh.trainer_group(config)
    replicas = [vh.Replica(i, config) for i in range(2)]
    yield config, trainers, replicas, vh.manager(config, trainers, replicas)
    for r in replicas:
        vh.release(r.workers, r.pool)
    vh.release(trainers.workers, trainers.pool)


def expected(step: int) -> dict[str, str]:
    return {name: vh.digest(t) for name, t in vh.state_dict(step).items()}


def check_last_update(replicas, step: int) -> None:
    want = expected(step)
    for r in replicas:
        assert [s[-1] for s in r.steps()] == [step] * len(r.workers)
        for got in r.digests():
            assert got.keys() == want.keys()
            wrong = [n for n in want if got[n] != want[n]]
            assert not wrong, f"tensors that differ from the trainer's at step {step}: {wrong}"
        assert r.engines("global_steps") == [step] * len(r.workers)


def test_three_updates_bitwise_once_per_byte(cluster):
    config, trainers, replicas, mgr = cluster
    model_bytes = sum(t.numel() * t.element_size() for t in vh.state_dict(0).values())
    for n, step in enumerate([1, 2, 3], start=1):
        metrics = mgr.update_weights(global_steps=step)
        check_last_update(replicas, step)
        for r in replicas:
            assert r.engines("version") == [n, n]
            assert r.engines("joins") == [1, 1]  # joined once: the plan is made once
        # Relayed between the 4 rollout ranks, the trainer ranks write each byte once (plus
        # the 8-byte step); without relays it would be 4 times as much.
        sent = [v for k, v in metrics.items() if k.startswith("torch_p2p/bytes_sent/")]
        assert len(sent) == 2 and sum(sent) == model_bytes + 8
        assert min(sent) > 0  # both trainer ranks send their share


def test_added_replica_joins_without_disturbing(cluster):
    config, trainers, replicas, mgr = cluster
    mgr.update_weights(global_steps=1)
    added = vh.Replica(2, config)
    mgr.add_replicas([added])
    replicas.append(added)
    mgr.update_weights(global_steps=2)
    check_last_update(replicas, 2)
    for r in replicas[:2]:
        assert r.engines("joins") == [1, 1] and r.engines("version") == [2, 2]
        assert [len(s) for s in r.steps()] == [2, 2]
    assert added.engines("joins") == [1, 1] and added.engines("version") == [2, 2]
    assert [len(s) for s in added.steps()] == [1, 1]


def received_versions(replica) -> list:
    """Per worker: the last version whose every byte reached its buffers."""
    return ray.get([w.__ray_call__.remote(lambda self: self.checkpoint_engine.receiving.dest.version)
                    for w in replica.workers])


def test_removed_live_replica_is_left_out(cluster):
    config, trainers, replicas, mgr = cluster
    mgr.update_weights(global_steps=1)
    removed = replicas.pop(0)
    mgr.remove_replicas([removed])
    mgr.update_weights(global_steps=2)
    check_last_update(replicas, 2)
    # Alive and still holding version 1, the removed replica got no byte of version 2: the push
    # neither wrote to it nor waited for it.
    assert received_versions(removed) == [1, 1]
    assert removed.engines("version") == [1, 1]
    mgr.add_replicas([removed])
    replicas.append(removed)
    mgr.update_weights(global_steps=3)
    check_last_update(replicas, 3)
    assert removed.engines("joins") == [2, 2] and received_versions(removed) == [3, 3]


def test_trainer_killed_mid_update_fails_receivers(cluster, tmp_path):
    config, trainers, replicas, mgr = cluster
    mgr.update_weights(global_steps=1)  # every rollout rank has joined
    workers = [w for r in replicas for w in r.workers]
    rollout = RayWorkerGroup(worker_handles=workers, ray_cls_with_init=RayClassWithInitArgs(cls=_worker_cls))
    mgr.build_process_group(rollout)  # what update_weights does before moving anything
    started = str(tmp_path / "trainer-started")
    trainers.set_delay(0.5, started)  # each tensor takes the trainer 0.5 s to produce
    trainer_refs = trainers.update_weights(global_steps=2)
    rollout_refs = rollout.update_weights(global_steps=2)
    assert eventually(lambda: os.path.exists(started), timeout=60), "the trainer's update never began"
    ready, _ = ray.wait(rollout_refs, timeout=0)
    assert not ready, "the receivers finished before the trainer could be killed"
    ray.kill(trainers.workers[0])
    killed = time.monotonic()
    errors = []
    for ref in rollout_refs:
        with pytest.raises(ray.exceptions.RayTaskError) as info:
            ray.get(ref, timeout=KILL_BOUND_S + 30)
        errors.append(str(info.value))
    took = time.monotonic() - killed
    assert took < KILL_BOUND_S, f"the receivers failed {took:.1f} s after the trainer died"
    assert all("trainer rank 0 is gone" in e for e in errors), errors[0]
    with pytest.raises(Exception):
        ray.get(trainer_refs, timeout=60)
