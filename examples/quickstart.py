"""Two processes on one machine: the owner registers a tensor and hands over its RemoteTensor;
the writer writes non-contiguous views into it and reads them back.

    python examples/quickstart.py                 # a GPU and the next one (the ipc route), else
                                                  # host memory (the cma route: the kernel copies)
    python examples/quickstart.py --provider shm  # the fabric route, when same-host routes are off
    python examples/quickstart.py --device cuda:0 --peer-device cuda:1

The engine picks a route per peer (engine.route): between processes of one host, CUDA IPC for
GPU memory and the kernel's cross-memory copies for host memory; the provider (tcp by default,
held to loopback) carries the rest. The last line names the route the bytes took.

The RemoteTensor travels as bytes (here through a multiprocessing pipe; any side channel
works: a store, an HTTP call, a file). No world, ranks or rendezvous in the engine itself.
"""
import argparse
import multiprocessing as mp

import torch

import torch_p2p as p2p


def engine_args(provider: str) -> dict:
    # Keep the example's traffic on loopback when using tcp.
    return dict(provider=provider, domains=["lo"] if provider == "tcp" else None)


def owner(conn, provider: str, device: str) -> None:
    with p2p.Engine(device, **engine_args(provider)) as engine:
        cache = torch.zeros(4, 8, 16, device=device)   # e.g. [layers, blocks, block elements]
        region = engine.register(cache)
        conn.send(region.remote.to_bytes())            # the handle: metadata and keys only
        conn.recv()                                    # the writer is done
        conn.send(cache.cpu())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--provider", default="tcp")
    gpus = torch.cuda.device_count()  # a GPU when there is one; the second one for the peer
    parser.add_argument("--device", default="cuda:0" if gpus else "cpu", help="the writer's device")
    parser.add_argument("--peer-device", default=f"cuda:{min(1, gpus - 1)}" if gpus else "cpu",
                        help="the owner's device")
    args = parser.parse_args()

    ctx = mp.get_context("spawn")
    conn, child_conn = ctx.Pipe()
    child = ctx.Process(target=owner, args=(child_conn, args.provider, args.peer_device))
    child.start()
    child_conn.close()  # the child's end: if the child dies, conn.recv() raises EOFError instead of waiting
    try:
        with p2p.Engine(args.device, **engine_args(args.provider)) as engine:
            remote = p2p.RemoteTensor.from_bytes(conn.recv())
            print("got", remote)

            src = torch.randn(4, 8, 16, device=args.device)
            engine.register(src)
            # Block 2 of every layer goes to block 5 of the peer's cache: non-contiguous on
            # both sides (a KV-cache migration in miniature) ...
            engine.write_slices([src[:, 2]], [remote[:, 5]]).wait()
            # ... and mirror mode: a view lands at the same positions it has locally.
            engine.write_slices(src[1, ::2], remote).wait()

            back = torch.zeros(4, 16, device=args.device)
            engine.register(back)
            engine.read_slices([back], [remote[:, 5]]).wait()
            assert torch.equal(back, src[:, 2]), "read back differs"

            conn.send("done")
            cache = conn.recv()
            assert torch.equal(cache[:, 5], src[:, 2].cpu())
            assert torch.equal(cache[1, ::2], src[1, ::2].cpu())
            route = engine.route(remote)
            how = {"ipc": "CUDA IPC", "cma": "cross-memory copies"}.get(route, f"{engine.provider}, {route}")
            print(f"ok: views written, mirrored and read back; route {route} ({how})")
    finally:
        child.join(30)
        if child.is_alive():
            child.kill()


if __name__ == "__main__":
    main()
