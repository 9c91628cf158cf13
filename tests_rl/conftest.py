"""RL framework tests: torch_p2p inside real Ray (and verl), on a local Ray cluster per test
module (starting one takes seconds on two cores; CI runs each module in a process of its own,
which starts Ray once: .ci/run). Each framework's tests are skipped where it does not import;
a framework that is installed but broken fails them."""
from __future__ import annotations

import importlib.util
import os
import sys
import time

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.append(os.path.join(os.path.dirname(HERE), "tests"))
from checkout import pythonpath  # noqa: E402  (tests/checkout.py: what every suite shares)


def _installed(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


collect_ignore_glob = [f"test_{name}_*.py" for name in ("ray", "verl") if not _installed(name)]


def worker_env(**extra: str) -> dict:
    """The environment of the cluster's workers: they import this checkout's torch_p2p and the
    modules next to this file (the actor classes the tests use). An actor given a runtime_env
    of its own takes this one plus `extra`."""
    path = pythonpath(HERE, os.environ.get("PYTHONPATH", ""))
    return {"env_vars": dict(PYTHONPATH=path, OMP_NUM_THREADS="1", **extra)}


def start_ray(num_cpus: int, **options) -> None:
    """ray.init of a local cluster for one test module, its workers on worker_env(). Ray starts
    an idle worker per CPU it is told of (logical CPUs: actors that ask for none take none). On
    a loaded 2-core machine its raylet can miss its start-up deadlines (30 s for the raylet, its
    agents' registration, its GCS requests): longer ones, and a second try."""
    import ray

    os.environ.setdefault("RAY_agent_register_timeout_ms", "120000")
    os.environ.setdefault("RAY_raylet_start_wait_time_s", "300")
    os.environ.setdefault("RAY_gcs_server_request_timeout_seconds", "300")
    for attempt in (1, 2):
        try:
            ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=False, runtime_env=worker_env(),
                     **options)
            return
        except Exception as e:  # noqa: BLE001 - Ray raises a bare Exception for this
            ray.shutdown()
            if attempt == 2 or "timed out during startup" not in str(e):
                raise


@pytest.fixture(scope="module")
def ray_cluster():
    """A local Ray cluster with TORCH_P2P registered in the driver, for one module."""
    import ray

    import torch_p2p.integrations.ray as p2p_ray

    start_ray(2, object_store_memory=1 << 30)
    p2p_ray.register()  # before any actor is created
    try:
        yield ray
    finally:
        ray.shutdown()


def eventually(check, timeout: float = 30.0, interval: float = 0.2):
    """Calls check() until it returns something true, for at most `timeout` seconds; returns
    the last value (false if it never held)."""
    end = time.monotonic() + timeout
    while True:
        value = check()
        if value or time.monotonic() > end:
            return value
        time.sleep(interval)
