"""The package's argument checks: an amax is a real number (> 0 where the caller gives it, a stored 0
still used), routing ids fit int32, names and keywords are what they say (apply_recipe's list,
rank_amax's quantizer, eval's layers and recipe_root, load_safetensors' framework), and calibration
aborts through the binding."""

import os

import numpy as np
import pytest

import moefq
from conftest import first_mismatch, special_data, to_bf16_bits

H = 1024  # the tiny preset's hidden size
MODELOPT_ROOT = os.path.join(os.path.dirname(__file__), "..", "..", "tests", "quant", "data", "modelopt_layout")


def layer(**kw):
    return moefq.MoeLayer("tiny", ranks=2, max_tokens=16, threads=1, **kw)


def tokens(seed, n):
    return to_bf16_bits(special_data(np.random.default_rng(seed), n, H, finite=True))


# ---- amax: a real number; the public operations take one > 0, as `moefq qdq --amax` does.

def test_public_operations_refuse_a_zero_amax():
    x = np.linspace(-3, 3, 64, dtype=np.float32).reshape(2, 32)
    for amax in (0, 0.0, -0.0, np.zeros(1, np.float32)):
        with pytest.raises(ValueError, match="qdq: amax must be a finite number > 0, got"):
            moefq.qdq(x, "fp8", amax)
    rows = to_bf16_bits(np.ones((2, 3, 32), np.float32))
    with pytest.raises(ValueError, match="combine_qdq_resum: amax must be a finite number > 0, got 0"):
        moefq.combine_qdq_resum(rows, "nvfp4", 0.0)
    assert first_mismatch(moefq.qdq(x, "fp8", 1e-30), moefq.qdq(x, "fp8", 1.0)) is None  # a tiny amax is fine


def test_stored_zero_amax_still_quantizes():
    # A quantizer calibrated on all-zero data holds 0; its qdq and the torch combine module use it.
    q = moefq.Quantizer("layers.0.q", "fp8", amax=0.0)
    x = np.linspace(-3, 3, 32, dtype=np.float32).reshape(2, 16)
    assert first_mismatch(q.qdq(x), moefq.qdq(x, "fp8", 1.0)) is None
    torch = pytest.importorskip("torch")
    import moefq.torch as mt
    m = mt.CombineQuantizer("fp8", amax=0.0)
    rows = torch.linspace(-3, 3, 2 * 3 * 32).reshape(2, 3, 32).to(torch.bfloat16).requires_grad_()
    weights = torch.full((3, 2), 0.5, requires_grad=True)
    got = m(rows, topk_idx=torch.zeros((3, 2), dtype=torch.int32), topk_weights=weights)
    got.float().sum().backward()  # the weights' gradient QDQs the rows again, with the same amax
    assert weights.grad is not None and torch.isfinite(weights.grad).all()
    # docs/numerics.md: fp8 with an amax <= 2^-24 uses 1.
    want = moefq.combine_qdq_resum(rows.detach(), "fp8", 1.0, topk_weights=weights.detach())
    assert torch.equal(got.detach().view(torch.int16), want.view(torch.int16))


@pytest.mark.parametrize("bad", ["3", b"3", True, None, [1.0]])
def test_amax_must_be_a_real_number(bad):
    x = np.ones((2, 16), np.float32)
    if bad is not None:  # None: no amax (dynamic, or none yet)
        with pytest.raises(TypeError, match="layers.0.q: amax: expected a number, got"):
            moefq.Quantizer("layers.0.q", "fp8", amax=bad)
        with pytest.raises(TypeError, match="qdq: amax: expected a number, got"):
            moefq.qdq(x, "fp8", bad)
        with pytest.raises(TypeError, match="set_calibrated_amax: combine_amax: expected a number, got"):
            layer(recipe="moe_combine_fp8").set_calibrated_amax(1.0, bad)
    q = moefq.Quantizer("layers.0.q", "fp8", amax=2.0)
    with pytest.raises(TypeError, match="layers.0.q: amax: expected a number, got"):
        q.amax = bad
    assert q.amax == 2.0


def test_numpy_scalars_are_numbers():
    q = moefq.Quantizer("layers.0.q", "fp8", amax=np.float32(2.5))
    q.amax = np.int64(3)
    assert q.amax == 3.0
    x = np.ones((2, 16), np.float32)
    assert first_mismatch(moefq.qdq(x, "fp8", np.float64(3.0)), moefq.qdq(x, "fp8", 3.0)) is None


# ---- Routing ids are checked to fit int32 before the conversion (a wrapped id routes elsewhere).

def test_wide_routing_ids_must_fit_int32():
    L = layer()
    x = tokens(1, 4)
    idx, w = L.route(x)
    wide = idx.astype(np.int64)
    assert first_mismatch(L.forward(x, wide, w), L.forward(x, idx, w)) is None
    wide[1, 0] = 2 ** 32  # would wrap to expert 0
    with pytest.raises(ValueError, match=r"forward: topk_idx: ids must fit int32 \(\[-2147483648, 2147483647\]\), "
                                         r"got values in \[-?[0-9]+, 4294967296\]"):
        L.forward(x, wide, w)
    rows = to_bf16_bits(np.ones((2, 3, 32), np.float32))
    for ids in (np.full((3, 2), -2 ** 31 - 1, np.int64), np.full((3, 2), 2 ** 31, np.uint64)):
        with pytest.raises(ValueError, match="combine_qdq_resum: topk_idx: ids must fit int32"):
            moefq.combine_qdq_resum(rows, None, topk_idx=ids)
    torch = pytest.importorskip("torch")
    t = torch.zeros((3, 2), dtype=torch.int64)
    t[2, 1] = 2 ** 40
    with pytest.raises(ValueError, match="combine_qdq_resum: topk_idx: ids must fit int32"):
        moefq.combine_qdq_resum(torch.from_numpy(rows.view(np.int16)).view(torch.bfloat16), None, topk_idx=t)


# ---- Names and keywords.

def test_rank_amax_takes_the_bindings_names_and_indices():
    L = layer(recipe="moe_combine_fp8")
    L.calibrate([tokens(2, 8)])
    assert L.rank_amax(1) == L.rank_amax("combine") and max(L.rank_amax("combine")) == L.combine_amax
    assert L.rank_amax(0) == L.rank_amax("dispatch")
    with pytest.raises(ValueError, match="MoeLayer.rank_amax: which must be 'dispatch' or 'combine', got 'x'"):
        L.rank_amax("x")


@pytest.mark.parametrize("names", ["layers.0.mlp.experts.combine_quantizer", b"layers.0"])
def test_apply_recipe_wants_a_list_of_names(names):
    kind = type(names).__name__
    with pytest.raises(TypeError, match=f"apply_recipe: quantizer_names must be a list of names, got a {kind}$"):
        moefq.apply_recipe("moe_combine_nvfp4", names)
    one = ["layers.0.mlp.experts.combine_quantizer"]
    assert list(moefq.apply_recipe("moe_combine_nvfp4", tuple(one))) == one


def test_eval_layers_are_integers():
    for layers in (0.7, [0, 0.7], [None]):
        with pytest.raises(TypeError, match="layers: expected a string such as"):
            moefq.eval(preset="tiny", device="cpu", layers=layers)
    report = moefq.eval(preset="tiny", device="cpu", layers=np.int64(1), ranks=1, tokens=8, calib_batches=1,
                        eval_batches=1, threads=1, recipes="moe_combine_fp8")
    assert [r["layer"] for r in report["results"]] == [1]


def test_load_safetensors_framework(tmp_path):
    path = tmp_path / "a.safetensors"
    moefq.save_safetensors(path, {"a": np.arange(4, dtype=np.int32)})
    with pytest.raises(ValueError, match="framework must be 'numpy' or 'torch', got 'jax'"):
        moefq.load_safetensors(path, framework="jax")
    assert moefq.load_safetensors(path)["a"].tolist() == [0, 1, 2, 3]


def test_eval_recipe_root(tmp_path):
    # A whole-model recipe of the test tree copied outside it: its imports are found only under
    # recipe_root.
    name = "moe_dispatch_fp8-combine_nvfp4-kv_fp8"
    recipe = tmp_path / f"{name}.yaml"
    with open(os.path.join(MODELOPT_ROOT, "general", "ptq", f"{name}.yaml")) as f:
        recipe.write_text(f.read())
    run = dict(preset="tiny", layers=[0, 3], device="cpu", ranks=2, tokens=16, calib_batches=1, eval_batches=1,
               threads=1, recipes=[recipe])
    with pytest.raises(ValueError) as e:
        moefq.eval(**run)
    assert "cannot find 'configs/ptq/units/base_disable_all'" in str(e.value), str(e.value)
    assert "recipe_root" in str(e.value) and "--" not in str(e.value), str(e.value)
    with pytest.raises(ValueError, match="recipe_root=.*missing: not a directory"):
        moefq.eval(**run, recipe_root=tmp_path / "missing")
    report = moefq.eval(**run, recipe_root=MODELOPT_ROOT)
    assert report["config"]["recipes"] == [name]
    formats = {r["layer"]: (r["dispatch_format"], r["combine_format"]) for r in report["results"]}
    assert formats == {0: ("fp8", "nvfp4"), 3: ("fp8", None)}, formats  # the recipe turns layer 3's combine off


# ---- Calibration aborts through the binding (which restores what start_calibration found).

def test_abort_calibration_is_the_bindings():
    assert moefq.Quantizer.abort_calibration is moefq._moefq.Quantizer.abort_calibration
    L = layer(recipe="moe_combine_fp8")
    L.set_calibrated_amax(1.0, 3.0)
    L.start_calibration()
    L.forward(to_bf16_bits(np.full((8, H), 40.0, np.float32)))
    L.abort_calibration()
    assert L.combine_amax == 3.0 and not any(L.combine_quantizer(r).calibrating for r in range(L.ranks))
