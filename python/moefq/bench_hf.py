"""The cost of moefq.hf.quantize_moe on the GPU: a transformers model with DeepSeek-V3's MoE block shapes
(hidden 7168, 256 routed experts of width 2048, top 8 in 8 groups, one shared expert), as many MoE
layers as fit the GPU, built with AutoModelForCausalLM.from_config (random weights). It times the
model's forward on `--tokens` tokens unpatched, with transformers' grouped_mm experts implementation,
and patched with both quantizers on (fp8 dispatch, nvfp4 combine, calibrated on one batch), and prints
both times and their ratio.

    python3 -m moefq.bench_hf [--tokens 4096] [--layers N] [--iters 5] [--recipe FILE_OR_UNIT ...]

Needs transformers (>= 5, with experts implementations) and a GPU; says so otherwise (exit 2).
"""

import argparse
import sys
import tempfile
import time

BOTH = "$import: [moe_dispatch_fp8, moe_combine_nvfp4]\nalgorithm: max\n"
# DeepSeek-V3's MoE shapes; attention shrunk (the benchmark is about the MoE blocks).
SHAPES = dict(hidden_size=7168, moe_intermediate_size=2048, intermediate_size=18432, n_routed_experts=256,
              num_experts_per_tok=8, n_group=8, topk_group=4, n_shared_experts=1, routed_scaling_factor=2.5,
              norm_topk_prob=True, first_k_dense_replace=0, vocab_size=1024, num_attention_heads=8,
              num_key_value_heads=8, q_lora_rank=512, kv_lora_rank=128, qk_nope_head_dim=64, qk_rope_head_dim=32,
              v_head_dim=64, max_position_embeddings=8192, tie_word_embeddings=False)


def _fail(message):
    print(f"moefq.bench_hf: {message}", file=sys.stderr)
    sys.exit(2)


def _layers_that_fit(torch, requested):
    if requested:
        return requested
    H, E, I = SHAPES["hidden_size"], SHAPES["n_routed_experts"], SHAPES["moe_intermediate_size"]
    per_layer = (E + SHAPES["n_shared_experts"]) * 3 * H * I * 2  # bf16 expert weights
    free, _ = torch.cuda.mem_get_info()
    # Leave room for the activations of 4096 tokens x 8 slots (rows, GEMM outputs: a few GiB).
    return max(1, int((free - 12 * 2**30) // per_layer))


def _time(torch, fn, iters):
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    times.sort()
    return times[len(times) // 2]


def main(argv=None):
    p = argparse.ArgumentParser(prog="python3 -m moefq.bench_hf", description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--layers", type=int, default=0, help="MoE layers (default: as many as fit)")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--recipe", default=None, help="a recipe file or unit (default: fp8 dispatch + nvfp4 combine)")
    args = p.parse_args(argv)
    if args.tokens < 1 or args.iters < 1 or args.layers < 0:
        _fail("--tokens and --iters must be >= 1, --layers >= 0")
    try:
        import torch
        import transformers
    except ImportError as e:
        _fail(f"needs torch and transformers ({e})")
    if not torch.cuda.is_available():
        _fail("needs a GPU (torch.cuda.is_available() is False)")
    import moefq
    import moefq.hf as mh
    if moefq.cuda_device_count() == 0:
        _fail("moefq was built without CUDA")

    layers = _layers_that_fit(torch, args.layers)
    cfg = transformers.AutoConfig.for_model("deepseek_v3", num_hidden_layers=layers, **SHAPES)
    torch.manual_seed(0)
    with torch.device("cuda"):
        try:
            model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
        except TypeError:
            model = transformers.AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.bfloat16)
    model = model.to("cuda").eval()  # built there already where from_config honours the device context
    if not hasattr(model, "set_experts_implementation"):
        _fail(f"transformers {transformers.__version__} has no experts implementations (needs >= 5)")
    model.set_experts_implementation("grouped_mm")
    ids = torch.randint(0, SHAPES["vocab_size"], (1, args.tokens), device="cuda")

    def run():
        with torch.no_grad():
            model(ids)

    base = _time(torch, run, args.iters)
    recipe = args.recipe
    if recipe is None:
        recipe = tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False).name
        with open(recipe, "w") as f:
            f.write(BOTH)
    q = mh.quantize_moe(model, recipe, lambda m: run())
    patched = _time(torch, run, args.iters)
    mh.restore_moe(model)
    print(q.summary())
    print(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}, transformers "
          f"{transformers.__version__}, {layers} MoE layers (DeepSeek-V3 shapes), {args.tokens} tokens, median of "
          f"{args.iters}")
    print(f"unpatched (grouped_mm) {base * 1e3:.2f} ms, patched (both quantizers on) {patched * 1e3:.2f} ms, "
          f"ratio {patched / base:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
