"""moefq.torch's modules on CUDA tensors: CombineQuantizer's forward bit-identical to the CPU module,
its straight-through gradients equal to the CPU ones (the weights' within fp32 summation order),
calibration of the routed rows only, and the _amax buffer through .cuda(), state_dict and deepcopy.
Skipped without torch, a GPU or a CUDA build of moefq."""

import copy

import pytest

import moefq

torch = pytest.importorskip("torch")
import moefq.torch as mt  # noqa: E402 (needs torch)

if not (torch.cuda.is_available() and moefq.built_with_cuda and moefq.cuda_device_count() > 0):
    pytest.skip("no GPU visible to torch, or this moefq was built without CUDA", allow_module_level=True)

K, T, H = 4, 9, 128


def inputs(seed):
    g = torch.Generator().manual_seed(seed)
    rows = (torch.randn(K, T, H, generator=g) * 3).bfloat16()
    shared = torch.randn(T, H, generator=g).bfloat16()
    weights = torch.rand(T, K, generator=g) * 0.9 + 0.05
    idx = torch.randint(0, 16, (T, K), generator=g, dtype=torch.int32)
    idx[::2, 3] = -1
    rows[(idx < 0).t()] = float("nan")  # unrouted: never read
    grad = torch.randn(T, H, generator=g).bfloat16()
    return rows, shared, weights, idx, grad


def run(m, rows, shared, weights, idx, grad, device):
    # Leaves on the device (.to() of a tensor that requires grad is not a leaf: no .grad).
    r = rows.detach().to(device).requires_grad_()
    s = shared.detach().to(device).requires_grad_()
    w = weights.detach().to(device).requires_grad_()
    y = m(r, s, topk_idx=idx.to(device), topk_weights=w)
    y.backward(grad.to(device))
    return [t.cpu() for t in (y.detach(), r.grad, s.grad, w.grad)]


@pytest.mark.parametrize("fmt", ["nvfp4", "fp8", "mxfp8"])
def test_combine_module_cuda_matches_cpu(fmt):
    rows, shared, weights, idx, grad = inputs(1)
    amax = 20.0 if fmt != "mxfp8" else None
    cpu = run(mt.CombineQuantizer(fmt, amax=amax), rows, shared, weights, idx, grad, "cpu")
    gpu = run(mt.CombineQuantizer(fmt, amax=amax).cuda(), rows, shared, weights, idx, grad, "cuda")
    for name, a, b in zip(("y", "d rows", "d shared"), cpu[:3], gpu[:3]):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16)), name
    torch.testing.assert_close(gpu[3], cpu[3], rtol=1e-5, atol=1e-4)


def test_combine_calibration_and_state_on_cuda():
    rows, shared, _, idx, _ = inputs(2)
    m = mt.CombineQuantizer("nvfp4").cuda()
    with m.calibrate():
        m(rows.cuda(), shared.cuda(), topk_idx=idx.cuda())
    assert m.amax == float(rows[(idx >= 0).t()].float().abs().max())
    assert m._amax.device.type == "cuda" and float(m._amax) == m.amax
    other = mt.CombineQuantizer("nvfp4").cuda()
    other.load_state_dict(m.state_dict())
    twin = copy.deepcopy(m)
    want = m(rows.cuda(), shared.cuda(), topk_idx=idx.cuda())
    for q in (other, twin):
        assert q.amax == m.amax
        assert torch.equal(q(rows.cuda(), shared.cuda(), topk_idx=idx.cuda()).view(torch.int16),
                           want.view(torch.int16))
