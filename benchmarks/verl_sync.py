"""verl_sync.py: verl weight updates of one trainer rank to 1, 2 and 3 rollout replicas through
verl's own CheckpointEngineManager on a local Ray cluster, the "torch_p2p" checkpoint engine
against verl's "nixl" engine (engine_kwargs device "cpu") and against what a CPU user of verl
has without either: the state dict through Ray's object store. Same weights, same run.

    <venv with ray and verl>/bin/python benchmarks/verl_sync.py           # 256 MiB, 1-3 replicas
    python benchmarks/verl_sync.py --mib 512 --updates 5 --backends torch_p2p,nixl

Each update changes every byte of the trainer's weights (fp32, bf16, fp16, int64 tensors, all
contiguous, as a trainer's gathered tensors are and as verl's nixl engine requires) and
is timed around CheckpointEngineManager.update_weights(global_steps): verl's prepare,
build_topology, init_process_group, send/receive, finalize, and each rollout rank loading the
tensors it receives into a model of its own (one copy, as an inference engine's load does).
The first update of each backend is not timed (it allocates and registers). After the timed
updates every rollout rank's model must equal the trainer's weights bitwise, or the row fails.

  torch_p2p     torch_p2p.integrations.verl: one push, relayed between replicas.
  nixl          verl's NIXLCheckpointEngine (UCX, a chain through the replicas, two buckets of
                update_weights_bucket_megabytes). verl 0.9.1's engine needs CUDA even with
                device "cpu", and its build_topology miscounts a single rollout rank;
                benchmarks/_verl_nixl_cpu.py removes exactly those obstacles.
  object_store  the trainer ray.put()s its state dict; each rollout rank ray.get()s it and loads.

Columns: median seconds per update, GB/s of state dict per replica-update, ratios against nixl
(and the object store) at the same replica count, and against the same backend with one replica.
Needs ray and verl (pip install torch_p2p[verl]); without them it says so and exits 0.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.join(ROOT, "tests_rl")
sys.path[:0] = [ROOT, TESTS, HERE]

from _table import aligned  # noqa: E402

BACKENDS = {"torch_p2p": ("torch_p2p", "torch_p2p.integrations.verl"),
            "nixl": ("nixl", "_verl_nixl_cpu")}


def _missing() -> str | None:
    for module in ("ray", "verl"):
        try:
            __import__(module)
        except ImportError as e:
            return f"{module} ({e})"
    return None


def _load_from_store(worker, refs):
    """On a rollout worker: the state dict from the object store into the adapter's model."""
    import ray
    import torch

    sd = ray.get(refs[0])
    model = worker.server_adapter.model
    with torch.no_grad():
        for name, t in sd.items():
            if name not in model:
                model[name] = torch.empty_like(t)
            model[name].copy_(t)
    worker.server_adapter.steps.append(-1)


class Setup:
    """One trainer rank and three one-rank replicas of one backend."""

    def __init__(self, vh, backend: str, scale: int, bucket_mib: int):
        name, module = BACKENDS.get(backend, BACKENDS["torch_p2p"])
        self.vh = vh
        self.config = vh.config(name, module, tp=1, bucket_mib=bucket_mib)
        # contiguous: verl's nixl engine flattens each tensor with view(-1)
        self.trainers = vh.trainer_group(self.config, world=1, scale=scale, contiguous=True)
        self.replicas = [vh.Replica(i, self.config) for i in range(3)]

    def updates(self, replicas: int, steps: list[int]) -> list[float]:
        mgr = self.vh.manager(self.config, self.trainers, self.replicas[:replicas])
        seconds = []
        for step in steps:
            self.trainers.make_weights(step)
            start = time.perf_counter()
            mgr.update_weights(global_steps=step)
            seconds.append(time.perf_counter() - start)
        return seconds

    def store_updates(self, replicas: int, steps: list[int]) -> list[float]:
        import ray

        trainer = self.trainers.workers[0]
        workers = [w for r in self.replicas[:replicas] for w in r.workers]
        seconds = []
        for step in steps:
            self.trainers.make_weights(step)
            start = time.perf_counter()
            ref = trainer.__ray_call__.remote(lambda self: self.sd)  # the task's result: in the object store
            ray.get([w.__ray_call__.remote(_load_from_store, [ref]) for w in workers])
            seconds.append(time.perf_counter() - start)
        return seconds

    def check(self, replicas: int) -> None:
        want = self.trainers.weight_digests()[0]
        for r in self.replicas[:replicas]:
            for got in r.digests():
                if got != want:
                    wrong = [n for n in want if got.get(n) != want[n]]
                    raise SystemExit(f"verl_sync: a rollout rank's model differs from the trainer's: {wrong[:5]}")

    def close(self) -> None:
        import ray

        for w in self.trainers.workers + [w for r in self.replicas for w in r.workers]:
            ray.kill(w)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=256, help="state dict size (MiB, about)")
    parser.add_argument("--updates", type=int, default=3, help="timed updates per row")
    parser.add_argument("--replicas", default="1,2,3")
    parser.add_argument("--backends", default="torch_p2p,nixl,object_store")
    parser.add_argument("--bucket-mib", type=int, default=256, help="nixl's update_weights_bucket_megabytes")
    args = parser.parse_args()
    missing = _missing()
    if missing:
        print(f"verl_sync: skipped, needs ray and verl (pip install torch_p2p[verl]): cannot import {missing}")
        return 0
    import ray
    import verl_helpers as vh

    per_scale = sum(t.numel() * t.element_size() for t in vh.state_dict(0, 1).values())
    scale = max(1, round((args.mib << 20) / per_scale))
    model_bytes = sum(t.numel() * t.element_size() for t in vh.state_dict(0, scale).values())
    counts = [int(n) for n in args.replicas.split(",")]
    backends = [b.strip() for b in args.backends.split(",")]
    path = os.pathsep.join([ROOT, TESTS, HERE] + [p for p in [os.environ.get("PYTHONPATH")] if p])
    env = {"env_vars": {"PYTHONPATH": path, "OMP_NUM_THREADS": "1"}}
    if os.environ.get("RAY_ADDRESS"):  # a running cluster
        ray.init(log_to_driver=False, runtime_env=env)
    else:
        os.environ.setdefault("RAY_raylet_start_wait_time_s", "300")  # a loaded 2-core machine
        os.environ.setdefault("RAY_gcs_server_request_timeout_seconds", "300")
        ray.init(num_cpus=32, include_dashboard=False, log_to_driver=False,
                 object_store_memory=4 * model_bytes + (1 << 30), runtime_env=env)
    print(f"verl_sync: state dict {model_bytes / 2**20:.0f} MiB, 1 trainer rank, replicas of 1 rank, "
          f"{args.updates} timed updates per row (median); nixl bucket {args.bucket_mib} MiB", flush=True)
    results: dict[tuple[str, int], float] = {}
    steps = iter(range(1, 10**6))
    for backend in backends:
        setup = Setup(vh, backend, scale, args.bucket_mib)
        try:
            for n in sorted(counts):  # ascending: a replica joins, none leaves
                if backend == "object_store":
                    setup.store_updates(n, [next(steps)])  # untimed
                    times = setup.store_updates(n, [next(steps) for _ in range(args.updates)])
                else:
                    setup.updates(n, [next(steps)])  # untimed: the first update allocates and registers
                    times = setup.updates(n, [next(steps) for _ in range(args.updates)])
                setup.check(n)
                results[backend, n] = statistics.median(times)
                print(f"  {backend:12s} {n} replicas: " + " ".join(f"{t:.3f}" for t in times) + " s", flush=True)
        except Exception as e:  # noqa: BLE001 - a baseline that fails is reported; ours is not excused
            if backend == "torch_p2p":
                raise
            last = (str(e).strip().splitlines() or [""])[-1][:200]
            print(f"  {backend:12s} failed, left out of the table: {type(e).__name__}: {last}", flush=True)
        finally:
            setup.close()
    rows = [["backend", "replicas", "s/update", "GB/s/replica", "vs nixl", "vs object store", "vs 1 replica"]]
    for (backend, n), s in results.items():
        def ratio(other):
            return f"{s / other:.2f}x" if other else "-"
        rows.append([backend, str(n), f"{s:.3f}", f"{model_bytes * n / s / 1e9:.2f}",
                     ratio(results.get(("nixl", n))), ratio(results.get(("object_store", n))),
                     ratio(results.get((backend, 1)))])
    print(aligned(rows, 1))
    ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
