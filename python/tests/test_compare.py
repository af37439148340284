"""moefq compare on the CPU (no transformers): the statistics against direct computations on
hand-made log-probabilities, the reference file and its refusals, run_compare end to end on a tiny
causal LM around the transformers 5.x MoE block look-alikes (one layer made fragile), the pick
within a KL budget, the reports, every refusal, and the command line's refusals."""

import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import moefq  # noqa: E402
import moefq.hf as hf  # noqa: E402
from moefq import _compare_stats as st  # noqa: E402
from moefq import compare as mc  # noqa: E402

from compare_tinylm import TinyCausalLM  # noqa: E402
import hf_lookalikes as hl  # noqa: E402

CTX = 32


def _tokens(n_chunks, seed=0, vocab=64):
    return np.random.default_rng(seed).integers(0, vocab, CTX * n_chunks).astype(np.int64)


def _lp(logits):
    return torch.log_softmax(torch.as_tensor(logits, dtype=torch.float64), dim=-1).float().numpy()


# ---- statistics ------------------------------------------------------------------------------------------


def test_kl_of_identical_distributions_is_zero():
    lp = _lp(np.random.default_rng(1).standard_normal((50, 40)) * 3)
    t = np.random.default_rng(2).integers(0, 40, 50)
    kl, same, nll, nll_ref = st.token_stats(lp, lp, t)
    assert np.all(kl == 0.0) and same.all()
    s = st.summarize(kl, same, nll, nll_ref)
    assert s["kl"]["mean"] == 0 and s["kl"]["max"] == 0 and s["same_top1"]["fraction"] == 1
    assert s["ppl_ratio"]["value"] == 1 and s["ln_ppl_ratio"]["error"] == 0 and s["ppl_diff"]["value"] == 0
    # The torch path (a model's device) gives the same.
    kl_t, same_t, _, _ = st.token_stats(torch.from_numpy(lp), torch.from_numpy(lp), t)
    assert np.all(kl_t == 0.0) and same_t.all()


def test_kl_of_a_known_pair():
    p = np.log(np.array([[0.5, 0.5], [0.25, 0.75]], dtype=np.float64)).astype(np.float32)
    q = np.log(np.array([[0.9, 0.1], [0.25, 0.75]], dtype=np.float64)).astype(np.float32)
    kl, same, nll, nll_ref = st.token_stats(p, q, np.array([1, 0]))
    assert kl[0] == pytest.approx(0.5 * math.log(0.5 / 0.9) + 0.5 * math.log(0.5 / 0.1), rel=1e-6)
    assert kl[1] == 0
    assert list(same) == [True, True]                      # argmax of [0.5, 0.5] is the first, as [0.9, 0.1]'s
    assert nll[0] == pytest.approx(-math.log(0.1), rel=1e-6) and nll_ref[1] == pytest.approx(-math.log(0.25), rel=1e-6)


def test_statistics_against_direct_computation():
    rng = np.random.default_rng(3)
    n, v = 400, 97
    base = rng.standard_normal((n, v)) * 2.5
    ref, q = _lp(base), _lp(base + rng.standard_normal((n, v)) * 0.3)
    t = rng.integers(0, v, n)
    kl, same, nll, nll_ref = st.token_stats(ref, q, t)
    # KL by torch's own kl_div (an independent implementation of the same definition).
    direct = torch.nn.functional.kl_div(torch.from_numpy(q).double(), torch.from_numpy(ref).double(),
                                        reduction="none", log_target=True).sum(-1).numpy()
    np.testing.assert_allclose(kl, direct, rtol=1e-9, atol=1e-12)
    kl_t, same_t, nll_t, _ = st.token_stats(torch.from_numpy(ref), torch.from_numpy(q), t)
    np.testing.assert_allclose(kl_t, kl, rtol=1e-12, atol=1e-15)
    assert (same_t == same).all() and np.allclose(nll_t, nll)
    assert (same == (ref.argmax(1) == q.argmax(1))).all()
    s = st.summarize(kl, same, nll, nll_ref)
    assert s["kl"]["mean"] == pytest.approx(direct.mean(), rel=1e-12)
    assert s["kl"]["error"] == pytest.approx(np.std(direct) / math.sqrt(n - 1), rel=1e-9)
    for key, f in (("p50", 50), ("p90", 90), ("p99", 99), ("p99_9", 99.9)):
        assert s["kl"][key] == pytest.approx(np.percentile(direct, f), rel=1e-12)
    assert s["kl"]["max"] == pytest.approx(direct.max(), rel=1e-12)
    p = same.mean()
    assert s["same_top1"]["error"] == pytest.approx(math.sqrt(p * (1 - p) / (n - 1)), rel=1e-12)
    # Perplexities and the uncertainty of their ratio: the delta method on the paired per-token
    # differences gives the same figure as the covariance formula (sqrt(s^2 + s_ref^2 - 2c)).
    ppl, ppl_ref = math.exp(nll.mean()), math.exp(nll_ref.mean())
    assert s["ppl"]["value"] == pytest.approx(ppl, rel=1e-12)
    assert s["ppl_ref"]["value"] == pytest.approx(ppl_ref, rel=1e-12)
    d = nll - nll_ref
    ln_err = np.std(d) / math.sqrt(n - 1)
    assert s["ln_ppl_ratio"]["value"] == pytest.approx(d.mean(), rel=1e-9)
    assert s["ln_ppl_ratio"]["error"] == pytest.approx(ln_err, rel=1e-6)
    assert s["ppl_ratio"]["value"] == pytest.approx(ppl / ppl_ref, rel=1e-9)
    assert s["ppl_ratio"]["error"] == pytest.approx(ppl / ppl_ref * ln_err, rel=1e-6)
    diff_err = np.std(ppl * nll - ppl_ref * nll_ref) / math.sqrt(n - 1)
    assert s["ppl_diff"]["value"] == pytest.approx(ppl - ppl_ref, rel=1e-9)
    assert s["ppl_diff"]["error"] == pytest.approx(diff_err, rel=1e-6)
    # The correlation of the two series accounts for most of the spread: the ratio's error is far
    # below what independent series would give.
    assert s["nll_correlation"] == pytest.approx(np.corrcoef(nll, nll_ref)[0, 1], rel=1e-9)
    s_ind = math.sqrt(np.var(nll) / (n - 1) + np.var(nll_ref) / (n - 1))
    assert s["ln_ppl_ratio"]["error"] < 0.5 * s_ind


def test_histogram_counts_every_token():
    kl = np.array([0.0, -1e-12, 1e-9, 1e-3, 0.5, 1e3])
    h = st.kl_histogram(kl)
    assert sum(h["counts"]) == kl.size and h["counts"][0] == 3 and h["counts"][-1] == 1


def test_shapes_are_checked():
    with pytest.raises(ValueError, match="shapes"):
        st.token_stats(np.zeros((3, 4), np.float32), np.zeros((3, 5), np.float32), np.zeros(3, np.int64))
    with pytest.raises(ValueError, match="targets"):
        st.token_stats(np.zeros((3, 4), np.float32), np.zeros((3, 4), np.float32), np.zeros(2, np.int64))


# ---- wire bytes ------------------------------------------------------------------------------------------


def test_wire_bytes_match_moefq_eval():
    recipes = ["moe_dispatch_nvfp4", "moe_combine_mxfp8", "moe_combine_fp8_block128", "moe_combine_logfmt10"]
    rep = moefq.eval(preset="tiny", recipes=recipes, ranks=4, tokens=16, calib_batches=1, eval_batches=1,
                     device="cpu")
    H = rep["config"]["model"]["hidden"]
    assert rep["results"]
    for row in rep["results"]:
        assert mc.wire_bytes_per_row(row["dispatch_format"], H) == row["dispatch_wire_bytes_per_token"]
        if row["combine_format"] == "logfmt10":
            # eval counts the groups it could cast (the others go as bf16); compare gives the nominal size,
            # the least logfmt10 can send, and says so in docs/compare.md.
            assert mc.wire_bytes_per_row("logfmt10", H) <= row["combine_wire_bytes_per_token"] <= 2 * H
        else:
            assert mc.wire_bytes_per_row(row["combine_format"], H) == row["combine_wire_bytes_per_token"]
    assert mc.wire_bytes_per_row(None, 7168) == 2 * 7168
    assert mc.wire_bytes_per_row("nvfp4", 7168) == 7168 / 2 + 7168 / 16
    with pytest.raises(ValueError):
        mc.wire_bytes_per_row("fp5", 64)


# ---- tokens and the reference file -----------------------------------------------------------------------


def test_token_files(tmp_path):
    ids = np.arange(100, dtype=np.int64) % 13
    np.save(tmp_path / "t.npy", ids.astype(np.int32))
    torch.save(torch.from_numpy(ids), tmp_path / "t.pt")
    (tmp_path / "t.txt").write_text(" ".join(map(str, ids)) + "\n")
    for name in ("t.npy", "t.pt", "t.txt"):
        got = mc.load_tokens(tmp_path / name)
        assert got.dtype == np.int64 and (got == ids).all()
    (tmp_path / "bad.txt").write_text("1 2 three")
    with pytest.raises(mc.CompareError, match="not a token file"):
        mc.load_tokens(tmp_path / "bad.txt")
    np.save(tmp_path / "f.npy", np.zeros((2, 3)))
    with pytest.raises(mc.CompareError, match="1-D array of integer"):
        mc.load_tokens(tmp_path / "f.npy")
    with pytest.raises(mc.CompareError, match="no such file"):
        mc.load_tokens(tmp_path / "missing.npy")


def test_reference_round_trip_and_refusals(tmp_path):
    lp = _lp(np.random.default_rng(4).standard_normal((6, 10)))
    tok = np.arange(16, dtype=np.int64)
    fp = mc._fingerprint("abc", tok.reshape(2, 8), 8, 2, 10)
    path = tmp_path / "ref.safetensors"
    mc.save_reference(path, lp, tok, fp)
    got, got_tok, got_fp = mc.load_reference(path, fp)
    assert (got == lp).all() and got.dtype == np.float32 and (got_tok == tok).all() and got_fp == fp
    for change, what in ((dict(model="xyz"), "another model"), (dict(ctx=16), "another context"),
                         (dict(chunks=3), "another number of chunks"), (dict(vocab=11), "another vocabulary")):
        with pytest.raises(mc.CompareError, match=what):
            mc.load_reference(path, {**fp, **change})
    other = mc._fingerprint("abc", (tok + 1).reshape(2, 8), 8, 2, 10)
    with pytest.raises(mc.CompareError, match="another text"):
        mc.load_reference(path, other)
    moefq.save_safetensors(tmp_path / "x.safetensors", {"a": np.zeros(3, np.float32)})
    with pytest.raises(mc.CompareError, match="not a moefq compare reference"):
        mc.load_reference(tmp_path / "x.safetensors", fp)
    (tmp_path / "junk").write_bytes(b"12")
    with pytest.raises(mc.CompareError, match="not a moefq compare reference"):
        mc.load_reference(tmp_path / "junk", fp)


# ---- run_compare on a tiny causal LM ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def small_run(tmp_path_factory):
    """One run with a saved reference, shared by several tests."""
    d = tmp_path_factory.mktemp("cmp")
    model = TinyCausalLM(layers=3, fragile=1)
    tokens = _tokens(6)
    rep = mc.run_compare(model, tokens, ctx=CTX, chunks=4, calib_chunks=2,
                         recipes=["moe_combine_nvfp4", "moe_combine_fp8", "moe_dispatch_mxfp8"],
                         save_reference=d / "ref.safetensors", out=d / "out")
    return model, tokens, rep, d


def test_report_figures_are_the_direct_computation(small_run):
    """A recipe's KL and perplexity equal a computation by hand: patch with moefq.hf (calibrated on the
    same calibration chunks), run the chunks, score the second halves."""
    model, tokens, rep, _ = small_run
    chunks = tokens[:4 * CTX].reshape(4, CTX)
    calib = tokens[4 * CTX:6 * CTX].reshape(2, CTX)

    def logits(ids):
        with torch.no_grad():
            return model(torch.from_numpy(ids).reshape(1, -1)).logits[0].double()

    ref = [torch.log_softmax(logits(c), -1).float().double() for c in chunks]
    q = hf.quantize_moe(model, "moe_combine_nvfp4", lambda m: [m(torch.from_numpy(c).reshape(1, -1)) for c in calib])
    try:
        got = [torch.log_softmax(logits(c), -1).float().double() for c in chunks]
    finally:
        hf.restore_moe(model)
    first = CTX // 2
    kl, nll = [], []
    for c, r, g in zip(chunks, ref, got):
        r, g = r[first:CTX - 1], g[first:CTX - 1]
        kl.append((r.exp() * (r - g)).sum(-1))
        nll.append(-g[torch.arange(CTX - 1 - first), torch.from_numpy(c[first + 1:])])
    kl, nll = torch.cat(kl), torch.cat(nll)
    e = next(x for x in rep["runs"] if x["name"] == "moe_combine_nvfp4")
    assert e["tokens"] == 4 * (CTX - 1 - first) == rep["config"]["scored_tokens"]
    assert e["kl"]["mean"] == pytest.approx(float(kl.mean()), rel=1e-9)
    assert e["kl"]["max"] == pytest.approx(float(kl.max()), rel=1e-9)
    assert e["ppl"]["value"] == pytest.approx(math.exp(float(nll.mean())), rel=1e-9)
    assert q.amax()["model.layers.1.mlp.experts.combine_quantizer"] == \
        rep["calibration"]["before"]["model.layers.1.mlp.experts.combine_quantizer"]
    assert e["kl"]["mean"] > 0 and e["combine_format"] == "nvfp4" and e["dispatch_format"] is None
    assert e["wire_bytes_per_token"] == 2 * 32 + 32 / 2 + 32 / 16
    # Per block: the rel-L2 of each MoE block's output against the original model's, every layer.
    assert set(e["block_rel_l2"]) == {"0", "1", "2"} and all(v > 0 for v in e["block_rel_l2"].values())
    # The runs: none first, then best first by KL; the model is as it was (restored).
    names = [x["name"] for x in rep["runs"]]
    assert names[0] == "none" and len(names) == 4
    kls = [x["kl"]["mean"] for x in rep["runs"][1:]]
    assert kls == sorted(kls)
    assert all("forward" not in layer.mlp.__dict__ for layer in model.model.layers)
    assert hf.restore_moe(model) == []
    assert "second half" in rep["config"]["scoring"]


def test_none_run_is_the_summation_order_alone(small_run):
    _, _, rep, _ = small_run
    none = rep["runs"][0]
    assert none["name"] == "none" and none["dispatch_format"] is None and none["combine_format"] is None
    assert none["wire_saving_vs_bf16"] == 0
    worst = next(x for x in rep["runs"] if x["name"] == "moe_combine_nvfp4")
    assert 0 <= none["kl"]["mean"] < worst["kl"]["mean"]
    assert max(none["block_rel_l2"].values()) < 0.02   # bf16 rounding of a different summation order


def test_reference_reuse_gives_the_same_figures(small_run, tmp_path):
    model, tokens, rep, d = small_run
    again = mc.run_compare(model, tokens, ctx=CTX, chunks=4, calib_chunks=2,
                           recipes=["moe_combine_nvfp4", "moe_combine_fp8", "moe_dispatch_mxfp8"],
                           reference=d / "ref.safetensors")
    for a, b in zip(rep["runs"], again["runs"]):
        assert a["name"] == b["name"] and a["kl"] == b["kl"] and a["ppl"] == b["ppl"]
        assert b["block_rel_l2"] is None      # the original model did not run
    assert again["config"]["reference"]["loaded"] == str(d / "ref.safetensors")
    # Another model, another text, another context or chunk count: refused before any work.
    other = TinyCausalLM(layers=3, fragile=1, seed=5)
    cases = [((other, tokens), {}, "another model"),
             ((model, _tokens(6, seed=9)), {}, "another text"),
             ((model, tokens), {"chunks": 3}, "another number of chunks")]
    for (m, t), kw, what in cases:
        args = dict(ctx=CTX, chunks=4, calib_chunks=2, recipes=["moe_combine_fp8"], reference=d / "ref.safetensors",
                    out=tmp_path / "o")
        args.update(kw)
        with pytest.raises(mc.CompareError, match=what):
            mc.run_compare(m, t, **args)
        assert not (tmp_path / "o").exists()
    with pytest.raises(mc.CompareError, match="another context"):
        mc.run_compare(model, _tokens(12), ctx=2 * CTX, chunks=4, calib_chunks=2, recipes=["moe_combine_fp8"],
                       reference=d / "ref.safetensors")


def test_reports_written(small_run):
    _, _, rep, d = small_run
    out = d / "out"
    assert sorted(os.listdir(out)) == ["report.csv", "report.html", "report.json"]
    j = json.loads((out / "report.json").read_text())
    assert j["tool"] == "moefq compare" and [r["name"] for r in j["runs"]] == [r["name"] for r in rep["runs"]]
    lines = (out / "report.csv").read_text().splitlines()
    assert len(lines) == 1 + len(rep["runs"]) and lines[0].startswith("kind,name,recipe,layer")
    html = (out / "report.html").read_text()
    assert html.count("<svg") >= 2 and "<script" not in html and "http://" not in html.replace(
        "http://www.w3.org/2000/svg", "") and "https://" not in html
    assert "second half" in html
    assert not [f for f in os.listdir(d) if f.startswith(".out")]      # no temporary directory left


def test_sensitivity_ranks_the_fragile_layer_first():
    for fragile in (1, 3):
        model = TinyCausalLM(layers=4, fragile=fragile)
        rep = mc.run_compare(model, _tokens(5, seed=fragile), ctx=CTX, chunks=4, calib_chunks=1,
                             recipes=["moe_combine_nvfp4"], sensitivity=True)
        rows = rep["sensitivity"]["moe_combine_nvfp4"]
        assert [r["rank"] for r in rows] == [1, 2, 3, 4] and {r["layer"] for r in rows} == {0, 1, 2, 3}
        assert rows[0]["layer"] == fragile, rows
        assert rows[0]["kl_mean"] > 3 * rows[1]["kl_mean"], rows
        # One layer at a time: only that block was patched, so only its rel-L2 was measured.
        assert rows[0]["block_rel_l2"] > 0


def test_pick_within_a_budget(capsys):
    model = TinyCausalLM(layers=4, fragile=1)
    tokens = _tokens(5, seed=1)
    recipes = ["moe_combine_nvfp4", "moe_combine_fp8"]
    full = mc.run_compare(model, tokens, ctx=CTX, chunks=4, calib_chunks=1, recipes=recipes, sensitivity=True)
    by = {e["name"]: e for e in full["runs"]}
    none_kl, fp8_kl = by["none"]["kl"]["mean"], by["moe_combine_fp8"]["kl"]["mean"]
    # A budget between everything-bf16 and fp8 everywhere: the fragile layer must stay off 4-bit.
    budget = (none_kl + fp8_kl) / 2
    rep = mc.run_compare(model, tokens, ctx=CTX, chunks=4, calib_chunks=1, recipes=recipes, max_kl=budget,
                         table=True, progress=True)
    p = rep["pick"]
    assert p["met"] and p["max_kl"] == budget
    verified = next(e for e in rep["runs"] if e["name"] == p["verified_run"])
    assert verified["kl"]["mean"] <= budget
    assert p["assignment"]["1"] != "moe_combine_nvfp4"
    assert verified["wire_bytes_per_token"] < by["none"]["wire_bytes_per_token"]
    assert p["tries"][-1]["measured_kl"] == verified["kl"]["mean"]
    out = capsys.readouterr()
    assert "answer: " in out.out and p["description"] in out.out and "kl_mean" in out.out
    assert "eta" in out.err and "[1/" in out.err
    # A generous budget: the cheapest recipe everywhere.
    rep = mc.run_compare(model, tokens, ctx=CTX, chunks=4, calib_chunks=1, recipes=recipes, max_kl=100.0)
    assert rep["pick"]["description"] == "moe_combine_nvfp4 on every MoE layer"
    assert rep["cheapest_recipe_within_budget"] == "moe_combine_nvfp4"
    # Below the both-off run: nothing can meet it; the best reachable is said.
    with pytest.raises(mc.CompareError, match=r"no assignment meets it; the best reachable is"):
        mc.run_compare(model, tokens, ctx=CTX, chunks=4, calib_chunks=1, recipes=recipes, max_kl=none_kl / 2)


def test_describe_assignment():
    c = mc._Comparer.__new__(mc._Comparer)
    c.layers = [0, 1, 2, 3, 58]
    assert c.describe_assignment({0: "nvfp4", 1: "nvfp4", 2: "nvfp4", 3: "nvfp4", 58: "nvfp4"}) == \
        "nvfp4 on every MoE layer"
    assert c.describe_assignment({0: None, 1: None, 2: "nvfp4", 3: "nvfp4", 58: "fp8"}) == \
        "nvfp4 on every MoE layer except layers 0, 1 (bf16) and 58 (fp8)"
    assert c.describe_assignment({0: "fp8", 1: "nvfp4", 2: "nvfp4", 3: "nvfp4", 58: "nvfp4"}) == \
        "nvfp4 on every MoE layer except layer 0 (fp8)"


def test_default_sweep_is_moefq_evals():
    names = [r.name for r in mc.default_recipes()]
    sides = ("dispatch", "combine", "both")
    assert names == [f"{side}_{f}" for f in ("fp8", "nvfp4", "mxfp8", "mxfp4") for side in sides]
    r = dict((x.name, x.recipe) for x in mc.default_recipes())["both_nvfp4"]
    cfg = moefq.apply_recipe(r, ["a.experts.dispatch_quantizer", "a.experts.combine_quantizer"])
    assert all(c.enable and c.spec.format == "nvfp4" for c in cfg.values())


# ---- refusals --------------------------------------------------------------------------------------------


class DenseLM(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.model = hl.DecoderModel(32, [hl.MLP(32, 24), hl.MLP(32, 24)])
        self.lm_head = torch.nn.Linear(32, 50, bias=False)

    def forward(self, ids):
        return self.lm_head(self.model(ids))


def test_refusals(tmp_path):
    model = TinyCausalLM(layers=2)
    tokens = _tokens(4)
    out = tmp_path / "out"

    def refused(match, m=model, t=tokens, **kw):
        args = dict(ctx=CTX, calib_chunks=1, recipes=["moe_combine_fp8"], out=out)
        args.update(kw)
        with pytest.raises(mc.CompareError, match=match):
            mc.run_compare(m, t, **args)
        assert not out.exists()

    refused("has no MoE block", m=DenseLM())
    refused("holds float32 weights", m=TinyCausalLM(layers=2).float())
    refused("shorter than one chunk", t=tokens[:CTX - 1])
    refused(r"need 160", chunks=4, calib_chunks=1)
    refused("not enough for", calib_chunks=4)
    refused("must lie in", t=tokens + 60)
    (tmp_path / "nothing.yaml").write_text(
        "quant_cfg:\n  - quantizer_name: '*nothing*'\n    cfg:\n      num_bits: e4m3\n")
    refused("enables no quantizer", recipes=[str(tmp_path / "nothing.yaml")])
    refused("'no_such_recipe' is neither a recipe file", recipes=["no_such_recipe"])
    (tmp_path / "after.yaml").write_text("$import: [moe_combine_fp8]\ncombine_weighting: after\n")
    refused("combine_weighting after", recipes=[str(tmp_path / "after.yaml")], combine_weighting="before")
    refused("both combine weightings", recipes=[str(tmp_path / "after.yaml"), "moe_combine_fp8"], max_kl=0.1)
    refused("needs a calibrated amax", calib_chunks=0)
    refused("--sensitivity both_fp8: not one of the recipes", sensitivity=["both_fp8"])
    refused("--max-kl -1", max_kl=-1.0)
    refused("--ctx 2", ctx=2)
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("mine")
    refused("holds other files", out=tmp_path / "busy")
    (tmp_path / "afile").write_text("x")
    refused("not a directory", out=tmp_path / "afile")
    refused("--save-reference", save_reference=tmp_path)
    refused("no such file", reference=tmp_path / "missing.safetensors")
    assert (tmp_path / "busy" / "notes.txt").read_text() == "mine"


def test_out_replaces_an_earlier_report(tmp_path):
    model = TinyCausalLM(layers=2)
    out = tmp_path / "out"
    out.mkdir()
    (out / "report.json").write_text("old")
    mc.run_compare(model, _tokens(3), ctx=CTX, calib_chunks=1, recipes=["moe_combine_fp8"], out=out)
    assert json.loads((out / "report.json").read_text())["tool"] == "moefq compare"
    assert sorted(os.listdir(tmp_path)) == ["out"]


# ---- the command line ------------------------------------------------------------------------------------


def _cli(*args, cwd=None):
    env = dict(os.environ)
    p = subprocess.run([sys.executable, "-m", "moefq.compare", *map(str, args)], capture_output=True, text=True,
                       env=env, cwd=cwd)
    return p.returncode, p.stdout, p.stderr


def test_cli_refusals(tmp_path):
    tok = tmp_path / "t.npy"
    np.save(tok, _tokens(4))
    short = tmp_path / "short.txt"
    short.write_text("1 2 3")
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps({"model_type": "qwen3_moe"}))
    out = tmp_path / "out"
    cases = [
        (["--model", tmp_path / "nope", "--tokens", tok, "--ctx", "32"], "not a directory"),
        (["--model", tmp_path, "--tokens", tok, "--ctx", "32"], "not a model directory (no config.json)"),
        (["--model", model_dir, "--tokens", short], "shorter than one chunk"),
        (["--model", model_dir, "--tokens", tok], "128 tokens, shorter than one chunk of --ctx 512"),
        (["--model", model_dir, "--tokens", tmp_path / "missing.npy"], "no such file"),
        (["--model", model_dir, "--tokens", tok, "--ctx", "32", "--device", "cuda"], "--device cuda"),
        (["--model", model_dir, "--tokens", tok, "--ctx", "32", "--out", short], "not a directory"),
        (["--model", model_dir, "--tokens", tok, "--ctx", "32", "--reference", tmp_path / "r.st"], "no such file"),
        (["--model", model_dir, "--tokens", tok, "--ctx", "32", "--max-kl", "nan"], "--max-kl"),
        (["--model", model_dir, "--tokens", tok, "--ctx", "32", "--recipes", "no_such_unit"], "no_such_unit"),
        (["--model", model_dir, "--text", short, "--ctx", "32"], "transformers"),
    ]
    import importlib.util
    if importlib.util.find_spec("transformers") is not None:
        cases = cases[:-1]  # --text then loads the directory: not a refusal to test here
    if torch.cuda.is_available():
        cases = [c for c in cases if "--device" not in c[0]]
    for args, match in cases:
        rc, so, se = _cli(*args, "--out", out) if "--out" not in args else _cli(*args)
        assert rc == 2, (args, so, se)
        lines = se.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("moefq compare: ") and match in lines[0], (args, se)
        assert not out.exists()


def test_cli_help():
    rc, so, _ = _cli("--help")
    assert rc == 0 and "--max-kl" in so and "--save-reference" in so and "--calib-chunks" in so


def test_both_combine_weightings_calibrate_once_each(tmp_path):
    (tmp_path / "combine_fp8_after.yaml").write_text("$import: [moe_combine_fp8]\ncombine_weighting: after\n")
    model = TinyCausalLM(layers=2)
    rep = mc.run_compare(model, _tokens(4), ctx=CTX, calib_chunks=1,
                         recipes=[str(tmp_path / "combine_fp8_after.yaml"), "moe_combine_fp8"])
    assert sorted(rep["calibration"]) == ["after", "before"]
    assert rep["config"]["combine_weighting"] == {"combine_fp8_after": "after", "moe_combine_fp8": "before"}
    name = "model.layers.0.mlp.experts.combine_quantizer"
    # The rows are unweighted with "after": another max, hence its own calibration.
    assert rep["calibration"]["after"][name] != rep["calibration"]["before"][name]
    by = {e["name"]: e for e in rep["runs"]}
    assert by["combine_fp8_after"]["kl"]["mean"] > 0 and by["moe_combine_fp8"]["kl"]["mean"] > 0


def test_report_html_renders(small_run, tmp_path):
    """report.html in headless Chromium (where there is one): the charts are in the DOM."""
    import shutil
    browser = next((b for b in ("chromium", "chromium-browser", "google-chrome") if shutil.which(b)), None)
    if browser is None:
        pytest.skip("no Chromium to render the report with")
    _, _, _, d = small_run
    p = subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", f"--user-data-dir={tmp_path}",
                        "--dump-dom", (d / "out" / "report.html").as_uri()], capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stderr
    dom = p.stdout
    assert dom.count("<svg") >= 2 and dom.count("<circle") >= 4 and "<polyline" in dom and "The pick" not in dom
    assert "mean KL divergence against wire bytes per token" in dom and "per-token KL divergence" in dom


def test_greedy_pick_on_given_sensitivities():
    """The greedy on hand-made one-layer KLs: every layer starts on its cheapest recipe, and the move
    saving the most KL per wire byte is made until the estimate fits."""
    c = mc._Comparer.__new__(mc._Comparer)
    c.layers, c.hidden = [0, 1, 2], {0: 64, 1: 64, 2: 64}
    c.qnames = {l: (f"l{l}.dispatch", f"l{l}.combine") for l in c.layers}
    c.formats = {r: {n: ((fmt, True) if n.endswith("combine") else (None, False))
                     for l in c.layers for n in c.qnames[l]} for r, fmt in (("nv", "nvfp4"), ("f8", "fp8"))}
    sens = {"nv": {0: 0.01, 1: 0.2, 2: 0.01}, "f8": {0: 0.001, 1: 0.02, 2: 0.001}}
    # Bytes per layer: nv 128 + 36 = 164, f8 128 + 64 = 192, bf16 256.
    assert c._layer_wire(0, "nv") == 164 and c._layer_wire(0, "f8") == 192 and c._layer_wire(0, None) == 256
    assign, est = c._greedy(sens, 0.0003, 1.0)
    assert assign == {0: "nv", 1: "nv", 2: "nv"} and est == pytest.approx(0.22)
    # Layer 1 to fp8 saves 0.18 for 28 bytes: the best move by far.
    assign, est = c._greedy(sens, 0.0003, 0.05)
    assert assign == {0: "nv", 1: "f8", 2: "nv"} and est == pytest.approx(0.04)
    # Then layers 0 and 2 to fp8 (0.009 per 28 bytes) before layer 1 to bf16 (0.0199 per 64 bytes).
    assign, est = c._greedy(sens, 0.0003, 0.025, start=assign)
    assert assign == {0: "f8", 1: "f8", 2: "f8"} and est == pytest.approx(0.022)
    # Nothing fits below the bf16 floor: every layer ends on bf16 (the estimate: the none run's KL).
    assign, est = c._greedy(sens, 0.0003, 1e-9)
    assert assign == {0: None, 1: None, 2: None} and est == pytest.approx(0.0003)


def test_model_fingerprint():
    """Config fields and weights count; where the model was loaded from does not."""
    class Config:
        def __init__(self, **kw):
            self.__dict__.update(kw)

        def to_dict(self):
            return dict(self.__dict__)

    a, b = TinyCausalLM(layers=2), TinyCausalLM(layers=2)
    a.config = Config(hidden_size=32, _name_or_path="/here", transformers_version="5.17.0")
    b.config = Config(hidden_size=32, _name_or_path="/elsewhere", transformers_version="5.18.0")
    assert mc.model_fingerprint(a) == mc.model_fingerprint(b)
    b.config.hidden_size = 33
    assert mc.model_fingerprint(a) != mc.model_fingerprint(b)
    b.config.hidden_size = 32
    with torch.no_grad():
        b.lm_head.weight[0, 0] += 1
    assert mc.model_fingerprint(a) != mc.model_fingerprint(b)
    assert mc.model_fingerprint(a) != mc.model_fingerprint(TinyCausalLM(layers=2).float())
