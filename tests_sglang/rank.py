"""One SGLang scheduler rank (prefill or decode) in a process of its own, driving the torch_p2p
backend's classes as SGLang's scheduler does, over CPU (or CUDA) pools that SGLang's KVArgs
describe. The test sends it one JSON command a line on stdin and reads one JSON reply a line.

    python rank.py prefill|decode --tp-size N --tp-rank R --port P [--device cpu] [--mla]

Pools are filled from the model's "true" KV (``model_kv``: every head, seeded), each rank
holding its heads, so that a decode rank can check what it received page by page.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

# Replies go to the original stdout; libraries that print (UCX, Mooncake) get stderr.
REPLIES = os.fdopen(os.dup(1), "w")
os.dup2(2, 1)
sys.path.insert(0, os.path.dirname(__file__))
import stubs  # noqa: E402  (before sglang)

stubs.install()

import numpy as np  # noqa: E402
import torch  # noqa: E402
from sglang.srt.disaggregation.base.conn import KVPoll  # noqa: E402

# Pool shape; benchmarks/sglang.py sets larger ones (layers, heads, head bytes, page size, pages).
LAYERS, HEADS, HEAD_BYTES, PAGE, PAGES = (int(x) for x in os.environ.get("TORCH_P2P_SGLANG_POOL", "3,4,32,4,64").split(","))
AUX_ROWS = 8
AUX_ITEMS = (64, 16)  # two aux buffers of different row sizes (as SGLang's MetadataBuffers)


def model_kv(seed: int, mla: bool) -> list[torch.Tensor]:
    """Every layer's K then V buffer ([tokens, all heads, head bytes]; MLA: latent buffers)."""
    g = torch.Generator().manual_seed(seed)
    heads = 1 if mla else HEADS
    count = LAYERS if mla else 2 * LAYERS
    return [torch.randint(0, 256, (PAGES * PAGE, heads, HEAD_BYTES), generator=g, dtype=torch.uint8)
            for _ in range(count)]


def kv_args(role: str, tp_size: int, tp_rank: int, device: str, mla: bool, dtype: str, head_bytes: int):
    from sglang.srt.disaggregation.base.conn import KVArgs

    heads = 1 if mla else HEADS // tp_size
    lo = 0 if mla else tp_rank * heads
    if role == "prefill":
        bufs = [b[:, lo:lo + heads].contiguous().to(device) for b in model_kv(1, mla)]
    else:
        bufs = [torch.zeros(PAGES * PAGE, heads, head_bytes, dtype=torch.uint8, device=device)
                for _ in model_kv(1, mla)]
    aux = [torch.zeros(AUX_ROWS, n, dtype=torch.uint8) for n in AUX_ITEMS]
    if role == "prefill":
        for i, a in enumerate(aux):
            a.copy_(torch.arange(AUX_ROWS * a.shape[1]).view_as(a) * (i + 1) % 251)
    args = KVArgs()
    args.engine_rank, args.gpu_id, args.page_size = tp_rank, 0, PAGE
    args.kv_data_ptrs = [b.data_ptr() for b in bufs]
    args.kv_data_lens = [b.nbytes for b in bufs]
    args.kv_item_lens = [b[:PAGE].nbytes for b in bufs]
    args.kv_layer_ids = list(range(len(bufs)))
    args.kv_data_mem_kinds = ["DRAM" if device == "cpu" else "VRAM"] * len(bufs)  # read by SGLang's nixl backend
    args.kv_cache_dtype_str, args.kv_head_num, args.total_kv_head_num = dtype, heads, HEADS
    args.aux_data_ptrs = [a.data_ptr() for a in aux]
    args.aux_data_lens = [a.nbytes for a in aux]
    args.aux_item_lens = [a[0].nbytes for a in aux]
    for name in ("state_types", "state_data_ptrs", "state_data_lens", "state_item_lens", "state_layer_ids",
                 "state_dim_per_tensor", "state_slice_outer_counts", "state_conv_shard_groups"):
        setattr(args, name, [])
    args.ib_device, args.system_dp_rank, args.rust_http_port, args.pp_rank = None, 0, None, 0
    args.prefill_start_layer, args.prefill_end_layer, args.mla_compression_ratios = 0, None, None
    args.is_hybrid_mla_backend, args.swa_kv_cache_layout = False, None
    args.kv_buf_groups = args.hidden_kv_layers = args.draft_kv_layers = 0
    return args, bufs, aux


class Rank:
    def __init__(self, a):
        from sglang.srt.plugins import load_plugins

        load_plugins()  # the entry point (pip install -e ".[sglang]"), as every SGLang process does
        import torch_p2p.integrations.sglang as plugin
        from sglang.srt.plugins.hook_registry import HookRegistry

        if plugin.BACKEND not in __import__("sglang.srt.disaggregation.utils").srt.disaggregation.utils.TransferBackend._value2member_map_:
            plugin.register()  # no entry point in this environment (PYTHONPATH checkout): what it runs
            HookRegistry.apply_hooks()
        from sglang.srt.disaggregation.utils import DisaggregationMode, KVClassType, TransferBackend, get_kv_class
        from sglang.test.test_utils import published_topology
        self.a, self.classes = a, {}
        backend = TransferBackend(a.backend)
        for t in KVClassType:
            self.classes[t.value] = get_kv_class(backend, t)
        self._topology = published_topology(
            "scheduler", ranks=dict(world_rank=a.tp_rank), disaggregation_mode=a.role, tp_size=a.tp_size,
            disaggregation_transfer_backend=a.backend, disaggregation_bootstrap_port=a.port, device=a.device,
            host="127.0.0.1", page_size=PAGE)
        self._topology.__enter__()
        from sglang.srt.runtime_context import get_parallel
        get_parallel().override_permanently(pp_group=None)  # one stage: no pipeline group (the transfer never uses it)
        self.server = None
        if a.role == "prefill" and a.tp_rank == 0:
            self.server = self.classes["bootstrap_server"](host="127.0.0.1", port=a.port)
        self.args, self.bufs, self.aux = kv_args(a.role, a.tp_size, a.tp_rank, a.device, a.mla, a.dtype, a.head_bytes)
        mode = DisaggregationMode.PREFILL if a.role == "prefill" else DisaggregationMode.DECODE
        if a.backend == "mooncake":  # SGLang's model runner starts its shared engine first
            from sglang.srt.distributed.device_communicators.mooncake_transfer_engine import \
                init_mooncake_transfer_engine
            init_mooncake_transfer_engine(hostname="127.0.0.1", gpu_id=0)
        self.mgr = self.classes["manager"](self.args, mode, self._topology_args(), is_mla_backend=a.mla)
        self.rooms = {}

    def _topology_args(self):
        from sglang.srt.runtime_context import get_server_args
        return get_server_args()

    # -- commands (each returns the reply's fields) ---------------------------------------------
    def open(self, room):
        if self.a.role == "prefill":
            self.rooms[room] = self.classes["sender"](mgr=self.mgr, bootstrap_addr=f"127.0.0.1:{self.a.port}",
                                                      bootstrap_room=room)
        else:
            addr = f"127.0.0.1:{self.a.port}"
            self.rooms[room] = self.classes["receiver"](mgr=self.mgr, bootstrap_addr=addr, bootstrap_room=room)
        return dict(state=int(self.rooms[room].poll()))

    def bootstrap(self, room, timeout):
        """Decode: fetch the prefill's parallel info (as the prealloc queue does), then init."""
        deadline = time.monotonic() + timeout
        while not self.mgr.try_ensure_parallel_info(f"127.0.0.1:{self.a.port}"):
            if time.monotonic() > deadline:
                return dict(error="no prefill parallel info")
            time.sleep(0.05)  # polling interval of SGLang's prealloc queue, not a synchronisation
        self.rooms[room].init(prefill_dp_rank=0)
        return dict(state=int(self.rooms[room].poll()))

    def metadata(self, room, pages, aux_index):
        self.rooms[room].send_metadata(np.asarray(pages, dtype=np.int32), aux_index=aux_index)
        return dict(state=int(self.rooms[room].poll()))

    def send(self, room, pages, aux_index, chunks=1):
        sender = self.rooms[room]
        sender.init(len(pages), aux_index)
        for part in np.array_split(np.asarray(pages, dtype=np.int32), chunks):
            sender.send(part)
        return dict(state=int(sender.poll()))

    def timed_send(self, room, pages, aux_index, timeout):
        """Prefill: send and poll until the room ends; seconds from send to Success (or None)."""
        sender = self.rooms[room]
        sender.init(len(pages), aux_index)
        start = time.perf_counter()
        sender.send(np.asarray(pages, dtype=np.int32))
        while (s := int(sender.poll())) not in (int(KVPoll.Success), int(KVPoll.Failed)):
            if time.perf_counter() - start > timeout:
                break
        return dict(seconds=time.perf_counter() - start if s == int(KVPoll.Success) else None, state=s)

    def wait(self, room, states, timeout):
        """Polls the room (as the scheduler's event loop does) until it is in one of `states`;
        every distinct state seen, in order."""
        seen, deadline = [], time.monotonic() + timeout
        while True:
            s = int(self.rooms[room].poll())
            if not seen or seen[-1] != s:
                seen.append(s)
            if s in states or time.monotonic() > deadline:
                return dict(state=s, seen=seen)
            time.sleep(0.005)  # the scheduler's loop interval, not a synchronisation

    def failure(self, room):
        try:
            self.rooms[room].failure_exception()
        except Exception as e:  # noqa: BLE001 - the contract is that it raises
            return dict(type=type(e).__name__, message=str(e))
        return dict(type=None)

    def abort(self, room):
        self.rooms[room].abort()
        return dict(state=int(self.rooms[room].poll()))

    def clear(self, room):
        self.rooms.pop(room).clear()
        return {}

    def check(self, src_pages, dst_pages, aux_src, aux_dst, seed=1):
        """Decode: compares every received page with the prefill's, layer by layer, and the aux
        rows; the first mismatch, or None."""
        truth = model_kv(seed, self.a.mla)
        heads = self.bufs[0].shape[1]
        lo = 0 if self.a.mla else self.a.tp_rank * heads
        for i, (buf, t) in enumerate(zip(self.bufs, truth)):
            got, want = buf.cpu().view(PAGES, PAGE, heads, -1), t[:, lo:lo + heads].reshape(PAGES, PAGE, heads, -1)
            for s, d in zip(src_pages, dst_pages):
                if not torch.equal(got[d], want[s]):
                    return dict(mismatch=f"buffer {i}: page {d} differs from prefill page {s}")
        for i, a in enumerate(self.aux):
            want = torch.arange(AUX_ROWS * a.shape[1]).view_as(a) * (i + 1) % 251
            if not torch.equal(a[aux_dst], want[aux_src].to(torch.uint8)):
                return dict(mismatch=f"aux buffer {i}: row {aux_dst} differs from prefill row {aux_src}")
        return dict(mismatch=None)

    def forget(self, addr_port, timeout):
        """Decode: waits (bounded) until SGLang's heartbeat has dropped the prefill at the port."""
        deadline, addr = time.monotonic() + timeout, f"127.0.0.1:{addr_port}"
        while addr in self.mgr.prefill_info_table and time.monotonic() < deadline:
            time.sleep(0.05)  # the heartbeat thread's interval is seconds; polling its table
        return dict(forgotten=addr not in self.mgr.prefill_info_table)

    def pid(self):
        return dict(pid=os.getpid())


def main():
    p = argparse.ArgumentParser()
    p.add_argument("role", choices=["prefill", "decode"])
    p.add_argument("--tp-size", type=int, default=1)
    p.add_argument("--tp-rank", type=int, default=0)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--backend", default="torch_p2p")
    p.add_argument("--mla", action="store_true")
    p.add_argument("--head-bytes", type=int, default=HEAD_BYTES, help="decode only: a model of another head dim")
    rank = Rank(p.parse_args())
    print(json.dumps(dict(ready=True)), file=REPLIES, flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        try:
            reply = getattr(rank, cmd.pop("op"))(**cmd)
        except Exception as e:  # noqa: BLE001 - reported to the test, which fails on it
            reply = dict(error=f"{type(e).__name__}: {e}")
        print(json.dumps(reply), file=REPLIES, flush=True)
    os._exit(0)  # SGLang's daemon threads and atexit hooks do not end on their own


if __name__ == "__main__":
    main()
