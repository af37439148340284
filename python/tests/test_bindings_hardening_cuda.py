"""The layer's guards on the CUDA engine (label gpu): no forward with an amax a quantizer does not
have, no in-place forward, calibration that can be aborted (the device's amax restored), and a
refused CUDA tensor released. Skipped without torch, a GPU or a CUDA build of moefq."""

import numpy as np
import pytest

import moefq
from conftest import first_mismatch, special_data, to_bf16_bits

torch = pytest.importorskip("torch")
if not (torch.cuda.is_available() and moefq.built_with_cuda and moefq.cuda_device_count() > 0):
    pytest.skip("needs a GPU visible to torch and a moefq built with CUDA", allow_module_level=True)

RANKS, TOKENS, H = 2, 16, 1024  # the tiny preset's hidden size


def tokens(seed, n, scale=1.0):
    bits = to_bf16_bits(scale * special_data(np.random.default_rng(seed), n, H, finite=True)).view(np.int16)
    return torch.from_numpy(bits).view(torch.bfloat16).cuda()


def same_bits(a, b):
    return first_mismatch(a.cpu().view(torch.int16).numpy(), b.cpu().view(torch.int16).numpy())


def cuda_layer(**kw):
    return moefq.MoeLayer("tiny", ranks=RANKS, max_tokens=TOKENS, device="cuda", **kw)


def test_cuda_forward_without_amax_is_refused():
    x = tokens(60, 8)
    L = cuda_layer(recipe="moe_combine_nvfp4")
    with pytest.raises(ValueError, match=f"{L.quantizer_names[1]}: no amax yet: calibrate it"):
        L.forward(x)
    reference = cuda_layer().forward(x)
    _, combine_amax = L.calibrate([x])
    assert combine_amax is not None and combine_amax > 0
    y = L.forward(x)
    assert torch.isfinite(y.float()).all() and same_bits(y, reference) is not None  # quantized


def test_cuda_forward_refuses_in_place():
    L = cuda_layer()
    x = tokens(61, 8)
    idx, w = L.route(x)
    buf = torch.zeros(8 * H, dtype=torch.bfloat16, device="cuda")
    out = buf.view(8, H)  # also seen as x, then as the routing
    for args, name in (((out, idx, w), "x"), ((x, buf[: 8 * 8 * 2].view(torch.int32).view(8, 8), w), "topk_idx")):
        with pytest.raises(ValueError, match=f"MoeLayer.forward: out overlaps {name}"):
            L.forward(*args, out=out)


def test_cuda_abort_calibration_restores_the_device_amax():
    x, loud = tokens(62, 8), tokens(63, 8, scale=50.0)
    L = cuda_layer(recipe="moe_combine_nvfp4")
    L.set_calibrated_amax(2.0, 3.0)
    y = L.forward(x)
    L._layer.start_calibration()
    L.forward(loud)
    L._layer.abort_calibration()
    assert not L.combine_quantizer().calibrating and L.combine_amax == 3.0
    assert same_bits(L.forward(x), y) is None  # the kernels read 3.0 again


def test_refused_cuda_tensor_is_released():
    torch.cuda.synchronize()
    start = torch.cuda.memory_allocated()
    for _ in range(50):
        with pytest.raises(ValueError, match="is not contiguous"):
            moefq.qdq(torch.randn(1024, 1024, device="cuda").t(), "fp8", 1.0)
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == start


@pytest.mark.parametrize("own_streams", [False, True])
def test_cuda_concurrent_forward_on_one_layer_matches_serial(own_streams):
    """Threads sharing one CUDA layer (on torch's default stream, or each on a stream of its own):
    each call gets its serial result; the layer's one workspace is never used by two calls at once."""
    from test_bindings_hardening_threads import run_in_threads

    L = moefq.MoeLayer("tiny", ranks=4, max_tokens=64, device="cuda")
    xs = [tokens(200 + i, 64 + 32 * (i % 3)) for i in range(12)]
    serial = [L.forward(x).clone() for x in xs]
    torch.cuda.synchronize()
    errors = []

    def work(k):
        stream = torch.cuda.Stream() if own_streams else torch.cuda.current_stream()
        with torch.cuda.stream(stream):
            for _ in range(3):
                for i in range(k, len(xs), 4):
                    try:
                        y = L.forward(xs[i])
                        stream.synchronize()
                        if same_bits(y, serial[i]) is not None:
                            errors.append(f"call {i} differs from the serial result")
                    except Exception as e:  # noqa: BLE001 - any error is a failure, reported below
                        errors.append(repr(e))

    run_in_threads(work, 4)
    assert errors == []
