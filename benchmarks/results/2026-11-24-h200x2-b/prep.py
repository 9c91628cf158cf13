"""Prepared calls vs write_slices on the IPC route: submit cost (GPU held) and steady rate by window."""
import os, sys, time, torch
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "2026-11-23-h200x2"))
import torch_p2p as p2p
from decomp import burst, gpu_pair, PAGE, NPAGES

def steady(call, window, secs=0.6):
    futs = []; n = 0; t = time.perf_counter()
    while time.perf_counter() - t < secs:
        futs.append(call()); n += 1
        if len(futs) >= window: futs.pop(0).wait()
    for f in futs: f.wait()
    return (time.perf_counter() - t) / n

def main():
    with gpu_pair() as (e, remote, src):
        for n in (1, 256):
            ls = torch.randperm(NPAGES)[:n]; rs = torch.randperm(NPAGES)[:n]
            a, b = p2p.pages(src, ls), p2p.pages(remote, rs)
            pc = e.prepare_write(a, b)
            for _ in range(3): e.write_slices(a, b).wait(); pc.run().wait()
            for what, call in (("write_slices", lambda: e.write_slices(a, b)), ("prepared", pc.run)):
                bt = burst(e, call)
                line = " ".join(f"w{w} {steady(call, w)*1e6:5.1f}" for w in (1, 8, 32, 128))
                print(f"pages={n:4d} {what:12s}: burst {bt*1e6:5.1f} us/call; steady us/call by window: {line}", flush=True)

if __name__ == "__main__":
    main()
