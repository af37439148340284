"""The extension module's guards: no forward with an amax a quantizer does not have, no in-place
layer forward, every refused tensor released, concurrent calibration that keeps the maximum,
calibration that can be aborted, Ctrl-C that stops eval and calibrate, and error types and messages
that name the Python argument."""

import gc
import os
import signal
import sys
import threading
import time

import numpy as np
import pytest

import moefq
from conftest import first_mismatch, special_data, to_bf16_bits

RANKS, TOKENS, H = 2, 16, 1024  # the tiny preset's hidden size


def tokens(seed, n):
    return to_bf16_bits(special_data(np.random.default_rng(seed), n, H, finite=True))


def layer(**kw):
    return moefq.MoeLayer("tiny", ranks=RANKS, max_tokens=TOKENS, threads=1, **kw)


# ---- A layer that would quantize with an amax it does not have refuses to run.

@pytest.mark.parametrize("recipe", ["moe_combine_nvfp4", "moe_dispatch_fp8"])
def test_forward_without_amax_is_refused(recipe):
    x = tokens(1, 8)
    L = layer(recipe=recipe)
    name = L.quantizer_names[1 if "combine" in recipe else 0]
    with pytest.raises(ValueError, match=f"{name}: no amax yet: calibrate it"):
        L.forward(x)
    L.start_calibration()
    L.forward(x)  # calibrating: no QDQ, no amax needed
    L.finish_calibration()
    calibrated = L.forward(x)
    # Configured again: the quantizers are new and hold no amax until it is set.
    L.configure(recipe)
    with pytest.raises(ValueError, match="no amax yet"):
        L.forward(x)
    L.set_calibrated_amax(1.0, 1.0)
    assert L.forward(x).shape == calibrated.shape
    # A disabled or unconfigured quantizer needs nothing.
    L.configure(None)
    L.forward(x)


# ---- MoeLayer.forward cannot run in place.

def test_forward_refuses_out_overlapping_its_inputs():
    L = layer()
    x = tokens(2, 8)
    idx, w = L.route(x)
    with pytest.raises(ValueError, match="MoeLayer.forward: out overlaps x; pass a separate out tensor"):
        L.forward(x, idx, w, out=x)
    with pytest.raises(ValueError, match="out overlaps x"):
        L.forward(x, idx, w, out=x, include_shared=False)
    big = np.concatenate([x, x[:1]])
    with pytest.raises(ValueError, match="out overlaps x"):
        L.forward(big[:8], idx, w, out=big[1:])  # a partial overlap
    # The routing shares memory with out: a buffer viewed as out [8, H] bf16 and as the routing.
    buf = np.zeros(8 * H, np.uint16)
    out = buf.reshape(8, H)
    idx_alias = buf[: 8 * 8 * 2].view(np.int32).reshape(8, 8)
    idx_alias[...] = idx
    with pytest.raises(ValueError, match="out overlaps topk_idx"):
        L.forward(x, idx_alias, w, out=out)
    w_alias = buf[8 * H // 2: 8 * H // 2 + 8 * 8 * 2].view(np.float32).reshape(8, 8)
    w_alias[...] = w
    with pytest.raises(ValueError, match="out overlaps topk_weights"):
        L.forward(x, idx, w_alias, out=out)
    # Separate memory is fine and gives what a new out gets.
    y = np.empty_like(x)
    assert L.forward(x, idx, w, out=y) is y
    assert first_mismatch(y, L.forward(x, idx, w)) is None


# ---- A tensor the binding refuses is released (its DLPack deleter runs).

def test_refused_numpy_array_is_released():
    a = np.ones((256, 64), np.float32).T  # not contiguous
    before = sys.getrefcount(a)
    for _ in range(20):
        with pytest.raises(ValueError, match="is not contiguous"):
            moefq.qdq(a, "fp8", 1.0)
    assert sys.getrefcount(a) == before  # numpy's capsule holds a reference until the deleter runs


def rss_mib():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def test_refused_torch_tensors_do_not_leak():
    torch = pytest.importorskip("torch")
    for _ in range(5):  # warm-up: allocator pools
        with pytest.raises(ValueError):
            moefq.qdq(torch.randn(256, 1024).t(), "fp8", 1.0)
    gc.collect()
    start = rss_mib()
    for _ in range(200):  # 1 MiB each
        with pytest.raises(ValueError, match="is not contiguous"):
            moefq.qdq(torch.randn(256, 1024).t(), "fp8", 1.0)
    gc.collect()
    assert rss_mib() - start < 50


# ---- Concurrent collects on one quantizer keep the maximum.

def test_concurrent_collect_keeps_the_maximum():
    big = np.full((1 << 22,), 1.0, np.float32)   # long collects that started before ...
    peak = np.full((16,), 100.0, np.float32)     # ... a short one with the maximum
    for _ in range(3):
        q = moefq.Quantizer("layers.0.q", "fp8")
        q.start_calibration()
        workers = [threading.Thread(target=q.collect, args=(big,)) for _ in range(3)]
        for t in workers:
            t.start()
        q.collect(peak)
        for t in workers:
            t.join()
        assert q.collected_max == 100.0
        q.finish_calibration()
        assert q.amax == 100.0


# ---- Calibration can be aborted: the state before start_calibration comes back.

def test_quantizer_abort_calibration():
    q = moefq.Quantizer("layers.0.q", "nvfp4", amax=4.0)
    q.abort_calibration()  # not calibrating: nothing happens
    assert q.amax == 4.0 and not q.calibrating
    q.start_calibration()
    q.collect(np.full((2, 16), 9.0, np.float32))
    q.abort_calibration()
    assert q.amax == 4.0 and not q.calibrating and not q.seen_data and q.collected_max == 0.0
    x = np.linspace(-8, 8, 64, dtype=np.float32).reshape(2, 32)
    assert first_mismatch(q.qdq(x), moefq.qdq(x, "nvfp4", 4.0)) is None
    # A set_amax during the calibration is undone too; a quantizer that had none has none again.
    q.start_calibration()
    q.set_amax(7.0)
    q.abort_calibration()
    assert q.amax == 4.0
    fresh = moefq.Quantizer("layers.0.r", "fp8")
    fresh.start_calibration()
    fresh.collect(np.ones(4, np.float32))
    fresh.abort_calibration()
    assert fresh.amax is None and not fresh.calibrating
    # A finish that failed (no data) leaves it calibrating; abort then gets it out.
    fresh.start_calibration()
    with pytest.raises(ValueError, match="no calibration data reached layers.0.r"):
        fresh.finish_calibration()
    assert fresh.calibrating
    fresh.abort_calibration()
    assert not fresh.calibrating and fresh.amax is None


def test_layer_abort_calibration():
    x = tokens(3, 8)
    other = to_bf16_bits(50.0 * np.random.default_rng(5).standard_normal((8, H)).astype(np.float32))
    L = layer(recipe="moe_combine_nvfp4")
    L.set_calibrated_amax(2.0, 3.0)
    y = L.forward(x)
    native = L._layer
    native.abort_calibration()  # not calibrating: nothing happens
    native.start_calibration()
    L.forward(other)
    assert L.combine_quantizer().calibrating
    native.abort_calibration()
    for r in range(RANKS):
        assert not L.combine_quantizer(r).calibrating
        assert L.combine_quantizer(r).amax == 3.0
    assert first_mismatch(L.forward(x), y) is None
    # An aborted first calibration leaves no amax: forward refuses again.
    fresh = layer(recipe="moe_combine_nvfp4")
    native = fresh._layer
    native.start_calibration()
    fresh.forward(other)
    native.abort_calibration()
    assert fresh.combine_amax is None
    with pytest.raises(ValueError, match="no amax yet"):
        fresh.forward(x)
    # A finish that failed (no data reached the quantizer) is aborted as a whole.
    native.start_calibration()
    with pytest.raises(ValueError, match="no calibration data reached"):
        native.finish_calibration()
    native.abort_calibration()
    assert not fresh.combine_quantizer().calibrating and fresh.combine_amax is None


# ---- Ctrl-C stops eval and calibrate at the next step; nothing is written.

def interrupt_after(seconds):
    timer = threading.Timer(seconds, lambda: os.kill(os.getpid(), signal.SIGINT))
    timer.start()
    return timer


# Runs of several seconds on one thread, each step well under a second, so that the interrupt at
# 1.5 s falls early in them on a machine several times faster than CI's: eval about 10 s on CI's
# 2-core machine (3 layers, 4 batches of 3 steps each), calibrate about 8 s (12 layers).
LONG_RUN = dict(preset="tiny", ranks=2, tokens=256, calib_batches=1, device="cpu", threads=1)


def test_ctrl_c_stops_eval(tmp_path):
    out = tmp_path / "reports"
    timer = interrupt_after(1.5)
    start = time.monotonic()
    try:
        with pytest.raises(KeyboardInterrupt):
            moefq.eval(**LONG_RUN, layers=[0, 1, 2], eval_batches=4, recipes=["moe_combine_nvfp4", "moe_dispatch_fp8"],
                       out=out)
    finally:
        timer.cancel()
    elapsed = time.monotonic() - start
    assert not out.exists() and list(tmp_path.iterdir()) == []
    # The run stops at its next step (each under a second), well before its end.
    assert elapsed < 4.0, elapsed


def test_ctrl_c_stops_calibrate(tmp_path):
    save = tmp_path / "calib.json"
    timer = interrupt_after(1.5)
    try:
        with pytest.raises(KeyboardInterrupt):
            moefq.calibrate(save, **LONG_RUN, layers=list(range(12)))
    finally:
        timer.cancel()
    assert not save.exists() and list(tmp_path.iterdir()) == []


def test_progress_callback_and_interrupt_checks_coexist():
    lines = []
    report = moefq.eval(preset="tiny", ranks=1, tokens=16, calib_batches=1, eval_batches=1, device="cpu",
                        threads=1, recipes=["moe_combine_nvfp4"], progress=lines.append)
    assert len(lines) == 4 and lines[0].startswith("[1/4] layer 0") and report["results"]

    def boom(line):
        raise KeyError("from the callback")
    with pytest.raises(KeyError, match="from the callback"):
        moefq.eval(preset="tiny", ranks=1, tokens=16, device="cpu", threads=1, progress=boom)
    with pytest.raises(ValueError, match="progress: expected a callable, got <class 'int'>"):
        moefq.eval(preset="tiny", device="cpu", progress=5)


# ---- Error types and messages name the Python argument.

def test_rank_amax_names_a_bad_quantizer():
    L = layer()
    with pytest.raises(ValueError, match="MoeLayer.rank_amax: which must be 'dispatch' or 'combine', got 'x'"):
        L._layer.rank_amax("x")
    with pytest.raises(ValueError, match=r"which must be 0 \(dispatch\) or 1 \(combine\), got 5"):
        L._layer.rank_amax(5)
    assert L._layer.rank_amax("combine") == L._layer.rank_amax(1) == [0.0] * RANKS


def test_layer_too_large_is_refused_up_front():
    with pytest.raises(ValueError, match=r"max_tokens must be at most 2147483647; ranks=1 x max_tokens=1000000000000 "
                                         r"of tiny would need more than [0-9.]+ GiB"):
        moefq.MoeLayer("tiny", max_tokens=10**12)
    with pytest.raises(ValueError, match=r"ranks=2 x max_tokens=100000000 of tiny needs [0-9.]+ GiB of host memory"):
        moefq.MoeLayer("tiny", ranks=2, max_tokens=10**8)


def test_eval_integer_options_out_of_range(tmp_path):
    with pytest.raises(ValueError, match=r"calib_batches=1099511627776 is out of range \(at most 2147483647\)"):
        moefq.eval(preset="tiny", device="cpu", calib_batches=2**40)
    with pytest.raises(ValueError, match=r"seed=18446744073709551616 is out of range \(at most 9223372036854775807\)"):
        moefq.calibrate(tmp_path / "c.json", preset="tiny", device="cpu", seed=2**64)
    with pytest.raises(ValueError, match=r"threads=-2147483649 is out of range \(at least -2147483648\)"):
        moefq.eval(preset="tiny", device="cpu", threads=-2**31 - 1)
    with pytest.raises(ValueError, match="ranks: expected an integer, got <class 'float'>"):
        moefq.eval(preset="tiny", device="cpu", ranks=1.0)
    assert moefq.eval(preset="tiny", device="cpu", ranks=np.int64(1), tokens=8, calib_batches=1, eval_batches=1,
                      threads=1)["config"]["ranks"] == 1


def test_eval_messages_name_keywords(tmp_path):
    base = dict(preset="tiny", device="cpu", tokens=8, calib_batches=1, eval_batches=1, threads=1)
    cases = [
        (dict(ranks=0), "ranks must be >= 1, got 0"),
        (dict(ranks=3), "ranks=3 must divide the 32 routed experts of tiny"),
        (dict(eval_batches=0), "eval_batches must be >= 1, got 0"),
        (dict(max_rel_l2=-1.0), "max_rel_l2 must be a finite number > 0, got -1"),
        (dict(config="/nonexistent/c.json"), "preset and config cannot be used together"),
        (dict(activations="/nonexistent/a.safetensors"), "activations=/nonexistent/a.safetensors: "),
        (dict(layers="0,x"), "layers='0,x': 'x' is not a layer index"),
    ]
    for options, message in cases:
        with pytest.raises(ValueError) as e:
            moefq.eval(**{**base, **options})
        assert message in str(e.value) and "--" not in str(e.value), (options, str(e.value))
    with pytest.raises(ValueError) as e:
        moefq.calibrate(tmp_path / "c.json", preset="tiny", device="cpu", tokens=0)
    assert str(e.value) == "tokens must be >= 1, got 0"


# ---- amax values: a calibration on all-zero data stores 0, as the C++ quantizer does.

def test_zero_calibration_matches_the_cpp_quantizer():
    q = moefq.Quantizer("layers.0.q", "fp8")
    q.start_calibration()
    q.collect(np.zeros((4, 16), np.float32))
    q.finish_calibration()
    assert q.amax == 0.0
    # docs/numerics.md: fp8 with an amax <= 2^-24 uses 1.
    x = np.linspace(-3, 3, 32, dtype=np.float32).reshape(2, 16)
    assert first_mismatch(q.qdq(x), moefq.qdq(x, "fp8", 1.0)) is None
    # A calibrated 0 round-trips through set_calibrated_amax as through a calibration file.
    L = layer(recipe="moe_combine_fp8")
    L.set_calibrated_amax(0.0, 0.0)
    assert L.combine_amax == 0.0
    with pytest.raises(ValueError, match="amax must be a finite number >= 0, got -1"):
        L.set_calibrated_amax(0.0, -1.0)
