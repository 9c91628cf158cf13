"""What a benchmark reads and prints: sizes on its command line and in its cells, rates,
aligned tables, and its rows written out (--json, --plot)."""
from __future__ import annotations

import argparse
import json
import re


def parse_size(text: str) -> int:
    m = re.fullmatch(r"(\d+)\s*([KMG]?)(?:i?B)?", text.strip(), re.IGNORECASE)
    if not m or int(m[1]) == 0:
        raise argparse.ArgumentTypeError(f"bad size {text!r}: use e.g. 4096, 4K, 64KiB, 1M")
    return int(m[1]) << {"": 0, "K": 10, "M": 20, "G": 30}[m[2].upper()]


def fmt_size(n: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift}{unit}"
    return f"{n}B"


def fmt_bytes(n: float) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):.2f}{unit}"
    return f"{n:.0f}B"


def fmt_rate(per_s: float, unit: str) -> str:
    """A rate with the SI prefix that keeps three significant digits: 420 views/s, not 0.000 Mops."""
    for prefix, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if per_s >= scale:
            return f"{per_s / scale:.3g}{prefix}{unit}"
    return f"{per_s:.3g}{unit}"


def aligned(lines: list[list[str]], left: int) -> str:
    """Rows of cells as columns: the first `left` columns flush left, the others flush right."""
    widths = [max(len(line[i]) for line in lines) for i in range(len(lines[0]))]
    return "\n".join("  ".join(c.ljust(w) if i < left else c.rjust(w) for i, (c, w) in enumerate(zip(line, widths)))
                     for line in lines)


def save_rows(args, rows, plot, title: str) -> None:
    """The rows as a JSON list at --json, and plot(rows, path, title) at --plot, where given."""
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1, default=str)
    if args.plot:
        plot(rows, args.plot, title)


def print_rows(title: str, table: str, legend: str, rows: list[dict], failure) -> list[dict]:
    """Prints the title, the table and its legend, then a line failure(row) for each row that
    failed (not row["ok"]); returns those rows."""
    print(title)
    print(table)
    print(legend)
    failed = [r for r in rows if not r["ok"]]
    for r in failed:
        print(failure(r))
    return failed
