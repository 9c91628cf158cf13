"""Per-call cost of the IPC route: where the ~23 us of a small paged write goes."""
import sys, time, torch, torch.multiprocessing as mp
import torch_p2p as p2p

PAGE, NPAGES = 4096, 8192

def peer(q_out, q_in, dev, npages=NPAGES, page=PAGE):
    with p2p.Engine(dev) as e:
        buf = torch.zeros(npages, page, dtype=torch.uint8, device=dev)
        r = e.register(buf)
        q_out.put(r.remote.to_bytes())
        q_in.get()

def main():
    dev = sys.argv[1] if len(sys.argv) > 1 else "cuda:0"
    pdev = sys.argv[2] if len(sys.argv) > 2 else dev
    ctx = mp.get_context("spawn")
    qo, qi = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=peer, args=(qo, qi, pdev)); p.start()
    blob = qo.get()
    with p2p.Engine(dev) as e:
        remote = p2p.RemoteTensor.from_bytes(blob)
        src = torch.randn(NPAGES, PAGE // 4, device=dev).view(torch.uint8).view(NPAGES, PAGE)
        e.register(src)
        print("route", e.route(remote))
        for n in (1, 256, 4096):
            ls = torch.randperm(NPAGES)[:n]; rs = torch.randperm(NPAGES)[:n]
            e.write_slices(p2p.pages(src, ls), p2p.pages(remote, rs)).wait()
            t = time.perf_counter()
            for _ in range(1000): a, b = p2p.pages(src, ls), p2p.pages(remote, rs)
            tp = (time.perf_counter() - t) / 1000
            for window in (1, 32):
                futs = []
                t = time.perf_counter(); tc = 0.0
                iters = 2000 if n < 4096 else 300
                for i in range(iters):
                    c0 = time.perf_counter()
                    futs.append(e.write_slices(p2p.pages(src, ls), p2p.pages(remote, rs)))
                    tc += time.perf_counter() - c0
                    if len(futs) >= window: futs.pop(0).wait()
                for f in futs: f.wait()
                dt = (time.perf_counter() - t) / iters
                print(f"pages={n:5d} window={window:2d}: {dt*1e6:7.1f} us/call, call returns in {tc/iters*1e6:6.1f} us, "
                      f"pages() x2 {tp*1e6:5.1f} us, {n*PAGE/dt/1e9:7.1f} GB/s", flush=True)
        ls = torch.randperm(NPAGES)[:256]; rs = torch.randperm(NPAGES)[:256]
        from torch.profiler import profile, ProfilerActivity
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            futs = [e.write_slices(p2p.pages(src, ls), p2p.pages(remote, rs)) for _ in range(200)]
            for f in futs: f.wait()
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
    qi.put(0); p.join()

if __name__ == "__main__":
    main()
