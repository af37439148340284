"""moefq with torch tensors on the CPU: torch in, torch out, zero-copy, the quantizer modules, a tiny
PyTorch MoE with the quantizers inside, and capture_moe_inputs feeding `moefq eval`."""

import json

import numpy as np
import pytest

try:
    import torch
except ImportError:
    pytest.skip("torch is not installed for this interpreter (Debian: python3-torch)", allow_module_level=True)

import moefq
import moefq.torch as mt
from conftest import first_mismatch, run_cli, special_data, to_bf16_bits


def bf16_tensor(rng, rows, cols, finite=True):
    bits = to_bf16_bits(special_data(rng, rows, cols, finite=finite)).view(np.int16)
    return torch.from_numpy(bits).view(torch.bfloat16)


def bits(t):
    return t.detach().contiguous().view(torch.int16).numpy().view(np.uint16) if t.dtype == torch.bfloat16 \
        else t.detach().contiguous().numpy()


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4", "mxfp8", "mxfp4", "int8"])
def test_qdq_torch_matches_numpy(fmt):
    x = bf16_tensor(np.random.default_rng(5), 16, 128, finite=False)
    y = moefq.qdq(x, fmt, 12.0)
    assert isinstance(y, torch.Tensor) and y.dtype == torch.bfloat16 and y.shape == x.shape
    assert first_mismatch(bits(y), moefq.qdq(bits(x).copy(), fmt, 12.0)) is None
    xf = torch.from_numpy(special_data(np.random.default_rng(6), 4, 64))
    assert first_mismatch(bits(moefq.qdq(xf, fmt, 12.0)), moefq.qdq(xf.numpy().copy(), fmt, 12.0)) is None


def test_qdq_torch_zero_copy():
    x = bf16_tensor(np.random.default_rng(8), 4, 64)
    want = moefq.qdq(x, "nvfp4", 9.0)
    ptr = x.data_ptr()
    assert moefq.qdq(x, "nvfp4", 9.0, out=x) is x and x.data_ptr() == ptr
    assert torch.equal(x.view(torch.int16), want.view(torch.int16))
    # A view with an offset is handed over as itself, not a copy.
    big = bf16_tensor(np.random.default_rng(9), 8, 64)
    part = big[4:]
    want = moefq.qdq(part.clone(), "fp8", 3.0)
    moefq.qdq(part, "fp8", 3.0, out=part)
    assert torch.equal(big[4:].view(torch.int16), want.view(torch.int16))


def test_torch_errors():
    with pytest.raises(ValueError, match="qdq: x has dtype float16; expected bfloat16 or float32"):
        moefq.qdq(torch.ones(2, 64, dtype=torch.float16), "fp8", 1.0)
    with pytest.raises(ValueError, match="not contiguous"):
        moefq.qdq(torch.ones(64, 2).t(), "fp8", 1.0)
    with pytest.raises(ValueError, match="stream= is for tensors other than torch's"):
        moefq.qdq(torch.ones(2, 64), "fp8", 1.0, stream=0)


def test_dispatch_quantizer_module(tmp_path):
    x = bf16_tensor(np.random.default_rng(10), 8, 64)
    m = mt.DispatchQuantizer("nvfp4")
    with m.calibrate():
        assert m(x) is x  # calibration passes x through
    assert m.amax == float(x.float().abs().max())
    assert torch.equal(m(x).view(torch.int16), moefq.qdq(x, "nvfp4", m.amax).view(torch.int16))
    assert not torch.equal(m(x).view(torch.int16), x.view(torch.int16))
    assert m.disable()(x) is x
    m.enable()
    m.save(tmp_path / "calib.json")
    other = mt.DispatchQuantizer("nvfp4")
    other.load(tmp_path / "calib.json")
    assert other.amax == m.amax
    # Straight-through gradient.
    xf = x.float().requires_grad_()
    mt.DispatchQuantizer("fp8", amax=10.0)(xf).sum().backward()
    assert torch.equal(xf.grad, torch.ones_like(xf))
    with pytest.raises(ValueError, match="no amax yet"):
        mt.DispatchQuantizer("fp8")(x)


def test_combine_quantizer_module():
    rng = np.random.default_rng(11)
    rows = torch.stack([bf16_tensor(rng, 5, 64) for _ in range(4)])
    shared = bf16_tensor(rng, 5, 64)
    m = mt.CombineQuantizer("nvfp4")
    with m.calibrate():
        plain = m(rows, shared)
    assert torch.equal(plain.view(torch.int16), moefq.combine_qdq_resum(rows, None, shared=shared).view(torch.int16))
    assert m.amax == float(rows.float().abs().max())
    want = moefq.combine_qdq_resum(rows, "nvfp4", m.amax, shared=shared)
    assert torch.equal(m(rows, shared).view(torch.int16), want.view(torch.int16))
    assert not torch.equal(want.view(torch.int16), plain.view(torch.int16))
    with pytest.raises(ValueError, match="dynamic amax cannot be used for combine"):
        mt.CombineQuantizer("fp8", amax_source="dynamic")


def test_combine_quantizer_module_weighting_after():
    # Unweighted rows and the router weights: the module passes the weights to the re-sum, and the
    # result differs from treating the rows as already weighted.
    rng = np.random.default_rng(12)
    rows = torch.stack([bf16_tensor(rng, 5, 64) for _ in range(4)])
    weights = torch.from_numpy(rng.uniform(0.05, 0.5, size=(5, 4)).astype(np.float32))
    m = mt.CombineQuantizer("nvfp4")
    with m.calibrate():
        plain = m(rows, topk_weights=weights)
    assert torch.equal(plain.view(torch.int16), moefq.combine_qdq_resum(rows, None, topk_weights=weights).view(torch.int16))
    assert m.amax == float(rows.float().abs().max())  # the unweighted rows, as the quantizer sees them
    got = m(rows, topk_weights=weights)
    want = moefq.combine_qdq_resum(rows, "nvfp4", m.amax, topk_weights=weights)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    assert not torch.equal(got.view(torch.int16), moefq.combine_qdq_resum(rows, "nvfp4", m.amax).view(torch.int16))


class TinyMoeBlock(torch.nn.Module):
    """A top-k MoE in plain PyTorch with moefq's quantizers where the tokens leave and the expert
    outputs come back."""

    def __init__(self, hidden, experts, top_k, fmt):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.top_k = top_k
        self.gate = torch.nn.Linear(hidden, experts, bias=False)
        self.experts = torch.nn.ModuleList(torch.nn.Linear(hidden, hidden, bias=False) for _ in range(experts))
        self.shared_expert = torch.nn.Linear(hidden, hidden, bias=False)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
        self.dispatch_quantizer = mt.DispatchQuantizer(fmt)
        self.combine_quantizer = mt.CombineQuantizer(fmt)

    def forward(self, hidden_states):
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])
        probs = torch.softmax(self.gate(x.float()), dim=-1)
        weights, idx = torch.topk(probs, self.top_k, dim=-1)
        xq = self.dispatch_quantizer(x).float()
        rows = torch.zeros(self.top_k, x.shape[0], x.shape[1], dtype=torch.bfloat16)
        for k in range(self.top_k):
            for e in idx[:, k].unique().tolist():
                sel = idx[:, k] == e
                rows[k, sel] = (self.experts[e](xq[sel]) * weights[sel, k:k + 1]).bfloat16()
        shared = self.shared_expert(x.float()).bfloat16()
        return self.combine_quantizer(rows, shared).reshape(shape), rows, shared


def test_tiny_moe_with_quantizers_inside():
    torch.manual_seed(1)
    block = TinyMoeBlock(64, 6, 2, "nvfp4")
    calib = torch.randn(2, 16, 64).bfloat16()
    x = torch.randn(2, 16, 64).bfloat16()
    with block.dispatch_quantizer.calibrate(), block.combine_quantizer.calibrate():
        block(calib)
    assert block.dispatch_quantizer.amax == float(calib.float().abs().max())
    y, rows, shared = block(x)
    # The combine output is the combine quantizer applied to the block's own rows.
    want = moefq.combine_qdq_resum(rows, "nvfp4", block.combine_quantizer.amax, shared=shared)
    assert torch.equal(y.reshape(-1, 64).view(torch.int16), want.view(torch.int16))
    block.dispatch_quantizer.disable()
    block.combine_quantizer.disable()
    ref, _, _ = block(x)
    err = float((y.float() - ref.float()).norm() / ref.float().norm())
    assert 1e-3 < err < 0.3, err  # quantized, and still close to the unquantized block


class Qwen3MoeSparseMoeBlock(TinyMoeBlock):
    """Named as Hugging Face names Qwen3-MoE's block, which is how capture_moe_inputs finds it."""

    def forward(self, hidden_states):
        return super().forward(hidden_states)[0]


class DecoderLayer(torch.nn.Module):
    def __init__(self, mlp, hidden):
        super().__init__()
        self.norm = torch.nn.LayerNorm(hidden)
        self.mlp = mlp

    def forward(self, h):
        return h + self.mlp(self.norm(h.float()).bfloat16())


class TinyModel(torch.nn.Module):
    def __init__(self, hidden):
        super().__init__()
        self.embed = torch.nn.Embedding(100, hidden)
        layers = [DecoderLayer(torch.nn.Linear(hidden, hidden).bfloat16(), hidden)]
        layers += [DecoderLayer(Qwen3MoeSparseMoeBlock(hidden, 4, 2, "fp8"), hidden) for _ in range(2)]
        for layer in layers[1:]:
            layer.mlp.dispatch_quantizer.disable()
            layer.mlp.combine_quantizer.disable()
        self.layers = torch.nn.ModuleList(layers)

    def forward(self, ids):
        h = self.embed(ids).bfloat16()
        for layer in self.layers:
            h = layer(h)
        return h


def test_capture_moe_inputs_feeds_eval(tmp_path, moefq_binary):
    H = 1024  # the tiny preset's hidden size
    torch.manual_seed(2)
    model = TinyModel(H)
    assert sorted(mt.find_moe_blocks(model)) == [1, 2]
    seen = []
    model.layers[2].mlp.register_forward_pre_hook(lambda mod, args: seen.append(args[0].reshape(-1, H).clone()))
    batches = [torch.randint(0, 100, (2, 16)) for _ in range(2)]
    path = tmp_path / "acts.safetensors"
    assert mt.capture_moe_inputs(model, [2], batches, path) == {2: 64}
    acts = moefq.load_safetensors(path, framework="torch")
    assert list(acts) == ["layers.2"]
    assert torch.equal(acts["layers.2"].view(torch.int16), torch.cat(seen).view(torch.int16))
    with pytest.raises(ValueError, match=r"layers \[0\] have no MoE block \(MoE layers: \[1, 2\]\)"):
        mt.capture_moe_inputs(model, [0], batches, tmp_path / "x.safetensors")

    opts = dict(preset="tiny", layers=[2], activations=path, ranks=2, tokens=16, calib_batches=1, eval_batches=1,
                recipes=["moe_combine_nvfp4"], device="cpu", threads=1)
    report = moefq.eval(**opts, out=tmp_path / "py")
    rc, out = run_cli(moefq_binary, "eval", "--preset", "tiny", "--layers", "2", "--activations", path, "--ranks", 2,
                      "--tokens", 16, "--calib-batches", 1, "--eval-batches", 1, "--recipe", "moe_combine_nvfp4",
                      "--device", "cpu", "--threads", 1, "--out", tmp_path / "cli")
    assert rc == 0, out
    cli = json.loads((tmp_path / "cli" / "report.json").read_text())
    written = json.loads((tmp_path / "py" / "report.json").read_text())
    for key in ("config", "calibration", "results", "summary"):
        assert report[key] == cli[key] == written[key], key
    assert [(r["layer"], r["recipe"]) for r in report["results"]] == [(2, "moe_combine_nvfp4")]
