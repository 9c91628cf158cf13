"""What bw.py prints: the table of its rows (GPUs of one run merged), the ratios to each baseline,
the route in words, the note on small calls, and the plot."""
from __future__ import annotations

import collections
import os
import sys

from _table import aligned, fmt_rate, fmt_size, print_rows, save_rows

LEGEND = """\
columns:
  MiB/call       bytes one call moves (pages x page size), in MiB
  Gbps           payload, 1e9 bits per second of the timed calls (time.perf_counter() around them)
  %line          Gbps / the rails' link speed, where the provider reports one (EFA, verbs); "-" on
                 loopback, shm and the same-host routes (ipc, cma), which have no line rate
  views/s        views per second (k = 1e3, M = 1e6): pages on paged and views rows, calls on
                 contiguous rows
  <b> Gbps       baseline <b> moving the same bytes per call, measured in this run
  ratio          Gbps / the baseline's Gbps to its left (above 1: torch_p2p is faster)
  x paged        a views row's Gbps / the paged row's of the same op, page size and pages: what a
                 list of views costs against p2p.pages()"""


def merge(per_gpu: list[list[dict]]) -> list[dict]:
    """One row per row index over the GPUs of a multi-GPU run: bandwidths and counts add up
    (the rows ran together); a row is ok only if it is ok on every GPU."""
    if len(per_gpu) == 1:
        return per_gpu[0]
    merged = []
    for rows in zip(*per_gpu):
        row = dict(rows[0], gpus=len(rows), device=",".join(r["device"] for r in rows),
                   peer_device=",".join(r["peer_device"] for r in rows),
                   ok=all(r["ok"] for r in rows), error="; ".join(r["error"] for r in rows if r["error"]) or None)
        for key in ("gbps", "mops", "bytes", "calls", "views", "baseline_gbps", "line_rate_bps"):
            values = [r[key] for r in rows]
            row[key] = sum(values) if None not in values else None
        row["seconds"] = max(r["seconds"] or 0 for r in rows) or None
        if not row["ok"]:
            row.update(gbps=None, mops=None)
        row["ratio"] = row["gbps"] / row["baseline_gbps"] if row["gbps"] and row["baseline_gbps"] else None
        row["baselines"] = {}
        for name in rows[0]["baselines"]:
            values = [r["baselines"].get(name) for r in rows]
            row["baselines"][name] = sum(values) if all(values) else None
        row["ratios"] = {name: row["gbps"] / base if row["gbps"] and base else None
                         for name, base in row["baselines"].items()}
        merged.append(row)
    return merged


def table(rows: list[dict]) -> str:
    head = ["op", "layout", "page", "pages", "rails", "MiB/call", "Gbps", "%line", "views/s"]
    names = list(dict.fromkeys(name for r in rows for name in r["baselines"]))
    host = rows[0]["device"].startswith("cpu")
    for name in names:
        head += [f"{'1-thread memcpy' if name == 'memcpy' and host else name} Gbps", "ratio"]
    paged = {(r["op"], r["page_bytes"], r["pages"], r["rails"]): r["gbps"] for r in rows if r["layout"] == "paged"}
    beside = any(r["layout"] == "views" for r in rows) and paged
    if beside:
        head.append("x paged")
    lines = [head]
    for r in rows:
        cells = [r["op"], r["layout"], fmt_size(r["page_bytes"]), str(r["pages"]), str(r["rails"]),
                 f"{r['pages'] * r['page_bytes'] / (1 << 20):.2f}"]
        if r["ok"]:
            line = r["line_rate_bps"]
            cells += [f"{r['gbps']:.3f}", f"{100 * r['gbps'] * 1e9 / line:.1f}" if line else "-", fmt_rate(r['mops'] * 1e6, "")]
        else:
            cells += ["CORRUPT" if (r["error"] or "").startswith("CORRUPT") else "FAILED", "-", "-"]
        for name in names:
            base, ratio = r["baselines"].get(name), r["ratios"].get(name)
            cells += [f"{base:.3f}" if base else "-", f"{ratio:.2f}" if ratio else "-"]
        if beside:
            ref = paged.get((r["op"], r["page_bytes"], r["pages"], r["rails"]))
            cells.append(f"{r['gbps'] / ref:.2f}" if r["layout"] == "views" and r["gbps"] and ref else "-")
        lines.append(cells)
    return aligned(lines, 2)


def summary(args, rows: list[dict]) -> str:
    r = rows[0]
    gpus = f", {r['gpus']} process pairs summed" if r["gpus"] > 1 else ""
    return (f"# torch_p2p bw: {r['device']} -> peer {r['peer_device']}, {route_long(r)}{gpus}, "
            f"window {args.window}{', prepared calls' if args.prepared else ''}, {args.duration:g} s per row")


def copy_threads() -> int:
    """The cma route's copy threads in this process (csrc/core/copies.cpp names them)."""
    names = []
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/comm") as f:
                names.append(f.read().strip())
        except FileNotFoundError:  # a thread that ended meanwhile
            pass
    return names.count("p2p-copy")


def _threads(n: int) -> str:
    return f"{n} copy thread{'s' * (n != 1)}" if n else "copied by the worker thread"


def route_short(facts: dict) -> str:
    """The route in a row's live line: what carries the bytes."""
    if facts["route"] == "ipc":
        return "ipc"
    if facts["route"] == "cma":
        return f"cma, {_threads(facts['copy_threads'])}"
    rails = facts["rails"]
    return f"{facts['provider'].split(';')[0]} {facts['route']}, {rails} rail{'s' * (rails > 1)}"


def route_long(facts: dict) -> str:
    """The route in a title: the same-host routes name no provider, the fabric names no copy threads."""
    if facts["route"] == "ipc":
        return "route ipc (CUDA IPC: the GPUs' copy engines, no fabric)"
    if facts["route"] == "cma":
        return f"route cma (host memory copied between the processes, {_threads(facts['copy_threads'])}; no fabric)"
    how = "the NIC reads and writes the memory" if facts["route"] == "direct" else "through pinned host slots"
    return f"route {facts['route']} over {facts['provider']} [{facts['domains']}] ({how})"


def plot(rows: list[dict], path: str, title: str) -> None:
    """Gbps against page size: one panel per pages-per-call, one line per rails/layout/op,
    the baseline dotted."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    counts = sorted({r["pages"] for r in rows})
    fig, axes = plt.subplots(1, len(counts), figsize=(6 * len(counts), 4.5), squeeze=False, sharey=True)
    for ax, pages in zip(axes[0], counts):
        lines: dict[tuple, dict] = collections.defaultdict(dict)  # (name, rails, style) -> {x: y}
        for r in rows:
            if r["pages"] != pages:
                continue
            if r["gbps"] is not None:
                lines[(f"{r['op']} {r['layout']}", r["rails"], "-")][r["page_bytes"]] = r["gbps"]
            for name, base in r["baselines"].items():
                if base:
                    lines[(f"{r['op']} {r['layout']} {name}", r["rails"], ":")][r["page_bytes"]] = base
        for (name, rails, style), points in sorted(lines.items()):
            xs, ys = zip(*sorted(points.items()))
            ax.plot(xs, ys, style, marker="o", label=f"{name}, {rails} rail{'s' * (rails > 1)}")
        sizes = sorted({r["page_bytes"] for r in rows})
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, [fmt_size(x) for x in sizes])
        ax.set(title=f"{pages} pages per call", xlabel="page size", ylabel="Gbps")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=8)
    fig.savefig(path, dpi=120, bbox_inches="tight")


SMALL_CALL_BYTES = 1 << 20  # calls up to this size can be bound by the engine's cost per call


def small_call_note(args, rows: list[dict]) -> str | None:
    """Why rows of small calls fall far below the memcpy baseline: each call pays the engine's
    fixed cost (the Python call and its checks; unless the calling thread copies it, a mapped
    host call of at most TORCH_P2P_CMA_INLINE bytes, the hand-off to the worker thread and the
    future's completion), which a memcpy loop does not, and with few bytes a call that cost outweighs the copy. Says
    so with the row's own numbers: the time per call against the baseline's time for its bytes."""
    slow = [r for r in rows if r["ok"] and r["pages"] * r["page_bytes"] <= SMALL_CALL_BYTES
            and r["baselines"].get("memcpy") and r["ratios"].get("memcpy") is not None
            and r["ratios"]["memcpy"] < 0.5]
    if not slow:
        return None
    worst = min(slow, key=lambda r: r["ratios"]["memcpy"])
    call_bytes = worst["pages"] * worst["page_bytes"]
    per_call_us = 1e6 * worst["seconds"] / worst["calls"]
    copy_us = 1e6 * call_bytes * 8 / (worst["baselines"]["memcpy"] * 1e9)
    return (f"note: {len(slow)} row(s) of at most {fmt_size(SMALL_CALL_BYTES)} a call are under 0.5 x memcpy, e.g. "
            f"{worst['op']} {worst['layout']} {fmt_size(worst['page_bytes'])} x{worst['pages']}: "
            f"{per_call_us:.1f} us a call ({args.window} in flight) where memcpy copies its "
            f"{fmt_size(call_bytes)} in {copy_us:.1f} us. Such calls pay the engine's fixed cost per call (the "
            f"Python call and its checks, and where the calling thread does not copy them, the hand-off to the "
            f"worker thread and the future's completion), which a memcpy loop does not: their ratio measures that cost, not the copy (docs/performance.md).")


def report(args, rows: list[dict]) -> int:
    """Table on stdout, then --json and --plot; the exit status: 1 if a row failed."""
    if not rows:
        print("no rows: every size x pages combination is above --max-bytes", file=sys.stderr)
        return 1
    title = summary(args, rows)
    failed = print_rows(title, table(rows), LEGEND, rows, lambda r: f"! {r['op']} {r['layout']} "
                        f"{fmt_size(r['page_bytes'])} x{r['pages']}, {r['rails']} rails: {r['error']}")
    small = small_call_note(args, rows)
    if small:
        print(small)
    for r in rows:
        if r.get("latency_p50_us") is not None:
            print(f"latency {r['op']} {r['layout']} {fmt_size(r['page_bytes'])} x{r['pages']}: "
                  f"median {r['latency_p50_us']:.1f} us, p99 {r['latency_p99_us']:.1f} us (call to completion)")
    save_rows(args, rows, plot, title)
    return 1 if failed else 0
