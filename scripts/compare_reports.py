#!/usr/bin/env python3
"""Compares two `moefq eval` report.json files row by row: every number within a relative
tolerance (1e-12 by default; calc_diff, a difference of sums, 1e-9), every other field equal.
Prints the largest relative difference per field; exit status 1 when a field is out of tolerance.
Usage: scripts/compare_reports.py A/report.json B/report.json [--tol 1e-12]"""
import json
import math
import sys


def rel(a, b):
    if isinstance(a, str) or isinstance(b, str):
        return 0.0 if a == b else math.inf
    if a == b:
        return 0.0
    return abs(a - b) / max(abs(a), abs(b))


def main():
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    tol = 1e-12
    if "--tol" in sys.argv:
        tol = float(sys.argv[sys.argv.index("--tol") + 1])
    a, b = (json.load(open(p)) for p in args[:2])
    worst, bad = {}, []
    rows_b = {(r["layer"], r["recipe"]): r for r in b["results"]}
    for ra in a["results"]:
        key = (ra["layer"], ra["recipe"])
        rb = rows_b.get(key)
        if rb is None:
            bad.append(f"{key}: missing in {args[1]}")
            continue
        for field, va in ra.items():
            vb = rb.get(field)
            if isinstance(va, (int, float)) and isinstance(vb, (int, float)) and not isinstance(va, bool):
                d = rel(va, vb)
                worst[field] = max(worst.get(field, 0.0), d)
                limit = 1e-9 if field == "calc_diff" else tol
                if d > limit:
                    bad.append(f"{key} {field}: {va!r} vs {vb!r} (rel {d:.3g})")
            elif va != vb:
                bad.append(f"{key} {field}: {va!r} vs {vb!r}")
    for ca, cb in zip(a["calibration"], b["calibration"]):
        for k in ("dispatch_amax", "combine_amax", "dispatch_rank_amax", "combine_rank_amax"):
            if ca[k] != cb[k]:
                bad.append(f"calibration layer {ca['layer']} {k}: {ca[k]} vs {cb[k]}")
    print(f"{len(a['results'])} rows compared; largest relative difference per field:")
    for f, d in sorted(worst.items()):
        print(f"  {f:32s} {d:.3g}")
    for line in bad[:40]:
        print("DIFFERS:", line)
    print("PASS" if not bad else f"FAIL ({len(bad)} differences)")
    return 0 if not bad else 1


if __name__ == "__main__":
    sys.exit(main())
