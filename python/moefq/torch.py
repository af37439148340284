"""moefq's quantizers as torch.nn.Modules, to put into a model's MoE, and capture_moe_inputs, which
records a Hugging Face model's MoE inputs into the activations file `moefq eval --activations` reads.

DispatchQuantizer sits where the tokens leave for the experts (x -> QDQ(x)); CombineQuantizer
replaces the sum of the weighted expert outputs (rows [K, T, H] -> one bf16 row per token), the
combine quantizer of moefq.combine_qdq_resum. Both hold a moefq.Quantizer: calibrate (max |x|),
enable/disable, amax, save/load of the project's calibration file. Gradients pass straight through
the QDQ (the straight-through estimator), so a model keeps training with them inside.
"""

import contextlib
import os

import torch

from . import Quantizer, combine_qdq_resum, save_safetensors

__all__ = ["DispatchQuantizer", "CombineQuantizer", "capture_moe_inputs", "find_moe_blocks"]


class _StraightThrough(torch.autograd.Function):
    """y = f(x) forward, dy/dx = 1 backward."""

    @staticmethod
    def forward(ctx, x, fn):
        return fn(x)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _QuantizerModule(torch.nn.Module):
    """What both modules share: the moefq.Quantizer and its controls."""

    def __init__(self, name, format, amax, amax_source, constant_amax):
        super().__init__()
        self.quantizer = Quantizer(name, format, amax_source=amax_source, constant_amax=constant_amax, amax=amax)

    @property
    def amax(self):
        return self.quantizer.amax

    @amax.setter
    def amax(self, value):
        self.quantizer.amax = value

    @property
    def enabled(self):
        return self.quantizer.enabled

    def enable(self, on=True):
        self.quantizer.enable(on)
        return self

    def disable(self):
        return self.enable(False)

    @property
    def calibrating(self):
        return self.quantizer.calibrating

    @contextlib.contextmanager
    def calibrate(self):
        """with m.calibrate(): model(batch) ... -- inputs pass unquantized, their max |x| is
        collected; the amax is stored when the block ends without an error."""
        with self.quantizer.calibrate():
            yield self

    def save(self, path):
        self.quantizer.save(path)

    def load(self, path):
        self.quantizer.load(path)

    def extra_repr(self):
        return f"{self.quantizer.spec.describe()}, {'enabled' if self.enabled else 'disabled'}, amax={self.amax}"


class DispatchQuantizer(_QuantizerModule):
    """x [..., H] (bf16 or float32) -> QDQ(x) in `format`, as the dispatch quantizer does to the
    tokens sent to the experts. While calibrating: collects max |x| and returns x; disabled: x."""

    def __init__(self, format, *, amax=None, amax_source=None, constant_amax=None,
                 name="layers.0.mlp.experts.dispatch_quantizer"):
        super().__init__(name, format, amax, amax_source, constant_amax)

    def forward(self, x):
        if self.calibrating:
            self.quantizer.collect(x)
            return x
        if not self.enabled:
            return x
        return _StraightThrough.apply(x.contiguous(), self.quantizer.qdq)


class CombineQuantizer(_QuantizerModule):
    """rows [K, T, H] bf16 (slot k of token t: the expert's output times its router weight, zero
    where the slot is not routed) -> [T, H] bf16: each row QDQ'd in `format`, summed in ascending
    slot order in fp32 from 0, `shared` [T, H] added last unquantized, one rounding to bf16
    (moefq.combine_qdq_resum). While calibrating: collects max |rows| and returns the plain sum;
    disabled: the plain sum. topk_idx [T, K]: negative marks a slot whose row is not read.
    topk_weights [T, K] float32 (combine_weighting after): the rows are the unweighted expert
    outputs, and each (QDQ'd) row is multiplied by its router weight in fp32 before it is added;
    calibration then sees the unweighted rows, as the quantizer does."""

    def __init__(self, format, *, amax=None, amax_source=None, constant_amax=None,
                 name="layers.0.mlp.experts.combine_quantizer"):
        if amax_source == "dynamic":
            raise ValueError(f"{name}: a dynamic amax cannot be used for combine (the rows arrive at different "
                             "ranks); calibrate it or set constant_amax")
        super().__init__(name, format, amax, amax_source, constant_amax)

    def forward(self, rows, shared=None, topk_idx=None, topk_weights=None):
        fmt, amax = None, None
        if self.calibrating:
            self.quantizer.collect(rows)
        elif self.enabled:
            fmt = self.quantizer.format
            amax = self.quantizer.amax
            if amax is None and self.quantizer.needs_calibration:
                raise ValueError(f"{self.quantizer.name}: no amax yet: calibrate it (with m.calibrate(): ...), load "
                                 "a calibration file or set amax")

        def resum(r):
            return combine_qdq_resum(r, fmt, amax, shared=shared, topk_idx=topk_idx, topk_weights=topk_weights)

        return _StraightThrough.apply(rows.contiguous(), resum) if rows.requires_grad else resum(rows.contiguous())


# Hugging Face MoE blocks by class name: DeepSeek-V3 (DeepseekV3MoE), Qwen3-MoE
# (Qwen3MoeSparseMoeBlock), Mixtral (MixtralSparseMoeBlock), and their relatives (Qwen2-MoE,
# DeepSeek-V2); the block's input is the post-attention-norm hidden state [batch, seq, H].
_MOE_CLASS_SUFFIXES = ("MoE", "SparseMoeBlock")


def _decoder_layers(model):
    for path in ("model.layers", "layers", "model.model.layers", "transformer.h"):
        obj = model
        for part in path.split("."):
            obj = getattr(obj, part, None)
            if obj is None:
                break
        if isinstance(obj, torch.nn.ModuleList):
            return obj
    raise ValueError(f"capture_moe_inputs: {type(model).__name__} has no decoder layers (model.layers or "
                     "model.model.layers)")


def find_moe_blocks(model):
    """{decoder layer index: its MoE block} of a Hugging Face model (dense layers are left out)."""
    blocks = {}
    for i, layer in enumerate(_decoder_layers(model)):
        for attr in ("mlp", "block_sparse_moe", "moe"):
            block = getattr(layer, attr, None)
            if block is not None and type(block).__name__.endswith(_MOE_CLASS_SUFFIXES):
                blocks[i] = block
                break
    return blocks


def capture_moe_inputs(model, layers, batches, path, *, max_tokens=None):
    """Runs the model on `batches` (each a tensor of input ids, or a dict of keyword arguments) and
    writes the inputs of the MoE blocks of `layers` (indices of decoder layers) to `path`: a
    safetensors file with one tensor `layers.{i}` [tokens, H] bf16 per layer, the tokens in batch
    order, which `moefq eval --activations path --layers ...` reads. max_tokens: stop keeping rows
    after that many per layer. Returns {layer: number of rows}."""
    blocks = find_moe_blocks(model)
    layers = [int(i) for i in ([layers] if isinstance(layers, int) else layers)]
    if not layers:
        raise ValueError("capture_moe_inputs: no layers given")
    missing = [i for i in layers if i not in blocks]
    if missing:
        raise ValueError(f"capture_moe_inputs: layers {missing} have no MoE block (MoE layers: {sorted(blocks)})")
    captured = {i: [] for i in layers}
    counts = {i: 0 for i in layers}

    def hook_for(i):
        def hook(module, args, kwargs=None):
            x = args[0] if args else (kwargs or {}).get("hidden_states")
            if x is None:
                raise ValueError(f"capture_moe_inputs: layer {i}'s MoE block got no hidden_states")
            rows = x.detach().reshape(-1, x.shape[-1])
            if max_tokens is not None:
                rows = rows[:max(0, int(max_tokens) - counts[i])]
            if rows.shape[0]:
                captured[i].append(rows.to(device="cpu", dtype=torch.bfloat16))
                counts[i] += rows.shape[0]
        return hook

    handles = [blocks[i].register_forward_pre_hook(hook_for(i)) for i in layers]
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
    save_safetensors(os.fspath(path), tensors, {"source": type(model).__name__, "layers": ",".join(map(str, layers))})
    return {i: int(t.shape[0]) for i, t in zip(layers, tensors.values())}
