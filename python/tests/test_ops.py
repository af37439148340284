"""moefq.qdq and moefq.combine_qdq_resum on numpy arrays: bit-identical to `moefq qdq` and to the
combine rule computed here from the QDQ'd rows, zero-copy, and errors with the library's messages."""

import numpy as np
import pytest

import moefq
from conftest import first_mismatch, from_bf16_bits, run_cli, special_data, to_bf16_bits

FORMATS = ["fp8", "nvfp4", "mxfp8", "mxfp4", "int8"]


def cli_qdq(binary, tmp_path, x, fmt, amax=None):
    src, dst = tmp_path / "in.safetensors", tmp_path / "out.safetensors"
    moefq.save_safetensors(src, {"x": x})
    args = ["qdq", "--in", src, "--out", dst, "--format", fmt, "--device", "cpu"]
    if amax is not None:
        args += ["--amax", repr(amax)]
    rc, out = run_cli(binary, *args)
    assert rc == 0, out
    return moefq.load_safetensors(dst)["x"]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", ["bf16", "f32"])
def test_qdq_matches_cli(moefq_binary, tmp_path, fmt, dtype):
    rng = np.random.default_rng(7)
    for finite, amax in ((True, None), (False, 37.5)):
        x = special_data(rng, 24, 128, finite=finite)
        if dtype == "bf16":
            x = to_bf16_bits(x)
        want = cli_qdq(moefq_binary, tmp_path, x, fmt, amax)
        got = moefq.qdq(x, fmt, amax)
        assert got.dtype == x.dtype and got.shape == x.shape
        assert first_mismatch(got, want) is None, (fmt, dtype, amax, first_mismatch(got, want))
        assert first_mismatch(got, x) is not None  # QDQ changed something: the comparison can fail


def test_qdq_out_and_in_place_share_memory():
    x = to_bf16_bits(special_data(np.random.default_rng(1), 8, 64, finite=True))
    expected = moefq.qdq(x, "nvfp4", 20.0)
    out = np.empty_like(x)
    assert moefq.qdq(x, "nvfp4", 20.0, out=out) is out
    assert first_mismatch(out, expected) is None
    ptr = x.ctypes.data
    y = moefq.qdq(x, "nvfp4", 20.0, out=x)
    assert y is x and x.ctypes.data == ptr
    assert first_mismatch(x, expected) is None


def test_qdq_dynamic_amax_is_the_tensor_max():
    x = special_data(np.random.default_rng(2), 4, 64, finite=True)
    amax = float(np.max(np.abs(x)))
    assert first_mismatch(moefq.qdq(x, "fp8"), moefq.qdq(x, "fp8", amax)) is None
    assert first_mismatch(moefq.qdq(x, "fp8"), moefq.qdq(x, "fp8", amax * 2)) is not None


def test_qdq_errors():
    x = np.ones((4, 64), dtype=np.float32)
    with pytest.raises(ValueError, match="qdq: format: unknown format 'fp7'"):
        moefq.qdq(x, "fp7")
    with pytest.raises(ValueError, match=r"qdq: x has dtype int32; expected bfloat16 or float32"):
        moefq.qdq(np.ones((4, 64), dtype=np.int32), "fp8", 1.0)
    with pytest.raises(ValueError, match=r"qdq: out has shape \[4, 32\] but qdq: x has \[4, 64\]"):
        moefq.qdq(x, "fp8", 1.0, out=np.empty((4, 32), dtype=np.float32))
    with pytest.raises(ValueError, match="not contiguous"):
        moefq.qdq(np.ones((64, 4), dtype=np.float32).T, "fp8", 1.0)
    with pytest.raises(ValueError, match="amax must be a finite number > 0, got -1"):
        moefq.qdq(x, "fp8", -1.0)
    buf = np.ones(5 * 64, dtype=np.float32)
    with pytest.raises(ValueError, match="qdq: out overlaps x without being x"):
        moefq.qdq(buf[:256].reshape(4, 64), "fp8", 1.0, out=buf[64:].reshape(4, 64))
    with pytest.raises(TypeError, match="expected a torch tensor, a numpy array"):
        moefq.qdq([1.0, 2.0], "fp8", 1.0)
    ro = np.ones((2, 64), dtype=np.float32)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        moefq.qdq(ro, "fp8", 1.0)


def fma32(v, w, acc):
    """float32 fma(v, w, acc) with one rounding, elementwise: the product is exact in float64, the
    two-sum s + err is the exact sum, and err decides the one case where rounding s to float32
    differs from rounding the exact sum (s on a float32 midpoint)."""
    p = v.astype(np.float64) * np.float64(w)
    a = acc.astype(np.float64)
    s = p + a
    bb = s - p
    err = (p - (s - bb)) + (a - bb)
    r = s.astype(np.float32)
    toward = np.where(s > r.astype(np.float64), np.float32(np.inf), np.float32(-np.inf))
    n = np.nextafter(r, toward)
    mid = (r.astype(np.float64) + n.astype(np.float64)) / 2
    fix = (s == mid) & (err != 0) & ((err > 0) == (n > r))
    return np.where(fix, n, r).astype(np.float32)


def combine_oracle(rows, fmt, amax, shared=None, topk_idx=None, topk_weights=None):
    """The combine rule written out: per token, the active rows QDQ'd (moefq.qdq, checked against
    the CLI above), each added as fma(row, weight, acc) with one rounding when topk_weights is
    given, summed in fp32 from +0 in ascending slot order, the shared row added last, one bf16
    rounding (numpy's float32 operations round to nearest even, as the engine's do)."""
    K, T, H = rows.shape
    y = np.empty((T, H), dtype=np.uint16)
    for t in range(T):
        acc = np.zeros(H, dtype=np.float32)
        for k in range(K):
            if topk_idx is not None and topk_idx[t, k] < 0:
                continue
            row = rows[k, t].copy()
            if fmt is not None:
                row = moefq.qdq(row, fmt, amax)
            v = from_bf16_bits(row)
            acc = fma32(v, topk_weights[t, k], acc) if topk_weights is not None else acc + v
        if shared is not None:
            acc = acc + from_bf16_bits(shared[t])
        y[t] = to_bf16_bits(acc)
    return y


def routed_rows(rng, K, T, H):
    """[K, T, H] bf16 rows and [T, K] ids: each token routes 1..K slots, the others hold zero rows."""
    rows = to_bf16_bits(special_data(rng, K * T, H, finite=True)).reshape(K, T, H)
    idx = np.arange(T * K, dtype=np.int32).reshape(T, K)
    for t in range(T):
        for k in range(1 + t % K, K):
            rows[k, t] = 0
            idx[t, k] = -1
    return rows, idx


@pytest.mark.parametrize("fmt", [None] + FORMATS)
def test_combine_matches_the_rule(fmt):
    rng = np.random.default_rng(3)
    rows, idx = routed_rows(rng, 8, 6, 256)
    shared = to_bf16_bits(special_data(rng, 6, 256, finite=True))
    amax = float(np.max(np.abs(from_bf16_bits(rows))))
    for sh in (None, shared):
        want = combine_oracle(rows, fmt, amax, sh)
        got = moefq.combine_qdq_resum(rows, fmt, amax, shared=sh)
        assert got.shape == (6, 256) and got.dtype == np.uint16
        assert first_mismatch(got, want) is None, (fmt, first_mismatch(got, want))
    if fmt is not None:  # the QDQ is applied: the plain sum differs
        assert first_mismatch(moefq.combine_qdq_resum(rows, None), moefq.combine_qdq_resum(rows, fmt, amax)) is not None


@pytest.mark.parametrize("fmt", [None, "nvfp4", "mxfp8"])
def test_combine_weighted_after_matches_the_rule(fmt):
    rng = np.random.default_rng(9)
    rows, idx = routed_rows(rng, 8, 6, 256)
    shared = to_bf16_bits(special_data(rng, 6, 256, finite=True))
    weights = rng.uniform(0.01, 1.5, size=(6, 8)).astype(np.float32)
    amax = float(np.max(np.abs(from_bf16_bits(rows))))
    want = combine_oracle(rows, fmt, amax, shared, idx, weights)
    got = moefq.combine_qdq_resum(rows, fmt, amax, shared=shared, topk_idx=idx, topk_weights=weights)
    assert first_mismatch(got, want) is None, (fmt, first_mismatch(got, want))
    unweighted = moefq.combine_qdq_resum(rows, fmt, amax, shared=shared, topk_idx=idx)
    assert first_mismatch(got, unweighted) is not None  # the weights were applied
    ones = np.ones((6, 8), dtype=np.float32)
    got_ones = moefq.combine_qdq_resum(rows, fmt, amax, shared=shared, topk_idx=idx, topk_weights=ones)
    assert first_mismatch(got_ones, unweighted) is None
    with pytest.raises(ValueError, match="topk_weights"):
        moefq.combine_qdq_resum(rows, fmt, amax, topk_weights=weights[:, :4].copy())


def test_combine_skips_inactive_slots():
    rng = np.random.default_rng(4)
    rows, idx = routed_rows(rng, 4, 5, 64)
    want = moefq.combine_qdq_resum(rows, "nvfp4", 30.0)
    garbage = rows.copy()
    garbage[idx.T < 0] = to_bf16_bits(np.full(64, 5.0, dtype=np.float32))
    assert first_mismatch(moefq.combine_qdq_resum(garbage, "nvfp4", 30.0), want) is not None
    got = moefq.combine_qdq_resum(garbage, "nvfp4", 30.0, topk_idx=idx.astype(np.int64))
    assert first_mismatch(got, want) is None


def test_combine_errors():
    rows = np.zeros((2, 3, 64), dtype=np.uint16)
    with pytest.raises(ValueError, match="combine_qdq_resum: nvfp4 needs an amax"):
        moefq.combine_qdq_resum(rows, "nvfp4")
    with pytest.raises(ValueError, match=r"rows has shape \[3, 64\]; expected \[K, T, H\]"):
        moefq.combine_qdq_resum(rows[0], None)
    with pytest.raises(ValueError, match="must be 1..32"):
        moefq.combine_qdq_resum(np.zeros((33, 1, 64), dtype=np.uint16), None)
    with pytest.raises(ValueError, match=r"shared has shape \[3, 32\]; expected \[3, 64\]"):
        moefq.combine_qdq_resum(rows, None, shared=np.zeros((3, 32), dtype=np.uint16))
    with pytest.raises(ValueError, match=r"rows has dtype float32; expected bfloat16"):
        moefq.combine_qdq_resum(np.zeros((2, 3, 64), dtype=np.float32), None)
    with pytest.raises(ValueError, match=r"topk_idx has shape \[2, 3\]; expected \[3, 2\]"):
        moefq.combine_qdq_resum(rows, None, topk_idx=np.zeros((2, 3), dtype=np.int32))


def test_formats_and_version():
    assert set(FORMATS) <= set(moefq.formats)
    assert moefq.__version__
    assert moefq.cuda_device_count() >= 0


def test_recipes_and_quantizer(tmp_path):
    names = ["layers.0.mlp.experts.dispatch_quantizer", "layers.0.mlp.experts.combine_quantizer"]
    configs = moefq.apply_recipe(moefq.load_recipe("moe_combine_nvfp4"), names)
    assert not configs[names[0]].enable
    assert configs[names[1]].enable and configs[names[1]].spec.format == "nvfp4"
    with pytest.raises(ValueError, match="'nope' is neither a recipe file.*nor a unit"):
        moefq.load_recipe("nope")
    q = moefq.Quantizer(names[1], "nvfp4")
    x = special_data(np.random.default_rng(12), 4, 64, finite=True)
    with q.calibrate():
        q.collect(x)
        assert first_mismatch(q.qdq(x), x) is None  # no QDQ while calibrating
    assert q.amax == float(np.max(np.abs(x)))
    assert first_mismatch(q.qdq(x), moefq.qdq(x, "nvfp4", q.amax)) is None
    q.save(tmp_path / "calib.json")
    other = moefq.Quantizer(names[1], "nvfp4")
    other.load(tmp_path / "calib.json")
    assert other.amax == q.amax
    bad = x.copy()
    bad[0, 0] = np.nan
    with pytest.raises(ValueError, match=names[1] + ": calibration data contains NaN"):
        with q.calibrate():
            q.collect(bad)
