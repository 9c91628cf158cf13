"""bw.py: torch_p2p's bandwidth benchmark, write_slices / read_slices between two engines.

Quick start, one machine (spawns its peer process; loopback only):

    python benchmarks/bw.py

sweeps page size x pages per call, the three layouts, write and read, and prints a table on
stdout. On stderr a live line shows the row in progress (on a terminal; elsewhere, as in CI
logs, one line per finished row). Each row issues calls of `pages` views for --duration
seconds, keeping --window calls in flight, after a warm-up of about one window; then every
page of the destination is checked. A row whose data arrived wrong reports no bandwidth.
Exit status: 0, 1 if a row failed or was corrupt, 2 if the peer or the setup failed.

Layouts (each side owns one [pages, page_bytes] buffer):
  contiguous  one view of the whole buffer per call
  paged       `pages` pages per call, source pages taken in one random order and destination
              pages in another, as when a KV cache migrates between two block tables; given as
              p2p.pages(buffer, ids) on both sides
  views       the paged layout's pages as a list of views on each side, [buf[i] for i in mine]
              and [remote[j] for j in theirs] (built once per row), the form users write
              first; its "x paged" column is its Gbps over the paged row's
              (--page-views: views rows only, no paged rows)
With --prepared each row's call is checked once (engine.prepare_write / prepare_read) and every
call of the row is a run() of it: the host cost of calls that move the same views again.

Route: the engine's choice for the peer (engine.route): "ipc" between GPUs of one host (CUDA
IPC, no fabric), "cma" between host memory of one host (the peer's buffer is in shared memory
by default, which the route maps and copies with memcpy; with --host-memory private the kernel
copies between the two processes), else "direct" or "staged" over the provider; the table's
title names it.

Baselines (--baseline, one or several; by default memcpy on the ipc and cma routes and kernel on the ipc
route, else tcp where the
line rate is unknown: loopback, shm):
  tcp    plain TCP to the same peer address, one stream per rail, Python sockets
         (sendall / recv_into on preallocated buffers, one thread per stream)
  nccl   torch.distributed send/recv between the same two processes, GPU tensors (paged rows:
         batch_isend_irecv of the call's pages, at most 4096 per group: NCCL does not finish
         one group of 65,536); in local mode NCCL is held to its socket transport on lo
         (NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 NCCL_IB_DISABLE=1 NCCL_NET=Socket
         NCCL_SOCKET_IFNAME=lo, unless set), or with --nccl-nvlink left to its own choice
         (NVLink between GPUs of one host); it needs the peer on another GPU
  gloo   the same with gloo on CPU tensors
  kernel paged rows on GPUs: the call's pages moved by one plain copy kernel per call (Triton,
         one program per page) between the two GPUs in this process, through peer access:
         what a paged call could reach if it cost nothing but its kernel (auto on the ipc route)
  memcpy cudaMemcpyPeerAsync of the call's bytes as one block, GPU to GPU in this process
         (local mode): the ceiling of the same-host route; on host memory ("1-thread memcpy"),
         one memcpy per page of the row's pages on one thread of this process: one core's
         ceiling, while the cma route copies on several (the title and rows say how many)
  nixl   NIXL (pip install 'torch_p2p[nixl]') between the same buffers, the row's pages in the
         row's orders as one descriptor each, one transfer per call, --window in flight; UCX
         backend, plus a nixl-libfabric column (its LIBFABRIC backend) where libfabric >= 1.21
  mooncake  Mooncake Transfer Engine (pip install 'torch_p2p[mooncake]') the same way, one
         batch per call: tcp transport for host memory, nvlink_intra for GPU memory
  none
  The destination pages of nixl and mooncake are checked after their timed calls. A baseline
  whose package is missing or cannot run here is skipped with a one-line reason.

Examples:
  python benchmarks/bw.py --rails 1 2 4 8 --baseline tcp --provider tcp --device cpu
  python benchmarks/bw.py --device cuda:0 --baseline nccl          # peer on cuda:1
  python benchmarks/bw.py --baseline nccl --nccl-nvlink --sizes 4K 64K --pages 256 4096
  python benchmarks/bw.py --sizes 64K 1M --pages 256 --ops write --json bw.json --plot bw.png
  python benchmarks/bw.py --device cpu --provider shm --sizes 4K 64K --pages 256 --baseline nixl mooncake

Two machines, one process per GPU on each, each with its own engine and peer (the table
sums the GPUs, whose rows start together; the live line is the first GPU's):
  node B:  python benchmarks/bw.py --listen --gpus 8        # prints the ADDR for node A
  node A:  python benchmarks/bw.py --connect ADDR           # ADDR = HOST:PORT[,PORT...]
or under torchrun, whose first half of the ranks drive and second half serve (rank 0 prints;
on one node, as with --standalone, everything stays on loopback):
  torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29500 benchmarks/bw.py
The side channel (engine addresses, RemoteTensor bytes, commands) is JSON over TCP, or the
torchrun store; data moves only through the engines and the baselines.
"""
from __future__ import annotations

import argparse
import importlib.util
import ipaddress
import json
import multiprocessing as mp
import os
import queue
import socket
import sys
import tempfile
import traceback
import warnings

# torch warns at import (in every process) when NumPy is missing; nothing here uses NumPy, and
# the quick start does not install it.
warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
import torch  # noqa: E402

try:
    import torch_p2p as p2p
except ImportError:  # run from a checkout without installing: use the in-place build
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import torch_p2p as p2p

from _bw_driver import CONTROL_TIMEOUT_S, Driver
from _bw_peer import Target, serve_listener, serve_socket
from _bw_report import LEGEND, merge, report
from _channel import PeerFailed, SocketChannel, StoreBarrier, StoreChannel
from _peer_library import PEER_LIBRARIES
from _processes import exit_on_sigterm, reap, spawn
from _progress import Progress
from _table import parse_size


# -- modes ------------------------------------------------------------------------------------------
def device_for(base: str, i: int) -> torch.device:
    """The device of the i-th process of a multi-GPU run: cuda:(N + i) from --device cuda:N."""
    dev = torch.device(base)
    return torch.device("cuda", (dev.index or 0) + i) if dev.type == "cuda" else dev


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
    except (OSError, ValueError):
        return False


def drive(args, sock: socket.socket, host: str, device: str, progress: Progress, barrier=None) -> list[dict]:
    """Runs the sweep over `sock`, connected to a peer at `host`; says bye at the end."""
    loopback = is_loopback(host)
    channel = SocketChannel(sock, CONTROL_TIMEOUT_S)
    try:
        with tempfile.TemporaryDirectory(prefix="bw-") as tmp:
            # A FileStore needs both ranks on one machine; elsewhere the peer hosts a TCPStore.
            store = {"kind": "file", "path": os.path.join(tmp, "dist-store")} if loopback else {"kind": "tcp"}
            rows = Driver(args, channel, torch.device(device), progress, loopback=loopback, dist_store=store,
                          peer_host=host, barrier=barrier).run()
            channel.send(cmd="bye")
            return rows
    finally:
        channel.close()


def run_local(args) -> int:
    """The default: a spawned peer process on this machine, talking over a socket pair."""
    device = torch.device(args.device)
    if args.peer_device:
        peer_device = args.peer_device
    elif device.type == "cuda":  # another GPU where there is one, as a migration would
        peer_device = f"cuda:{(device.index + 1) % torch.cuda.device_count()}"
    else:
        peer_device = "cpu"
    mine, theirs = socket.socketpair()
    proc = spawn(serve_socket, (theirs, peer_device, "127.0.0.1"), "bw-peer")
    theirs.close()
    try:
        rows = drive(args, mine, "127.0.0.1", args.device, Progress())
    finally:
        reap([proc])
    return report(args, rows)


def run_listen(args) -> int:
    """--listen: serves as the peer of a --connect run, one process per GPU, one port each."""
    host, _, port = args.listen.rpartition(":") if ":" in args.listen else (args.listen, "", "0")
    host, port = host or "0.0.0.0", int(port or 0)
    listeners = [socket.create_server((host, port + i if port else 0)) for i in range(args.gpus)]
    shown = socket.getfqdn() if host in ("0.0.0.0", "::") else host
    addr = f"{shown}:{','.join(str(s.getsockname()[1]) for s in listeners)}"
    print(f"listening on {addr}; on the other node run: python benchmarks/bw.py --connect {addr}", flush=True)
    devices = [str(device_for(args.device, i)) for i in range(args.gpus)]
    if args.gpus == 1:
        serve_listener(listeners[0], devices[0])
        return 0
    procs = [spawn(serve_listener, (s, d), f"bw-peer{i}") for i, (s, d) in enumerate(zip(listeners, devices))]
    for s in listeners:
        s.close()
    try:
        for p in procs:
            p.join()
    finally:
        reap(procs)
    return max(p.exitcode or 0 for p in procs)


def _drive_worker(args, host: str, port: int, rank: int, barrier, results) -> None:
    """Entry of the i-th driver process of a multi-GPU --connect run."""
    try:
        sock = socket.create_connection((host, port), timeout=CONTROL_TIMEOUT_S)
        rows = drive(args, sock, host, str(device_for(args.device, rank)), Progress(rank == 0), barrier)
        results.put((rank, rows, None))
    except BaseException as e:  # noqa: BLE001 - reported by the parent
        barrier.abort()
        results.put((rank, None, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))


def run_connect(args) -> int:
    """--connect HOST:PORT[,PORT...]: drives the peers that --listen started, one per port."""
    host, _, ports_text = args.connect.rpartition(":")
    ports = [int(p) for p in ports_text.split(",")]
    if args.gpus not in (None, len(ports)):
        sys.exit(f"--gpus {args.gpus} but {args.connect} names {len(ports)} ports: one per GPU")
    if len(ports) == 1:
        sock = socket.create_connection((host, ports[0]), timeout=CONTROL_TIMEOUT_S)
        return report(args, drive(args, sock, host, args.device, Progress()))
    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(len(ports)), ctx.Queue()
    procs = [spawn(_drive_worker, (args, host, port, i, barrier, results), f"bw-driver{i}")
             for i, port in enumerate(ports)]
    per_gpu: list = [None] * len(ports)
    answered = 0
    try:
        while answered < len(procs):
            try:
                rank, rows, error = results.get(timeout=1)
            except queue.Empty:
                if any(p.is_alive() for p in procs):
                    continue
                break  # a driver died without a word (the others' barrier waits end in time)
            answered += 1
            per_gpu[rank] = rows
            if error:
                print(f"driver {rank} failed: {error}", file=sys.stderr)
    finally:
        reap(procs)
    if None in per_gpu:
        return 1
    return report(args, merge(per_gpu))


def run_torchrun(args) -> int:
    """Under torchrun: ranks [0, W/2) drive, rank r + W/2 serves rank r; rank 0 reports."""
    import torch.distributed as dist

    store, rank, world = next(dist.rendezvous("env://"))
    if world % 2:
        sys.exit(f"bw.py under torchrun pairs ranks: WORLD_SIZE must be even, not {world}")
    half, pair = world // 2, rank % (world // 2)
    device = device_for(args.device, int(os.environ.get("LOCAL_RANK", 0)))
    loopback = int(os.environ.get("LOCAL_WORLD_SIZE", 0)) == world  # one node: keep to loopback
    pair_store = dist.PrefixStore(f"bw/pair{pair}", store)
    if rank >= half:
        channel = StoreChannel(pair_store, "peer", "driver")
        Target(channel, device, "127.0.0.1" if loopback else None, shared_store=store).serve()
        return 0
    channel = StoreChannel(pair_store, "driver", "peer")
    rows = Driver(args, channel, device, Progress(rank == 0), loopback=loopback,
                  dist_store={"kind": "shared", "prefix": f"bw/dist{pair}"}, shared_store=store,
                  barrier=StoreBarrier(dist.PrefixStore("bw/barrier", store), half)).run()
    channel.send(cmd="bye")
    store.set(f"bw/rows/{rank}", json.dumps(rows))
    if rank:
        return 0
    return report(args, merge([json.loads(store.get(f"bw/rows/{r}")) for r in range(half)]))


# -- command line -----------------------------------------------------------------------------------
def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, epilog=LEGEND, formatter_class=argparse.RawDescriptionHelpFormatter)
    default_device = "cuda:0" if torch.cuda.is_available() else "cpu"
    ap.add_argument("--sizes", nargs="+", type=parse_size, default=[4 << 10, 64 << 10, 1 << 20, 16 << 20],
                    metavar="SIZE", help="page sizes, e.g. 4K 64K 1M 16M (default); multiples of 8 bytes")
    ap.add_argument("--pages", nargs="+", type=int, default=[16, 256], metavar="N",
                    help="pages (views) per call (default: 16 256)")
    ap.add_argument("--max-bytes", type=parse_size, default=256 << 20, metavar="SIZE",
                    help="skip size x pages above this many bytes per call (default 256M)")
    ap.add_argument("--layouts", nargs="+", choices=["contiguous", "paged", "views"],
                    default=["contiguous", "paged", "views"])
    ap.add_argument("--ops", nargs="+", choices=["write", "read"], default=["write", "read"])
    ap.add_argument("--rails", nargs="+", type=int, default=[None], metavar="N",
                    help="rails (NICs, or domains on one NIC) per engine; several values sweep them "
                         "(default: the engine's choice)")
    ap.add_argument("--provider", default=None,
                    help="libfabric provider (default: the engine's: efa, verbs, then tcp; on loopback tcp "
                         "uses the 'lo' domain)")
    ap.add_argument("--device", default=default_device, help=f"this side's device (default {default_device})")
    ap.add_argument("--peer-device", default=None,
                    help="local mode: the peer's device (default: the next GPU, or cpu)")
    ap.add_argument("--host-memory", choices=["shared", "private"], default="shared",
                    help="host buffers in shared memory (share_memory_(), default: the cma route maps the "
                         "peer's and copies with memcpy) or private (the kernel copies between the processes)")
    ap.add_argument("--duration", type=float, default=0.5, metavar="S",
                    help="timed seconds per row (default 0.5)")
    ap.add_argument("--window", type=int, default=4, metavar="N",
                    help="calls in flight (default 4); 1 also reports each call's latency (median, p99)")
    ap.add_argument("--baseline", nargs="+", default=["auto"],
                    choices=["auto", "tcp", "nccl", "gloo", "memcpy", "kernel", *PEER_LIBRARIES, "none"],
                    help="measured beside the engine, a Gbps and ratio column each (default auto: memcpy on "
                         "the ipc route, tcp when the line rate is unknown, else none)")
    ap.add_argument("--nccl-nvlink", action="store_true",
                    help="local mode: let NCCL use NVLink / shared memory instead of holding it to sockets")
    ap.add_argument("--page-views", action="store_true",
                    help="views rows instead of paged rows (one view per page instead of p2p.pages())")
    ap.add_argument("--prepared", action="store_true",
                    help="prepare each row's call once (engine.prepare_write / prepare_read) and run it "
                         "again and again, instead of one write_slices / read_slices per call")
    ap.add_argument("--first-contact", type=int, default=3, metavar="N",
                    help="before the sweep, time the first 4 KiB write to a new peer, cold and after "
                         "engine.warm(), against the steady state; median of N trials (0: skip)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the paged layouts' page orders")
    ap.add_argument("--json", metavar="PATH", help="write the rows as a JSON list")
    ap.add_argument("--plot", metavar="PATH", help="plot Gbps against page size (needs matplotlib)")
    ap.add_argument("--listen", nargs="?", const="0.0.0.0:0", metavar="[HOST][:PORT]",
                    help="serve as the peer of a --connect run on another node (default: all addresses, "
                         "free ports); prints the ADDR to connect to")
    ap.add_argument("--connect", metavar="ADDR", help="drive the peers of a --listen run: HOST:PORT[,PORT...]")
    ap.add_argument("--gpus", type=int, default=None, metavar="N",
                    help="with --listen / --connect: processes, one per GPU from --device on (default: 1 / "
                         "one per port of ADDR)")
    args = ap.parse_args(argv)
    if any(s % 8 for s in args.sizes):
        ap.error("page sizes must be multiples of 8 bytes")
    if min(args.pages) < 1 or args.window < 1 or args.duration <= 0:
        ap.error("--pages and --window must be >= 1 and --duration > 0")
    if any(r is not None and r < 1 for r in args.rails):
        ap.error("--rails must be >= 1")
    if args.listen is not None and args.connect:
        ap.error("--listen and --connect exclude each other")
    if args.gpus is not None and args.listen is None and not args.connect:
        ap.error("--gpus needs --listen or --connect")
    if args.listen is not None:
        args.gpus = args.gpus or 1
    for name in ("device", "peer_device"):
        dev = getattr(args, name) and torch.device(getattr(args, name))
        if dev and dev.type == "cuda":
            if not torch.cuda.is_available():
                ap.error(f"--{name.replace('_', '-')} {dev} but CUDA is not available here")
            setattr(args, name, str(torch.device("cuda", dev.index or 0)))
    if args.page_views:
        args.layouts = list(dict.fromkeys("views" if layout == "paged" else layout for layout in args.layouts))
    if args.plot and importlib.util.find_spec("matplotlib") is None:  # now, not after the sweep
        ap.error("--plot needs matplotlib: pip install matplotlib")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        if args.listen is not None:
            return run_listen(args)
        if args.connect:
            return run_connect(args)
        if int(os.environ.get("WORLD_SIZE", "1")) > 1 and "MASTER_ADDR" in os.environ:
            return run_torchrun(args)
        return run_local(args)
    except (PeerFailed, p2p.P2PError) as e:  # the message names the call; the peer's carries its traceback
        print(f"bw.py: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    exit_on_sigterm()
    sys.exit(main())
