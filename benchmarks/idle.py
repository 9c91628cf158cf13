"""idle.py: a small write after a pause, beside the device's own cost of waking after the same pause.

    python benchmarks/idle.py                          # a GPU's memory if there is one, else host memory
    python benchmarks/idle.py --device cpu --pauses 0 0.001 0.02

A peer process registers a buffer; this process warms the peer (engine.warm) and then, after
each pause, times one 4 KiB write_slices to it (until its future is done) and, after the same
pause, the baseline: a tiny torch op on the same device (a kernel and a stream synchronize on a
GPU). Pauses below 2 ms are busy-waits, longer ones sleeps. Medians of --trials each, us.

A GPU that idles wakes slowly: on an H100 the tiny kernel takes about 20 us back to back and
over 150 us after 5-20 ms of idleness, and so does anything that launches work on it. A write's
"first after engine.warm()" cost (bw.py --first-contact) includes such a pause: compare it with
this table's baseline, not with back-to-back writes.
"""

import argparse
import os
import statistics
import sys
import time

import torch

try:
    import torch_p2p as p2p
except ImportError:  # run from a checkout without installing: use the in-place build
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import torch_p2p as p2p
from _processes import dismiss, exit_on_sigterm, message_from, spawn_with_pipe


def peer(conn, device: str) -> None:
    with p2p.Engine(device) as engine:
        buf = torch.zeros(1 << 16, dtype=torch.uint8, device=device)
        conn.send(engine.register(buf).remote.to_bytes())
        conn.recv()


def pause(seconds: float) -> None:
    if seconds >= 0.002:
        time.sleep(seconds)
        return
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    default_device = "cuda:0" if torch.cuda.is_available() else "cpu"
    ap.add_argument("--device", default=default_device, help=f"both sides' device (default {default_device})")
    ap.add_argument("--pauses", nargs="+", type=float, default=[0, 50e-6, 200e-6, 1e-3, 5e-3, 20e-3], metavar="S")
    ap.add_argument("--trials", type=int, default=15)
    args = ap.parse_args()
    cuda = args.device.startswith("cuda")

    here, child = spawn_with_pipe(peer, (args.device,), "idle-peer")
    try:
        remote = p2p.RemoteTensor.from_bytes(message_from(here, child, "idle.py: the peer process"))
        with p2p.Engine(args.device) as engine:
            src = torch.ones(4096, dtype=torch.uint8, device=args.device)
            engine.register(src)
            dst = remote[:4096]
            x = torch.ones(1024, device=args.device)
            engine.warm(remote).wait()
            print(f"# 4 KiB write to a peer process, route {engine.route(remote)}, {args.device}; "
                  f"baseline: a tiny torch op{' and a synchronize' if cuda else ''}; medians of {args.trials}, us")

            def write() -> float:
                start = time.perf_counter()
                engine.write_slices([src], [dst]).wait()
                return (time.perf_counter() - start) * 1e6

            def op() -> float:
                start = time.perf_counter()
                x.add_(1)
                if cuda:
                    torch.cuda.synchronize(args.device)
                return (time.perf_counter() - start) * 1e6

            for _ in range(30):
                write(), op()
            print(f"{'pause us':>9} {'write us':>9} {'baseline us':>12} {'x baseline':>11}")
            for gap in args.pauses:
                writes, ops = [], []
                for _ in range(args.trials):
                    pause(gap)
                    writes.append(write())
                    pause(gap)
                    ops.append(op())
                w, o = statistics.median(writes), statistics.median(ops)
                print(f"{gap * 1e6:9.0f} {w:9.0f} {o:12.1f} {w / o:11.2f}", flush=True)
    finally:
        dismiss([here], [child], 0)


if __name__ == "__main__":
    exit_on_sigterm()
    main()
