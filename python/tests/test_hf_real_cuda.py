"""moefq.hf.quantize_moe on the real transformers 5.x classes: tiny models built with
AutoModelForCausalLM.from_config for every family (Qwen3-MoE, Mixtral, OLMoE, DeepSeek-V3, GLM-4.5,
DeepSeek-V2, GPT-OSS, Qwen2-MoE, Qwen3-Next) and a vision-language wrapper (Qwen3-VL-MoE), on the GPU:
found, patched, calibrated, run, restored bit for bit, and with both quantizers off within the
documented summation-order bound of the unpatched blocks. Skipped without transformers or a GPU."""

import pytest

try:
    import torch
except ImportError:
    pytest.skip("torch is not installed for this interpreter", allow_module_level=True)
transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install transformers)")

import moefq
import moefq.hf as mh

if not torch.cuda.is_available() or moefq.cuda_device_count() == 0:
    pytest.skip("no GPU (or moefq built without CUDA)", allow_module_level=True)

BOTH = "$import: [moe_dispatch_fp8, moe_combine_nvfp4]\nalgorithm: max\n"
COMMON = dict(vocab_size=128, hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
              max_position_embeddings=512, tie_word_embeddings=False, rms_norm_eps=1e-6)
# DeepSeek's attention (MLA): its head_dim is the rotary part's.
MLA = dict(q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16,
           num_key_value_heads=4, head_dim=16)
# model_type: (config keywords, expected block class, top-k)
FAMILIES = {
    "qwen3_moe": (dict(intermediate_size=256, moe_intermediate_size=64, num_experts=8, num_experts_per_tok=2,
                       num_hidden_layers=2, decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True),
                  "Qwen3MoeSparseMoeBlock", 2),
    "mixtral": (dict(intermediate_size=64, num_local_experts=8, num_experts_per_tok=2, num_hidden_layers=2),
                "MixtralSparseMoeBlock", 2),
    "olmoe": (dict(intermediate_size=64, num_experts=8, num_experts_per_tok=2, num_hidden_layers=2,
                   num_key_value_heads=4), "OlmoeSparseMoeBlock", 2),
    "deepseek_v3": (dict(intermediate_size=256, moe_intermediate_size=64, n_routed_experts=16, num_experts_per_tok=4,
                         n_group=4, topk_group=2, n_shared_experts=1, first_k_dense_replace=1, num_hidden_layers=3,
                         routed_scaling_factor=2.5, norm_topk_prob=True, **MLA), "DeepseekV3MoE", 4),
    "glm4_moe": (dict(intermediate_size=256, moe_intermediate_size=64, n_routed_experts=16, num_experts_per_tok=4,
                      n_group=1, topk_group=1, n_shared_experts=1, first_k_dense_replace=1, num_hidden_layers=3,
                      routed_scaling_factor=1.0, norm_topk_prob=True), "Glm4MoeMoE", 4),
    "deepseek_v2": (dict(intermediate_size=256, moe_intermediate_size=64, n_routed_experts=16, num_experts_per_tok=4,
                         n_group=4, topk_group=2, topk_method="group_limited_greedy", n_shared_experts=1,
                         first_k_dense_replace=1, num_hidden_layers=3, routed_scaling_factor=1.5,
                         **dict(MLA, q_lora_rank=None)), "DeepseekV2Moe", 4),
    "gpt_oss": (dict(intermediate_size=64, num_local_experts=8, num_experts_per_tok=2, num_hidden_layers=2,
                     sliding_window=64), "GptOssMLP", 2),
    "qwen2_moe": (dict(intermediate_size=256, moe_intermediate_size=64, shared_expert_intermediate_size=128,
                       num_experts=8, num_experts_per_tok=2, num_hidden_layers=2, decoder_sparse_step=1,
                       mlp_only_layers=[]), "Qwen2MoeSparseMoeBlock", 2),
    "qwen3_next": (dict(intermediate_size=256, moe_intermediate_size=64, shared_expert_intermediate_size=128,
                        num_experts=8, num_experts_per_tok=2, num_hidden_layers=4, decoder_sparse_step=1,
                        mlp_only_layers=[], linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=32,
                        linear_value_head_dim=32, linear_conv_kernel_dim=4), "Qwen3NextSparseMoeBlock", 2),
}


def set_experts_implementation(model, impl):
    if hasattr(model, "set_experts_implementation"):
        model.set_experts_implementation(impl)
        return
    for m in model.modules():
        cfg = getattr(m, "config", None)
        if cfg is not None and hasattr(cfg, "_experts_implementation"):
            cfg._experts_implementation = impl


def from_config(auto, cfg):
    torch.manual_seed(0)
    try:
        model = auto.from_config(cfg, dtype=torch.bfloat16)
    except TypeError:
        model = auto.from_config(cfg, torch_dtype=torch.bfloat16)
    model = model.to(device="cuda", dtype=torch.bfloat16).eval()
    with torch.no_grad():  # the default init (std 0.02) gives tiny expert outputs; larger ones exercise the sums
        for name, p in model.named_parameters():
            if name.endswith(("gate_up_proj", "down_proj")) and p.dim() == 3:
                p.normal_(0, 0.1)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.uniform_(-0.2, 0.2)  # the correction bias changes the choice only
    set_experts_implementation(model, "eager")
    return model


def build(model_type):
    kwargs, _, _ = FAMILIES[model_type]
    cfg = transformers.AutoConfig.for_model(model_type, **dict(COMMON, **kwargs))
    return from_config(transformers.AutoModelForCausalLM, cfg)


def batches(n=2, seed=0, T=48):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 128, (2, T), generator=g).cuda() for _ in range(n)]


def logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


def forward_loop(model):
    for ids in batches(3, seed=5):
        model(ids)


def row_ulps(y, ref):
    """|y - ref| in units of the bf16 ulp of the token's largest output element (docs/python.md)."""
    y, ref = y.float().reshape(-1, y.shape[-1]), ref.float().reshape(-1, ref.shape[-1])
    top = ref.abs().max(dim=1, keepdim=True).values.clamp_min(1e-30)
    return (y - ref).abs() / torch.pow(2.0, torch.floor(torch.log2(top)) - 7)


def first(out):
    return out[0] if isinstance(out, tuple) else out


def one_ulp_noise_logits(model, ids, blocks, frac=0.2):
    """The logits with a fifth of every MoE block's output elements moved by one bf16 ulp (up or down at
    random): about what the patched blocks change (docs/python.md), as a measure of the model's own
    sensitivity."""
    g = torch.Generator(device="cuda").manual_seed(1)

    def hook(module, args, out):
        y = first(out)
        bits = y.view(torch.int16)
        flip = (torch.rand(y.shape, generator=g, device=y.device) < frac) & (y != 0) & torch.isfinite(y)
        step = torch.where(torch.rand(y.shape, generator=g, device=y.device) < 0.5, 1, -1).to(torch.int16)
        noisy = torch.where(flip, bits + step, bits).view(torch.bfloat16)
        return (noisy,) + tuple(out[1:]) if isinstance(out, tuple) else noisy

    handles = [b.register_forward_hook(hook) for b in blocks.values()]
    try:
        return logits(model, ids)
    finally:
        for h in handles:
            h.remove()


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_found_patched_and_within_the_summation_bound(model_type, monkeypatch):
    # The experts one GEMM pair per expert, as transformers' eager forward computes them, so that the rows
    # are the original's and what is measured is the summation alone (test_grouped_mm_and_the_loop_agree
    # compares the grouped GEMMs).
    monkeypatch.setattr(mh, "_grouped_mm_fn", lambda: None)
    model = build(model_type)
    _, cls, _ = FAMILIES[model_type]
    blocks = mh.find_moe_blocks(model)
    assert blocks and all(type(b).__name__.lower() == cls.lower() for b in blocks.values()), blocks
    # The inputs each block sees in the unpatched model, then each block alone, unpatched and patched.
    inputs = {}
    hooks = [b.register_forward_pre_hook(lambda m, a, kw, i=i: inputs.__setitem__(i, (a, kw)), with_kwargs=True)
             for i, b in blocks.items()]
    ids = batches(1)[0]
    ref_logits = logits(model, ids)
    for h in hooks:
        h.remove()
    with torch.no_grad():
        ref = {i: first(b(*inputs[i][0], **inputs[i][1])).clone() for i, b in blocks.items()}
    q = mh.quantize_moe(model, None)
    assert [r.layer for r in q.blocks] == sorted(blocks) and {r.family for r in q.blocks} == {model_type}
    assert "forward" in blocks[min(blocks)].__dict__
    for i, b in blocks.items():
        with torch.no_grad():
            y = first(b(*inputs[i][0], **inputs[i][1]))
        u = row_ulps(y, ref[i])
        identical = float((y.view(torch.int16) == ref[i].view(torch.int16)).float().mean())
        print(f"{model_type} layer {i}: identical {identical:.3f}, row ulps max {float(u.max()):.2f} "
              f"mean {float(u.mean()):.3f}")
        assert float(u.max()) <= 4.0 and float(u.mean()) < 0.5
    patched = logits(model, ids)
    assert torch.isfinite(patched).all()
    rel = float((patched.float() - ref_logits.float()).norm() / ref_logits.float().norm())
    # How far the model itself carries a one-ulp change of its MoE outputs: a tiny random model can amplify
    # it through its other layers (Qwen3-Next's linear attention does), so the bound on the whole model's
    # logits is relative to that floor, measured on the unpatched model.
    mh.restore_moe(model)
    floor = float((one_ulp_noise_logits(model, ids, blocks).float() - ref_logits.float()).norm()
                  / ref_logits.float().norm())
    print(f"{model_type} logits: rel {rel:.3g}, one-ulp floor {floor:.3g}")
    assert rel < max(2e-2, 4 * floor), (rel, floor)
    assert torch.equal(logits(model, ids).view(torch.int16), ref_logits.view(torch.int16))


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
@pytest.mark.parametrize("weighting", ["before", "after"])
def test_calibrated_quantizers(model_type, weighting, tmp_path):
    recipe = tmp_path / "both.yaml"
    recipe.write_text(BOTH)
    model = build(model_type)
    ids = batches(1, seed=9)[0]
    ref = logits(model, ids)
    keys = set(model.state_dict())
    q = mh.quantize_moe(model, str(recipe), forward_loop, combine_weighting=weighting)
    print(q)
    amax = q.amax()
    assert amax and all(v is not None and v > 0 for v in amax.values())
    state = model.state_dict()
    assert all(f"{name}._amax" in state for name in amax)
    out = logits(model, ids)
    assert torch.isfinite(out).all() and not torch.equal(out, ref)
    rel = float((out.float() - ref.float()).norm() / ref.float().norm())
    assert rel < 0.5, rel  # quantized, still the same model
    # The calibration file and the state dict reproduce the run on a fresh copy.
    q.save_calibration(tmp_path / "calib.json")
    other = build(model_type)
    mh.quantize_moe(other, str(recipe), calibration=tmp_path / "calib.json", combine_weighting=weighting)
    assert torch.equal(logits(other, ids).view(torch.int16), out.view(torch.int16))
    mh.restore_moe(other)
    mh.quantize_moe(other, str(recipe), calibration={n: 1.0 for n in amax}, combine_weighting=weighting)
    other.load_state_dict(state)
    assert torch.equal(logits(other, ids).view(torch.int16), out.view(torch.int16))
    mh.restore_moe(model)
    assert set(model.state_dict()) == keys
    assert torch.equal(logits(model, ids).view(torch.int16), ref.view(torch.int16))


def test_vision_language_wrapper():
    try:
        cfg = transformers.AutoConfig.for_model(
            "qwen3_vl_moe",
            text_config=dict(COMMON, intermediate_size=256, moe_intermediate_size=64, num_experts=8,
                             num_experts_per_tok=2, num_hidden_layers=2, decoder_sparse_step=1, mlp_only_layers=[],
                             rope_scaling={"rope_type": "default", "mrope_section": [4, 6, 6]}),
            vision_config=dict(depth=1, hidden_size=64, num_heads=2, intermediate_size=128, out_hidden_size=128,
                               deepstack_visual_indexes=[]))
        model = from_config(transformers.AutoModelForImageTextToText, cfg)
    except Exception as e:  # building the tiny wrapper is not what this test checks
        pytest.skip(f"could not build a tiny qwen3_vl_moe with this transformers: {type(e).__name__}: {e}")
    paths = mh.moe_block_paths(model)
    assert paths and all(".language_model.layers." in p for p in paths.values()), paths
    ids = batches(1)[0]
    with torch.no_grad():
        ref = model(input_ids=ids).logits
    q = mh.quantize_moe(model, "moe_combine_mxfp8")
    assert [b.path for b in q.blocks] == list(paths.values())
    with torch.no_grad():
        out = model(input_ids=ids).logits
    assert torch.isfinite(out).all() and not torch.equal(out, ref)
    mh.restore_moe(model)
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits.view(torch.int16), ref.view(torch.int16))


def test_grouped_mm_and_the_loop_agree():
    # On CUDA the experts run as two grouped GEMMs where torch has them; the per-expert loop is the
    # fallback. Both are the same computation; the GEMMs may round differently (a few ulps).
    if mh._grouped_mm_fn() is None:
        pytest.skip(f"torch {torch.__version__} has no grouped GEMM")
    model = build("deepseek_v3")
    ids = batches(1)[0]
    mh.quantize_moe(model, None)
    a = logits(model, ids)
    grouped = mh._grouped_mm_fn
    mh._grouped_mm_fn = lambda: None
    try:
        b = logits(model, ids)
    finally:
        mh._grouped_mm_fn = grouped
    rel = float((a.float() - b.float()).norm() / b.float().norm())
    assert rel < 1e-2, rel
