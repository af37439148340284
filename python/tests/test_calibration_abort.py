"""A calibration that fails leaves a quantizer (and a MoeLayer) as it was before: its previous amax,
not calibrating, so it quantizes again instead of passing data through unquantized. Also: a
moefq.Quantizer survives copy.deepcopy and pickle, and the package namespace holds only its API."""

import copy
import pickle

import numpy as np
import pytest

import moefq
from conftest import first_mismatch, special_data, to_bf16_bits

H = 1024  # the tiny preset's hidden size


def data(seed, rows=4, cols=64, scale=1.0):
    return (np.random.default_rng(seed).standard_normal((rows, cols)) * scale).astype(np.float32)


def quantizes(q, x):
    """Whether q changes x (QDQ applied) rather than passing it through."""
    return first_mismatch(q.qdq(x.copy()), x) is not None


@pytest.mark.parametrize("error", ["nan", "interrupt", "runtime"])
def test_error_inside_calibrate_restores_the_quantizer(error):
    q = moefq.Quantizer("layers.0.mlp.experts.combine_quantizer", "nvfp4", amax=4.0)
    x = data(1, scale=10.0)
    want = q.qdq(x.copy())
    raised = {"nan": ValueError, "interrupt": KeyboardInterrupt, "runtime": RuntimeError}[error]
    with pytest.raises(raised):
        with q.calibrate():
            q.collect(data(2, scale=50.0))  # a larger max, which must not be stored
            if error == "nan":
                q.collect(np.full((2, 16), np.nan, dtype=np.float32))
            raise raised("from the calibration loop")
    assert not q.calibrating
    assert q.amax == 4.0
    assert first_mismatch(q.qdq(x.copy()), want) is None
    with q.calibrate():  # and it calibrates again
        q.collect(x)
    assert q.amax == float(np.abs(x).max())


def test_calibrate_without_data_is_refused_and_changes_nothing():
    fresh = moefq.Quantizer("q.fresh", "fp8")
    with pytest.raises(ValueError, match="no calibration data reached q.fresh"):
        with fresh.calibrate():
            pass
    assert not fresh.calibrating and fresh.amax is None
    with pytest.raises(ValueError, match="no amax yet"):
        fresh.qdq(data(3))  # still uncalibrated: refused, not passed through

    held = moefq.Quantizer("q.held", "int8", amax=3.0)
    with pytest.raises(ValueError, match="no calibration data reached q.held"):
        with held.calibrate():
            pass
    assert not held.calibrating and held.amax == 3.0 and quantizes(held, data(4, scale=5.0))


def test_abort_calibration():
    q = moefq.Quantizer("q", "fp8", amax=2.0)
    q.start_calibration()
    q.collect(data(5, scale=100.0))
    q.abort_calibration()
    assert not q.calibrating and q.amax == 2.0 and quantizes(q, data(6, scale=5.0))
    fresh = moefq.Quantizer("q2", "nvfp4")
    fresh.start_calibration()
    fresh.collect(data(7))
    fresh.abort_calibration()
    assert not fresh.calibrating and fresh.amax is None
    constant = moefq.Quantizer("q3", "fp8", constant_amax=448.0)
    with pytest.raises(KeyboardInterrupt):
        with constant.calibrate():
            raise KeyboardInterrupt
    assert not constant.calibrating and constant.amax == 448.0


def layer_tokens(seed, n):
    return to_bf16_bits(special_data(np.random.default_rng(seed), n, H, finite=True))


def test_layer_calibrate_error_restores_the_layer():
    layer = moefq.MoeLayer("tiny", ranks=2, max_tokens=16, threads=1, recipe="moe_combine_nvfp4")
    calib, x = layer_tokens(30, 32), layer_tokens(31, 32)
    amax = layer.calibrate([calib])
    want = layer.forward(x)
    bad_shape = layer_tokens(32, 8)[:, :512].copy()
    nan = layer_tokens(33, 32)
    nan[3, 7] = 0x7FC0  # a bf16 NaN
    for batches in ([calib * 0 + 0x4780, bad_shape], [nan], []):  # 0x4780: 65536, a larger max first
        with pytest.raises(ValueError):
            layer.calibrate(batches)
        assert not layer.dispatch_quantizer().calibrating and not layer.combine_quantizer().calibrating
        assert (layer.dispatch_amax, layer.combine_amax) == amax
        assert first_mismatch(layer.forward(x), want) is None  # quantized as before, not passed through
    fresh = moefq.MoeLayer("tiny", ranks=2, max_tokens=16, threads=1, recipe="moe_combine_nvfp4")
    with pytest.raises(ValueError, match="no calibration data reached"):
        fresh.calibrate([])
    assert not fresh.combine_quantizer().calibrating and fresh.combine_amax is None
    assert fresh.calibrate([calib]) == amax


def test_quantizer_deepcopy_and_pickle():
    specs = [moefq.Quantizer("a", "nvfp4", amax=12.5), moefq.Quantizer("b", "fp8", constant_amax=448.0),
             moefq.Quantizer("c", "mxfp8", enabled=False), moefq.Quantizer("d", "fp8", amax_source="dynamic"),
             moefq.Quantizer("e", "int8")]
    x = data(8, scale=3.0)
    for q in specs:
        for other in (copy.deepcopy(q), pickle.loads(pickle.dumps(q))):
            assert isinstance(other, moefq.Quantizer) and other is not q
            assert (other.name, other.spec, other.enabled, other.amax) == (q.name, q.spec, q.enabled, q.amax)
            if q.amax is not None or not q.needs_calibration:
                assert first_mismatch(other.qdq(x.copy()), q.qdq(x.copy())) is None
    q = moefq.Quantizer("f", "fp8")
    q.start_calibration()
    with pytest.raises(TypeError, match="f: cannot copy or pickle a quantizer while it calibrates"):
        copy.deepcopy(q)


def test_namespace_is_the_api():
    for helper in ("capsule", "empty", "empty_like", "stream_of", "check_tensor", "json", "os", "contextlib"):
        assert not hasattr(moefq, helper), helper
    assert set(moefq.__all__) <= set(dir(moefq))
    # The package's own submodules appear as attributes once something imported them.
    submodules = {"torch", "hf", "compare", "bench_hf"}
    public = {n for n in dir(moefq) if not n.startswith("_")} - submodules
    assert public <= set(moefq.__all__), public - set(moefq.__all__)
