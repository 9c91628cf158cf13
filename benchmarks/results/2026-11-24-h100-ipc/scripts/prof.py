"""Per-call cost breakdown of small IPC-route calls (temporary instrumentation, _C._prof)."""
import os, sys, time, torch, torch.multiprocessing as mp
import torch_p2p as p2p
from torch_p2p import _C

PAGE, NPAGES = 4096, 8192

def peer(q_out, q_in, dev):
    with p2p.Engine(dev) as e:
        buf = torch.zeros(NPAGES, PAGE, dtype=torch.uint8, device=dev)
        q_out.put(e.register(buf).remote.to_bytes())
        q_in.get()

def threads():
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            s = open(f"/proc/self/task/{tid}/stat").read()
        except OSError:
            continue
        name = s[s.index("(") + 1:s.rindex(")")]
        f = s[s.rindex(")") + 2:].split()
        out[tid] = (name, (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK"))
    return out

def steady(call, window, secs=1.0):
    futs = []; n = 0
    _C._prof(); th0 = threads(); tt0 = time.thread_time()
    t = time.perf_counter()
    while time.perf_counter() - t < secs:
        futs.append(call()); n += 1
        if len(futs) >= window: futs.pop(0).wait()
    for f in futs: f.wait()
    wall = time.perf_counter() - t
    tt = time.thread_time() - tt0; th1 = threads(); prof = _C._prof()
    busy = sorted(((th1[k][1] - th0[k][1]) / wall, th1[k][0]) for k in th1 if k in th0)[-6:]
    return wall / n, tt / wall, busy, prof, n

def main():
    dev = sys.argv[1] if len(sys.argv) > 1 else "cuda:0"
    pdev = sys.argv[2] if len(sys.argv) > 2 else dev
    sizes = [int(x) for x in os.environ.get("PAGES", "1,256").split(",")]
    windows = [int(x) for x in os.environ.get("WINDOWS", "1,8,32").split(",")]
    whats = os.environ.get("WHAT", "write_slices,prepared").split(",")
    ctx = mp.get_context("spawn")
    qo, qi = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=peer, args=(qo, qi, pdev)); p.start()
    remote = p2p.RemoteTensor.from_bytes(qo.get())
    try:
        with p2p.Engine(dev) as e:
            src = torch.randn(NPAGES, PAGE // 4, device=dev).view(torch.uint8).view(NPAGES, PAGE)
            e.register(src)
            print("route", e.route(remote), "rails", len(e.rails), flush=True)
            if os.environ.get("PIN"):  # the driving thread on a core of its own, next to the worker's
                core = (e.plan.cpu + 1) % os.cpu_count()
                os.sched_setaffinity(0, {core})
                print("python thread pinned to", core, "worker on", e.plan.cpu, flush=True)
            for n in sizes:
                ls = torch.randperm(NPAGES)[:n]; rs = torch.randperm(NPAGES)[:n]
                a, b = p2p.pages(src, ls), p2p.pages(remote, rs)
                pc = e.prepare_write(a, b)
                for _ in range(20): e.write_slices(a, b).wait(); pc.run().wait()
                def per(fn, k=3000):
                    t = time.perf_counter()
                    for _ in range(k): fn()
                    return (time.perf_counter() - t) / k * 1e6
                args = (True, a, b, None, None)
                print(f"pages={n}: python pieces us: prepare (parse+build) {per(lambda: e._c.prepare(*args)):.2f}, "
                      f"Future() {per(torch.futures.Future):.2f}, "
                      f"perf_counter {per(time.perf_counter):.3f}", flush=True)
                for what, call in (("write_slices", lambda: e.write_slices(a, b)), ("prepared", pc.run)):
                    if what not in whats:
                        continue
                    for w in windows:
                        per, py, busy, prof, calls = steady(call, w)
                        us = {k: (v[0] / max(v[1], 1) / 1e3, v[1] / calls) for k, v in prof.items() if v[1]}
                        print(f"pages={n:4d} {what:12s} w{w:<3d}: {per*1e6:6.1f} us/call ({n*PAGE/per/1e9:6.1f} GB/s), "
                              f"python thread busy {py:.2f}", flush=True)
                        print("   threads busy:", ", ".join(f"{nm}:{b:.2f}" for b, nm in busy))
                        print("   " + ", ".join(f"{k} {v[0]:.2f}us x{v[1]:.2f}" for k, v in us.items()))
    finally:
        qi.put(0); p.join()

if __name__ == "__main__":
    main()
