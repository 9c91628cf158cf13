"""Ray Direct Transport: TORCH_P2P against Ray's own NIXL and GLOO transports and its object
store (no tensor_transport), moving the same tensors between the same two actors of a local
cluster, in one run.

    python benchmarks/ray_transports.py [--sizes 16M 64M 256M 1G] [--repeats 5]

Per size, the producer actor holds one float32 tensor of that size and returns it from a
method called with ``.options(tensor_transport=...)``; the consumer actor takes it as its
argument (and returns its checksum on the warm-up call, its size otherwise). A transfer is the driver's round trip
``ray.get(consumer.take.remote(producer.give.remote()))``: Ray's two task calls, the transport
(or the object store's put and get), and the consumer's fresh receive buffer. Each transport
moves each size once to warm up (its checksum must match the producer's, else the run fails),
then --repeats times, transports taking turns; the table gives medians and GB/s, and each
transport's time over TORCH_P2P's ("x": how many times longer the other takes; "best other"
is the fastest of the others). Two floors are timed in the same rotation: "no tensor" (the
same two calls, ``give`` returning None) and "TORCH_P2P 4 B" (the same call moving one float32:
Ray's tensor-transport machinery and ours with nothing to copy). "ceiling x" is the best
other's time over that floor: what "best other x" would be if TORCH_P2P's transfer of the
bytes took no time at all. A transport that cannot run here is named with the reason.
Needs Ray (and nixl for NIXL); without Ray it says so and exits 0.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

from _table import aligned, fmt_size, parse_size  # noqa: E402

TRANSPORTS = ["TORCH_P2P", "NIXL", "GLOO", "object store"]
FLOORS = {"no tensor": lambda p: p.give_nothing,
          "TORCH_P2P 4 B": lambda p: p.give_tiny.options(tensor_transport="TORCH_P2P")}


def define_actor(ray, torch):
    @ray.remote(num_cpus=0, enable_tensor_transport=True)
    class Peer:
        def hold(self, nbytes: int) -> int:
            self.tensor = torch.empty(nbytes // 4, dtype=torch.float32).uniform_()
            self.tiny = torch.ones(1)
            return self.checksum(self.tensor)

        def give(self):
            return self.tensor

        def give_tiny(self):
            return self.tiny

        def give_nothing(self):
            return None

        def take(self, t, check: bool) -> int:
            if t is None:
                return 0
            return self.checksum(t) if check else t.numel()

        def checksum(self, t) -> int:
            return int(t.view(torch.int32).sum(dtype=torch.int64))

        def ready(self) -> bool:
            return True

    return Peer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", nargs="+", type=parse_size, default=[16 << 20, 64 << 20, 256 << 20, 1 << 30])
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    if importlib.util.find_spec("ray") is None:
        print("ray_transports.py: skipped: Ray is not installed here (pip install 'torch_p2p[ray]', or "
              "the virtual environment .ci/run makes for tests_rl)")
        sys.exit(0)

    import ray
    import torch

    import torch_p2p.integrations.ray as p2p_ray

    path = os.pathsep.join([ROOT] + [p for p in [os.environ.get("PYTHONPATH")] if p])
    # On a loaded machine the raylet may wait long for its agents to say their ports.
    os.environ.setdefault("RAY_agent_register_timeout_ms", "120000")
    for attempt in (1, 2, 3):  # Ray gives its raylet 30 s to come up: a loaded machine may miss it
        try:
            ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
                     object_store_memory=max(2 * max(args.sizes), 1 << 30) + (256 << 20),
                     runtime_env={"env_vars": {"PYTHONPATH": path, "OMP_NUM_THREADS": "1"}})
            break
        except Exception as e:  # noqa: BLE001 - Ray raises a bare Exception for this
            ray.shutdown()
            if attempt == 3 or "timed out during startup" not in str(e):
                raise
    p2p_ray.register()
    try:
        run(ray, torch, args)
    finally:
        ray.shutdown()


def run(ray, torch, args) -> None:
    Peer = define_actor(ray, torch)
    producer, consumer = Peer.remote(), Peer.remote()
    ray.get([producer.ready.remote(), consumer.ready.remote()])
    transports, skipped = list(TRANSPORTS), {}
    try:
        from ray.experimental.collective import create_collective_group

        create_collective_group([producer, consumer], backend="torch_gloo")
    except Exception as e:  # noqa: BLE001 - reported in the table's notes
        transports.remove("GLOO")
        skipped["GLOO"] = f"no gloo group: {e!r}"

    def once(transport: str, check: bool = False) -> tuple[float, int]:
        if transport in FLOORS:
            give = FLOORS[transport](producer)
        elif transport == "object store":
            give = producer.give
        else:
            give = producer.give.options(tensor_transport=transport)
        start = time.perf_counter()
        checksum = ray.get(consumer.take.remote(give.remote(), check), timeout=600)
        return time.perf_counter() - start, checksum

    rows = []
    for size in args.sizes:
        expected = ray.get(producer.hold.remote(size))
        for floor in FLOORS:
            once(floor)  # untimed, as each transport's first call
        times = {floor: [] for floor in FLOORS}
        for transport in list(transports):
            try:
                _, checksum = once(transport, check=True)
            except Exception as e:  # noqa: BLE001 - a baseline that cannot run is reported, not fatal
                transports.remove(transport)
                skipped[transport] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
                continue
            if checksum != expected:
                raise SystemExit(f"{transport} moved wrong bytes at {fmt_size(size)}: checksum {checksum}, "
                                 f"expected {expected}")
            times[transport] = []
        for _ in range(args.repeats):
            for transport in list(times):
                try:
                    times[transport].append(once(transport)[0])
                except Exception as e:  # noqa: BLE001 - e.g. Ray's memory monitor killed an actor
                    del times[transport]
                    skipped[f"{transport} at {fmt_size(size)}"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        medians = {t: statistics.median(v) for t, v in times.items()}
        rows.append((size, medians))
        line = "  ".join(f"{t} {m * 1e3:.1f} ms" for t, m in medians.items())
        print(f"{fmt_size(size)}: {line}", flush=True)

    shown = [t for t in TRANSPORTS if t not in skipped]
    header = (["size"] + [f"{t} ms (GB/s)" for t in shown] + [f"{t} x" for t in shown[1:]] + ["best other x"]
              + [f"{f} ms" for f in FLOORS] + ["ceiling x"])
    lines = [header]
    for size, medians in rows:
        ours = medians.get("TORCH_P2P")
        cells = [fmt_size(size)]
        cells += [f"{medians[t] * 1e3:.1f} ({size / medians[t] / 1e9:.2f})" if t in medians else "-" for t in shown]
        cells += [f"{medians[t] / ours:.2f}" if ours and t in medians else "-" for t in shown[1:]]
        others = [medians[t] for t in shown[1:] if t in medians]
        cells.append(f"{min(others) / ours:.2f}" if ours and others else "-")
        cells += [f"{medians[f] * 1e3:.1f}" if f in medians else "-" for f in FLOORS]
        floor = medians.get("TORCH_P2P 4 B")
        cells.append(f"{min(others) / floor:.2f}" if floor and others else "-")
        lines.append(cells)
    print(aligned(lines, 1))
    for transport, why in skipped.items():
        print(f"{transport}: not measured: {why}")


if __name__ == "__main__":
    main()
