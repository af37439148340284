"""moefq on CUDA tensors (torch with CUDA): QDQ and the combine quantizer bit-identical to the CPU,
in place without copies, ordered on the caller's current stream, and the combine quantizer captured
in a CUDA graph and replayed on new data. Skipped without torch, a GPU or a CUDA build of moefq."""

import numpy as np
import pytest

try:
    import torch
except ImportError:
    pytest.skip("torch is not installed for this interpreter", allow_module_level=True)

import moefq
from conftest import first_mismatch, special_data, to_bf16_bits

if not torch.cuda.is_available():
    pytest.skip("no GPU visible to torch", allow_module_level=True)
if not moefq.built_with_cuda or moefq.cuda_device_count() == 0:
    pytest.skip("this moefq was built without CUDA, or sees no GPU", allow_module_level=True)

FORMATS = ["fp8", "nvfp4", "mxfp8", "mxfp4", "int8"]


def bf16(rng, rows, cols, finite=True):
    bits = to_bf16_bits(special_data(rng, rows, cols, finite=finite)).view(np.int16)
    return torch.from_numpy(bits).view(torch.bfloat16)


def same_bits(a, b):
    return first_mismatch(a.cpu().view(torch.int16).numpy(), b.cpu().view(torch.int16).numpy())


@pytest.mark.parametrize("fmt", FORMATS)
def test_qdq_cuda_matches_cpu(fmt):
    x = bf16(np.random.default_rng(30), 64, 256, finite=False)
    xd = x.cuda()
    y = moefq.qdq(xd, fmt, 25.0)
    assert y.is_cuda and y.dtype == torch.bfloat16
    assert same_bits(y, moefq.qdq(x, fmt, 25.0)) is None
    amax = torch.full((1,), 25.0, device="cuda")
    assert same_bits(moefq.qdq(xd, fmt, amax), y) is None
    finite = bf16(np.random.default_rng(31), 64, 256).cuda()
    assert same_bits(moefq.qdq(finite, fmt), moefq.qdq(finite.cpu(), fmt)) is None  # dynamic amax
    xf = torch.from_numpy(special_data(np.random.default_rng(32), 16, 128)).cuda()
    assert first_mismatch(moefq.qdq(xf, fmt, 9.0).cpu().numpy(), moefq.qdq(xf.cpu(), fmt, 9.0).numpy()) is None


def test_qdq_cuda_in_place_zero_copy():
    x = bf16(np.random.default_rng(33), 32, 128).cuda()
    want = moefq.qdq(x.cpu(), "nvfp4", 11.0)
    ptr = x.data_ptr()
    assert moefq.qdq(x, "nvfp4", 11.0, out=x) is x and x.data_ptr() == ptr
    assert same_bits(x, want) is None


def test_work_goes_on_the_current_stream():
    # The input is written on a side stream after a long sleep; moefq's kernel must queue behind it
    # (on the default stream it would read the zeros).
    data = bf16(np.random.default_rng(34), 512, 1024)
    want = moefq.qdq(data, "nvfp4", 40.0)
    x = torch.zeros_like(data, device="cuda")
    src = data.cuda()
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.cuda._sleep(200_000_000)
        x.copy_(src)
        y = moefq.qdq(x, "nvfp4", 40.0)
    side.synchronize()
    assert same_bits(y, want) is None


def combine_inputs(seed, K=8, T=64, H=1024):
    rng = np.random.default_rng(seed)
    rows = torch.stack([bf16(rng, T, H) for _ in range(K)])
    idx = torch.arange(T * K, dtype=torch.int32).reshape(T, K)
    for t in range(T):
        idx[t, 1 + t % K:] = -1
    shared = bf16(rng, T, H)
    return rows, idx, shared


@pytest.mark.parametrize("fmt", [None] + FORMATS)
def test_combine_cuda_matches_cpu(fmt):
    rows, idx, shared = combine_inputs(35)
    amax = float(rows.float().abs().max())
    want = moefq.combine_qdq_resum(rows, fmt, amax, shared=shared, topk_idx=idx)
    got = moefq.combine_qdq_resum(rows.cuda(), fmt, amax, shared=shared.cuda(), topk_idx=idx.cuda())
    assert got.is_cuda and same_bits(got, want) is None
    no_shared = moefq.combine_qdq_resum(rows.cuda(), fmt, amax, topk_idx=idx.cuda())
    assert same_bits(no_shared, moefq.combine_qdq_resum(rows, fmt, amax, topk_idx=idx)) is None


@pytest.mark.parametrize("fmt", [None] + FORMATS)
def test_combine_weighted_cuda_matches_cpu(fmt):
    rows, idx, shared = combine_inputs(36)
    weights = torch.from_numpy(np.random.default_rng(37).uniform(0.01, 1.5, size=tuple(idx.shape)).astype(np.float32))
    amax = float(rows.float().abs().max())
    want = moefq.combine_qdq_resum(rows, fmt, amax, shared=shared, topk_idx=idx, topk_weights=weights)
    got = moefq.combine_qdq_resum(rows.cuda(), fmt, amax, shared=shared.cuda(), topk_idx=idx.cuda(),
                                  topk_weights=weights.cuda())
    assert got.is_cuda and same_bits(got, want) is None
    assert same_bits(got, moefq.combine_qdq_resum(rows, fmt, amax, shared=shared, topk_idx=idx)) is not None


def test_combine_graph_capture_and_replay():
    rows, idx, shared = combine_inputs(36)
    d_rows, d_idx, d_shared = rows.cuda(), idx.cuda(), shared.cuda()
    amax = torch.full((1,), float(rows.float().abs().max()), device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the capture, as torch asks
        moefq.combine_qdq_resum(d_rows, "nvfp4", amax, shared=d_shared, topk_idx=d_idx)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = moefq.combine_qdq_resum(d_rows, "nvfp4", amax, shared=d_shared, topk_idx=d_idx)
    for seed in (37, 38):
        new_rows, _, new_shared = combine_inputs(seed)
        d_rows.copy_(new_rows)
        d_shared.copy_(new_shared)
        graph.replay()
        torch.cuda.synchronize()
        want = moefq.combine_qdq_resum(new_rows, "nvfp4", float(amax.item()), shared=new_shared, topk_idx=idx)
        assert same_bits(out, want) is None, seed


def test_int64_ids_on_cuda_are_clamped_without_a_sync():
    rows, idx, shared = combine_inputs(39)
    d_rows, d_shared = rows.cuda(), shared.cuda()
    wide = idx.to(torch.int64).cuda()
    want = moefq.combine_qdq_resum(rows, "nvfp4", 5.0, shared=shared, topk_idx=idx)
    assert same_bits(moefq.combine_qdq_resum(d_rows, "nvfp4", 5.0, shared=d_shared, topk_idx=wide), want) is None
    # Ids beyond int32 keep their meaning instead of wrapping: 2**32 (would wrap to id 0) stays
    # active, -2**31 - 1 (would wrap to 2**31 - 1, an active slot) stays inactive.
    idx_cpu = idx.to(torch.int64)
    active = int((idx_cpu[3] >= 0).nonzero()[0])
    inactive = int((idx_cpu[5] < 0).nonzero()[0]) if bool((idx_cpu[5] < 0).any()) else None
    wide[3, active] = 2 ** 32
    if inactive is not None:
        wide[5, inactive] = -(2 ** 31) - 1
    assert same_bits(moefq.combine_qdq_resum(d_rows, "nvfp4", 5.0, shared=d_shared, topk_idx=wide), want) is None
    # The CPU refuses such ids (it can check them without a device sync).
    with pytest.raises(ValueError, match="combine_qdq_resum: topk_idx: ids must fit int32"):
        moefq.combine_qdq_resum(rows, "nvfp4", 5.0, shared=shared, topk_idx=wide.cpu())
    # A CUDA graph captures the conversion of int64 ids: the replay gives the eager bits.
    amax = torch.full((1,), 5.0, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        moefq.combine_qdq_resum(d_rows, "nvfp4", amax, shared=d_shared, topk_idx=wide)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = moefq.combine_qdq_resum(d_rows, "nvfp4", amax, shared=d_shared, topk_idx=wide)
    graph.replay()
    torch.cuda.synchronize()
    assert same_bits(out, want) is None


def test_cuda_errors():
    x = torch.ones(4, 64, device="cuda")
    with pytest.raises(ValueError, match="qdq: out is on cpu but qdq: x is on cuda:0"):
        moefq.qdq(x, "fp8", 1.0, out=torch.empty(4, 64))
    with pytest.raises(ValueError, match="amax is on cpu"):
        moefq.qdq(x, "fp8", torch.ones(1))


def test_moe_layer_cuda_close_to_cpu():
    # The two engines accumulate the fp8 GEMMs in different orders (docs/engine_cuda.md): the
    # unquantized layers agree to about 1e-3; nvfp4 then rounds some of the slightly different
    # elements to neighbouring codes, so the quantized layers differ by a fraction of nvfp4's own
    # error (rel_l2 about 0.08 here).
    x = bf16(np.random.default_rng(39), 64, 1024)
    cpu = moefq.MoeLayer("tiny", ranks=2, max_tokens=32)
    gpu = moefq.MoeLayer("tiny", ranks=2, max_tokens=32, device="cuda")
    y = gpu.forward(x.cuda())
    gpu.synchronize()
    m = moefq.metrics(y.cpu(), cpu.forward(x))
    assert m["rel_l2"] < 1e-2, m
    cpu.configure("moe_combine_nvfp4")
    gpu.configure("moe_combine_nvfp4")
    cpu.calibrate([x])
    gpu.calibrate([x.cuda()])
    assert gpu.combine_amax == pytest.approx(cpu.combine_amax, rel=1e-2)
    y = gpu.forward(x.cuda())
    gpu.synchronize()
    m = moefq.metrics(y.cpu(), cpu.forward(x))
    assert m["rel_l2"] < 5e-2, m
