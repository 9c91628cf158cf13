"""us per 256 x 4 KiB write (window 8) with the calling thread unpinned, on the worker's SMT
sibling, or on another physical core: python pin.py"""
import os, sys, time, torch, torch.multiprocessing as mp
import torch_p2p as p2p
from torch_p2p.topology import parse_cpulist
sys.path.insert(0, __file__.rsplit("/", 1)[0])
from pprof import peer, loop, PAGE, NPAGES

def siblings(c):
    with open(f"/sys/devices/system/cpu/cpu{c}/topology/thread_siblings_list") as f:
        return parse_cpulist(f.read())

def main():
    ctx = mp.get_context("spawn")
    qo, qi = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=peer, args=(qo, qi, "cuda:0")); p.start()
    remote = p2p.RemoteTensor.from_bytes(qo.get())
    allowed = sorted(os.sched_getaffinity(0))
    with p2p.Engine("cuda:0") as e:
        w = e.plan.cpu
        sib = [c for c in siblings(w) if c != w] if w is not None else []
        print("allowed", allowed, "worker core", w, "its siblings", sib, "plan:", e.plan.reason, flush=True)
        src = torch.randn(NPAGES, PAGE // 4, device="cuda:0").view(torch.uint8).view(NPAGES, PAGE)
        e.register(src)
        ls = torch.randperm(NPAGES)[:256]; rs = torch.randperm(NPAGES)[:256]
        a, b = p2p.pages(src, ls), p2p.pages(remote, rs)
        plain = lambda: e.write_slices(a, b)
        prepared = e.prepare_write(a, b).run
        loop(plain, 0.5)
        far = [c for c in allowed if c != w and c not in sib and w not in siblings(c)]
        places = [("unpinned", allowed)] + ([("worker's sibling", sib[:1])] if sib else []) + [("another core", far[-1:])]
        for rnd in range(2):
            for name, cpus in places:
                os.sched_setaffinity(0, cpus)
                r = {k: sorted(loop(m, 1.0) for _ in range(3))[1] for k, m in (("plain", plain), ("prepared", prepared))}
                print(f"round {rnd + 1} {name:18s} {cpus if len(cpus) < 4 else 'all'}: plain {r['plain']:.1f} us, prepared {r['prepared']:.1f} us", flush=True)
        os.sched_setaffinity(0, allowed)
    qi.put(0); p.join()

if __name__ == "__main__":
    main()
