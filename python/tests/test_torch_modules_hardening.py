"""moefq.torch's modules as a PyTorch user handles them: the straight-through gradients of
CombineQuantizer against an fp64 reference sum, calibration that sees only what the quantizer
sees and recovers from errors, state_dict/deepcopy/pickle/torch.save, and capture_moe_inputs'
checks before any work."""

import copy
import io
import pickle

import numpy as np
import pytest

try:
    import torch
except ImportError:
    pytest.skip("torch is not installed for this interpreter (Debian: python3-torch)", allow_module_level=True)

import moefq
import moefq.hf
import moefq.torch as mt

K, T, H = 3, 5, 64


def combine_inputs(seed, inactive=True):
    """rows [K, T, H] bf16 with NaN in the unrouted slots (never read), shared [T, H] bf16, router
    weights [T, K] float32, topk_idx [T, K] (-1: not routed; every token keeps slot 0), and an
    upstream gradient [T, H] that bf16 holds exactly."""
    g = torch.Generator().manual_seed(seed)
    rows = (torch.randn(K, T, H, generator=g) * 3).bfloat16()
    shared = torch.randn(T, H, generator=g).bfloat16()
    weights = torch.rand(T, K, generator=g) * 0.9 + 0.05
    idx = torch.randint(0, 8, (T, K), generator=g, dtype=torch.int32)
    if inactive:
        idx[1:, 2] = -1
        idx[3, 1] = -1
        rows[(idx < 0).t()] = float("nan")
    grad = torch.randn(T, H, generator=g).bfloat16().float()
    return rows, shared, weights, idx, grad


def reference(rows, shared, weights, idx):
    """The combine's sum in fp64 with QDQ as the identity: sum over active k of w[t, k] * rows[k, t]
    (w = 1 without weights) + shared[t]."""
    active = (idx >= 0).t().unsqueeze(-1)
    r = torch.where(active, rows, torch.zeros((), dtype=rows.dtype))
    if weights is not None:
        r = r * weights.t().unsqueeze(-1)
    return r.sum(0) + shared


def grads(m, rows, shared, weights, idx, grad, after):
    rows, shared = rows.clone().requires_grad_(), shared.clone().requires_grad_()
    weights = weights.clone().requires_grad_()
    y = m(rows, shared, topk_idx=idx, topk_weights=weights if after else None)
    assert y.requires_grad and y.shape == (T, H) and y.dtype == torch.bfloat16
    (y.float() * grad).sum().backward()
    return y, rows.grad, shared.grad, weights.grad if after else None


@pytest.mark.parametrize("after", [False, True], ids=["weighted_before", "weighted_after"])
@pytest.mark.parametrize("inactive", [False, True], ids=["all_active", "unrouted_slots"])
def test_combine_gradient_matches_fp64_reference(after, inactive):
    rows, shared, weights, idx, grad = combine_inputs(1, inactive)
    m = mt.CombineQuantizer("nvfp4", amax=20.0).disable()  # QDQ off: the plain sum
    y, g_rows, g_shared, g_w = grads(m, rows, shared, weights, idx if inactive else None, grad, after)

    r64, s64 = rows.double().requires_grad_(), shared.double().requires_grad_()
    w64 = weights.double().requires_grad_()
    y64 = reference(r64, s64, w64 if after else None, idx if inactive else torch.zeros(T, K, dtype=torch.int32))
    (y64 * grad.double()).sum().backward()

    torch.testing.assert_close(y.double(), y64.detach(), rtol=2 ** -7, atol=1e-6)
    assert g_rows.shape == rows.shape and g_rows.dtype == torch.bfloat16
    torch.testing.assert_close(g_rows.double(), r64.grad, rtol=2 ** -7, atol=0)
    if inactive:
        assert torch.all(g_rows[(idx < 0).t()] == 0)
    assert torch.equal(g_shared, grad.bfloat16())
    if after:
        assert g_w.shape == (T, K) and g_w.dtype == torch.float32
        torch.testing.assert_close(g_w.double(), w64.grad, rtol=1e-5, atol=1e-4)
        if inactive:
            assert torch.all(g_w[idx < 0] == 0)


@pytest.mark.parametrize("fmt", moefq.formats)
def test_combine_gradient_with_qdq_on(fmt):
    """Straight through the QDQ: the rows' and shared's gradients are those of the plain sum; the
    weights' gradient is the dot product with the row as the forward summed it, QDQ'd."""
    rows, shared, weights, idx, grad = combine_inputs(2)
    amax = 20.0 if moefq._C.format_info(fmt, "fmt")[1] else None  # None: no global amax
    # The combine QDQs each row as moefq.qdq does a row (one active slot: the sum is that row, but
    # for -0, which the sum from +0 turns into +0).
    one = rows[:1, :1].contiguous()
    assert torch.equal(moefq.combine_qdq_resum(one, fmt, amax).float(), moefq.qdq(one[0], fmt, amax).float())
    on = mt.CombineQuantizer(fmt, amax=amax)
    y, g_rows, g_shared, g_w = grads(on, rows, shared, weights, idx, grad, after=True)
    want = moefq.combine_qdq_resum(rows, fmt, 20.0, shared=shared, topk_idx=idx, topk_weights=weights)
    assert torch.equal(y.view(torch.int16), want.view(torch.int16))
    off = mt.CombineQuantizer(fmt, amax=amax).disable()
    _, p_rows, p_shared, p_w = grads(off, rows, shared, weights, idx, grad, after=True)
    assert torch.equal(g_rows.view(torch.int16), p_rows.view(torch.int16))
    assert torch.equal(g_shared.view(torch.int16), p_shared.view(torch.int16))
    active = (idx >= 0).t().unsqueeze(-1)
    routed = torch.where(active, rows, torch.zeros((), dtype=rows.dtype)).reshape(-1, H)
    sent = moefq.qdq(routed, fmt, amax)
    want_w = torch.einsum("th,kth->tk", grad.double(), sent.reshape(K, T, H).double())
    torch.testing.assert_close(g_w.double(), want_w, rtol=1e-5, atol=1e-4)
    if not torch.equal(sent.float(), routed.float()):  # (logfmt10 may send a group as bf16 unchanged)
        assert not torch.equal(g_w, p_w)  # the QDQ'd rows, not the raw ones


def test_combine_output_requires_grad_when_any_input_does():
    rows, shared, weights, idx, _ = combine_inputs(3)
    m = mt.CombineQuantizer("nvfp4", amax=20.0)
    for name in ("shared", "weights"):
        s = shared.clone().requires_grad_(name == "shared")
        w = weights.clone().requires_grad_(name == "weights")
        y = m(rows, s, topk_idx=idx, topk_weights=w)
        assert y.requires_grad, name
        y.float().sum().backward()
        assert (s.grad if name == "shared" else w.grad) is not None, name
    with torch.no_grad():
        assert not m(rows, shared.clone().requires_grad_()).requires_grad


class Qwen3MoeSparseMoeBlock(torch.nn.Module):
    def __init__(self, hidden, experts, top_k):
        super().__init__()
        self.top_k, self.norm_topk_prob = top_k, True
        self.gate = torch.nn.Linear(hidden, experts, bias=False)
        self.experts = torch.nn.ModuleList(torch.nn.Linear(hidden, hidden, bias=False) for _ in range(experts))


class QuantizedQwen3Moe(torch.nn.Module):
    """The quantizer modules inside MoE code of your own (a block of one Linear per expert, routed by hand)."""

    def __init__(self, block, fmt="nvfp4"):
        super().__init__()
        self.block = block
        self.dispatch, self.combine = mt.DispatchQuantizer(fmt), mt.CombineQuantizer(fmt)

    def forward(self, hidden_states):
        b, shape = self.block, hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])
        logits = b.gate(x)
        weights, idx = torch.topk(torch.softmax(logits, dim=-1, dtype=torch.float), b.top_k, dim=-1)
        if b.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        xq = self.dispatch(x)
        rows = x.new_zeros(b.top_k, *x.shape)
        for k in range(b.top_k):
            for e in idx[:, k].unique().tolist():
                sel = idx[:, k] == e
                rows[k, sel] = (b.experts[e](xq[sel]) * weights[sel, k, None]).to(x.dtype)
        return self.combine(rows).reshape(shape), logits


def test_hand_written_block_trains():
    torch.manual_seed(4)
    m = QuantizedQwen3Moe(Qwen3MoeSparseMoeBlock(64, 4, 2).bfloat16())
    h = torch.randn(2, 8, 64).bfloat16()
    with m.dispatch.calibrate(), m.combine.calibrate(), torch.no_grad():
        m(h)
    y, _ = m(h)
    y.float().pow(2).mean().backward()
    assert m.block.gate.weight.grad is not None and m.block.gate.weight.grad.abs().sum() > 0
    assert any(e.weight.grad is not None and e.weight.grad.abs().sum() > 0 for e in m.block.experts)


def test_combine_calibration_sees_only_the_routed_rows():
    rows, shared, _, idx, _ = combine_inputs(5)
    active_max = float(rows[(idx >= 0).t()].float().abs().max())
    for garbage in (1e6, float("nan"), float("inf")):
        r = rows.clone()
        r[(idx < 0).t()] = garbage
        m = mt.CombineQuantizer("nvfp4")
        with m.calibrate():
            plain = m(r, shared, topk_idx=idx)
        assert m.amax == active_max, garbage
        want = moefq.combine_qdq_resum(r, None, shared=shared, topk_idx=idx)
        assert torch.equal(plain.view(torch.int16), want.view(torch.int16))
    with pytest.raises(ValueError, match=r"topk_idx has shape \[3, 5\]; expected \[T, K\] = \[5, 3\]"):
        with mt.CombineQuantizer("nvfp4").calibrate() as m:
            m(rows, topk_idx=idx.t())


def test_dispatch_calibrates_on_a_non_contiguous_input():
    x = torch.randn(64, 8).t() * 5
    assert not x.is_contiguous()
    m = mt.DispatchQuantizer("fp8")
    with m.calibrate():
        assert m(x) is x
    assert m.amax == float(x.abs().max())
    assert torch.equal(m(x), moefq.qdq(x.contiguous(), "fp8", m.amax))


def test_module_calibration_error_restores_the_module():
    m = mt.DispatchQuantizer("nvfp4", amax=4.0)
    x = torch.randn(4, 64) * 10
    want = m(x)
    with pytest.raises(ValueError, match="NaN/inf"):
        with m.calibrate():
            m(x * 100)
            m(torch.full((2, 64), float("nan")))
    assert not m.calibrating and m.amax == 4.0 and torch.equal(m(x), want)
    with pytest.raises(ValueError, match="no calibration data reached"):
        with m.calibrate():
            pass
    assert not m.calibrating and m.amax == 4.0 and torch.equal(m(x), want)
    assert float(m.state_dict()["_amax"]) == 4.0


class QuantizedNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.dispatch, self.linear, self.combine = mt.DispatchQuantizer("nvfp4"), torch.nn.Linear(64, 64), \
            mt.CombineQuantizer("fp8")

    def forward(self, x):
        y = self.linear(self.dispatch(x))
        return self.combine(torch.stack([y, -y]).bfloat16())


def model_with_quantizers():
    torch.manual_seed(6)
    model = QuantizedNet()
    with model.dispatch.calibrate(), model.combine.calibrate():
        model(torch.randn(4, 64) * 7)
    return model


def test_state_dict_carries_the_amax():
    model = model_with_quantizers()
    sd = model.state_dict()
    assert float(sd["dispatch._amax"]) == model.dispatch.amax and float(sd["combine._amax"]) == model.combine.amax
    assert sd["dispatch._amax"].dtype == torch.float32
    fresh = QuantizedNet()
    assert "dispatch._amax" not in fresh.state_dict()  # no amax yet, no entry
    fresh.load_state_dict(sd)
    assert fresh.dispatch.amax == model.dispatch.amax and fresh.combine.amax == model.combine.amax
    x = torch.randn(4, 64)
    assert torch.equal(fresh(x), model(x))
    # The buffer follows the quantizer, also when it is changed on the quantizer itself.
    fresh.dispatch.quantizer.amax = 3.0
    assert float(fresh.state_dict()["dispatch._amax"]) == 3.0
    # Missing: an error in strict mode (the quantizer holds an amax), untouched otherwise.
    partial = {k: v for k, v in sd.items() if k != "combine._amax"}
    with pytest.raises(RuntimeError, match=r"Missing key\(s\) in state_dict: \"combine._amax\""):
        fresh.load_state_dict(partial)
    assert fresh.load_state_dict(partial, strict=False).missing_keys == ["combine._amax"]
    # An amax for a quantizer that takes none, and a bad value, are errors naming the key.
    constant = torch.nn.Sequential(mt.DispatchQuantizer("nvfp4", constant_amax=2688.0))
    with pytest.raises(RuntimeError, match="0._amax: .*set_amax applies to calibrated quantizers"):
        constant.load_state_dict({"0._amax": torch.tensor(5.0)})
    with pytest.raises(RuntimeError, match="dispatch._amax: .*amax must be a finite number >= 0"):
        fresh.load_state_dict({**sd, "dispatch._amax": torch.tensor(float("nan"))})


def test_deepcopy_pickle_and_torch_save():
    model = model_with_quantizers()
    model.combine.disable()
    x = torch.randn(4, 64)
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    for other in (copy.deepcopy(model), pickle.loads(pickle.dumps(model)), torch.load(buf)):
        assert other.dispatch.quantizer is not model.dispatch.quantizer
        assert other.dispatch.amax == model.dispatch.amax and other.combine.amax == model.combine.amax
        assert other.dispatch.enabled and not other.combine.enabled
        assert other.dispatch.quantizer.spec == model.dispatch.quantizer.spec
        assert torch.equal(other(x), model(x))
        other.dispatch.amax = 1.0
        assert model.dispatch.amax != 1.0  # an independent copy


class CountingMoe(torch.nn.Module):
    """Named like Qwen3-MoE's block; counts its calls."""

    calls = 0

    def __init__(self, keyword):
        super().__init__()
        self.keyword = keyword

    def forward(self, hidden_states):
        CountingMoe.calls += 1
        return hidden_states


CountingMoe.__name__ = "Qwen3MoeSparseMoeBlock"


class Layer(torch.nn.Module):
    def __init__(self, keyword=False):
        super().__init__()
        self.mlp = CountingMoe(keyword)

    def forward(self, h):
        return self.mlp(hidden_states=h) if self.mlp.keyword else self.mlp(h)


class TinyModel(torch.nn.Module):
    def __init__(self, keyword=False):
        super().__init__()
        self.embed = torch.nn.Embedding(10, 8)
        self.layers = torch.nn.ModuleList([Layer(keyword), Layer(keyword)])

    def forward(self, ids):
        h = self.embed(ids)
        for layer in self.layers:
            h = layer(h)
        return h


def test_capture_checks_before_any_work(tmp_path):
    model, batches = TinyModel(), [torch.randint(0, 10, (2, 3))]
    CountingMoe.calls = 0
    with pytest.raises(ValueError, match=r"capture_moe_inputs: layers \[1\] given more than once"):
        mt.capture_moe_inputs(model, [0, 1, 1], batches, tmp_path / "a.safetensors")
    with pytest.raises(ValueError, match="is a directory; give a file name"):
        mt.capture_moe_inputs(model, [0], batches, tmp_path)
    with pytest.raises(ValueError, match="the folder .*missing does not exist"):
        mt.capture_moe_inputs(model, [0], batches, tmp_path / "missing" / "a.safetensors")
    assert CountingMoe.calls == 0 and not list(tmp_path.iterdir())
    assert mt.capture_moe_inputs(model, [0, 1], batches, tmp_path / "a.safetensors") == {0: 6, 1: 6}
    assert CountingMoe.calls == 2


def test_capture_of_a_block_called_with_keywords(tmp_path):
    model, batches = TinyModel(keyword=True), [torch.randint(0, 10, (2, 3))]
    path = tmp_path / "a.safetensors"
    if moefq.hf._HOOKS_SEE_KWARGS:
        assert mt.capture_moe_inputs(model, [1], batches, path) == {1: 6}
    else:
        with pytest.raises(ValueError, match=r"layer 1's MoE block was called without a positional argument "
                                             r"\(e\.g\. mlp\(hidden_states=h\)\); forward hooks of torch .* call the "
                                             r"block with hidden_states positionally"):
            mt.capture_moe_inputs(model, [1], batches, path)
        assert not path.exists()


def test_qdq_does_not_track_gradients():
    g = torch.randn(4, 64, requires_grad=True)
    y = moefq.qdq(g, "fp8", 3.0)
    assert not y.requires_grad
    before = g.detach().clone()
    with pytest.raises(ValueError, match="qdq: out requires grad, and moefq writes it outside autograd"):
        moefq.qdq(g, "fp8", 3.0, out=g)
    assert torch.equal(g.detach(), before)
    with pytest.raises(ValueError, match="combine_qdq_resum: out requires grad"):
        moefq.combine_qdq_resum(torch.zeros(2, 4, 64).bfloat16(), None,
                                out=torch.zeros(4, 64).bfloat16().requires_grad_())
    with torch.no_grad():
        assert moefq.qdq(g, "fp8", 3.0, out=g) is g  # as torch allows in-place work under no_grad
    assert not torch.equal(g.detach(), before)


def test_amax_buffer_lives_where_the_module_does():
    # An amax that appears after .to(device) is made on that device (meta stands in for a GPU).
    m = mt.CombineQuantizer("nvfp4").to("meta")
    m.amax = 3.0
    assert m._amax.device.type == "meta" and m.amax == 3.0
    m = mt.DispatchQuantizer("fp8").half()
    m.amax = 2.0
    assert m._amax.dtype == torch.float32 and m._amax.device.type == "cpu"
