"""KV push timeline on the IPC route: python kvloop.py SECONDS [op]: Llama-3-8B, 4k tokens
(256 random blocks of 600 on each side), push/pull return and completion times, contiguous."""
import sys, time, statistics, torch, torch.multiprocessing as mp
sys.path.insert(0, "benchmarks")
import torch_p2p as p2p
from torch_p2p import kv
from kv import PRESETS, make_cache
pre = PRESETS["llama3-8b"]; BLOCKS = 600

def peer(q_out, q_in):
    with p2p.Engine("cuda:1") as e:
        layers, cache = make_cache(e, pre, BLOCKS)
        contig = torch.empty(256 * cache.block_bytes, dtype=torch.uint8, device="cuda:1")
        q_out.put((cache.handle.to_bytes(), e.register(contig).remote.to_bytes())); q_in.get()

def main():
    secs = float(sys.argv[1]); op = sys.argv[2] if len(sys.argv) > 2 else "push"
    ctx = mp.get_context("spawn"); qo, qi = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=peer, args=(qo, qi)); p.start()
    with p2p.Engine("cuda:0") as e:
        layers, cache = make_cache(e, pre, BLOCKS)
        hb, cb = qo.get()
        peerh = kv.KVCacheHandle.from_bytes(hb); rc = p2p.RemoteTensor.from_bytes(cb)
        contig = torch.empty(256 * cache.block_bytes, dtype=torch.uint8, device="cuda:0"); e.register(contig)
        g = torch.Generator().manual_seed(0)
        mine = torch.randperm(BLOCKS, generator=g)[:256].tolist(); theirs = torch.randperm(BLOCKS, generator=g)[:256].tolist()
        move = (lambda: cache.push(peerh, mine, theirs)) if op == "push" else (lambda: cache.pull(peerh, theirs, mine))
        cmove = e.write_slices if op == "push" else e.read_slices
        for _ in range(5): move().wait(); cmove([contig], [rc]).wait()
        ret, tot, ctot, sub = [], [], [], []
        real = e._call
        def timed_call(start, *a):
            t = time.perf_counter(); r = real(start, *a); sub.append(time.perf_counter() - t); return r
        e._call = timed_call
        t_end = time.perf_counter() + secs
        while time.perf_counter() < t_end:
            t0 = time.perf_counter(); f = move(); t1 = time.perf_counter(); f.wait(); t2 = time.perf_counter()
            e._call = real; cmove([contig], [rc]).wait(); e._call = timed_call; t3 = time.perf_counter()
            ret.append(t1 - t0); tot.append(t2 - t0); ctot.append(t3 - t2)
        m = statistics.median
        print(f"kvloop {op}: n={len(ret)} returns {m(ret)*1e3:.3f} ms (_call(submit) {m(sub)*1e3:.3f}), done {m(tot)*1e3:.3f} ms; contiguous {m(ctot)*1e3:.3f} ms; ratio {m(ctot)/m(tot):.3f}", flush=True)
    qi.put(0); p.join()

if __name__ == "__main__":
    main()
