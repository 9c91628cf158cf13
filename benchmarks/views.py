"""views.py: the host's cost of a write_slices / read_slices call per view pair, for each form a
call's pages can take, and the cost of building remote views, each beside p2p.pages.

    python benchmarks/views.py                      # host memory (a GPU's memory if there is one)
    python benchmarks/views.py --pages 256 4096 --page-bytes 4K 64K --json views.json

No data moves and no peer is needed: a call's parse is what engine.prepare_write /
prepare_read do (take the arguments apart, check them, decompose them into pages or runs: all
that write_slices does before the progress thread has the call), measured against a second
region of this engine standing in for a peer's (its RemoteTensor). Each call moves `pages`
random pages of a buffer of 2 x `pages` pages to random pages of another, as a KV cache's block
tables do. Forms of the call:

  pages      p2p.pages(buf, mine), p2p.pages(remote, theirs): the reference
  views      [buf[i] for i in mine], [remote[j] for j in theirs]: pairs of one storage and one
             region, shape, strides and dtype are taken as pages natively
  mixed      the same, every other local page a view of a second buffer: no two neighbouring
             pairs share a storage, so every pair takes the view-by-view path

Building (per view; the lists of the views form, made once per call by the user):
  remote[j]       one RemoteTensor view per page
  remote[j][:n]   a view of a view (half a page)
  remote[j].view  a page reshaped (rows of 64 bytes)
  buf[i]          torch's own view of a local page, for scale
  p2p.pages       p2p.pages(remote, theirs) per call, divided by its pages

With --pybind11 (compiles a small extension with torch.utils.cpp_extension, about a minute),
what pybind11's own argument handling costs for the views form's two lists, doing nothing
else: the hand parse in csrc/bindings.cpp stands only while the whole parse of a call costs less
than these casters alone:
  pybind11 tensors   a std::vector<at::Tensor> argument of the local views
  pybind11 remotes   a std::vector<py::object> argument of the RemoteTensors, each one's view
                     attribute read (what a RemoteView caster would have to do first)

Columns: us/call, us per view pair (per view when building), and x pages: the form's cost over
p2p.pages' in the same run. Each number is the best of --repeat rounds of --seconds each.
Target: the views form's parse at most 0.15 us per view pair.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings

warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
import torch  # noqa: E402

try:
    import torch_p2p as p2p
except ImportError:  # run from a checkout without installing: use the in-place build
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import torch_p2p as p2p
from _table import aligned, parse_size

TARGET_US = 0.15  # per view pair, the views form's parse


def best_us(fn, seconds: float, repeat: int) -> float:
    """Microseconds per call of fn(): the best of `repeat` rounds of about `seconds` each."""
    fn()
    n, t = 1, 0.0
    while t < seconds / 10:  # calls per round: a tenth of a round, then scaled up
        n *= 2
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        t = time.perf_counter() - t0
    n = max(1, int(n * seconds / t / 10 * 10))
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - t0) / n)
    return best * 1e6


def pybind11_casters():
    """A module whose two functions take the views form's lists through pybind11's casters."""
    from torch.utils.cpp_extension import load_inline

    source = """
#include <torch/extension.h>
int64_t tensors(const std::vector<at::Tensor>& views) { return static_cast<int64_t>(views.size()); }
int64_t objects(const std::vector<py::object>& remotes) {
  int64_t n = 0;
  for (const auto& r : remotes) n += r.attr("_v").ptr() != nullptr;
  return n;
}
"""
    return load_inline("views_pybind11_casters", cpp_sources=source, functions=["tensors", "objects"],
                       extra_cflags=["-O2"])


def measure(engine: p2p.Engine, device: torch.device, pages: int, page_bytes: int, args) -> list[dict]:
    total = 2 * pages
    src = torch.zeros(total, page_bytes, dtype=torch.uint8, device=device)
    other = torch.zeros(total, page_bytes, dtype=torch.uint8, device=device)
    dst = torch.zeros(total, page_bytes, dtype=torch.uint8, device=device)
    regions = [engine.register(t) for t in (src, other, dst)]
    remote = regions[2].remote
    g = torch.Generator().manual_seed(pages * 7919 + page_bytes)
    mine = torch.randperm(total, generator=g)[:pages].tolist()
    theirs = torch.randperm(total, generator=g)[:pages].tolist()
    forms = {
        "pages": ([p2p.pages(src, mine)], [p2p.pages(remote, theirs)]),
        "views": ([src[i] for i in mine], [remote[j] for j in theirs]),
        "mixed": ([(src if k % 2 else other)[i] for k, i in enumerate(mine)], [remote[j] for j in theirs]),
    }
    rows = []
    for op in ("write", "read"):
        prepare = engine.prepare_write if op == "write" else engine.prepare_read
        for form, (local, remotes) in forms.items():
            us = best_us(lambda: prepare(local, remotes), args.seconds, args.repeat)
            rows.append(dict(what="parse", op=op, form=form, pages=pages, page_bytes=page_bytes,
                             us_per_call=us, us_per_view=us / pages))
    if args.pybind11:
        casters = pybind11_casters()
        local, remotes = forms["views"]
        for form, call in (("pybind11 tensors", lambda: casters.tensors(local)),
                           ("pybind11 remotes", lambda: casters.objects(remotes))):
            us = best_us(call, args.seconds, args.repeat)
            rows.append(dict(what="parse", op="write", form=form, pages=pages, page_bytes=page_bytes,
                             us_per_call=us, us_per_view=us / pages))
    half, rows64 = page_bytes // 2, page_bytes // 64
    builds = {
        "remote[j]": lambda: [remote[j] for j in theirs],
        "remote[j][:n]": lambda: [remote[j][:half] for j in theirs],
        "remote[j].view": lambda: [remote[j].view(rows64, 64) for j in theirs],
        "buf[i]": lambda: [src[i] for i in mine],
        "p2p.pages": lambda: p2p.pages(remote, theirs),
    }
    if not hasattr(p2p.RemoteTensor, "view"):  # a build from before RemoteTensor.view
        del builds["remote[j].view"]
    for form, build in builds.items():
        us = best_us(build, args.seconds, args.repeat)
        rows.append(dict(what="build", op="-", form=form, pages=pages, page_bytes=page_bytes,
                         us_per_call=us, us_per_view=us / pages))
    for r in regions:
        r.close()
    for r in rows:  # beside p2p.pages of the same run
        ref = next(x for x in rows if x["what"] == r["what"] and x["op"] == r["op"] and x["pages"] == r["pages"]
                   and x["page_bytes"] == r["page_bytes"] and x["form"] in ("pages", "p2p.pages"))
        r["x_pages"] = r["us_per_call"] / ref["us_per_call"]
    return rows


def table(rows: list[dict]) -> str:
    head = ["what", "op", "form", "pages", "page", "us/call", "us/view", "x pages"]
    lines = [head] + [[r["what"], r["op"], r["form"], str(r["pages"]), f"{r['page_bytes'] >> 10}KiB",
                       f"{r['us_per_call']:.2f}", f"{r['us_per_view']:.3f}", f"{r['x_pages']:.1f}"] for r in rows]
    return aligned(lines, 3)


def main(argv=None) -> int:
    default_device = "cuda:0" if torch.cuda.is_available() and p2p._C.with_cuda else "cpu"
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default=default_device, help=f"where the buffers live (default {default_device})")
    ap.add_argument("--provider", default=None, help="the engine's provider (default: the engine's choice)")
    ap.add_argument("--pages", nargs="+", type=int, default=[256], metavar="N", help="view pairs per call")
    ap.add_argument("--page-bytes", nargs="+", type=parse_size, default=[4 << 10, 64 << 10], metavar="SIZE")
    ap.add_argument("--seconds", type=float, default=0.2, help="length of one round (default 0.2)")
    ap.add_argument("--repeat", type=int, default=5, help="rounds per number; the best counts (default 5)")
    ap.add_argument("--pybind11", action="store_true", help="also time pybind11's casters (see above)")
    ap.add_argument("--json", metavar="PATH", help="write the rows as a JSON list")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    rows = []
    with p2p.Engine(device, provider=args.provider) as engine:
        print(f"# {engine.provider}, {device}, torch {torch.__version__}, {os.cpu_count()} cores", flush=True)
        for pages in args.pages:
            for page_bytes in args.page_bytes:
                rows += measure(engine, device, pages, page_bytes, args)
    print(table(rows))
    views = [r["us_per_view"] for r in rows if r["what"] == "parse" and r["form"] == "views"]
    print(f"views form's parse: at most {max(views):.3f} us per view pair (target {TARGET_US} us): "
          + ("ok" if max(views) <= TARGET_US else "ABOVE TARGET"))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
