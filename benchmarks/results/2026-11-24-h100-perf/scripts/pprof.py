"""Steady 256 x 4 KiB IPC writes (window 8), plain then prepared, each sampled by perf for a few
seconds in the middle: python pprof.py PERF OUTDIR"""
import os, subprocess, sys, threading, time, torch, torch.multiprocessing as mp
import torch_p2p as p2p

PAGE, NPAGES = 4096, 8192

def peer(q_out, q_in, dev):
    with p2p.Engine(dev) as e:
        buf = torch.zeros(NPAGES, PAGE, dtype=torch.uint8, device=dev)
        q_out.put(e.register(buf).remote.to_bytes())
        q_in.get()

def loop(move, secs, window=8):
    futs = []; n = 0; t = time.perf_counter()
    while time.perf_counter() - t < secs:
        futs.append(move()); n += 1
        if len(futs) >= window: futs.pop(0).wait()
    for f in futs: f.wait()
    return (time.perf_counter() - t) / n * 1e6

def main():
    perf, out = sys.argv[1], sys.argv[2]
    ctx = mp.get_context("spawn")
    qo, qi = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=peer, args=(qo, qi, "cuda:0")); p.start()
    remote = p2p.RemoteTensor.from_bytes(qo.get())
    with p2p.Engine("cuda:0") as e:
        src = torch.randn(NPAGES, PAGE // 4, device="cuda:0").view(torch.uint8).view(NPAGES, PAGE)
        e.register(src)
        ls = torch.randperm(NPAGES)[:256]; rs = torch.randperm(NPAGES)[:256]
        a, b = p2p.pages(src, ls), p2p.pages(remote, rs)
        print("route", e.route(remote), "main tid", threading.get_native_id(),
              "threads", [(t.name, t.native_id) for t in threading.enumerate()], flush=True)
        plain = lambda: e.write_slices(a, b)
        prepared = e.prepare_write(a, b).run
        for name, move in (("plain", plain), ("prepared", prepared)):
            before = loop(move, 1.5)
            rec = subprocess.Popen([perf, "record", "-e", "cpu-clock", "-F", "10000", "-g", "-p", str(os.getpid()),
                                    "-o", f"/tmp/{name}.data", "--", "sleep", "3"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            time.sleep(0.3)
            during = loop(move, 2.5)
            rec.wait()
            after = loop(move, 1.5)
            print(f"{name}: {before:.1f} us/call before perf, {during:.1f} under perf, {after:.1f} after", flush=True)
    qi.put(0); p.join()

if __name__ == "__main__":
    main()
