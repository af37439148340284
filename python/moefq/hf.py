"""moefq inside a Hugging Face transformers model: every MoE block computed as the fused Mega-MoE kernel
computes it, with the dispatch and combine quantizers in place, reversibly.

    import moefq.hf as mh
    q = mh.quantize_moe(model, "moe_combine_nvfp4", forward_loop=lambda m: [m(ids) for ids in calib])
    print(q)                      # what was replaced, per layer and family
    ...                           # measure: perplexity, task scores
    mh.restore_moe(model)         # the original forward, bit for bit

The contract (kept stable for the tools built on it, such as `moefq compare`):

- quantize_moe(model, recipe, forward_loop=None, *, combine_weighting=None, layers=None, calibration=None,
  verbose=False) -> MoeQuantization
  - recipe: a moefq Recipe, a recipe file or a shipped unit name; None (both quantizers off: what remains is
    the kernel's summation order); or a dict {decoder layer index: recipe or None} (layers absent from the
    dict are patched with both quantizers off).
  - layers: the decoder layer indices to patch (default every MoE block); the others stay original.
  - calibration: a moefq calibration file, a dict {quantizer name: amax} or a state dict saved from a
    patched model (its ..._quantizer._amax entries), loaded instead of calibrating (forward_loop must then
    be None).
  - forward_loop(model): runs the calibration data; the quantizers that need an amax collect max |x| (the
    dispatch quantizer over the tokens sent to an expert, the combine quantizer over the active rows),
    every quantizer passes data through meanwhile, the amax is the MAX of what each one saw.
  - A model already patched is refused (restore_moe first); a model without a MoE block, a block this
    module cannot express (Llama 4, the transformers 4.x per-expert layout), an enabled quantizer that
    would run without an amax, and a quantizer that saw no calibration data are ValueErrors naming them;
    on any error the model is left as it was.
- restore_moe(model) -> [module paths restored]: the original forwards back; on an unpatched model a no-op
  returning [].
- MoeQuantization: .blocks (MoeBlock records: .layer, .path, .family, .class_name, .shared, .recipe (the
  recipe's name or None), .dispatch_quantizer, .combine_quantizer, .block), .combine_weighting,
  .quantizers() -> {name: module}, .amax() -> {name: float or None}, .save_calibration(path),
  .load_calibration(path_or_dict), .summary() (a text table, also str()).
- find_moe_blocks(model) -> {decoder layer index: block}; moe_block_paths(model) -> {index: module path}.
- The quantizers are submodules of each block's experts module, named
  `<block path>.experts.dispatch_quantizer` / `.combine_quantizer` (model.layers.3.mlp.experts....), so a
  recipe's patterns select layers and model.state_dict() carries their amax.

What the patched block computes (docs/python.md has the families table): the block's own forward runs
with its experts module replaced by a probe, so its router (scoring, group-limited top-k, correction
bias, renormalisation, scaling, weight dtype) and its shared expert (plain or sigmoid-gated) run
unchanged on the unquantized input; the probe receives the router's (x, top_k_index, top_k_weights),
returns zeros, and the block's output is then exactly its shared part. The routed part is computed from
the experts' own fused weights (gate_up_proj/down_proj, transposed or not, biases, the family's
activation): x through the dispatch quantizer, each active (token, slot) row out[t, k] = down(act(gate_up
(x))) computed once per expert (batched over the expert's tokens, never a loop over tokens), weighted
p[t, k] = bf16(out * w[t, k]) (combine_weighting before) or left unweighted (after), and the combine
quantizer re-sums the rows in fp32 from +0 in ascending slot order, the shared part added last
unquantized, one rounding to bf16 (moefq.combine_qdq_resum, its CUDA kernels on the GPU).
"""

import inspect
import os
import types

import torch

from . import (Quantizer, QuantSpec, Recipe, apply_recipe, load_calibration, load_recipe, save_calibration,
               save_safetensors)

__all__ = ["quantize_moe", "restore_moe", "find_moe_blocks", "moe_block_paths", "capture_moe_inputs",
           "MoeQuantization", "MoeBlock"]

# Where a decoder's layers live: causal LMs (model.layers), bare models (layers), vision-language wrappers
# (model.language_model.layers in transformers 5.x, language_model.model.layers before), GPT-2 style.
_LAYER_PATHS = ("model.layers", "layers", "model.language_model.layers", "language_model.model.layers",
                "language_model.layers", "model.model.layers", "model.language_model.model.layers", "transformer.h")
# The attribute of a decoder layer that holds its MoE block: most families' mlp, Mixtral's
# block_sparse_moe (transformers 4.x), Llama 4's feed_forward, others' moe.
_BLOCK_ATTRS = ("mlp", "block_sparse_moe", "feed_forward", "moe")
# transformers 4.x blocks by class name (DeepseekV3MoE, Qwen3MoeSparseMoeBlock, MixtralSparseMoeBlock, ...).
_MOE_CLASS_SUFFIXES = ("MoE", "Moe", "SparseMoeBlock")
_ATTR = "_moefq_quantization"  # the MoeQuantization, on the model
_RECORD = "_moefq_block"  # its MoeBlock, on each patched block


def _get(obj, path):
    for part in path.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def _fused_experts(module):
    """The experts module of a transformers 5.x block (3-D gate_up_proj and down_proj), or None."""
    experts = getattr(module, "experts", None)
    if not isinstance(experts, torch.nn.Module) or isinstance(experts, torch.nn.ModuleList):
        return None
    gate_up, down = getattr(experts, "gate_up_proj", None), getattr(experts, "down_proj", None)
    if isinstance(gate_up, torch.Tensor) and isinstance(down, torch.Tensor) and gate_up.dim() == 3 and down.dim() == 3:
        return experts
    return None


def _is_moe_block(module):
    if not isinstance(module, torch.nn.Module):
        return False
    if _fused_experts(module) is not None and (hasattr(module, "gate") or hasattr(module, "router")):
        return True
    return type(module).__name__.endswith(_MOE_CLASS_SUFFIXES)


def _decoder_layers(model, who):
    """(path, ModuleList) of the decoder layers: the first known path that holds a MoE block, else the first
    known path, else any ModuleList named layers that holds one."""
    found = []
    for path in _LAYER_PATHS:
        obj = _get(model, path)
        if isinstance(obj, torch.nn.ModuleList):
            found.append((path, obj))
    for name, obj in model.named_modules():
        if isinstance(obj, torch.nn.ModuleList) and name.rsplit(".", 1)[-1] == "layers" and \
                all(name != p for p, _ in found):
            found.append((name, obj))
    for path, layers in found:
        if any(_layer_block(layer) is not None for layer in layers):
            return path, layers
    if found:
        return found[0]
    raise ValueError(f"{who}: {type(model).__name__} has no decoder layers (looked for "
                     f"{', '.join(_LAYER_PATHS)} and any ModuleList named layers)")


def _layer_block(layer):
    """(attribute, block) of a decoder layer's MoE block, or None."""
    for attr in _BLOCK_ATTRS:
        block = getattr(layer, attr, None)
        if _is_moe_block(block):
            return attr, block
    return None


def _blocks_with_paths(model, who):
    path, layers = _decoder_layers(model, who)
    out = {}
    for i, layer in enumerate(layers):
        found = _layer_block(layer)
        if found is not None:
            out[i] = (f"{path}.{i}.{found[0]}" if path else f"{i}.{found[0]}", found[1])
    return out


def find_moe_blocks(model):
    """{decoder layer index: its MoE block} of a Hugging Face model (dense layers are left out): transformers
    5.x blocks (a router and a fused experts module) by structure, 4.x blocks by class name, under mlp,
    block_sparse_moe, feed_forward or moe of the layers of model.layers, layers, model.language_model.layers
    (vision-language wrappers) and the like."""
    return {i: b for i, (_, b) in _blocks_with_paths(model, "find_moe_blocks").items()}


def moe_block_paths(model):
    """{decoder layer index: the module path of its MoE block} (model.layers.3.mlp)."""
    return {i: p for i, (p, _) in _blocks_with_paths(model, "moe_block_paths").items()}


# ---- families ----------------------------------------------------------------------------------------

_FAMILIES = (("DeepseekV3", "deepseek_v3"), ("DeepseekV2", "deepseek_v2"), ("Glm4Moe", "glm4_moe"),
             ("Qwen3Next", "qwen3_next"), ("Qwen3VLMoe", "qwen3_vl_moe"), ("Qwen3Moe", "qwen3_moe"),
             ("Qwen2Moe", "qwen2_moe"), ("Mixtral", "mixtral"), ("Olmoe", "olmoe"), ("GptOss", "gpt_oss"),
             ("Llama4", "llama4"))


def _family(block):
    """The family: the transformers model folder the class comes from, else a known class prefix."""
    module = type(block).__module__ or ""
    if ".models." in module:
        return module.split(".models.", 1)[1].split(".", 1)[0]
    name = type(block).__name__
    for prefix, family in _FAMILIES:
        if name.startswith(prefix):
            return family
    return "generic"


def _shared_form(block):
    if getattr(block, "shared_expert_gate", None) is not None:
        return "sigmoid-gated"
    if getattr(block, "shared_expert", None) is not None or getattr(block, "shared_experts", None) is not None:
        return "plain"
    return "none"


def _unsupported(block):
    """Why this block cannot be computed as the Mega-MoE kernel does, or None."""
    name = type(block).__name__
    experts = _fused_experts(block)
    if name.startswith("Llama4") or (experts is not None and _positional_count(experts.forward) < 3):
        return (f"{name} weights the expert input (x times its router weight) before the experts, which a "
                "Mega-MoE combine (weighting the expert outputs) cannot express")
    if experts is None:
        return (f"{name} holds one module per expert (the transformers 4.x layout); quantize_moe computes the "
                "5.x fused experts (gate_up_proj/down_proj): use transformers >= 5")
    if getattr(experts, "has_gate", True) is False:
        return f"{name}'s experts have no gate (has_gate=False): not a SwiGLU-style expert"
    return None


def _positional_count(fn):
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return 3
    if any(p.kind == p.VAR_POSITIONAL for p in params):
        return 3
    return sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params)


# ---- the experts, computed from the block's own weights -------------------------------------------------

def _transposed(experts, hidden):
    """Whether gate_up_proj is [E, H, 2I] (GPT-OSS, Llama 4) rather than [E, 2I, H]: the decorator's flag when
    the class has it, else the shapes (unambiguous: both layouts at once would need I = 0)."""
    flag = getattr(experts, "is_transposed", None)
    if flag is None:
        flag = getattr(experts, "experts_are_transposed", None)
    if flag is not None:
        return bool(flag)
    gu, d = experts.gate_up_proj.shape, experts.down_proj.shape
    if gu[2] == hidden and d[1] == hidden:
        return False
    if gu[1] == hidden and d[2] == hidden:
        return True
    raise ValueError(f"{type(experts).__name__}: gate_up_proj {list(gu)} and down_proj {list(d)} do not fit "
                     f"hidden size {hidden}")


def _bias(experts, name):
    b = getattr(experts, name, None)
    if b is None or getattr(experts, "has_bias", True) is False:
        return None
    return b


def _activation(experts, h):
    """The family's own gating: the class's _apply_gate (GPT-OSS's clamped, interleaved SwiGLU with alpha and
    limit; transformers' default chunked act(gate) * up), else act_fn(gate) * up on the two halves."""
    apply = getattr(experts, "_apply_gate", None)
    if apply is not None:
        return apply(h)
    gate, up = h.chunk(2, dim=-1)
    return experts.act_fn(gate) * up


def _linear(x, w, transposed):
    return x @ w if transposed else torch.nn.functional.linear(x, w)


def _grouped_mm_fn():
    fn = getattr(torch.nn.functional, "grouped_mm", None)
    return fn if fn is not None else getattr(torch, "_grouped_mm", None)


def _grouped_mm_for(x, w):
    """torch's grouped GEMM where it serves: CUDA bf16 tensors and a torch that has one; else None."""
    if x.is_cuda and x.dtype == torch.bfloat16 and w.dtype == torch.bfloat16:
        return _grouped_mm_fn()
    return None


def _expert_rows(experts, xq, idx_sorted, counts, transposed):
    """out [S, H] for the S (token, slot) pairs in expert order: xq [S, H] sorted by expert, counts per expert.
    CUDA bf16 with torch's grouped GEMM: two grouped GEMMs; otherwise one pair of GEMMs per expert that has
    tokens (a loop over experts, never over tokens)."""
    W1, W2 = experts.gate_up_proj, experts.down_proj
    b1, b2 = _bias(experts, "gate_up_proj_bias"), _bias(experts, "down_proj_bias")
    gmm = _grouped_mm_for(xq, W1)
    if gmm is not None:
        offs = torch.cumsum(counts, 0, dtype=torch.int32)
        try:
            h = gmm(xq, W1 if transposed else W1.transpose(-2, -1), offs=offs)
            if b1 is not None:
                h = h + b1[idx_sorted]
            a = _activation(experts, h)
            out = gmm(a.to(W2.dtype), W2 if transposed else W2.transpose(-2, -1), offs=offs)
            if b2 is not None:
                out = out + b2[idx_sorted]
            return out
        except RuntimeError:
            pass  # shapes the grouped GEMM does not take (alignment): the loop below
    out = None
    start = 0
    for e, n in enumerate(counts.tolist()):
        if n == 0:
            continue
        part = xq[start:start + n]
        h = _linear(part, W1[e], transposed)
        if b1 is not None:
            h = h + b1[e]
        y = _linear(_activation(experts, h), W2[e], transposed)
        if b2 is not None:
            y = y + b2[e]
        if out is None:
            out = xq.new_empty((xq.shape[0], y.shape[-1]), dtype=y.dtype)
        out[start:start + n] = y
        start += n
    if out is None:
        out = xq.new_empty((0, xq.shape[1]))
    return out


class _Probe:
    """Stands in for the experts module's forward during one block call: keeps what the router sent."""

    def __init__(self):
        self.calls = []

    def __call__(self, hidden_states, top_k_index=None, top_k_weights=None, **kwargs):
        if top_k_index is None:
            top_k_index = kwargs.pop("router_indices", kwargs.pop("selected_experts", None))
        if top_k_weights is None:
            top_k_weights = kwargs.pop("routing_weights", kwargs.pop("router_scores", None))
        if top_k_index is None or top_k_weights is None:
            raise ValueError("moefq: the block called its experts without (top_k_index, top_k_weights)")
        self.calls.append((hidden_states, top_k_index, top_k_weights))
        return torch.zeros_like(hidden_states)


def _mega_moe_forward(block, *args, **kwargs):
    """The forward that replaces a patched block's (bound to it as an instance attribute). It reads its
    record from the block, so a copy.deepcopy of the model carries a working patch."""
    record = block.__dict__[_RECORD]
    experts = record.experts
    probe = _Probe()
    experts.forward = probe
    try:
        result = type(block).forward(block, *args, **kwargs)
    finally:
        del experts.forward
    if len(probe.calls) != 1:
        raise ValueError(f"{record.path}: the block's forward called its experts {len(probe.calls)} times; "
                         "moefq expects one call experts(x, top_k_index, top_k_weights)")
    x, idx, w = probe.calls[0]
    # With the probe's zeros for the routed part, the block's output is its non-routed part: the shared
    # expert in the family's own form (whatever its attribute name), exact zeros without one.
    out = result[0] if isinstance(result, tuple) else result
    y = record.routed_combine(x, idx, w, out.reshape(-1, out.shape[-1]).to(x.dtype)).reshape(out.shape)
    if isinstance(result, tuple):
        return (y,) + tuple(result[1:])
    return y


class MoeBlock:
    """One patched block: where it is, what it is, its two quantizers (torch modules, submodules of its
    experts module)."""

    def __init__(self, layer, path, block, dispatch_quantizer, combine_quantizer, combine_weighting, recipe):
        self.layer, self.path, self.block, self.recipe = layer, path, block, recipe
        self.family, self.class_name, self.shared = _family(block), type(block).__name__, _shared_form(block)
        self.experts = _fused_experts(block)
        self.dispatch_quantizer, self.combine_quantizer = dispatch_quantizer, combine_quantizer
        self.combine_weighting = combine_weighting
        self.num_experts = int(self.experts.gate_up_proj.shape[0])

    def routed_combine(self, x, idx, w, shared):
        """[T, H] bf16: the routed rows of x by (idx [T, K], w [T, K] or [T, E]) re-summed by the combine
        quantizer with `shared` added last."""
        if x.dtype != torch.bfloat16:
            raise ValueError(f"{self.path}: the block runs in {x.dtype}; the Mega-MoE combine is bf16 (load the "
                             "model with torch_dtype=torch.bfloat16)")
        T, H = x.shape
        K = idx.shape[-1]
        idx = idx.reshape(T, K)
        if w.shape[-1] == self.num_experts and K != self.num_experts:
            w = w.reshape(T, -1).gather(1, idx.long().clamp(0, self.num_experts - 1))  # dense [T, E] scores
        w = w.reshape(T, K)
        active = (idx >= 0) & (idx < self.num_experts)  # an id past the experts: another rank's (EP sentinel)
        dq = self.dispatch_quantizer
        if dq.calibrating:
            sent = active.any(dim=1)
            dq.quantizer.collect(x[sent].contiguous() if not bool(sent.all()) else x.contiguous())
            xq = x
        else:
            xq = dq(x)
        # The (token, slot) pairs slot-major (k * T + t), grouped by expert: rows_flat[perm] gives [K, T, H].
        # An inactive slot is computed with the last expert (cheaper than a host sync to leave it out) and
        # its row is never read: the combine gets its id as -1.
        ids = torch.where(active, idx.long(), torch.full_like(idx.long(), self.num_experts - 1)).t().reshape(-1)
        perm = torch.sort(ids, stable=True).indices  # torch 1.13's argsort has no stable flag
        ids_sorted = ids[perm]
        tokens = perm % T
        # histc, not bincount: no host sync on CUDA.
        counts = torch.histc(ids_sorted.float(), bins=self.num_experts, min=0, max=self.num_experts - 1).long()
        transposed = _transposed(self.experts, H)
        out = _expert_rows(self.experts, xq[tokens], ids_sorted, counts, transposed)
        weights = w.t().reshape(-1)[perm]
        rows = x.new_empty((K * T, H))
        if self.combine_weighting == "before":
            rows[perm] = (out * weights[:, None]).to(x.dtype)
            topk_weights = None
        else:
            rows[perm] = out.to(x.dtype)
            topk_weights = w.float().contiguous()
        topk_idx = torch.where(active, idx.to(torch.int32), torch.full_like(idx, -1, dtype=torch.int32))
        return self.combine_quantizer(rows.view(K, T, H), None if shared is None else shared.contiguous(),
                                      topk_idx.contiguous(), topk_weights)

    def __repr__(self):
        return f"MoeBlock(layer={self.layer}, path={self.path!r}, family={self.family!r}, class={self.class_name})"


# ---- the quantizers --------------------------------------------------------------------------------------

def _quantizer_module(cls, name, config):
    """A DispatchQuantizer/CombineQuantizer named `name` from a recipe's QuantizerConfig (None: off)."""
    if config is None or not config.configured or config.spec is None:
        m = cls("fp8", name=name)
        m.quantizer = Quantizer(name, spec=QuantSpec("fp8"), enabled=False)
    else:
        spec = config.spec
        if cls.__name__ == "CombineQuantizer" and spec.amax_source == "dynamic" and config.enable:
            raise ValueError(f"{name}: a dynamic amax cannot be used for combine (the rows arrive at different "
                             "ranks); calibrate it or set a constant amax")
        m = cls("fp8", name=name)
        m.quantizer = Quantizer(name, spec=spec, enabled=bool(config.enable))
    m._sync_amax()
    return m


def _as_recipe(recipe):
    if recipe is None or isinstance(recipe, Recipe):
        return recipe
    if isinstance(recipe, (str, os.PathLike)):
        return load_recipe(recipe)
    raise TypeError(f"quantize_moe: recipe must be a Recipe, a file, a unit name, None or a dict {{layer: recipe}}; "
                    f"got {type(recipe).__name__}")


class MoeQuantization:
    """What quantize_moe replaced: one MoeBlock per patched block, in layer order."""

    def __init__(self, model, blocks, combine_weighting):
        self.model, self.blocks, self.combine_weighting = model, blocks, combine_weighting

    def quantizers(self):
        """{name: module} of every quantizer, dispatch then combine per block, in layer order."""
        out = {}
        for b in self.blocks:
            out[b.dispatch_quantizer.quantizer.name] = b.dispatch_quantizer
            out[b.combine_quantizer.quantizer.name] = b.combine_quantizer
        return out

    def amax(self):
        """{name: amax or None}."""
        return {name: m.amax for name, m in self.quantizers().items()}

    def save_calibration(self, path):
        """Writes the amax of the quantizers that have one to a moefq calibration file."""
        qs = [m.quantizer for m in self.quantizers().values() if m.quantizer.needs_calibration and m.amax is not None]
        if not qs:
            raise ValueError("save_calibration: no quantizer holds a calibrated amax")
        save_calibration(path, qs)

    def load_calibration(self, calibration):
        """Sets the amax of every quantizer that needs one from a calibration file or {name: amax}."""
        _load_calibration(self.quantizers(), calibration)

    def summary(self):
        rows = [("layer", "module", "family", "class", "shared expert", "recipe", "dispatch", "combine")]
        for b in self.blocks:
            rows.append((str(b.layer), b.path, b.family, b.class_name, b.shared, b.recipe or "-",
                         _describe(b.dispatch_quantizer), _describe(b.combine_quantizer)))
        widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
        lines = [f"moefq: {len(self.blocks)} MoE block(s) computed as the Mega-MoE kernel does "
                 f"(combine_weighting: {self.combine_weighting})"]
        for r in rows:
            lines.append("  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip())
        return "\n".join(lines)

    __str__ = summary

    def __repr__(self):
        return f"MoeQuantization({len(self.blocks)} blocks, combine_weighting={self.combine_weighting!r})"


def _describe(m):
    q = m.quantizer
    if not q.enabled:
        return "off"
    if not q.needs_calibration:
        return q.format if q.spec.amax_source != "constant" else f"{q.format}, constant amax={q.amax:g}"
    return f"{q.format}, amax={q.amax:g}" if q.amax is not None else f"{q.format}, no amax"


def _load_calibration(quantizers, calibration):
    if isinstance(calibration, dict) and any(str(k).endswith("._amax") for k in calibration):
        # A state dict (the model's, saved while patched): the quantizers' _amax entries, the rest ignored.
        calibration = {k[:-len("._amax")]: float(v) for k, v in calibration.items()
                       if k.endswith("._amax") and k[:-len("._amax")] in quantizers}
    if isinstance(calibration, dict):
        unknown = sorted(set(calibration) - set(quantizers))
        if unknown:
            raise ValueError(f"calibration: no quantizer named {', '.join(unknown)} (the quantizers: "
                             f"{', '.join(quantizers) or 'none'})")
        for name, value in calibration.items():
            m = quantizers[name]
            if value is None:
                continue
            if not m.quantizer.needs_calibration:
                raise ValueError(f"calibration: {name} takes no calibrated amax ({m.quantizer.spec.describe()}"
                                 f"{'' if m.enabled else ', off'})")
            m.amax = value
        return
    wanted = [m for m in quantizers.values() if m.enabled and m.quantizer.needs_calibration]
    if wanted:
        load_calibration(os.fspath(calibration), [m.quantizer for m in wanted])
        for m in wanted:
            m._sync_amax()


# ---- quantize_moe / restore_moe --------------------------------------------------------------------------

def _select(model, layers, recipe):
    blocks = _blocks_with_paths(model, "quantize_moe")
    if not blocks:
        raise ValueError(f"quantize_moe: {type(model).__name__} has no MoE block (looked at the mlp, "
                         "block_sparse_moe, feed_forward and moe of its decoder layers); nothing to quantize")
    if layers is not None:
        layers = [int(i) for i in ([layers] if isinstance(layers, int) else layers)]
        missing = sorted(set(layers) - set(blocks))
        if missing:
            raise ValueError(f"quantize_moe: layers {missing} have no MoE block (MoE layers: {sorted(blocks)})")
        blocks = {i: blocks[i] for i in sorted(set(layers))}
    if isinstance(recipe, dict):
        missing = sorted(set(int(i) for i in recipe) - set(blocks))
        if missing:
            raise ValueError(f"quantize_moe: the recipe names layers {missing}, which are not patched MoE layers "
                             f"({sorted(blocks)})")
    bad = [(i, why) for i, (_, b) in blocks.items() for why in [_unsupported(b)] if why]
    if bad:
        layers_txt = ", ".join(str(i) for i, _ in bad)
        raise ValueError(f"quantize_moe: layers {layers_txt}: {bad[0][1]}; nothing was patched")
    return blocks


def _weighting(recipes, combine_weighting):
    chosen = {r.combine_weighting for r in recipes if r is not None and r.combine_weighting}
    if combine_weighting is not None:
        if combine_weighting not in ("before", "after"):
            raise ValueError(f"quantize_moe: combine_weighting={combine_weighting!r}; expected 'before' or 'after'")
        clash = chosen - {combine_weighting}
        if clash:
            raise ValueError(f"quantize_moe: the recipe has combine_weighting: {clash.pop()}, but "
                             f"combine_weighting={combine_weighting!r} was given")
        return combine_weighting
    if len(chosen) > 1:
        raise ValueError(f"quantize_moe: the recipes disagree on combine_weighting ({', '.join(sorted(chosen))})")
    return chosen.pop() if chosen else "before"


def quantize_moe(model, recipe, forward_loop=None, *, combine_weighting=None, layers=None, calibration=None,
                 verbose=False):
    """Replaces the forward of every MoE block of a transformers model (or of `layers`) with the Mega-MoE
    kernel's computation, with a dispatch and a combine quantizer per block configured from `recipe`,
    calibrated by `forward_loop(model)` or loaded from `calibration`. Returns a MoeQuantization (printed
    when verbose). See the module docstring for the contract."""
    from ._modules import CombineQuantizer, DispatchQuantizer

    if forward_loop is not None and calibration is not None:
        raise ValueError("quantize_moe: give forward_loop (to calibrate) or calibration (to load), not both")
    if getattr(model, _ATTR, None) is not None:
        raise ValueError("quantize_moe: the model's MoE blocks are already patched by moefq; call "
                         "moefq.hf.restore_moe(model) first")
    blocks = _select(model, layers, recipe)
    if isinstance(recipe, dict):
        per_layer = {int(i): _as_recipe(r) for i, r in recipe.items()}
        recipes = {i: per_layer.get(i) for i in blocks}
    else:
        one = _as_recipe(recipe)
        recipes = {i: one for i in blocks}
    weighting = _weighting(recipes.values(), combine_weighting)

    # One apply_recipe per recipe over all the quantizers it configures: a pattern that selects layers
    # (*layers.3.*) must match among all of them, not within each block.
    names = {i: (f"{path}.experts.dispatch_quantizer", f"{path}.experts.combine_quantizer")
             for i, (path, _) in blocks.items()}
    configs = {}
    for r in {id(r): r for r in recipes.values() if r is not None}.values():
        configs.update(apply_recipe(r, [n for i in blocks if recipes[i] is r for n in names[i]]))
    records = []
    for i, (path, block) in blocks.items():
        dq = _quantizer_module(DispatchQuantizer, names[i][0], configs.get(names[i][0]))
        cq = _quantizer_module(CombineQuantizer, names[i][1], configs.get(names[i][1]))
        experts = _fused_experts(block)
        param = next(iter(experts.parameters()), None)
        if param is not None:
            dq.to(param.device)
            cq.to(param.device)
        records.append(MoeBlock(i, path, block, dq, cq, weighting, None if recipes[i] is None else recipes[i].name))
    q = MoeQuantization(model, records, weighting)

    _install(q)
    try:
        if calibration is not None:
            q.load_calibration(calibration)
        elif forward_loop is not None:
            _calibrate(q, model, forward_loop)
        missing = [name for name, m in q.quantizers().items()
                   if m.enabled and m.quantizer.needs_calibration and m.amax is None]
        if missing:
            raise ValueError(f"quantize_moe: {', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''} "
                             "enabled without an amax: give forward_loop (calibration data) or calibration "
                             "(a calibration file or {name: amax})")
    except BaseException:
        restore_moe(model)
        raise
    if verbose:
        print(q.summary())
    return q


def _install(q):
    for r in q.blocks:
        r.experts.add_module("dispatch_quantizer", r.dispatch_quantizer)
        r.experts.add_module("combine_quantizer", r.combine_quantizer)
        r.block.__dict__[_RECORD] = r
        r.block.forward = types.MethodType(_mega_moe_forward, r.block)
    object.__setattr__(q.model, _ATTR, q)


def _calibrate(q, model, forward_loop):
    """Max calibration of every enabled quantizer that needs an amax while forward_loop(model) runs; the other
    quantizers pass data through meanwhile (as moefq's engine calibrates: no QDQ during calibration). Every
    quantizer that saw no data is named in one error; on any error none stores an amax."""
    mods = list(q.quantizers().values())
    calibrated = [m for m in mods if m.enabled and m.quantizer.needs_calibration]
    if not calibrated:
        return  # nothing to calibrate: the loop is not run
    paused = [m for m in mods if m.enabled and not m.quantizer.needs_calibration]
    for m in paused:
        m.disable()
    started = []
    try:
        for m in calibrated:
            m.quantizer.start_calibration()
            started.append(m)
        with torch.no_grad():
            forward_loop(model)
        empty = [m.quantizer.name for m in calibrated if not m.quantizer.seen_data]
        if empty:
            raise ValueError(f"quantize_moe: no calibration data reached {', '.join(empty)}: forward_loop(model) "
                             "must run the model on batches whose tokens reach these blocks")
        for m in calibrated:
            m.quantizer.finish_calibration()
    except BaseException:
        for m in started:
            if m.quantizer.calibrating:
                m.quantizer.abort_calibration()
        raise
    finally:
        for m in paused:
            m.enable()
        for m in calibrated:
            m._sync_amax()


def restore_moe(model):
    """Gives every block patched by quantize_moe its original forward back (bit for bit: the class's own
    forward, the experts without the quantizer submodules). Returns the module paths restored; an unpatched
    model is left as it is ([])."""
    q = getattr(model, _ATTR, None)
    if q is None:
        return []
    for r in q.blocks:
        r.block.__dict__.pop("forward", None)
        r.block.__dict__.pop(_RECORD, None)
        for name in ("dispatch_quantizer", "combine_quantizer"):
            if name in r.experts._modules:
                del r.experts._modules[name]
    object.__delattr__(model, _ATTR)
    return [r.path for r in q.blocks]


# torch >= 2.0 shows forward pre-hooks the keyword arguments too (with_kwargs=True); torch 1.x does not.
_HOOKS_SEE_KWARGS = "with_kwargs" in inspect.signature(torch.nn.Module.register_forward_pre_hook).parameters


def _check_output_file(path, who):
    """Refuses, before any work, a path that cannot become the output file: a directory or another
    non-regular file, or a folder that does not exist or cannot be written."""
    if os.path.isdir(path):
        example = os.path.join(path, "acts.safetensors")
        raise ValueError(f"{who}: path {path} is a directory; give a file name (e.g. {example})")
    if os.path.lexists(path) and not os.path.isfile(path):
        raise ValueError(f"{who}: path {path} exists and is not a regular file; outputs only replace regular files")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise ValueError(f"{who}: path {path}: the folder {folder} does not exist")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise ValueError(f"{who}: path {path}: the folder {folder} is not writable")


def capture_moe_inputs(model, layers, batches, path, *, max_tokens=None):
    """Runs the model on `batches` (each a tensor of input ids, or a dict of keyword arguments) and
    writes the inputs of the MoE blocks of `layers` (indices of decoder layers, each once) to
    `path`: a safetensors file with one tensor `layers.{i}` [tokens, H] bf16 per layer, the tokens
    in batch order, which `moefq eval --activations path --layers ...` reads. max_tokens: stop
    keeping rows after that many per layer. Returns {layer: number of rows}. The path is checked
    before the model runs; nothing is written on an error."""
    path = os.fspath(path)
    layers = [int(i) for i in ([layers] if isinstance(layers, int) else layers)]
    if not layers:
        raise ValueError("capture_moe_inputs: no layers given")
    repeated = sorted({i for i in layers if layers.count(i) > 1})
    if repeated:
        raise ValueError(f"capture_moe_inputs: layers {repeated} given more than once")
    blocks = find_moe_blocks(model)
    missing = [i for i in layers if i not in blocks]
    if missing:
        raise ValueError(f"capture_moe_inputs: layers {missing} have no MoE block (MoE layers: {sorted(blocks)})")
    _check_output_file(path, "capture_moe_inputs")
    captured = {i: [] for i in layers}
    counts = {i: 0 for i in layers}

    def hook_for(i):
        def hook(module, args, kwargs=None):
            x = args[0] if args else (kwargs or {}).get("hidden_states")
            if x is None:
                if _HOOKS_SEE_KWARGS:
                    raise ValueError(f"capture_moe_inputs: layer {i}'s MoE block got no hidden_states (neither "
                                     "positional nor as the keyword hidden_states)")
                raise ValueError(f"capture_moe_inputs: layer {i}'s MoE block was called without a positional "
                                 f"argument (e.g. mlp(hidden_states=h)); forward hooks of torch {torch.__version__} "
                                 "do not see keyword arguments (torch >= 2.0 does): call the block with "
                                 "hidden_states positionally, mlp(h)")
            rows = x.detach().reshape(-1, x.shape[-1])
            if max_tokens is not None:
                rows = rows[:max(0, int(max_tokens) - counts[i])]
            if rows.shape[0]:
                captured[i].append(rows.to(device="cpu", dtype=torch.bfloat16))
                counts[i] += rows.shape[0]
        return hook

    kwargs = {"with_kwargs": True} if _HOOKS_SEE_KWARGS else {}
    handles = [blocks[i].register_forward_pre_hook(hook_for(i), **kwargs) for i in layers]
    try:
        with torch.no_grad():
            for batch in batches:
                if isinstance(batch, dict):
                    model(**batch)
                else:
                    model(batch)
    finally:
        for h in handles:
            h.remove()
    empty = [i for i in layers if not captured[i]]
    if empty:
        raise ValueError(f"capture_moe_inputs: no tokens reached layers {empty} (no batches?)")
    tensors = {f"layers.{i}": torch.cat(captured[i]).contiguous() for i in layers}
    save_safetensors(path, tensors, {"source": type(model).__name__, "layers": ",".join(map(str, layers))})
    return {i: int(t.shape[0]) for i, t in zip(layers, tensors.values())}
