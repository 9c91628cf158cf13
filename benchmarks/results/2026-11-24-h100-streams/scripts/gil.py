"""Steady 256 x 4 KiB IPC writes (window 8) on cuda:0 -> cuda:0: us per call and us per call
spent in fut.wait(), plain then prepared, median of 5 loops of 1 s. python gil.py LABEL"""
import statistics, sys, time, torch, torch.multiprocessing as mp
import torch_p2p as p2p

PAGE, NPAGES = 4096, 8192

def peer(q_out, q_in, dev):
    with p2p.Engine(dev) as e:
        buf = torch.zeros(NPAGES, PAGE, dtype=torch.uint8, device=dev)
        q_out.put(e.register(buf).remote.to_bytes())
        q_in.get()

def loop(move, secs, window=8):
    futs = []; n = 0; waited = 0.0; pc = time.perf_counter; t = pc()
    while pc() - t < secs:
        futs.append(move()); n += 1
        if len(futs) >= window:
            w = pc(); futs.pop(0).wait(); waited += pc() - w
    for f in futs: f.wait()
    return (pc() - t) / n * 1e6, waited / n * 1e6

def main():
    ctx = mp.get_context("spawn")
    qo, qi = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=peer, args=(qo, qi, "cuda:0")); p.start()
    remote = p2p.RemoteTensor.from_bytes(qo.get())
    with p2p.Engine("cuda:0") as e:
        src = torch.randn(NPAGES, PAGE // 4, device="cuda:0").view(torch.uint8).view(NPAGES, PAGE)
        e.register(src)
        ls = torch.randperm(NPAGES)[:256]; rs = torch.randperm(NPAGES)[:256]
        a, b = p2p.pages(src, ls), p2p.pages(remote, rs)
        plain = lambda: e.write_slices(a, b)
        prepared = e.prepare_write(a, b).run
        side = torch.cuda.Stream() if "side" in sys.argv[1:] else torch.cuda.current_stream()
        torch.cuda.set_stream(side)
        for name, move in (("plain", plain), ("prepared", prepared)):
            loop(move, 0.5)
            r = [loop(move, 1.0) for _ in range(5)]
            call = statistics.median(x[0] for x in r); wait = statistics.median(x[1] for x in r)
            print(f"{sys.argv[1]} {side} {name}: {call:.2f} us/call ({1048576 / call / 1e3:.0f} GB/s), {wait:.2f} us/call in wait", flush=True)
    qi.put(0); p.join()

if __name__ == "__main__":
    main()
