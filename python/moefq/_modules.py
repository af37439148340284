"""The torch.nn.Modules behind moefq.torch: DispatchQuantizer and CombineQuantizer (see moefq.torch
for the contract). moefq.hf builds on them; moefq.torch re-exports both, so neither imports the other."""

import contextlib

import torch

from . import Quantizer
from . import _combine_qdq_resum, _qdq


class _StraightThrough(torch.autograd.Function):
    """y = f(x) forward, dy/dx = 1 backward."""

    @staticmethod
    def forward(ctx, x, fn):
        return fn(x)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _CombineResum(torch.autograd.Function):
    """y[t] = bf16(sum over active k of w[t, k] * QDQ(rows[k, t]) + shared[t]) (w = 1 when the rows
    come weighted), with QDQ taken as the identity backward (the straight-through estimator):
    d rows[k, t] = w[t, k] * dy[t] on active slots and 0 on the others (their rows are never read),
    d shared[t] = dy[t], d w[t, k] = <dy[t], QDQ(rows[k, t])>, the row as the forward summed it.
    The sums run in fp32; each gradient comes back in its input's dtype."""

    @staticmethod
    def forward(ctx, rows, shared, topk_weights, topk_idx, fmt, amax):
        ctx.fmt, ctx.amax, ctx.rows_shape, ctx.rows_dtype = fmt, amax, rows.shape, rows.dtype
        # The rows only for the weights' gradient, which needs them QDQ'd again.
        ctx.save_for_backward(rows if ctx.needs_input_grad[2] else None, topk_weights, topk_idx)
        # The quantizer's own amax: a calibration on all-zero rows stores 0, which it may use.
        return _combine_qdq_resum(rows, fmt, amax, shared, topk_idx, topk_weights, None, None, stored=True)

    @staticmethod
    def backward(ctx, grad):
        rows, weights, idx = ctx.saved_tensors
        K, T, H = ctx.rows_shape
        g = grad.float()
        active = None if idx is None else (idx >= 0).t().unsqueeze(-1)  # [K, T, 1]
        grad_rows = grad_shared = grad_weights = None
        if ctx.needs_input_grad[0]:
            gr = g.unsqueeze(0).expand(K, T, H)
            if weights is not None:
                gr = gr * weights.float().t().unsqueeze(-1)
            if active is not None:
                gr = torch.where(active, gr, gr.new_zeros(()))
            grad_rows = gr.to(ctx.rows_dtype)
        if ctx.needs_input_grad[1]:
            grad_shared = grad
        if ctx.needs_input_grad[2]:
            sent = rows if ctx.fmt is None else _qdq(rows.reshape(K * T, H), ctx.fmt, ctx.amax, None, None, stored=True)
            sent = sent.reshape(K, T, H).float()
            if active is not None:
                sent = torch.where(active, sent, sent.new_zeros(()))  # an unread row may hold NaN
            grad_weights = torch.einsum("th,kth->tk", g, sent).to(weights.dtype)
        return grad_rows, grad_shared, grad_weights, None, None, None


class _QuantizerModule(torch.nn.Module):
    """What both modules share: the moefq.Quantizer and its controls. A calibrated amax is also the
    float32 buffer `_amax` (absent while there is none), so state_dict()/load_state_dict() carry it;
    the quantizer holds the value that counts, and the buffer follows it. copy.deepcopy, pickle and
    torch.save rebuild the quantizer from its spec, switch and amax."""

    def __init__(self, name, format, amax, amax_source, constant_amax):
        super().__init__()
        self.quantizer = Quantizer(name, format, amax_source=amax_source, constant_amax=constant_amax, amax=amax)
        # Where the module lives (.to()/.cuda() move it): an amax that appears later goes there.
        self._amax_device = torch.device("cpu")
        self.register_buffer("_amax", None)
        self._sync_amax()

    def _sync_amax(self):
        q = self.quantizer
        value = q.amax if q.needs_calibration else None
        held = self._buffers.get("_amax")
        device = held.device if held is not None else self._amax_device
        self._amax = None if value is None else torch.tensor(value, dtype=torch.float32, device=device)

    def _apply(self, fn, *args, **kwargs):
        super()._apply(fn, *args, **kwargs)
        self._amax_device = fn(torch.empty(0, device=self._amax_device)).device
        return self

    @property
    def amax(self):
        return self.quantizer.amax

    @amax.setter
    def amax(self, value):
        self.quantizer.amax = value
        self._sync_amax()

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
        collected; the amax is stored when the block ends without an error. On an error (NaN or
        inf in the data, KeyboardInterrupt, no data at all) the quantizer is as before the block
        (its previous amax, not calibrating) and the error propagates."""
        try:
            with self.quantizer.calibrate():
                yield self
        finally:
            self._sync_amax()

    def abort_calibration(self):
        self.quantizer.abort_calibration()
        self._sync_amax()

    def save(self, path):
        self.quantizer.save(path)

    def load(self, path):
        self.quantizer.load(path)
        self._sync_amax()

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        self._sync_amax()  # also after changes made on self.quantizer directly
        super()._save_to_state_dict(destination, prefix, keep_vars)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        key = prefix + "_amax"
        held = self._buffers["_amax"]
        self._buffers["_amax"] = None  # loaded here, into the quantizer, not copied into the buffer
        try:
            super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                          error_msgs)
        finally:
            self._buffers["_amax"] = held
        if key in unexpected_keys:
            unexpected_keys.remove(key)
        q = self.quantizer
        if key in state_dict:
            value = state_dict[key]
            try:
                if not isinstance(value, torch.Tensor) or value.numel() != 1:
                    raise ValueError(f"expected a 1-element tensor, got {type(value).__name__} "
                                     f"{list(getattr(value, 'shape', []))}")
                q.set_amax(float(value))
            except ValueError as e:
                error_msgs.append(f"{key}: {e}")
        elif q.needs_calibration and q.amax is not None:
            missing_keys.append(key)
        self._sync_amax()

    def extra_repr(self):
        return f"{self.quantizer.spec.describe()}, {'enabled' if self.enabled else 'disabled'}, amax={self.amax}"


class DispatchQuantizer(_QuantizerModule):
    """x [..., H] (bf16 or float32) -> QDQ(x) in `format`, as the dispatch quantizer does to the
    tokens sent to the experts. While calibrating: collects max |x| and returns x; disabled: x.
    Backward: the gradient passes straight through (dy/dx = 1)."""

    def __init__(self, format, *, amax=None, amax_source=None, constant_amax=None,
                 name="layers.0.mlp.experts.dispatch_quantizer"):
        super().__init__(name, format, amax, amax_source, constant_amax)

    def forward(self, x):
        if self.calibrating:
            self.quantizer.collect(x.contiguous())
            return x
        if not self.enabled:
            return x
        return _StraightThrough.apply(x.contiguous(), self.quantizer.qdq)


class CombineQuantizer(_QuantizerModule):
    """rows [K, T, H] bf16 (slot k of token t: the expert's output times its router weight, zero
    where the slot is not routed) -> [T, H] bf16: each row QDQ'd in `format`, summed in ascending
    slot order in fp32 from 0, `shared` [T, H] added last unquantized, one rounding to bf16
    (moefq.combine_qdq_resum). While calibrating: collects max |rows| over the active slots and
    returns the plain sum; disabled: the plain sum. topk_idx [T, K]: negative marks a slot whose
    row is not read (nor collected). topk_weights [T, K] float32 (combine_weighting after): the rows
    are the unweighted expert outputs, and each (QDQ'd) row is multiplied by its router weight in
    fp32 before it is added; calibration then sees the unweighted rows, as the quantizer does.
    Backward (rows, shared and topk_weights, whichever requires grad): straight through the QDQ,
    the derivative of that sum (_CombineResum)."""

    def __init__(self, format, *, amax=None, amax_source=None, constant_amax=None,
                 name="layers.0.mlp.experts.combine_quantizer"):
        if amax_source == "dynamic":
            raise ValueError(f"{name}: a dynamic amax cannot be used for combine (the rows arrive at different "
                             "ranks); calibrate it or set constant_amax")
        super().__init__(name, format, amax, amax_source, constant_amax)

    def forward(self, rows, shared=None, topk_idx=None, topk_weights=None):
        if rows.dim() != 3:
            raise ValueError(f"{self.quantizer.name}: rows has shape {list(rows.shape)}; expected [K, T, H]")
        if topk_idx is not None:
            topk_idx = torch.as_tensor(topk_idx, device=rows.device)
            K, T, _ = rows.shape
            if tuple(topk_idx.shape) != (T, K):
                raise ValueError(f"{self.quantizer.name}: topk_idx has shape {list(topk_idx.shape)}; expected "
                                 f"[T, K] = [{T}, {K}] for rows {list(rows.shape)}")
        fmt, amax = None, None
        if self.calibrating:
            self.quantizer.collect(_active_rows(rows, topk_idx))
        elif self.enabled:
            fmt = self.quantizer.format
            amax = self.quantizer.amax
            if amax is None and self.quantizer.needs_calibration:
                raise ValueError(f"{self.quantizer.name}: no amax yet: calibrate it (with m.calibrate(): ...), load "
                                 "a calibration file or set amax")
        rows, shared, topk_weights = (None if t is None else t.contiguous() for t in (rows, shared, topk_weights))
        return _CombineResum.apply(rows, shared, topk_weights, topk_idx, fmt, amax)


def _active_rows(rows, topk_idx):
    """The rows [n, H] of the active slots (all K x T without topk_idx): what calibration collects."""
    rows = rows.detach()
    if topk_idx is None:
        return rows.contiguous()
    return rows[(topk_idx >= 0).t()]
