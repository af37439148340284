"""moefq.MoeLayer on the CPU engine against `moefq eval` on the same tokens: the same calibrated amax
and the same error metrics, so the layer a Python caller drives is the one the eval measures."""

import numpy as np
import pytest

import moefq
from conftest import first_mismatch, special_data, to_bf16_bits

RANKS, TOKENS, H = 2, 32, 1024  # the tiny preset's hidden size


def tokens(seed, n):
    return to_bf16_bits(special_data(np.random.default_rng(seed), n, H, finite=True))


def test_layer_matches_eval(tmp_path):
    calib, held_out = tokens(20, RANKS * TOKENS), tokens(21, RANKS * TOKENS)
    acts = tmp_path / "acts.safetensors"
    moefq.save_safetensors(acts, {"layers.1": np.concatenate([calib, held_out])})
    report = moefq.eval(preset="tiny", layers=[1], activations=acts, ranks=RANKS, tokens=TOKENS, calib_batches=1,
                        eval_batches=1, recipes=["moe_dispatch_fp8", "moe_combine_nvfp4"], device="cpu", threads=1)

    layer = moefq.MoeLayer("tiny", layer=1, ranks=RANKS, max_tokens=TOKENS, threads=1)
    assert layer.config["hidden"] == H and layer.quantizer_names == [
        "layers.1.mlp.experts.dispatch_quantizer", "layers.1.mlp.experts.combine_quantizer"]
    reference = layer.forward(held_out)
    assert first_mismatch(layer.forward(held_out), reference) is None  # deterministic
    cal = report["calibration"][0]
    for recipe, which in (("moe_dispatch_fp8", "dispatch_amax"), ("moe_combine_nvfp4", "combine_amax")):
        layer.configure(recipe)
        amax = dict(zip(("dispatch_amax", "combine_amax"), layer.calibrate([calib])))
        assert amax[which] == cal[which], recipe  # the same max over the same routed values
        y = layer.forward(held_out)
        assert first_mismatch(y, reference) is not None
        row = next(r for r in report["results"] if r["recipe"] == recipe)
        m = moefq.metrics(y, reference)
        assert m["count"] == row["count"]
        assert m["rel_l2"] == pytest.approx(row["rel_l2"], rel=1e-9), recipe
        assert m["max_abs"] == row["max_abs"]


def test_layer_combine_weighting_after_matches_eval(tmp_path):
    calib, held_out = tokens(24, RANKS * TOKENS), tokens(25, RANKS * TOKENS)
    acts = tmp_path / "acts.safetensors"
    moefq.save_safetensors(acts, {"layers.0": np.concatenate([calib, held_out])})
    report = moefq.eval(preset="tiny", activations=acts, ranks=RANKS, tokens=TOKENS, calib_batches=1, eval_batches=1,
                        recipes=["moe_combine_nvfp4"], device="cpu", threads=1, combine_weighting="after")
    assert report["config"]["combine_weighting"] == "after"
    layer = moefq.MoeLayer("tiny", ranks=RANKS, max_tokens=TOKENS, threads=1, combine_weighting="after")
    assert layer.combine_weighting == "after"
    reference = layer.forward(held_out)
    before = moefq.MoeLayer("tiny", ranks=RANKS, max_tokens=TOKENS, threads=1)
    assert first_mismatch(before.forward(held_out), reference) is not None  # another rounding path
    layer.configure("moe_combine_nvfp4")
    _, combine_amax = layer.calibrate([calib])
    assert combine_amax == report["calibration"][0]["combine_amax"]
    m = moefq.metrics(layer.forward(held_out), reference)
    assert m["rel_l2"] == pytest.approx(report["results"][0]["rel_l2"], rel=1e-9)
    # A recipe for the other mode is refused; one for this mode is taken.
    (tmp_path / "before.yaml").write_text("$import: [moe_combine_nvfp4]\ncombine_weighting: before\n")
    (tmp_path / "after.yaml").write_text("$import: [moe_combine_nvfp4]\ncombine_weighting: after\n")
    assert moefq.load_recipe(tmp_path / "after.yaml").combine_weighting == "after"
    assert moefq.load_recipe("moe_combine_nvfp4").combine_weighting is None
    with pytest.raises(ValueError, match="recipe before has combine_weighting: before, but the layer applies"):
        layer.configure(tmp_path / "before.yaml")
    layer.configure(tmp_path / "after.yaml")
    with pytest.raises(ValueError, match="MoeLayer: combine_weighting must be 'before' or 'after', got 'later'"):
        moefq.MoeLayer("tiny", combine_weighting="later")
    with pytest.raises(ValueError, match="combine_weighting: unknown mode 'later'"):
        moefq.eval(preset="tiny", device="cpu", combine_weighting="later")


def test_layer_staging_matches_eval(tmp_path):
    """staging= (the baseline: e4m3 or bf16 activations into the expert GEMMs) as moefq.eval takes it;
    the default follows the model (tiny: e4m3; a Qwen3-MoE config: none)."""
    calib, held_out = tokens(26, RANKS * TOKENS), tokens(27, RANKS * TOKENS)
    acts = tmp_path / "acts.safetensors"
    moefq.save_safetensors(acts, {"layers.0": np.concatenate([calib, held_out])})
    report = moefq.eval(preset="tiny", activations=acts, ranks=RANKS, tokens=TOKENS, calib_batches=1, eval_batches=1,
                        recipes=["moe_dispatch_fp8"], device="cpu", threads=1, staging="none")
    assert report["staging"] == "none" and report["baseline"].startswith("bf16 activations")
    layer = moefq.MoeLayer("tiny", ranks=RANKS, max_tokens=TOKENS, threads=1, staging="none")
    assert layer.staging == "none"
    assert moefq.MoeLayer("tiny", ranks=RANKS, max_tokens=TOKENS, threads=1).staging == "e4m3"
    reference = layer.forward(held_out)
    staged = moefq.MoeLayer("tiny", ranks=RANKS, max_tokens=TOKENS, threads=1, staging="e4m3").forward(held_out)
    assert moefq.metrics(staged, reference)["rel_l2"] > 1e-2  # the other baseline
    layer.configure("moe_dispatch_fp8")
    dispatch_amax, _ = layer.calibrate([calib])
    assert dispatch_amax == report["calibration"][0]["dispatch_amax"]
    m = moefq.metrics(layer.forward(held_out), reference)
    assert m["rel_l2"] == pytest.approx(report["results"][0]["rel_l2"], rel=1e-9)
    cfg = tmp_path / "qwen.json"
    cfg.write_text('{"model_type": "qwen3_moe", "hidden_size": 256, "moe_intermediate_size": 128, "num_experts": 8, '
                   '"num_experts_per_tok": 2, "norm_topk_prob": true}')
    assert moefq.MoeLayer(config=cfg, max_tokens=4, threads=1).staging == "none"
    with pytest.raises(ValueError, match="MoeLayer: staging: unknown staging 'bf16' \\(expected e4m3 or none\\)"):
        moefq.MoeLayer("tiny", staging="bf16")
    with pytest.raises(ValueError, match="staging: unknown staging 'fp8'"):
        moefq.eval(preset="tiny", device="cpu", staging="fp8")
    with pytest.raises(ValueError, match="staging: unknown staging 'fp8'"):
        moefq.calibrate(tmp_path / "c.json", preset="tiny", device="cpu", staging="fp8")


def test_layer_calibration_file_round_trip(tmp_path):
    layer = moefq.MoeLayer("tiny", ranks=RANKS, max_tokens=TOKENS, threads=1, recipe="moe_combine_nvfp4")
    layer.calibrate([tokens(22, RANKS * TOKENS)])
    x = tokens(23, TOKENS)
    y = layer.forward(x)
    layer.save_calibration(tmp_path / "calib.json")
    other = moefq.MoeLayer("tiny", ranks=RANKS, max_tokens=TOKENS, threads=1, recipe="moe_combine_nvfp4")
    other.load_calibration(tmp_path / "calib.json")
    assert other.combine_amax == layer.combine_amax
    assert first_mismatch(other.forward(x), y) is None


def test_layer_errors(tmp_path):
    with pytest.raises(ValueError, match="MoeLayer: ranks 3 must divide the 32 routed experts of tiny"):
        moefq.MoeLayer("tiny", ranks=3)
    with pytest.raises(ValueError, match="MoeLayer: device must be 'cpu' or 'cuda', got 'tpu'"):
        moefq.MoeLayer("tiny", device="tpu")
    with pytest.raises(ValueError, match="MoeLayer: config .*missing.json: no such file"):
        moefq.MoeLayer(config=tmp_path / "missing.json")
    layer = moefq.MoeLayer("tiny", max_tokens=4, threads=1)
    with pytest.raises(ValueError, match=r"MoeLayer.route: x has shape \[2, 512\]; expected \[\*, 1024\]"):
        layer.forward(np.zeros((2, 512), dtype=np.uint16))
    with pytest.raises(ValueError, match="has 5 tokens; the layer takes at most ranks x max_tokens = 4"):
        layer.forward(np.zeros((5, 1024), dtype=np.uint16))
    with pytest.raises(ValueError, match="eval: unknown option 'recipe'"):
        moefq.eval(recipe="x")
    with pytest.raises(ValueError, match="device: unknown device 'gpu'"):
        moefq.eval(device="gpu")
    # pipeline= was removed (one runner per device): any value is refused with the reason.
    for value in ("host", "device", None):
        with pytest.raises(ValueError, match=f"pipeline={value}: the option was removed; the device runner gives "
                                             "the same bits"):
            moefq.eval(preset="tiny", device="cpu", pipeline=value)
        with pytest.raises(ValueError, match="the option was removed"):
            moefq.calibrate("unused.json", preset="tiny", device="cpu", pipeline=value)


def test_eval_checks_its_outputs_before_any_work(tmp_path):
    taken = tmp_path / "taken"
    taken.write_text("x")
    with pytest.raises(ValueError, match="^out"):
        moefq.eval(preset="tiny", out=taken, device="cpu", threads=1)
    with pytest.raises(ValueError, match="^save"):
        moefq.calibrate(tmp_path / "missing_dir" / "calib.json", preset="tiny", device="cpu", threads=1)
    assert taken.read_text() == "x" and not (tmp_path / "missing_dir").exists()
