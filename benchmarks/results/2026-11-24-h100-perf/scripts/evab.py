"""us per steady 256 x 4 KiB IPC write (window 8), plain and prepared: python evab.py LABEL"""
import sys, time, torch, torch.multiprocessing as mp
import torch_p2p as p2p
sys.path.insert(0, __file__.rsplit("/", 1)[0])
from pprof import peer, loop, PAGE, NPAGES

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
        loop(plain, 0.5)
        la, lb = torch.randperm(NPAGES)[:4096], torch.randperm(NPAGES)[:4096]
        big = lambda: e.write_slices(p2p.pages(src, la), p2p.pages(remote, lb))
        res = {}
        for name, move, w in (("plain", plain, 8), ("prepared", prepared, 8), ("lat1", plain, 1), ("4096", big, 8)):
            res[name] = sorted(loop(move, 1.0, w) for _ in range(3))
        print(sys.argv[1], " ".join(f"{k} {v[1]:.1f} us ({(16 if k == '4096' else 1) * 1048576 / v[1] / 1e3:.0f} GB/s) [{v[0]:.1f}-{v[2]:.1f}]" for k, v in res.items()), flush=True)
    qi.put(0); p.join()

if __name__ == "__main__":
    main()
