"""Steady 256 x 4 KiB writes, window 8, for a profiler to sample: python steady.py SECONDS"""
import sys, time, torch
import torch_p2p as p2p
sys.path.insert(0, __file__.rsplit("/", 1)[0])
from decomp import gpu_pair, NPAGES, PAGE

def main():
    secs = float(sys.argv[1])
    with gpu_pair() as (e, remote, src):
        ls = torch.randperm(NPAGES)[:256]; rs = torch.randperm(NPAGES)[:256]
        a, b = p2p.pages(src, ls), p2p.pages(remote, rs)
        futs = []; n = 0; t = time.perf_counter()
        while time.perf_counter() - t < secs:
            futs.append(e.write_slices(a, b)); n += 1
            if len(futs) >= 8: futs.pop(0).wait()
        for f in futs: f.wait()
        print(f"steady: {(time.perf_counter() - t) / n * 1e6:.1f} us/call", flush=True)

if __name__ == "__main__":
    main()
