"""us per steady 256 x 4 KiB IPC write (window 8): the caller on torch's default (legacy) stream
against a side stream of its own (torch.cuda.Stream()), plain and prepared, three rounds
alternating: python side.py"""
import sys, torch, torch.multiprocessing as mp
import torch_p2p as p2p
sys.path.insert(0, __file__.rsplit("/", 1)[0])
from pprof import peer, loop, PAGE, NPAGES

def main():
    ctx = mp.get_context("spawn")
    qo, qi = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=peer, args=(qo, qi, "cuda:0")); p.start()
    remote = p2p.RemoteTensor.from_bytes(qo.get())
    side = torch.cuda.Stream("cuda:0")
    with p2p.Engine("cuda:0") as e:
        src = torch.randn(NPAGES, PAGE // 4, device="cuda:0").view(torch.uint8).view(NPAGES, PAGE)
        e.register(src)
        torch.cuda.synchronize()
        ls = torch.randperm(NPAGES)[:256]; rs = torch.randperm(NPAGES)[:256]
        a, b = p2p.pages(src, ls), p2p.pages(remote, rs)
        plain = lambda: e.write_slices(a, b)
        prepared = e.prepare_write(a, b).run
        loop(plain, 0.5)
        for rnd in range(3):
            for sname, stream in (("default", torch.cuda.default_stream("cuda:0")), ("side", side)):
                with torch.cuda.stream(stream):
                    r = {k: sorted(loop(m, 1.0) for _ in range(3))[1] for k, m in (("plain", plain), ("prepared", prepared))}
                print(f"round {rnd + 1} {sname:8s} stream {stream.cuda_stream:#x}: plain {r['plain']:.1f} us "
                      f"({1048.576 / r['plain']:.0f} GB/s), prepared {r['prepared']:.1f} us ({1048.576 / r['prepared']:.0f} GB/s)", flush=True)
    qi.put(0); p.join()

if __name__ == "__main__":
    main()
