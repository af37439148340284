"""moefq.hf.quantize_moe on look-alikes of the transformers 5.x MoE blocks (hf_lookalikes.py): the
patched block against an independent re-sum written here, the dispatch QDQ on the experts' input only,
calibration of the active slots only, restore bit for bit, state dicts and calibration files, the
summation-order bound against the original block, and every refusal."""

import copy

import numpy as np
import pytest

try:
    import torch
    import torch.nn.functional as F
except ImportError:
    pytest.skip("torch is not installed for this interpreter (Debian: python3-torch)", allow_module_level=True)

import moefq
import moefq.hf as mh
import moefq.torch as mt
from hf_lookalikes import (FAMILIES, DeepseekV3MoE, ForCausalLM, ForConditionalGeneration, Llama4TextMoe, MLP,
                           MixtralSparseMoeBlock, PerExpertMoe, Qwen3MoeSparseMoeBlock, tiny_model)

H = 32
BOTH = """\
$import: [moe_dispatch_fp8, moe_combine_nvfp4]
algorithm: max
"""


def bits(t):
    return t.detach().contiguous().view(torch.int16)


def same_bits(a, b):
    return torch.equal(bits(a), bits(b))


def first(out):
    return out[0] if isinstance(out, tuple) else out


@pytest.fixture
def both_recipe(tmp_path):
    path = tmp_path / "both.yaml"
    path.write_text(BOTH)
    return str(path)


def calib_batches(n=3, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 50, (2, 10), generator=g) for _ in range(n)]


def loop_over(batches):
    def forward_loop(model):
        for ids in batches:
            model(ids)
    return forward_loop


# ---- an independent reference: the router, each (token, slot) expert row, the fp32 re-sum ----------------

def route(block, x):
    """(idx [T, K], w [T, K]) by the block's own routing, called piece by piece here."""
    name = type(block).__name__
    if name in ("DeepseekV3MoE", "Glm4MoeMoE"):
        return block.route_tokens_to_experts(block.gate(x))
    if name == "DeepseekV2Moe":
        return block.route_tokens_to_experts(F.linear(x.float(), block.gate.weight.float())[None])
    router = block.router if hasattr(block, "router") else block.gate
    _, w, idx = router(x)
    return idx, w


def shared_part(block, x):
    if hasattr(block, "shared_expert_gate"):
        return torch.sigmoid(block.shared_expert_gate(x)) * block.shared_expert(x)
    if hasattr(block, "shared_experts"):
        return block.shared_experts(x)
    return None


def reference_rows(block, x, xq, weighting):
    """p[k, t] from the experts' own per-expert function, each expert on its tokens in (slot, token) order,
    as the original eager forward batches them (a CPU bf16 GEMM's bits can depend on how many rows it
    gets, so the reference batches as the model does)."""
    idx, w = route(block, x)
    T, K = idx.shape
    rows = torch.zeros(K, T, x.shape[1], dtype=torch.bfloat16)
    for e in sorted(set(idx.flatten().tolist())):
        slots, toks = torch.where(idx.t() == e)
        out = block.experts.expert(e, xq[toks])
        for j, (k, t) in enumerate(zip(slots.tolist(), toks.tolist())):
            # The product in fp32 (the original's bf16 rows times [n, 1] weights promote to it), rounded once.
            rows[k, t] = (out[j].float() * w[t, k].float()).to(torch.bfloat16) if weighting == "before" else out[j]
    return rows, w


def resum(rows, shared, weights=None):
    """fp32 from +0 in ascending slot order, weights (after) in fp32 with their own rounding, shared last,
    one rounding to bf16: the kernel's rule, in numpy."""
    r = rows.float().numpy()
    acc = np.zeros(r.shape[1:], dtype=np.float32)
    for k in range(r.shape[0]):
        term = r[k] if weights is None else (weights[:, k:k + 1].float().numpy() * r[k]).astype(np.float32)
        acc = (acc + term).astype(np.float32)
    if shared is not None:
        acc = (acc + shared.float().numpy()).astype(np.float32)
    return torch.from_numpy(acc).bfloat16()


def block_of(model, layer=1):
    return model.model.layers[layer].mlp


def tokens(T=12, seed=3):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(1, T, H, generator=g) * 1.5).bfloat16()


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("weighting", ["before", "after"])
def test_quantizers_off_is_the_kernel_resum(family, weighting):
    model = tiny_model(family)
    block = block_of(model)
    if family == "deepseek_v3":  # the correction bias changes the choice, never the weights
        block.gate.e_score_correction_bias.copy_(torch.linspace(-0.3, 0.3, block.n_routed_experts))
    x = tokens()
    q = mh.quantize_moe(model, None, combine_weighting=weighting)
    assert q.combine_weighting == weighting
    with torch.no_grad():
        y = first(block(x)).reshape(-1, H)
        x2 = x.reshape(-1, H)
        rows, w = reference_rows(block, x2, x2, weighting)
        shared = shared_part(block, x2)
    want = resum(rows, shared, None if weighting == "before" else w)
    assert same_bits(y, want)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_both_quantizers_on_match_the_reference(family, both_recipe):
    model = tiny_model(family)
    q = mh.quantize_moe(model, both_recipe, loop_over(calib_batches()))
    block = block_of(model)
    record = q.blocks[0]
    assert (record.layer, record.path, record.family) == (1, "model.layers.1.mlp", family)
    dq, cq = record.dispatch_quantizer, record.combine_quantizer
    assert dq.amax > 0 and cq.amax > 0
    x = tokens(seed=9)
    with torch.no_grad():
        y = first(block(x)).reshape(-1, H)
        x2 = x.reshape(-1, H)
        xq = moefq.qdq(x2, "fp8", dq.amax)
        rows, _ = reference_rows(block, x2, xq, "before")
        shared = shared_part(block, x2)
    want = moefq.combine_qdq_resum(rows, "nvfp4", cq.amax, shared=shared)
    assert same_bits(y, want)
    assert not same_bits(y, resum(rows, shared))  # the combine QDQ did something


def test_dispatch_reaches_only_the_experts_input(both_recipe):
    model = tiny_model("qwen2_moe")
    mh.quantize_moe(model, both_recipe, loop_over(calib_batches()))
    block = block_of(model)
    seen = {}
    for name, mod in (("router", block.gate), ("shared", block.shared_expert), ("shared_gate",
                                                                                 block.shared_expert_gate)):
        mod.register_forward_pre_hook(lambda m, args, name=name: seen.__setitem__(name, args[0].clone()))
    x = tokens(seed=4)
    with torch.no_grad():
        block(x)
    for name in ("router", "shared", "shared_gate"):
        assert same_bits(seen[name], x.reshape(-1, H)), name


def test_calibration_sees_the_active_slots_only(both_recipe):
    model = tiny_model("qwen3_moe")
    batches = calib_batches()
    seen_x = []
    block = block_of(model)

    def record(module, args):
        seen_x.append(args[0].reshape(-1, H).clone())
    block.register_forward_pre_hook(record)
    q = mh.quantize_moe(model, both_recipe, loop_over(batches))
    x = torch.cat(seen_x)
    with torch.no_grad():
        rows, _ = reference_rows(block, x, x, "before")  # calibration: no QDQ meanwhile
    dq, cq = q.blocks[0].dispatch_quantizer, q.blocks[0].combine_quantizer
    assert dq.amax == float(x.float().abs().max())
    assert cq.amax == float(rows.float().abs().max())
    # A slot whose id is past the experts (another rank's, as expert parallelism marks it) is inactive:
    # neither its row nor (when all of its slots are) its token reaches the quantizers.
    rec = q.blocks[0]
    xs = torch.zeros(3, H, dtype=torch.bfloat16)
    xs[2] = 100.0
    idx = torch.tensor([[0, 1, 2], [3, 4, 5], [8, 9, 8]])
    w = torch.full((3, 3), 0.3)
    with rec.dispatch_quantizer.calibrate(), rec.combine_quantizer.calibrate():
        with torch.no_grad():
            rec.routed_combine((xs + 1.0 * (torch.arange(3)[:, None] < 2)).bfloat16(), idx, w, None)
    assert rec.dispatch_quantizer.amax == 1.0


def test_restore_gives_the_original_forward_back():
    model = tiny_model("deepseek_v3", layers=2)
    ids = calib_batches(1)[0]
    with torch.no_grad():
        ref = model(ids)
    keys = set(model.state_dict())
    mh.quantize_moe(model, "moe_combine_mxfp8")
    assert "model.layers.1.mlp.experts.combine_quantizer._amax" not in model.state_dict()  # mxfp8: no amax
    with torch.no_grad():
        patched = model(ids)
    assert not same_bits(patched, ref)
    assert mh.restore_moe(model) == ["model.layers.1.mlp", "model.layers.2.mlp"]
    with torch.no_grad():
        assert same_bits(model(ids), ref)
    assert set(model.state_dict()) == keys
    assert "forward" not in block_of(model).__dict__
    assert mh.restore_moe(model) == []  # an unpatched model: nothing to do


def test_state_dict_and_calibration_file_round_trip(tmp_path, both_recipe):
    model = tiny_model("mixtral", layers=2)
    q = mh.quantize_moe(model, both_recipe, loop_over(calib_batches()))
    state = model.state_dict()
    names = [f"model.layers.{i}.mlp.experts.{w}_quantizer._amax" for i in (1, 2) for w in ("dispatch", "combine")]
    for n in names:
        assert n in state
    amax = q.amax()
    assert set(amax) == {n[:-len("._amax")] for n in names}

    other = tiny_model("mixtral", layers=2)
    q2 = mh.quantize_moe(other, both_recipe, calibration={n: 1.0 for n in amax})
    assert set(q2.amax().values()) == {1.0}
    other.load_state_dict(state)
    assert q2.amax() == amax
    mh.restore_moe(other)
    assert mh.quantize_moe(other, both_recipe, calibration=state).amax() == amax  # straight from a state dict
    ids = calib_batches(1, seed=7)[0]
    with torch.no_grad():
        assert same_bits(other(ids), model(ids))

    path = tmp_path / "calib.json"
    q.save_calibration(path)
    mh.restore_moe(other)
    q3 = mh.quantize_moe(other, both_recipe, calibration=path)
    assert q3.amax() == amax


def test_per_layer_recipes_and_layer_selection(both_recipe):
    model = tiny_model("qwen3_moe", layers=3)
    q = mh.quantize_moe(model, {2: both_recipe, 3: "moe_combine_mxfp8"}, loop_over(calib_batches()))
    got = {b.layer: (b.dispatch_quantizer.enabled, b.combine_quantizer.enabled, b.combine_quantizer.quantizer.format)
           for b in q.blocks}
    assert got == {1: (False, False, "fp8"), 2: (True, True, "nvfp4"), 3: (False, True, "mxfp8")}
    mh.restore_moe(model)
    q = mh.quantize_moe(model, both_recipe, loop_over(calib_batches()), layers=[3])
    assert [b.layer for b in q.blocks] == [3]
    assert "forward" not in block_of(model, 2).__dict__
    # A recipe pattern that selects one layer: matched among all the blocks' quantizers.
    mh.restore_moe(model)
    sel = both_recipe.replace("both.yaml", "sel.yaml")
    with open(sel, "w") as f:
        f.write("quant_cfg:\n  - quantizer_name: '*layers.2.*combine_quantizer'\n"
                "    cfg: {num_bits: e4m3, axis: null}\nalgorithm: max\n")
    q = mh.quantize_moe(model, sel, loop_over(calib_batches()))
    assert [b.layer for b in q.blocks if b.combine_quantizer.enabled] == [2]


def test_summary_names_what_was_replaced(both_recipe, capsys):
    model = tiny_model("deepseek_v3", layers=1)
    q = mh.quantize_moe(model, both_recipe, loop_over(calib_batches()), verbose=True)
    printed = capsys.readouterr().out
    assert printed.strip() == q.summary() == str(q)
    assert "model.layers.1.mlp" in printed and "deepseek_v3" in printed and "DeepseekV3MoE" in printed
    assert "plain" in printed and "nvfp4, amax=" in printed and "fp8, amax=" in printed
    assert list(q.quantizers()) == ["model.layers.1.mlp.experts.dispatch_quantizer",
                                    "model.layers.1.mlp.experts.combine_quantizer"]
    assert isinstance(q.quantizers()["model.layers.1.mlp.experts.combine_quantizer"], mt.CombineQuantizer)


@pytest.mark.parametrize("placement", ["block_sparse_moe", "feed_forward", "language_model"])
def test_placements(placement):
    blocks = [MLP(H, 24), MixtralSparseMoeBlock()]
    if placement == "language_model":
        model = ForConditionalGeneration(H, blocks)
        path = "model.language_model.layers.1.mlp"
    else:
        model = ForCausalLM(H, blocks, attr=placement)
        path = f"model.layers.1.{placement}"
    assert list(mh.find_moe_blocks(model)) == [1]
    assert mh.moe_block_paths(model) == {1: path}
    ids = calib_batches(1)[0]
    with torch.no_grad():
        ref = model(ids)
    q = mh.quantize_moe(model, "moe_combine_fp8", loop_over(calib_batches()))
    assert q.blocks[0].path == path
    assert list(q.quantizers())[1] == f"{path}.experts.combine_quantizer"
    with torch.no_grad():
        assert not same_bits(model(ids), ref)
    mh.restore_moe(model)
    with torch.no_grad():
        assert same_bits(model(ids), ref)


def test_capture_finds_the_language_model_blocks(tmp_path):
    model = ForConditionalGeneration(H, [MLP(H, 24), Qwen3MoeSparseMoeBlock()])
    path = tmp_path / "acts.safetensors"
    ids = calib_batches(2)
    assert mt.capture_moe_inputs(model, [1], ids, path) == {1: 40}
    assert list(moefq.load_safetensors(path)) == ["layers.1"]


def row_ulps(y, ref):
    """|y - ref| in units of the bf16 ulp of the token's largest output element (per row)."""
    y, ref = y.float().reshape(-1, y.shape[-1]), ref.float().reshape(-1, ref.shape[-1])
    top = ref.abs().max(dim=1, keepdim=True).values.clamp_min(1e-30)
    return (y - ref).abs() / torch.pow(2.0, torch.floor(torch.log2(top)) - 7)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_summation_order_bound(family):
    # With both quantizers off, the patched block differs from the original only by the summation:
    # the original adds the weighted rows into a bf16 tensor one expert at a time (a rounding per add),
    # the kernel sums them in fp32 and rounds once. Measured on 2048 tokens (docs/python.md's table).
    torch.manual_seed(0)
    model = tiny_model(family, layers=1)
    block = block_of(model)
    x = torch.randn(8, 256, H).bfloat16()
    with torch.no_grad():
        ref = first(block(x))
        mh.quantize_moe(model, None)
        y = first(block(x))
    u = row_ulps(y, ref)
    identical = float((bits(y) == bits(ref)).float().mean())
    print(f"{family}: identical {identical:.3f}, row ulps max {float(u.max()):.2f} mean {float(u.mean()):.3f}")
    assert float(u.max()) <= 2.0
    assert float(u.mean()) < 0.2
    assert identical > 0.5


# ---- refusals ----------------------------------------------------------------------------------------

def test_refusals(both_recipe, tmp_path):
    with pytest.raises(ValueError, match="has no MoE block"):
        mh.quantize_moe(ForCausalLM(H, [MLP(H, 8)]), None)
    with pytest.raises(ValueError, match="has no decoder layers"):
        mh.quantize_moe(torch.nn.Linear(4, 4), None)
    llama = ForCausalLM(H, [Llama4TextMoe()], attr="feed_forward")
    assert list(mh.find_moe_blocks(llama)) == [0]
    with pytest.raises(ValueError, match="layers 0: Llama4TextMoe weights the expert input .* cannot express"):
        mh.quantize_moe(llama, None)
    old = ForCausalLM(H, [PerExpertMoe()])
    assert list(mh.find_moe_blocks(old)) == [0]  # found (capture works), not patched
    with pytest.raises(ValueError, match="one module per expert .* transformers >= 5"):
        mh.quantize_moe(old, None)

    model = tiny_model("qwen3_moe")
    with pytest.raises(ValueError, match=r"layers \[0\] have no MoE block \(MoE layers: \[1, 2\]\)"):
        mh.quantize_moe(model, None, layers=[0])
    with pytest.raises(ValueError, match=r"the recipe names layers \[5\]"):
        mh.quantize_moe(model, {5: both_recipe})
    with pytest.raises(ValueError, match="combine_weighting='sideways'"):
        mh.quantize_moe(model, None, combine_weighting="sideways")
    after = tmp_path / "after.yaml"
    after.write_text("$import: [moe_combine_nvfp4]\nalgorithm: max\ncombine_weighting: after\n")
    with pytest.raises(ValueError, match="combine_weighting: after, but combine_weighting='before'"):
        mh.quantize_moe(model, str(after), combine_weighting="before")
    with pytest.raises(ValueError, match="give forward_loop .* or calibration .*, not both"):
        mh.quantize_moe(model, both_recipe, loop_over(calib_batches()), calibration={})
    ran = []
    mh.quantize_moe(model, "moe_combine_mxfp8", lambda m: ran.append(1))  # nothing needs calibration
    assert ran == []
    mh.restore_moe(model)
    with pytest.raises(TypeError, match="recipe must be"):
        mh.quantize_moe(model, 3)
    keys = set(model.state_dict())
    # Enabled without an amax, and a calibration that saw no data: errors naming the quantizer; the model
    # is left unpatched.
    with pytest.raises(ValueError, match=r"model.layers.1.mlp.experts.dispatch_quantizer.* without an amax"):
        mh.quantize_moe(model, both_recipe)
    with pytest.raises(ValueError, match="no calibration data reached model.layers.1.mlp.experts.dispatch_quantizer, "
                                         "model.layers.1.mlp.experts.combine_quantizer, model.layers.2"):
        mh.quantize_moe(model, both_recipe, lambda m: None)
    with pytest.raises(ValueError, match="calibration: no quantizer named nope"):
        mh.quantize_moe(model, both_recipe, calibration={"nope": 1.0})
    assert set(model.state_dict()) == keys and "forward" not in block_of(model).__dict__
    assert getattr(model, "_moefq_quantization", None) is None

    mh.quantize_moe(model, None)
    with pytest.raises(ValueError, match=r"already patched by moefq; call moefq.hf.restore_moe\(model\) first"):
        mh.quantize_moe(model, None)
    mh.restore_moe(model)

    fp32 = tiny_model("qwen3_moe").float()
    mh.quantize_moe(fp32, None)
    with pytest.raises(ValueError, match="runs in torch.float32; the Mega-MoE combine is bf16"):
        fp32(calib_batches(1)[0])


def test_an_error_inside_forward_loop_leaves_the_model_as_it_was(both_recipe):
    model = tiny_model("gpt_oss")

    def broken(m):
        m(calib_batches(1)[0])
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        mh.quantize_moe(model, both_recipe, broken)
    assert getattr(model, "_moefq_quantization", None) is None
    assert "forward" not in block_of(model).__dict__


def test_gradients_reach_the_router_and_the_experts(both_recipe):
    model = tiny_model("deepseek_v2").float().bfloat16()
    mh.quantize_moe(model, both_recipe, loop_over(calib_batches()))
    block = block_of(model)
    out = model(calib_batches(1)[0])
    out.float().pow(2).mean().backward()
    assert block.experts.gate_up_proj.grad is not None and block.experts.gate_up_proj.grad.abs().sum() > 0
    assert block.gate.weight.grad is not None and block.gate.weight.grad.abs().sum() > 0
    assert block.shared_experts.gate_proj.weight.grad.abs().sum() > 0


def test_deepseek_v3_like_router_unchanged_under_patch():
    # The router's own choice (correction bias for the choice, group limit) is what the kernel sees: the
    # probe receives the indices the block's route_tokens_to_experts returns, slot order included.
    model = tiny_model("deepseek_v3")
    block = block_of(model)
    assert isinstance(block, DeepseekV3MoE)
    block.gate.e_score_correction_bias.copy_(torch.linspace(0.5, -0.5, block.n_routed_experts))
    x = tokens(seed=11).reshape(-1, H)
    idx, w = block.route_tokens_to_experts(block.gate(x))
    q = mh.quantize_moe(model, None)
    got = []
    orig = q.blocks[0].routed_combine
    q.blocks[0].routed_combine = lambda x_, i_, w_, s_: (got.append((i_, w_)), orig(x_, i_, w_, s_))[1]
    with torch.no_grad():
        block(x.reshape(1, -1, H))
    assert torch.equal(got[0][0], idx) and torch.equal(got[0][1], w)


def test_bench_says_what_it_needs(capsys):
    import importlib.util

    from moefq import bench_hf
    with pytest.raises(SystemExit) as e:
        bench_hf.main(["--tokens", "0"])
    assert e.value.code == 2 and "--tokens and --iters must be >= 1" in capsys.readouterr().err
    if importlib.util.find_spec("transformers") is None:
        with pytest.raises(SystemExit) as e:
            bench_hf.main([])
        assert e.value.code == 2 and "needs torch and transformers" in capsys.readouterr().err
    elif not torch.cuda.is_available():
        with pytest.raises(SystemExit) as e:
            bench_hf.main([])
        assert e.value.code == 2 and "needs a GPU" in capsys.readouterr().err


def test_a_deep_copy_carries_the_patch(both_recipe):
    model = tiny_model("glm4_moe")
    q = mh.quantize_moe(model, both_recipe, loop_over(calib_batches()))
    twin = copy.deepcopy(model)
    ids = calib_batches(1, seed=8)[0]
    with torch.no_grad():
        assert same_bits(twin(ids), model(ids))
    twin_q = twin._moefq_quantization
    assert twin_q is not q and twin_q.amax() == q.amax()
    assert twin_q.blocks[0].experts is block_of(twin).experts
    assert mh.restore_moe(twin) == ["model.layers.1.mlp", "model.layers.2.mlp"]
    assert "forward" in block_of(model).__dict__  # the original stays patched


@pytest.mark.parametrize("family", ["deepseek_v3", "gpt_oss"])
def test_the_grouped_gemm_path(family, monkeypatch):
    # On CUDA the experts run as two grouped GEMMs (offsets per expert, biases gathered by expert id); a
    # grouped GEMM written here with torch's semantics runs that path on the CPU: the same bits as the
    # per-expert loop, including inactive slots mapped to the last expert.
    calls = []

    def grouped_mm(a, b, offs):
        calls.append(offs)
        out = a.new_empty((a.shape[0], b.shape[-1]))
        start = 0
        for g, end in enumerate(offs.tolist()):
            out[start:end] = a[start:end] @ b[g]
            start = end
        return out

    model = tiny_model(family)
    x = tokens(seed=12)
    mh.quantize_moe(model, None)
    with torch.no_grad():
        want = first(block_of(model)(x))
        monkeypatch.setattr(mh, "_grouped_mm_for", lambda x_, w_: grouped_mm)
        got = first(block_of(model)(x))
    assert len(calls) == 2 and calls[0].dtype == torch.int32 and int(calls[0][-1]) == x.shape[1] * (
        block_of(model).top_k if family == "deepseek_v3" else block_of(model).router.top_k)
    assert same_bits(got, want)
