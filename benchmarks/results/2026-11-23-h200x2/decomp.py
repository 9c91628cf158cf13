"""Where a small IPC-route call's time goes: steady state, a burst with the GPU held (no
completions meanwhile), the C++ submit alone, and CPU tensors (no stream event)."""
import contextlib, sys, time, torch, torch.multiprocessing as mp
import torch_p2p as p2p
from torch_p2p.engine import _unpack, _worker_timeout

PAGE, NPAGES = 4096, 8192

def peer(q_out, q_in, dev):
    with p2p.Engine(dev) as e:
        buf = torch.zeros(NPAGES, PAGE, dtype=torch.uint8, device=dev)
        hb = torch.zeros(NPAGES, PAGE, dtype=torch.uint8)
        q_out.put((e.register(buf).remote.to_bytes(), e.register(hb).remote.to_bytes()))
        q_in.get()

@contextlib.contextmanager
def gpu_pair():
    """(engine on cuda:0, the handle of a peer process's buffer on cuda:1, a registered random
    [NPAGES, PAGE] source of the engine)."""
    ctx = mp.get_context("spawn")
    qo, qi = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=peer, args=(qo, qi, "cuda:1")); p.start()
    gblob, _ = qo.get()
    try:
        with p2p.Engine("cuda:0") as e:
            src = torch.randn(NPAGES, PAGE // 4, device="cuda:0").view(torch.uint8).view(NPAGES, PAGE)
            e.register(src)
            yield e, p2p.RemoteTensor.from_bytes(gblob), src
    finally:
        qi.put(0); p.join()

def burst(e, call, n=400):
    torch.cuda._sleep(int(4e8))  # holds the stream: nothing completes during the burst
    t = time.perf_counter()
    futs = [call() for _ in range(n)]
    dt = (time.perf_counter() - t) / n
    for f in futs: f.wait()
    return dt

def main():
    dev = sys.argv[1] if len(sys.argv) > 1 else "cuda:0"
    pdev = sys.argv[2] if len(sys.argv) > 2 else "cuda:1"
    ctx = mp.get_context("spawn")
    qo, qi = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=peer, args=(qo, qi, pdev)); p.start()
    gblob, hblob = qo.get()
    with p2p.Engine(dev) as e:
        remote = p2p.RemoteTensor.from_bytes(gblob); hremote = p2p.RemoteTensor.from_bytes(hblob)
        src = torch.randn(NPAGES, PAGE // 4, device=dev).view(torch.uint8).view(NPAGES, PAGE)
        hsrc = torch.randint(0, 255, (NPAGES, PAGE), dtype=torch.uint8)
        e.register(src); e.register(hsrc)
        print("route", e.route(remote), "host route", e.route(hremote))
        for n in (1, 256, 4096):
            ls = torch.randperm(NPAGES)[:n]; rs = torch.randperm(NPAGES)[:n]
            a, b = p2p.pages(src, ls), p2p.pages(remote, rs)
            e.write_slices(a, b).wait()
            (la, lp), (ra, rp) = _unpack(a, torch.Tensor), _unpack(b, p2p.RemoteTensor)
            args = (True, la, [r._v for r in ra], lp, rp, False, -1, _worker_timeout(None))
            t = time.perf_counter()
            for _ in range(2000): _unpack(a, torch.Tensor); _unpack(b, p2p.RemoteTensor)
            tu = (time.perf_counter() - t) / 2000
            t = time.perf_counter()
            for _ in range(2000): torch.futures.Future()
            tf = (time.perf_counter() - t) / 2000
            futs = []; tc = 0.0; iters = 2000 if n < 4096 else 300
            t = time.perf_counter()
            for i in range(iters):
                c0 = time.perf_counter(); futs.append(e.write_slices(a, b)); tc += time.perf_counter() - c0
                if len(futs) >= 32: futs.pop(0).wait()
            for f in futs: f.wait()
            dt = (time.perf_counter() - t) / iters
            bw = burst(e, lambda: e.write_slices(a, b))
            bc = burst(e, lambda: e._call(e._c.submit, *args))
            line = (f"pages={n:5d}: steady {dt*1e6:6.1f} us/call ({n*PAGE/dt/1e9:6.1f} GB/s), returns {tc/iters*1e6:5.1f}; "
                    f"burst write_slices {bw*1e6:5.1f}, burst _call(submit) {bc*1e6:5.1f}, _unpack x2 {tu*1e6:4.1f}, Future() {tf*1e6:4.2f}")
            if n <= 256:
                ha, hb = p2p.pages(hsrc, ls), p2p.pages(hremote, rs)
                e.write_slices(ha, hb).wait()
                hc = burst(e, lambda: e.write_slices(ha, hb), 200)
                line += f"; host tensors (tcp) burst {hc*1e6:5.1f}"
            print(line, flush=True)
    qi.put(0); p.join()

if __name__ == "__main__":
    main()
