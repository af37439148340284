#!/usr/bin/env python3
"""Where one MoE layer call's time goes, kernel by kernel, from an ncu CSV log
(`ncu --csv --log-file F --metrics gpu__time_duration.sum moefq bench moe ...`).

Prints the kernels in launch order from the one before the first dispatch_kernel (the staging of
x), up to 40 (`bench moe` runs the layer eagerly once, then in graphs with the shared expert and
the other timed cases), each with its grid, block and duration; then every kernel name's count
and median duration over the whole log. ncu runs one kernel at a time: no overlap between kernels.
Usage: scripts/ncu_layer_table.py ncu.csv"""
import csv
import statistics
import sys


def read(path):
    """[(id, name, grid, block, microseconds)] in launch order."""
    with open(path, newline="") as f:
        lines = [ln for ln in f if ln.startswith('"')]
    rows = list(csv.DictReader(lines))
    out = []
    for r in rows:
        if r.get("Metric Name") != "gpu__time_duration.sum":
            continue
        v = float(r["Metric Value"].replace(",", ""))
        unit = r.get("Metric Unit", "")
        us = v / 1e3 if unit in ("nsecond", "ns") else v * 1e3 if unit in ("msecond", "ms") else v
        out.append((int(r["ID"]), r["Kernel Name"], r.get("Grid Size", ""), r.get("Block Size", ""), us))
    return sorted(out)


def from_first_layer(kernels, count=40):
    """`count` kernels from the one before the first dispatch_kernel (the staging of x)."""
    starts = [i for i, k in enumerate(kernels) if k[1].startswith("dispatch_kernel")]
    begin = max(0, starts[0] - 1) if starts else 0
    return kernels[begin:begin + count]


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    kernels = read(sys.argv[1])
    if not kernels:
        sys.exit("no gpu__time_duration.sum rows in " + sys.argv[1])
    print("%-4s %-44s %-16s %-12s %10s" % ("id", "kernel", "grid", "block", "us"))
    for k in from_first_layer(kernels):
        print("%-4d %-44s %-16s %-12s %10.1f" % (k[0], k[1][:44], k[2], k[3], k[4]))
    print()
    by = {}
    for k in kernels:
        by.setdefault(k[1], []).append(k[4])
    print("%-60s %6s %12s" % ("kernel (whole log)", "count", "median_us"))
    for name, ts in sorted(by.items(), key=lambda x: -statistics.median(x[1]) * len(x[1])):
        print("%-60s %6d %12.1f" % (name[:60], len(ts), statistics.median(ts)))


if __name__ == "__main__":
    main()
