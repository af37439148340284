"""The outputs of `moefq compare`: the table on stdout, report.csv and report.html (one
self-contained page: inline CSS and SVG, no script, font, image or link), from the report dict
run_compare returns (docs/compare.md)."""

import html
import math

_COLOURS = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22",
            "#17becf", "#393b79", "#637939", "#843c39", "#7b4173"]


def _g(v, digits=4):
    if v is None:
        return "-"
    if isinstance(v, str):
        return v
    if not math.isfinite(v):
        return "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf")
    if v == 0:
        return "0"
    return f"{v:.{digits}g}"


def _pm(d, digits=4, scale=1.0):
    return f"{_g(d['value' if 'value' in d else 'fraction'] * scale, digits)}±{_g(d['error'] * scale, 2)}"


def _max_rel_l2(e):
    b = e.get("block_rel_l2")
    if not b:
        return None
    return max(b.values())


# ---------------------------------------------------------------------------------------------
# The table


def _rows(report):
    rows = []
    for e in report["runs"]:
        rows.append([e["name"], e["dispatch_format"] or "-", e["combine_format"] or "-",
                     f"{_g(e['kl']['mean'])}±{_g(e['kl']['error'], 2)}", _g(e["kl"]["p99"]), _g(e["kl"]["max"]),
                     f"{100 * e['same_top1']['fraction']:.2f}±{100 * e['same_top1']['error']:.2f}",
                     f"{e['ppl_ratio']['value']:.5f}±{e['ppl_ratio']['error']:.5f}", _g(_max_rel_l2(e), 3),
                     f"{e['wire_bytes_per_token']:.0f}", f"{100 * e['wire_saving_vs_bf16']:.1f}%"])
    return rows


def _format_table(head, rows, right):
    w = [max(len(str(r[i])) for r in [head] + rows) for i in range(len(head))]
    def line(r):
        return " ".join((str(c).rjust(w[i]) if right[i] else str(c).ljust(w[i])) for i, c in enumerate(r)).rstrip()

    out = [line(head), "-" * len(line(head))]
    out += [line(r) for r in rows]
    return out


def table_text(report):
    """What `moefq compare` prints on stdout: the runs (best first by mean KL after the both-off
    run), a legend, the sensitivity ranking and the pick."""
    c = report["config"]
    o = report["original"]["ppl"]
    lines = [f"moefq compare: {c['model']} ({c['model_class']}), {len(c['moe_layers'])} MoE layers, {c['device']} "
             f"{c['dtype']}",
             f"tokens: {c['chunks']} chunks of {c['ctx']}, {c['scored_tokens']} scored (the second half of each "
             "chunk); "
             f"{c['calib_chunks']} calibration chunks",
             f"original model: perplexity {_g(o['value'], 6)} ± {_g(o['error'], 2)}", ""]
    head = ["run", "disp", "comb", "kl_mean", "kl_p99", "kl_max", "top1_%", "ppl_ratio", "blk_l2", "B/token",
            "saving"]
    lines += _format_table(head, _rows(report), [False, False, False] + [True] * 8)
    lines += ["",
              "kl_*:      KL(original || run) per scored token: mean ± its standard error, 99th percentile, max",
              "top1_%:    how often the run's most likely token is the original's (± binomial error)",
              "ppl_ratio: PPL(run) / PPL(original), ± an error that accounts for their correlation",
              "blk_l2:    the worst MoE block's output relative L2 against the original model's (errors compound)",
              "B/token:   dispatch + combine bytes per token per destination rank (mean over MoE layers); saving: "
              "vs bf16",
              "none:      moefq's MoE with both quantizers off: the kernel's summation order alone"]
    for recipe, rows in report.get("sensitivity", {}).items():
        top = rows[:10]
        lines += ["", f"sensitivity to {recipe} (one layer at a time, most sensitive first):"]
        lines += ["  " + s for s in _format_table(
            ["rank", "layer", "kl_mean", "top1_%", "ppl_ratio"],
            [[x["rank"], x["layer"], _g(x["kl_mean"]), f"{100 * x['same_top1']:.2f}", f"{x['ppl_ratio']:.5f}"]
             for x in top], [True] * 5)]
        if len(rows) > len(top):
            lines.append(f"  ... {len(rows) - len(top)} more layers in the report")
    if report.get("cheapest_recipe_within_budget") is not None or report.get("pick"):
        lines.append("")
    if c.get("max_kl") is not None:
        ch = report.get("cheapest_recipe_within_budget")
        lines.append(f"uniform: {ch} is the cheapest single recipe within mean KL <= {_g(c['max_kl'])}" if ch else
                     f"uniform: no single recipe is within mean KL <= {_g(c['max_kl'])}")
    p = report.get("pick")
    if p:
        v = next((e for e in report["runs"] if e["name"] == p["verified_run"]), None)
        kl = f"{_g(v['kl']['mean'])}" if v else "?"
        lines.append(f"answer: {p['description']}: mean KL {kl} (verified by a full run), "
                     f"{v['wire_bytes_per_token']:.0f} B/token" if v else f"answer: {p['description']}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# CSV

_CSV_HEAD = ["kind", "name", "recipe", "layer", "dispatch_format", "combine_format", "kl_mean", "kl_error", "kl_p50",
             "kl_p90", "kl_p99", "kl_p99_9", "kl_max", "same_top1", "same_top1_error", "ppl", "ppl_error", "ppl_ref",
             "ln_ppl_ratio", "ln_ppl_ratio_error", "ppl_ratio", "ppl_ratio_error", "ppl_diff", "ppl_diff_error",
             "dispatch_wire_bytes_per_token", "combine_wire_bytes_per_token", "wire_bytes_per_token",
             "wire_saving_vs_bf16", "max_block_rel_l2", "tokens", "seconds"]


def _full(v):
    if v is None:
        return ""
    if isinstance(v, float):
        return _g(v, 17) if not math.isfinite(v) else f"{v:.17g}"
    return str(v)


def csv_text(report):
    """One line per run (off, each recipe, the verified pick) and per one-layer sensitivity run."""
    lines = [",".join(_CSV_HEAD)]
    for e in report["runs"]:
        k = e["kl"]
        vals = [e["kind"], e["name"], e["recipe"], e["layer"], e["dispatch_format"], e["combine_format"], k["mean"],
                k["error"], k["p50"], k["p90"], k["p99"], k["p99_9"], k["max"], e["same_top1"]["fraction"],
                e["same_top1"]["error"], e["ppl"]["value"], e["ppl"]["error"], e["ppl_ref"]["value"],
                e["ln_ppl_ratio"]["value"], e["ln_ppl_ratio"]["error"], e["ppl_ratio"]["value"],
                e["ppl_ratio"]["error"], e["ppl_diff"]["value"], e["ppl_diff"]["error"],
                e["dispatch_wire_bytes_per_token"], e["combine_wire_bytes_per_token"], e["wire_bytes_per_token"],
                e["wire_saving_vs_bf16"], _max_rel_l2(e), e["tokens"], e["seconds"]]
        lines.append(",".join(_csv_cell(v) for v in vals))
    for recipe, rows in report.get("sensitivity", {}).items():
        for x in rows:
            vals = ["sensitivity", f"{recipe}@{x['layer']}", recipe, x["layer"], "", "", x["kl_mean"], x["kl_error"],
                    "", "", x["kl_p99"], "", "", x["same_top1"], "", "", "", "", "", "", x["ppl_ratio"], "", "", "",
                    "", "", "", "", x["block_rel_l2"], "", ""]
            lines.append(",".join(_csv_cell(v) for v in vals))
    return "\n".join(lines) + "\n"


def _csv_cell(v):
    s = _full(v)
    return '"' + s.replace('"', '""') + '"' if ("," in s or '"' in s) else s


# ---------------------------------------------------------------------------------------------
# HTML

# The look of moefq eval's report.html, one rule per line.
_STYLE = "\n".join([
    'body{font-family:sans-serif;margin:24px;color:#222;max-width:1100px}',
    'h1{font-size:22px;margin-bottom:4px}',
    'h2{font-size:17px;margin-top:28px;border-bottom:1px solid #ddd}',
    'dl.meta{display:grid;grid-template-columns:max-content auto;gap:2px 16px;font-size:13px}',
    'dl.meta dt{font-weight:bold}',
    'dl.meta dd{margin:0}',
    'table{border-collapse:collapse;font-size:12px}',
    'th,td{padding:3px 8px;border-bottom:1px solid #eee}',
    'th{background:#f4f4f4;text-align:left}',
    'td.n{text-align:right;font-variant-numeric:tabular-nums}',
    'svg.chart{display:block;margin:8px 0;background:#fff}',
    '.ct{font-size:14px;font-weight:bold;fill:#222}',
    '.tick{font-size:11px;fill:#555}',
    '.lbl{font-size:12px;fill:#222}',
    '.grid{stroke:#e4e4e4;stroke-width:1}',
    '.frame{fill:none;stroke:#bbb}',
    '.budget{stroke:#222;stroke-width:1.5;stroke-dasharray:5 4}',
    '.front{fill:none;stroke:#999;stroke-width:1.5;stroke-dasharray:2 3}',
    'p.note{font-size:13px;color:#444}',
    'div.scroll{overflow-x:auto}',
])


def _esc(s):
    return html.escape(str(s), quote=True)


def _px(v):
    return f"{v:.1f}"


class _LogAxis:
    """A log10 axis over the positive finite values (whole decades)."""

    def __init__(self, values):
        v = [x for x in values if x is not None and math.isfinite(x) and x > 0]
        if not v:
            v = [1e-6, 1.0]
        self.lo = math.floor(math.log10(min(v)))
        self.hi = math.ceil(math.log10(max(v)))
        if self.hi <= self.lo:
            self.hi = self.lo + 1

    def frac(self, x):
        return (math.log10(x) - self.lo) / (self.hi - self.lo)

    def decades(self):
        return range(self.lo, self.hi + 1)


def _svg_open(w, h, title):
    return (f'<svg class="chart" role="img" xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" '
            f'viewBox="0 0 {w} {h}">\n<title>{_esc(title)}</title>\n'
            f'<text x="70" y="20" class="ct">{_esc(title)}</text>\n')


def pareto_svg(report):
    """Mean KL (log axis) against wire bytes per token, one point per run (not the one-layer runs),
    the Pareto front (no run both cheaper and better) dotted, the budget dashed."""
    pts = [(e["wire_bytes_per_token"], e["kl"]["mean"], e["name"]) for e in report["runs"]]
    budget = report["config"].get("max_kl")
    ax = _LogAxis([p[1] for p in pts] + ([budget] if budget else []))
    W, H, left, right, top, bottom = 920, 420, 70, 40, 34, 370
    xs = [p[0] for p in pts]
    x0, x1 = min(xs) * 0.95, max(xs) * 1.05
    if x1 <= x0:
        x0, x1 = x0 - 1, x1 + 1
    X = lambda v: left + (v - x0) / (x1 - x0) * (W - left - right)
    Y = lambda v: bottom - ax.frac(v) * (bottom - top)
    s = _svg_open(W, H, "mean KL divergence against wire bytes per token")
    for d in ax.decades():
        y = Y(10.0 ** d)
        s += f'<line x1="{left}" y1="{_px(y)}" x2="{W - right}" y2="{_px(y)}" class="grid"/>\n'
        s += f'<text x="{left - 6}" y="{_px(y + 4)}" class="tick" text-anchor="end">1e{d}</text>\n'
    for i in range(6):
        v = x0 + (x1 - x0) * i / 5
        s += f'<text x="{_px(X(v))}" y="{bottom + 18}" class="tick" text-anchor="middle">{v:.0f}</text>\n'
    s += (f'<text x="{_px((left + W - right) / 2)}" y="{bottom + 40}" class="tick" text-anchor="middle">'
          'dispatch + combine bytes per token per destination rank (mean over MoE layers)</text>\n')
    s += f'<rect x="{left}" y="{top}" width="{W - left - right}" height="{bottom - top}" class="frame"/>\n'
    good = [p for p in pts if math.isfinite(p[1]) and p[1] > 0]
    front, best = [], math.inf
    for p in sorted(good, key=lambda p: (p[0], p[1])):
        if p[1] < best:
            front.append(p)
            best = p[1]
    if len(front) > 1:
        s += '<polyline class="front" points="' + " ".join(f"{_px(X(b))},{_px(Y(k))}" for b, k, _ in front) + '"/>\n'
    if budget:
        y = Y(budget)
        s += f'<line x1="{left}" y1="{_px(y)}" x2="{W - right}" y2="{_px(y)}" class="budget"/>\n'
        s += f'<text x="{W - right - 4}" y="{_px(y - 4)}" class="tick" text-anchor="end">budget {_g(budget)}</text>\n'
    for i, (b, k, name) in enumerate(good):
        c = _COLOURS[i % len(_COLOURS)]
        s += (f'<circle cx="{_px(X(b))}" cy="{_px(Y(k))}" r="4" fill="{c}"><title>{_esc(name)}: KL {_g(k)}, {b:.0f} '
              f'B/token</title></circle>\n'
              f'<text x="{_px(X(b) + 6)}" y="{_px(Y(k) - 5)}" class="lbl">{_esc(name)}</text>\n')
    zero = [name for b, k, name in pts if not (math.isfinite(k) and k > 0)]
    s += "</svg>\n"
    if zero:
        s += f'<p class="note">Not drawn (KL 0 or not finite, no place on a log axis): {_esc(", ".join(zero))}.</p>\n'
    return s


def sensitivity_svg(recipe, rows, layers):
    """Bars of each layer's mean KL (log axis) when it alone is quantized with `recipe`."""
    by = {x["layer"]: x["kl_mean"] for x in rows}
    vals = [by.get(l) for l in layers]
    ax = _LogAxis(vals)
    n = len(layers)
    W = max(640, min(1100, 70 + 40 + n * 22))
    H, left, right, top, bottom = 320, 70, 40, 34, 270
    bw = (W - left - right) / max(n, 1)
    Y = lambda v: bottom - ax.frac(v) * (bottom - top)
    s = _svg_open(W, H, f"mean KL with only one layer quantized: {recipe}")
    for d in ax.decades():
        y = Y(10.0 ** d)
        s += f'<line x1="{left}" y1="{_px(y)}" x2="{W - right}" y2="{_px(y)}" class="grid"/>\n'
        s += f'<text x="{left - 6}" y="{_px(y + 4)}" class="tick" text-anchor="end">1e{d}</text>\n'
    step = max(1, n // 30)
    for i, l in enumerate(layers):
        v = by.get(l)
        x = left + i * bw
        if v is not None and math.isfinite(v) and v > 0:
            y = Y(v)
            s += (f'<rect x="{_px(x + bw * 0.15)}" y="{_px(y)}" width="{_px(bw * 0.7)}" height="{_px(bottom - y)}" '
                  f'fill="#1f77b4"><title>layer {l}: KL {_g(v)}</title></rect>\n')
        if i % step == 0:
            s += f'<text x="{_px(x + bw / 2)}" y="{bottom + 16}" class="tick" text-anchor="middle">{l}</text>\n'
    s += f'<text x="{_px((left + W - right) / 2)}" y="{bottom + 36}" class="tick" text-anchor="middle">layer</text>\n'
    s += f'<rect x="{left}" y="{top}" width="{W - left - right}" height="{bottom - top}" class="frame"/>\n</svg>\n'
    return s


def kl_distribution_svg(report):
    """The per-token KL distribution of each run: the fraction of scored tokens per bin of log10 KL,
    one line per run (KL at or below the first edge, 0 included, counts in the first bin)."""
    runs = [e for e in report["runs"] if e.get("kl_histogram")]
    edges = runs[0]["kl_histogram"]["log10_edges"]
    W, H, left, right, top, bottom = 920, 380, 70, 190, 34, 330
    lo, hi = edges[0], edges[-1]
    fr = [[c / max(sum(e["kl_histogram"]["counts"]), 1) for c in e["kl_histogram"]["counts"]] for e in runs]
    ymax = max([max(f) for f in fr] + [1e-9])
    X = lambda v: left + (v - lo) / (hi - lo) * (W - left - right)
    Y = lambda v: bottom - v / ymax * (bottom - top)
    s = _svg_open(W, H, "per-token KL divergence: fraction of the scored tokens per bin")
    for d in range(int(math.ceil(lo)), int(math.floor(hi)) + 1):
        s += f'<text x="{_px(X(d))}" y="{bottom + 18}" class="tick" text-anchor="middle">1e{d}</text>\n'
        s += f'<line x1="{_px(X(d))}" y1="{top}" x2="{_px(X(d))}" y2="{bottom}" class="grid"/>\n'
    for i in range(5):
        v = ymax * i / 4
        s += f'<text x="{left - 6}" y="{_px(Y(v) + 4)}" class="tick" text-anchor="end">{v:.2f}</text>\n'
    s += (f'<text x="{_px((left + W - right) / 2)}" y="{bottom + 40}" class="tick" text-anchor="middle">KL per token '
          f'(log scale; the first bin holds everything at or below 1e{lo:.0f})</text>\n')
    s += f'<rect x="{left}" y="{top}" width="{W - left - right}" height="{bottom - top}" class="frame"/>\n'
    for i, (e, f) in enumerate(zip(runs, fr)):
        c = _COLOURS[i % len(_COLOURS)]
        mids = [(edges[j] + edges[j + 1]) / 2 for j in range(len(f))]
        pts = " ".join(f"{_px(X(m))},{_px(Y(v))}" for m, v in zip(mids, f))
        s += (f'<polyline fill="none" stroke="{c}" stroke-width="2" points="{pts}">'
              f'<title>{_esc(e["name"])}</title></polyline>\n')
        ly = top + 8 + 16 * i
        s += (f'<line x1="{W - right + 14}" y1="{ly}" x2="{W - right + 40}" y2="{ly}" stroke="{c}" stroke-width="2"/>\n'
              f'<text x="{W - right + 46}" y="{ly + 4}" class="lbl">{_esc(e["name"])}</text>\n')
    return s + "</svg>\n"


def _html_table(head, rows):
    s = '<div class="scroll"><table><tr>' + "".join(f"<th>{_esc(h)}</th>" for h in head) + "</tr>\n"
    for r in rows:
        s += "<tr>" + "".join(f'<td class="n">{_esc(c)}</td>' if i >= 3 else f"<td>{_esc(c)}</td>"
                              for i, c in enumerate(r)) + "</tr>\n"
    return s + "</table></div>\n"


def html_text(report):
    c, o = report["config"], report["original"]["ppl"]
    title = f"moefq compare: {c['model']}"
    s = (f'<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n<title>{_esc(title)}</title>\n'
         f"<style>\n{_STYLE}\n</style>\n</head>\n<body>\n<h1>{_esc(title)}</h1>\n")
    meta = [("model", f"{c['model']} ({c['model_class']})"), ("device, dtype", f"{c['device']}, {c['dtype']}"),
            ("MoE layers", f"{len(c['moe_layers'])}: {', '.join(map(str, c['moe_layers']))}"),
            ("tokens", f"{c['chunks']} chunks of {c['ctx']}; {c['scored_tokens']} scored"),
            ("scoring", c["scoring"]), ("calibration", f"{c['calib_chunks']} chunks; {c['calibration']}"),
            ("original perplexity", f"{_g(o['value'], 6)} ± {_g(o['error'], 2)}"),
            ("reference", c["reference"]["loaded"] or "computed in this run"),
            ("generated", f"{report['generated']} by moefq {report['version']} in {report['wall_seconds']:.1f} s")]
    if c.get("max_kl") is not None:
        meta.append(("budget", f"mean KL <= {_g(c['max_kl'])}"))
    s += '<dl class="meta">' + "".join(f"<dt>{_esc(k)}</dt><dd>{_esc(v)}</dd>" for k, v in meta) + "</dl>\n"
    p = report.get("pick")
    if p:
        s += (f'<h2>The pick</h2>\n<p class="note"><b>{_esc(p["description"])}</b> '
              f'(verified: run {_esc(p["verified_run"])}).</p>\n')
    s += "<h2>Cost against wire bytes</h2>\n" + pareto_svg(report)
    s += "<h2>Runs</h2>\n" + _html_table(
        ["run", "disp", "comb", "KL mean", "KL p99", "KL max", "same top-1 %", "PPL ratio", "worst block rel-L2",
         "B/token", "saving"], _rows(report))
    s += ('<p class="note">KL: KL(original || run) per scored token, mean ± standard error. PPL ratio ± an error '
          'that accounts for the correlation of the two models\' per-token log-likelihoods. none: both quantizers '
          'off (the kernel\'s summation order alone).</p>\n')
    s += "<h2>Per-token KL distribution</h2>\n" + kl_distribution_svg(report)
    for recipe, rows in report.get("sensitivity", {}).items():
        s += f"<h2>Sensitivity per layer: {_esc(recipe)}</h2>\n" + sensitivity_svg(recipe, rows, c["moe_layers"])
        s += _html_table(["rank", "layer", "", "KL mean", "same top-1 %", "PPL ratio"],
                         [[x["rank"], x["layer"], "", _g(x["kl_mean"]), f"{100 * x['same_top1']:.2f}",
                           f"{x['ppl_ratio']:.5f}"] for x in rows])
    blocks = [e for e in report["runs"] if e.get("block_rel_l2")]
    if blocks:
        layers = c["moe_layers"]
        s += "<h2>MoE block output rel-L2 against the original model's, per layer</h2>\n"
        s += _html_table(["run", "", ""] + [str(l) for l in layers],
                         [[e["name"], "", ""] + [_g(e["block_rel_l2"].get(str(l)), 3) for l in layers] for e in blocks])
    return s + "</body>\n</html>\n"
