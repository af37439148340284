"""What the Python tests share: the built moefq binary (the CLI comparisons), bf16 helpers on numpy
arrays (uint16 bit patterns), and test data with outliers and the special values."""

import os
import shutil
import subprocess

import numpy as np
import pytest


@pytest.fixture(scope="session")
def moefq_binary():
    path = os.environ.get("MOEFQ_BINARY") or shutil.which("moefq")
    if not path or not os.path.exists(path):
        pytest.skip("no moefq binary to compare with (CTest sets MOEFQ_BINARY)")
    return path


def run_cli(binary, *args):
    """Runs the CLI; returns (exit code, stdout + stderr)."""
    p = subprocess.run([binary, *map(str, args)], capture_output=True, text=True)
    return p.returncode, p.stdout + p.stderr


def to_bf16_bits(x):
    """float32 -> bf16 bit patterns (uint16), round to nearest even; NaN stays NaN."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = (u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
    nan = np.isnan(x)
    out = rounded.astype(np.uint16)
    out[nan] = ((u[nan] >> np.uint32(16)) | np.uint32(0x40)).astype(np.uint16)
    return out


def from_bf16_bits(b):
    return (np.asarray(b, dtype=np.uint16).astype(np.uint32) << np.uint32(16)).view(np.float32)


def special_data(rng, rows, cols, finite=False):
    """float32 [rows, cols]: N(0, 1) with outliers, +-0, subnormals and (unless finite) NaN and inf."""
    x = rng.standard_normal((rows, cols)).astype(np.float32)
    flat = x.reshape(-1)
    n = flat.size
    idx = rng.permutation(n)
    flat[idx[: n // 50]] *= 300.0                      # outliers
    flat[idx[n // 50: n // 50 + 4]] = [0.0, -0.0, 1e-40, -3e-39]  # zeros, subnormals
    if not finite:
        flat[idx[n // 50 + 4: n // 50 + 7]] = [np.nan, np.inf, -np.inf]
    return x


def first_mismatch(a, b):
    """None when a and b hold the same bits, else a message naming the first differing element."""
    a = np.ascontiguousarray(a)
    b = np.ascontiguousarray(b)
    assert a.shape == b.shape and a.dtype.itemsize == b.dtype.itemsize, (a.shape, a.dtype, b.shape, b.dtype)
    ua = a.view(np.uint16 if a.dtype.itemsize == 2 else np.uint32).reshape(-1)
    ub = b.view(ua.dtype).reshape(-1)
    diff = np.nonzero(ua != ub)[0]
    if diff.size == 0:
        return None
    i = int(diff[0])
    return f"{diff.size} of {ua.size} elements differ; first at {i}: 0x{int(ua[i]):x} vs 0x{int(ub[i]):x}"
