"""Objects used from several threads at once, and tensors that cannot exist: a layer validates the
routing it uses (a copy, so another thread writing the caller's ids cannot slip past the check),
serializes the calls that share its workspace, and a DLPack shape whose element count or byte
size overflows is a ValueError wherever it enters."""

import os
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest

import moefq
from conftest import special_data, to_bf16_bits

H = 1024  # the tiny preset's hidden size


def tokens(seed, n):
    return to_bf16_bits(special_data(np.random.default_rng(seed), n, H, finite=True))


def run_python(code, timeout=240):
    """Runs `code` in a fresh interpreter (a crash there fails the test instead of ending pytest)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True,
                          timeout=timeout)


def run_in_threads(work, n):
    """work(k) on n threads at once, k = 0..n-1; returns when all have ended."""
    threads = [threading.Thread(target=work, args=(k,)) for k in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


# ---- The ids a forward validated are the ids it uses.

def test_forward_uses_the_ids_it_validated_while_another_thread_writes_them():
    torch = pytest.importorskip("torch")
    del torch
    r = run_python("""
        import random, threading, time, numpy as np, torch, moefq
        L = moefq.MoeLayer("tiny", ranks=2, max_tokens=256, threads=1)
        x = torch.from_numpy(np.random.default_rng(1).standard_normal((512, 1024), dtype=np.float32)).bfloat16()
        idx, w = L.route(x)
        good = idx.clone()
        bad = torch.full_like(idx, 1 << 30)       # far past every expert
        stop = threading.Event()
        def writer():
            # Good and bad for random spans about as long as a forward: some calls check good ids
            # and would then read bad ones (torch releases the GIL while it copies).
            while not stop.is_set():
                idx.copy_(good)
                time.sleep(random.random() * 0.004)
                idx.copy_(bad)
                time.sleep(random.random() * 0.004)
        t = threading.Thread(target=writer)
        t.start()
        ok = refused = 0
        try:
            for _ in range(300):
                try:
                    L.forward(x, idx, w)
                    ok += 1
                except ValueError as e:
                    assert "expert" in str(e), e
                    refused += 1
        finally:
            stop.set()
            t.join()
        print("calls", ok, refused)
    """)
    assert r.returncode == 0, f"exit {r.returncode}\n{r.stdout}\n{r.stderr[-3000:]}"
    assert "calls" in r.stdout


# ---- One layer, several threads: each call gets the serial result.

@pytest.mark.parametrize("shared", [True, False])
def test_concurrent_forward_on_one_layer_matches_serial(shared):
    L = moefq.MoeLayer("tiny", ranks=4, max_tokens=64, threads=1)
    xs = [tokens(100 + i, 64 + 32 * (i % 3)) for i in range(12)]
    serial = [L.forward(x, include_shared=shared) for x in xs]
    results = [None] * len(xs)
    errors = []
    barrier = threading.Barrier(4)

    def work(k):
        barrier.wait()
        for i in range(k, len(xs), 4):
            for _ in range(3):
                try:
                    results[i] = L.forward(xs[i], include_shared=shared)
                except Exception as e:  # noqa: BLE001 - any error is a failure, reported below
                    errors.append(repr(e))
                if results[i] is not None and not np.array_equal(results[i], serial[i]):
                    errors.append(f"call {i} differs from the serial result")

    run_in_threads(work, 4)
    assert errors == []
    for got, want in zip(results, serial):
        np.testing.assert_array_equal(got, want)


def test_concurrent_calibration_and_configure_on_one_layer():
    """Calls that change a layer's state (configure, calibration, amax) wait for a forward on
    another thread: no call sees a half-changed layer, and the results are those of some serial order."""
    L = moefq.MoeLayer("tiny", ranks=2, max_tokens=64, threads=1, recipe="moe_combine_fp8")
    x = tokens(7, 128)
    L.set_calibrated_amax(2.0, 2.0)
    expected = L.forward(x)
    errors = []
    stop = threading.Event()

    def forwards():
        while not stop.is_set():
            try:
                y = L.forward(x)
                if not np.array_equal(y, expected):
                    errors.append("forward differs")
            except Exception as e:  # noqa: BLE001
                errors.append(repr(e))

    t = threading.Thread(target=forwards)
    t.start()
    try:
        for _ in range(20):
            L.set_calibrated_amax(2.0, 2.0)
            assert L.combine_amax == 2.0
            assert L.rank_amax("combine") is not None
            L.dispatch_quantizer(1)
            L.layout_checked(0)
    finally:
        stop.set()
        t.join()
    assert errors == []


def test_collect_outside_calibration_is_a_value_error():
    q = moefq.Quantizer("q", "fp8")
    with pytest.raises(ValueError, match="q: collect called outside calibration"):
        q.collect(np.ones(4, np.float32))
    with pytest.raises(ValueError, match="q: collect_max called outside calibration"):
        q.collect_max(1.0)
    with pytest.raises(ValueError, match="q: finish_calibration called outside calibration"):
        q.finish_calibration()


def test_quantizer_state_changes_wait_for_collects():
    """collect may run from several threads; a finish on another thread waits for the collects in
    flight, so it stores a max that includes every collect that started before it."""
    q = moefq.Quantizer("q", "fp8")
    data = [np.full(1 << 16, float(i + 1), np.float32) for i in range(16)]
    for _ in range(3):
        q.start_calibration()
        threads = [threading.Thread(target=q.collect, args=(d,)) for d in data]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        q.finish_calibration()
        assert q.amax == 16.0


# ---- A shape whose element count or byte size overflows is refused where tensors enter.

def capsule_with_shape(arr, shape):
    import ctypes

    cap = arr.__dlpack__()
    ctypes.pythonapi.PyCapsule_GetPointer.restype = ctypes.c_void_p
    ctypes.pythonapi.PyCapsule_GetPointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
    ptr = ctypes.pythonapi.PyCapsule_GetPointer(cap, b"dltensor")

    class DLDevice(ctypes.Structure):
        _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]

    class DLDataType(ctypes.Structure):
        _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]

    class DLTensor(ctypes.Structure):
        _fields_ = [("data", ctypes.c_void_p), ("device", DLDevice), ("ndim", ctypes.c_int32),
                    ("dtype", DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                    ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]

    t = DLTensor.from_address(ptr)
    assert t.ndim == len(shape)
    for i, d in enumerate(shape):
        t.shape[i] = d
    t.strides = None
    return cap


class Hostile:
    """Hands out a capsule of `arr` whose shape says `shape` (a producer that lies or overflows)."""

    def __init__(self, arr, shape):
        self.arr, self.shape_ = arr, shape

    def __dlpack__(self, stream=None):
        return capsule_with_shape(self.arr, self.shape_)

    def __dlpack_device__(self):
        return (1, 0)


@pytest.mark.parametrize("shape", [(1 << 32, 1 << 32), (1 << 62, 4), (3, 1 << 62, 1 << 40), (1 << 61, 8)])
def test_overflowing_shape_is_a_value_error(shape):
    if not hasattr(np.ndarray, "__dlpack__"):
        pytest.skip("numpy without __dlpack__")
    r = run_python(f"""
        import numpy as np, moefq, sys
        sys.path.insert(0, {os.path.dirname(__file__)!r})
        from test_bindings_hardening_threads import Hostile
        shape = {shape!r}
        arr = np.zeros((1,) * len(shape), np.float32)
        for call in (lambda h: moefq.metrics(h, h), lambda h: moefq.qdq(h, "fp8", 1.0, out=np.zeros(1, np.float32)),
                     lambda h: moefq.qdq(h, "mxfp8", out=np.zeros(1, np.float32))):
            try:
                call(Hostile(arr, shape))
            except ValueError as e:
                assert "overflow" in str(e), e
                print("refused:", e)
            else:
                raise SystemExit("accepted " + repr(shape))
    """)
    assert r.returncode == 0, f"exit {r.returncode}\n{r.stdout}\n{r.stderr[-3000:]}"
    assert r.stdout.count("refused:") == 3
