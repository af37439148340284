"""moefq compare end to end on real transformers models (label gpu; skipped without transformers or
a GPU): tiny random-weight models of two families built with AutoModelForCausalLM.from_config, saved
with save_pretrained, run through `python3 -m moefq.compare` on the GPU: the reports, the reference
file reused, the sensitivity ranking and the pick, and the refusals that need a real model."""

import json
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
if not torch.cuda.is_available():
    pytest.skip("no GPU", allow_module_level=True)

import moefq  # noqa: E402

if not moefq.built_with_cuda:
    pytest.skip("moefq built without CUDA", allow_module_level=True)

VOCAB, CTX = 128, 64
COMMON = dict(vocab_size=VOCAB, hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
              max_position_embeddings=512, tie_word_embeddings=False, rms_norm_eps=1e-6)
FAMILIES = {
    "qwen3_moe": dict(intermediate_size=256, moe_intermediate_size=64, num_experts=8, num_experts_per_tok=2,
                      num_hidden_layers=3, decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True),
    # DeepSeek's attention (MLA): its head_dim is the rotary part's; layer 0 dense.
    "deepseek_v3": dict(intermediate_size=256, moe_intermediate_size=64, n_routed_experts=16, num_experts_per_tok=4,
                        n_group=4, topk_group=2, n_shared_experts=1, first_k_dense_replace=1, num_hidden_layers=3,
                        routed_scaling_factor=2.5, norm_topk_prob=True, q_lora_rank=32, kv_lora_rank=32,
                        qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16, num_key_value_heads=4, head_dim=16),
}
MOE_LAYERS = {"qwen3_moe": [0, 1, 2], "deepseek_v3": [1, 2]}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def saved(request, tmp_path_factory):
    """A tiny random-weight model of the family, saved with save_pretrained, and random token ids."""
    family = request.param
    d = tmp_path_factory.mktemp(family)
    torch.manual_seed(0)
    cfg = transformers.AutoConfig.for_model(family, **dict(COMMON, **FAMILIES[family]))
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    # The default init (std 0.02) gives flat next-token distributions and tiny expert outputs; larger
    # experts and head weights make the recipes' costs measurable.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("gate_up_proj", "down_proj")) and p.dim() == 3:
                p.normal_(0, 0.1)
        model.get_output_embeddings().weight.normal_(0, 0.1)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.uniform_(-0.2, 0.2)
    model.save_pretrained(d / "model")
    np.save(d / "tokens.npy", np.random.default_rng(0).integers(0, VOCAB, CTX * 6))
    return family, d


def _cli(*args):
    p = subprocess.run([sys.executable, "-m", "moefq.compare", *map(str, args)], capture_output=True, text=True)
    return p.returncode, p.stdout, p.stderr


def test_end_to_end(saved):
    family, d = saved
    out, ref = d / "out", d / "ref.safetensors"
    args = ["--model", d / "model", "--tokens", d / "tokens.npy", "--ctx", CTX, "--chunks", 4, "--calib-chunks", 1,
            "--device", "cuda", "--recipes", "moe_combine_nvfp4", "moe_combine_fp8", "both_mxfp8"]
    rc, so, se = _cli(*args, "--sensitivity", "moe_combine_nvfp4", "--max-kl", "10", "--save-reference", ref,
                      "--out", out)
    assert rc == 0, se
    rep = json.loads((out / "report.json").read_text())
    assert rep["config"]["moe_layers"] == MOE_LAYERS[family]
    assert rep["config"]["device"].startswith("cuda") and rep["config"]["dtype"] == "bfloat16"
    names = [e["name"] for e in rep["runs"]]
    assert names[0] == "none" and set(names) >= {"moe_combine_nvfp4", "moe_combine_fp8", "both_mxfp8", "pick"}
    for e in rep["runs"]:
        assert e["kl"]["mean"] >= -1e-9 and np.isfinite(e["kl"]["mean"]) and 0 <= e["same_top1"]["fraction"] <= 1
        assert set(e["block_rel_l2"]) == {str(l) for l in MOE_LAYERS[family]}
    by = {e["name"]: e for e in rep["runs"]}
    assert by["moe_combine_nvfp4"]["kl"]["mean"] > by["none"]["kl"]["mean"]
    assert [r["layer"] for r in rep["sensitivity"]["moe_combine_nvfp4"]] != []
    assert rep["pick"]["description"] == "moe_combine_nvfp4 on every MoE layer"
    assert "answer:" in so and "kl_mean" in so and "eta" in se
    print(f"\n{family}: {so}")
    for e in rep["runs"]:
        print(f"{family} {e['name']}: {e['seconds_per_chunk']:.3f} s per chunk of {CTX}")

    # The reference file reused: the same figures, without running the original model.
    rc, so2, se2 = _cli(*args[:-3], "moe_combine_nvfp4", "--reference", ref, "--out", d / "out2")
    assert rc == 0, se2
    rep2 = json.loads((d / "out2" / "report.json").read_text())
    e1 = by["moe_combine_nvfp4"]
    e2 = next(e for e in rep2["runs"] if e["name"] == "moe_combine_nvfp4")
    assert e2["kl"]["mean"] == pytest.approx(e1["kl"]["mean"], rel=1e-6, abs=1e-9)
    assert e2["ppl_ref"] == e1["ppl_ref"]

    # ... and refused with another context.
    rc, _, se3 = _cli(*args[:-3], "moe_combine_nvfp4", "--ctx", 2 * CTX, "--chunks", 2, "--reference", ref,
                      "--out", d / "out3")
    assert rc == 2 and "another context" in se3 and not (d / "out3").exists()


def test_refusals_with_a_real_model(saved):
    family, d = saved
    text = d / "text.txt"
    text.write_text("hello world " * 200)
    cases = [
        (["--text", text], "has no tokenizer"),
        (["--tokens", d / "tokens.npy", "--recipes", "moe_combine_fp8", "--max-kl", "0"], "no assignment meets it"),
        (["--tokens", d / "tokens.npy", "--recipes", "moe_combine_fp8", "--dtype", "float32"], "bf16"),
    ]
    for extra, match in cases:
        rc, _, se = _cli("--model", d / "model", "--ctx", CTX, "--calib-chunks", 1, "--device", "cuda", *extra,
                         "--out", d / "refused")
        assert rc == 2, se
        assert se.strip().splitlines()[-1].startswith("moefq compare: ") and match in se, se
        assert not (d / "refused").exists()
