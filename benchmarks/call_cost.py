"""call_cost.py: where the time of one small call goes, and small calls issued back to back.

    python benchmarks/call_cost.py                 # a GPU's memory if there is one (the peer on
                                                   # the next GPU where there are two), else host
    python benchmarks/call_cost.py --device cpu --trials 2000

A peer process registers a buffer; this process warms the peer (engine.warm) and times, back
to back, medians of --trials each (us):
  issue       write_slices() of 4 KiB returning: Python, the argument checks, the queueing
  write       write_slices() of 4 KiB until its future is done
  p2p.wait    the same, waited for with p2p.wait(future, 60): a wait with a timeout
  empty       disconnect() from an engine it never met (its own address) until its future is
              done: the same path (the call, the worker's turn, the completion, the future)
              with no peer, no route and no copy
  empty issue disconnect() returning
  copy        the bytes' own cost: on a GPU, copy_ of 4 KiB to the peer's device and a
              synchronize in this process (memcpy + synchronize); on the host, a 4 KiB copy_
  burst       16 writes of 4 KiB issued back to back, then waited for: per call
and the parts of an issue:
  run issue   the same write prepared once (engine.prepare_write), each run() returning: the
              issue without the arguments' parse and checks (issue - run issue)
  future      torch.futures.Future() alone (the engine makes one per call)
  query       torch.cuda.current_stream().query(), GPU only: a CUDA call asks once whether the
              caller's stream has work queued (natively, without this line's Python call)
It splits a write into: issuing it, the hops (the worker's turn, the completion reaching the
future: empty - empty issue), and the route (the rest: regions and peer resolved, the route's
work, the copy, its completion seen). A write within 1.5 x the copy is the goal on a GPU. On
the host the peer's buffer is in shared memory, so a write is copied by the calling thread
(core/caller_copies.h; TORCH_P2P_CMA_INLINE=0 turns that off): no hops then, and the summary
says so instead of splitting it.
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

PAGE = 4096
BURST = 16


def peer(conn, device: str) -> None:
    with p2p.Engine(device) as engine:
        buf = torch.zeros(BURST * PAGE, dtype=torch.uint8, device=device)
        if device == "cpu":
            buf.share_memory_()
        conn.send(engine.register(buf).remote.to_bytes())
        conn.recv()


def timed(fn, trials: int) -> float:
    """Median of `trials` calls of fn, us."""
    times = []
    for _ in range(trials):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    ap.add_argument("--device", default="cuda:0" if gpus else "cpu", help="this side's device")
    ap.add_argument("--peer-device", default=None, help="the peer's (default: the next GPU if any, else the same)")
    ap.add_argument("--trials", type=int, default=1000)
    args = ap.parse_args()
    cuda = args.device.startswith("cuda")
    peer_device = args.peer_device or (f"cuda:{1 if gpus > 1 else 0}" if cuda else args.device)

    here, child = spawn_with_pipe(peer, (peer_device,), "call-cost-peer")
    try:
        remote = p2p.RemoteTensor.from_bytes(message_from(here, child, "call_cost.py: the peer process"))
        with p2p.Engine(args.device) as engine:
            src = torch.ones(BURST * PAGE, dtype=torch.uint8, device=args.device)
            engine.register(src)
            pages = [(src[i * PAGE:(i + 1) * PAGE], remote[i * PAGE:(i + 1) * PAGE]) for i in range(BURST)]
            one_src, one_dst = [pages[0][0]], [pages[0][1]]
            engine.warm(remote).wait()
            nobody = engine.address  # disconnecting from it is a no-op on the worker
            here_buf = torch.ones(PAGE, dtype=torch.uint8, device=args.device)
            there_buf = torch.zeros(PAGE, dtype=torch.uint8, device=peer_device)

            prepared = engine.prepare_write(one_src, one_dst)
            stream = torch.cuda.current_stream(args.device) if cuda else None

            def write():
                engine.write_slices(one_src, one_dst).wait()

            def write_with_timeout():
                p2p.wait(engine.write_slices(one_src, one_dst), 60)

            def empty():
                engine.disconnect(nobody).wait()

            def copy():
                there_buf.copy_(here_buf, non_blocking=True)
                if cuda:
                    torch.cuda.synchronize(args.device)

            def burst():
                for f in [engine.write_slices([s], [d]) for s, d in pages]:
                    f.wait()

            for fn in (write, empty, copy, burst):  # warm-up
                timed(fn, max(10, args.trials // 10))
            us = {}
            parts = {"future": torch.futures.Future}
            if cuda:
                parts["query"] = stream.query
            for name, fn in (("write", write), ("p2p.wait", write_with_timeout), ("empty", empty), ("copy", copy),
                             *parts.items()):
                us[name] = timed(fn, args.trials)
            # Issuing alone: in rounds of 16, each round drained before the next; the kinds of
            # call take turns.
            issues = {"issue": lambda: engine.write_slices(one_src, one_dst), "run issue": prepared.run,
                      "empty issue": lambda: engine.disconnect(nobody)}
            times = {name: [] for name in issues}
            for _ in range(max(1, args.trials // BURST)):
                for name, call in issues.items():
                    futures = []
                    for _ in range(BURST):
                        start = time.perf_counter()
                        futures.append(call())
                        times[name].append(time.perf_counter() - start)
                    for f in futures:
                        f.wait()
            us.update((name, statistics.median(t) * 1e6) for name, t in times.items())
            us["burst"] = timed(burst, max(1, args.trials // 4)) / BURST
            hops = us["empty"] - us["empty issue"]
            route = us["write"] - us["issue"] - hops
            by_caller = True  # every write done on return: no hops
            for _ in range(8):
                last = engine.write_slices(one_src, one_dst)
                by_caller &= last.done()
                last.wait()
            pinned = (f"worker pinned to cpu {engine.plan.cpu} (completions spin)" if engine.plan.cpu is not None
                      else "worker not pinned (completions sleep)")
            print(f"# one 4 KiB write to a peer process: {args.device} -> {peer_device}, route "
                  f"{engine.route(remote)}, {pinned}; medians of {args.trials}, us")
            for name in ("write", "p2p.wait", "issue", "empty", "empty issue", "copy", "burst", "run issue", *parts):
                print(f"{name:>12} {us[name]:8.1f}")
            split = ("copied by the calling thread, no hops" if by_caller else
                     f"issue {us['issue']:.1f} + hops {hops:.1f} + route and copy {route:.1f} us")
            print(f"# a write = {split}; write / copy {us['write'] / us['copy']:.2f}; 16 back to back: "
                  f"{us['burst']:.1f} us a call, {BURST * PAGE / us['burst'] / 1e3:.2f} GB/s")
            rest = us["run issue"] - us["future"] - us.get("query", 0.0)
            print(f"# an issue = parse and checks {us['issue'] - us['run issue']:.1f} + torch future "
                  f"{us['future']:.1f}" + (f" + stream query {us['query']:.1f}" if cuda else "") +
                  " + the rest (the future's slot, the transfer, " +
                  ("the copy on this thread" if by_caller else "the queue") + f") {rest:.1f} us")
    finally:
        dismiss([here], [child], 0)


if __name__ == "__main__":
    exit_on_sigterm()
    main()
