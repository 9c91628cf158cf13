"""The destination processes of weights.py and the source's handle on them."""
from __future__ import annotations

import sys
import traceback

import torch

import torch_p2p.weights as pw
from _processes import dismiss, freeze_heap, message_from, spawn_with_pipe
from _timing import TIMEOUT_S
from _weights_broadcast import broadcast_update, join_group
from _weights_state import DTYPES, checksum, device_of, open_engine, shapes, state_dict


def destination(conn, rank: int, args) -> None:
    """Rank `rank` (1..): answers the source's commands until "bye"."""
    try:
        device = device_of(args.device, rank)
        dtype = DTYPES[args.dtype]
        tensors = state_dict(shapes(args.model, args.layers), dtype, device, fill=False)
        engine = open_engine(args, device)
        freeze_heap(not args.no_freeze)
        dest, groups, buf = None, {}, None
        conn.send(("ok", engine.address))
        while True:
            cmd, *rest = conn.recv()
            if cmd == "bye":
                break
            if cmd == "join":
                dest = pw.WeightDestination(engine, pw.whole(tensors), rest[0], name=f"dest{rank}",
                                            window=rest[1])
                dest.join().wait()
                conn.send(("ok", None))
            elif cmd == "leave":
                dest.close()
                dest = None
                conn.send(("ok", None))
            elif cmd == "checksum":
                conn.send(("ok", checksum(tensors.values(), dtype)))
            elif cmd == "dist":
                join_group(args, rank, device)
                conn.send(("ok", None))
            elif cmd == "group":
                import torch.distributed as dist

                n = rest[0]
                groups[n] = dist.new_group(list(range(n + 1)))
            elif cmd == "broadcast":
                n, count = rest  # the warm-ups and the timed updates
                if buf is None:
                    buf = torch.empty(args.bucket // torch.empty((), dtype=dtype).element_size(), dtype=dtype,
                                      device=device)
                for _ in range(count):
                    broadcast_update(list(tensors.values()), dtype, args.bucket, groups[n], False, buf)
                conn.send(("ok", None))
            elif cmd == "undist":  # every rank at once: NCCL's teardown waits for its peers
                import torch.distributed as dist

                dist.destroy_process_group()
                conn.send(("ok", None))
        if dest is not None:
            dest.close()
        engine.close()
        import torch.distributed as dist

        if dist.is_initialized():  # the source said bye before "undist": the teardown is out of order
            raise RuntimeError("told to leave while still in the baseline's process group")
    except BaseException as e:  # noqa: BLE001 - reported to the source
        conn.send(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
        sys.exit(1)


class Peers:
    """The source's handle on the destination processes: commands to ranks 1.. and their answers."""

    def __init__(self, args):
        self.conns, self.procs = [], []
        for rank in range(1, max(args.dests) + 1):
            conn, proc = spawn_with_pipe(destination, (rank, args), f"weights-dest{rank}")
            self.conns.append(conn)
            self.procs.append(proc)

    def ask(self, ranks, *cmd) -> list:
        for r in ranks:
            self.conns[r - 1].send(cmd)
        return [self.answer(r) for r in ranks]

    def answer(self, rank: int):
        if not self.conns[rank - 1].poll(TIMEOUT_S * 5):
            raise RuntimeError(f"destination {rank} did not answer")
        status, value = message_from(self.conns[rank - 1], self.procs[rank - 1], f"weights.py: destination {rank}")
        if status != "ok":
            raise RuntimeError(f"destination {rank} failed: {value}")
        return value

    def close(self) -> list[str]:
        """Says bye to every destination; what went wrong in any of them on the way out."""
        dismiss(self.conns, self.procs, ("bye",))
        errors = []
        for rank, (conn, proc) in enumerate(zip(self.conns, self.procs), 1):
            if proc.exitcode:
                try:
                    said = conn.recv()[1] if conn.poll() else f"exit code {proc.exitcode}"
                except (EOFError, OSError):  # it died before its reason was whole: the code is all there is
                    said = f"exit code {proc.exitcode}"
                errors.append(f"destination {rank} failed on the way out: {said}")
        return errors
