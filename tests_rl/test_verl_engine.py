"""verl's ``torch_p2p`` checkpoint engine under verl's own CheckpointEngineManager, on a local
Ray cluster: 2 trainer ranks, rollout replicas of 2 ranks (verl's CheckpointEngineWorker
actors). Each test builds its own trainers, replicas and manager (the cluster is the
module's), so any one runs alone or in any order."""
from __future__ import annotations

import os
import signal
import threading
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


def pid_of(worker) -> int:
    return ray.get(worker.__ray_call__.remote(lambda self: os.getpid()))


def set_delay(worker, delay_s: float) -> None:
    """One trainer rank's delay per tensor (set_delay sets every rank's)."""
    ray.get(worker.__ray_call__.remote(lambda self, d=delay_s: setattr(self, "delay_s", d)))


class Update(threading.Thread):
    """mgr.update_weights(global_steps=step) on a thread of its own: its result or error."""

    def __init__(self, mgr, step: int):
        super().__init__(daemon=True)
        self.mgr, self.step, self.value, self.error = mgr, step, None, None
        self.start()

    def run(self):
        try:
            self.value = self.mgr.update_weights(global_steps=self.step)
        except BaseException as e:  # noqa: BLE001 - the test looks at it
            self.error = e

    def outcome(self, timeout: float):
        self.join(timeout)
        assert not self.is_alive(), f"the update of global_steps {self.step} did not end within {timeout} s"
        return self.error


def leader_pushing(trainers, version: int) -> bool:
    """Whether trainer rank 0 has started pushing `version` (its share is moving)."""
    return ray.get(trainers.workers[0].__ray_call__.remote(
        lambda self, v=version: self.checkpoint_engine.source is not None
        and self.checkpoint_engine.source.version >= v))


def stopped_update_fails(mgr, trainers, step: int, pid: int) -> tuple[BaseException, float]:
    """The update of `step`, trainer rank 1 slow to produce its share (rank 0's moves first),
    `pid` SIGSTOPped once rank 0 pushes and resumed once the update failed: (its error, seconds
    from the stop to the failure)."""
    version = ray.get(trainers.workers[0].__ray_call__.remote(lambda self: self.checkpoint_engine.version)) + 1
    set_delay(trainers.workers[1], 0.5)  # 21 tensors: 10 s before rank 1's share moves
    update = Update(mgr, step)
    assert eventually(lambda: leader_pushing(trainers, version), 60), "the push never started"
    os.kill(pid, signal.SIGSTOP)
    stopped = time.monotonic()
    try:
        error = update.outcome(timeout=90)
        took = time.monotonic() - stopped
    finally:
        os.kill(pid, signal.SIGCONT)
    set_delay(trainers.workers[1], 0.0)
    assert error is not None, f"the update of global_steps {step} succeeded with a rank stopped"
    return error, took


def retry_and_go_on(mgr, replicas, step: int) -> None:
    """verl retries the step it lost, then goes on: every rank, the resumed one included, loads
    both bitwise."""
    for s in (step, step + 1):
        assert Update(mgr, s).outcome(timeout=120) is None
        check_last_update(replicas, s)


def test_rollout_rank_stopped_mid_update_fails_it_and_the_retried_step_is_taken(cluster):
    config, trainers, replicas, mgr = cluster
    mgr.update_weights(global_steps=1)  # every rollout rank has joined
    error, took = stopped_update_fails(mgr, trainers, 2, pid_of(replicas[0].workers[1]))
    assert "dropped during the push" in str(error), error
    assert 5.0 < took < KILL_BOUND_S + 10, took  # found by its silence, within a bound
    retry_and_go_on(mgr, replicas, 2)


def test_trainer_rank_stopped_mid_update_fails_it_and_the_retried_step_is_taken(cluster):
    config, trainers, replicas, mgr = cluster
    mgr.update_weights(global_steps=1)
    error, took = stopped_update_fails(mgr, trainers, 2, pid_of(trainers.workers[1]))
    assert took < KILL_BOUND_S + 10, took
    # The stopped rank's own send_weights ends once it runs again (the manager's call returned on
    # the first failure): its push fails instead of waiting for a leader that moved on.
    resumed = time.monotonic()
    assert eventually(lambda: ray.get(trainers.workers[1].__ray_call__.remote(
        lambda self: self.checkpoint_engine.source._impl.current is None
        and not self.checkpoint_engine.source._impl.queue)), 30), "the stopped trainer rank still pushes"
    assert time.monotonic() - resumed < 30
    retry_and_go_on(mgr, replicas, 2)
