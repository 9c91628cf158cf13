"""What remote_gpu.py prints and writes: the table of its (method, size) records, the JSON of
them and the plot of latency against size."""
from __future__ import annotations

import json
import os


def fmt_n(n: int) -> str:
    """1e4, 28e6, 4e8: the paper's way of naming sizes."""
    if n <= 0:
        return "-"
    for exp in range(15, 0, -1):
        if n % 10 ** exp == 0:
            return f"{n // 10 ** exp}e{exp}"
    return str(n)


def fmt_ms(x: float) -> str:
    return f"{x:.0f}" if x >= 100 else f"{x:.1f}" if x >= 10 else f"{x:.2f}" if x >= 1 else f"{x:.3f}"


def print_table(records: list[dict], header: str) -> None:
    print(header)
    cols = f"{'method':<16}{'elements':>9}{'input ms':>11}{'ops client ms':>15}{'ops GPU ms':>12}" \
           f"{'output ms':>11}{'latency ms':>22}{'GB/s':>8}{'runs':>6}"
    print(cols)
    print("-" * len(cols))
    notes = []
    for r in records:
        if r["status"] == "skipped":
            notes.append(f"{r['method']}: skipped: {r['note']}")
            continue
        name = f"{r['method']:<16}{fmt_n(r['elements']):>9}"
        if r["status"] == "failed":
            print(f"{name}   FAILED (see below)")
            notes.append(f"{r['method']} {fmt_n(r['elements'])}: FAILED: {r['note']}")
            continue
        lat = r["latency_ms"]
        print(f"{name}{fmt_ms(r['input_ms']['mean']):>11}{fmt_ms(r['ops_client_ms']['mean']):>15}"
              f"{fmt_ms(r['ops_gpu_ms']['mean']):>12}{fmt_ms(r['output_ms']['mean']):>11}"
              f"{fmt_ms(lat['mean']) + ' ± ' + fmt_ms(lat['std']):>22}{r['gbps']:>8.2f}{r['runs']:>6}")
        if r.get("note"):
            notes.append(f"{r['method']} {fmt_n(r['elements'])}: {r['note']}")
    print("\nLatency = input + ops client + output - ops GPU; GB/s = 3 x elements x 4 B / latency. "
          "Means over the kept round (± its std).")
    for note in notes:
        print(f"  {note}")


def write_json(path: str, config: dict, records: list[dict]) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump({"config": config, "records": records}, f, indent=1)
    os.replace(tmp, path)


def plot(path: str, records: list[dict], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5.5))
    for method in dict.fromkeys(r["method"] for r in records):  # in the order of --methods
        rows = [r for r in records if r["method"] == method and r["status"] == "ok"]
        if rows:
            ax.errorbar([r["elements"] for r in rows], [r["latency_ms"]["mean"] for r in rows],
                        yerr=[r["latency_ms"]["std"] for r in rows], marker="o", capsize=3, label=method)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("buffer size (float32 elements)")
    ax.set_ylabel("transfer latency (ms)")
    ax.set_title(title, fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
