"""Where a KV-sized paged call (64 entries x 256 random 32 KiB pages = 512 MiB) spends its time
on the IPC route: return time, completion time, and the copy kernel's GPU time (profiler)."""
import os, sys, time, torch, torch.multiprocessing as mp
import torch_p2p as p2p

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "2026-11-23-h100-ipc"))
from percall import peer  # noqa: E402

PAGE, NPAGES = 32768, 32768  # 1 GiB per side

def main():
    dev = "cuda:0"
    ctx = mp.get_context("spawn")
    qo, qi = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=peer, args=(qo, qi, dev, NPAGES, PAGE)); p.start()
    blob = qo.get()
    with p2p.Engine(dev) as e:
        remote = p2p.RemoteTensor.from_bytes(blob)
        src = torch.ones(NPAGES, PAGE, dtype=torch.uint8, device=dev)
        e.register(src)
        ents = [(torch.randperm(NPAGES)[:256], torch.randperm(NPAGES)[:256]) for _ in range(64)]
        def call():
            loc = [p2p.pages(src, a) for a, b in ents]; rem = [p2p.pages(remote, b) for a, b in ents]
            t0 = time.perf_counter(); f = e.write_slices(loc, rem); t1 = time.perf_counter(); f.wait()
            return t1 - t0, time.perf_counter() - t0
        for _ in range(3): call()
        r = sorted(call() for _ in range(20))
        ret = sorted(x[0] for x in r)[10]; tot = sorted(x[1] for x in r)[10]
        n = 16384 * PAGE
        whole = src[:16384]
        rwhole = remote[:16384]
        e.write_slices([whole], [rwhole]).wait()
        ts = []
        for _ in range(20):
            t0 = time.perf_counter(); e.write_slices([whole], [rwhole]).wait(); ts.append(time.perf_counter() - t0)
        c = sorted(ts)[10]
        print(f"paged 16384 x 32 KiB: returns {ret*1e3:.3f} ms, done {tot*1e3:.3f} ms ({n/tot/1e9:.0f} GB/s); "
              f"contiguous 512 MiB {c*1e3:.3f} ms ({n/c/1e9:.0f} GB/s); ratio {c/tot:.2f}", flush=True)
        from torch.profiler import profile, ProfilerActivity
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(5): call()
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=8))
    qi.put(0); p.join()

if __name__ == "__main__":
    main()
