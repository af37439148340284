"""moefq from Python: the fake quantizers of quantized expert-parallel MoE communication on your
own tensors, the simulated MoE layer, and `moefq eval`.

A thin binding over the C++ library: tensors cross through DLPack without copies (torch tensors on
the CPU or CUDA, numpy arrays), CUDA work goes on torch's current stream with no synchronisation
(capturable in a CUDA graph), the GIL is released during work, and errors keep the library's
messages (ValueError for bad input, RuntimeError otherwise). See docs/python.md.
"""

import contextlib as _contextlib
import json as _json
import operator as _operator
import os as _os

import importlib.util as _importlib_util

# torch, where it is installed, is loaded before the extension: a torch build that brings its own C++
# runtime must be the first to resolve the runtime's shared symbols in the process, or importing torch
# after moefq fails (seen as "free(): invalid pointer" with torch 2.11). Every test imports torch first;
# this makes `import moefq; import torch` (python -m moefq.compare, moefq.bench_hf) load in that order too.
if _importlib_util.find_spec("torch") is not None:
    import torch as _torch  # noqa: F401

from . import _moefq as _C
from . import _tensors as _t

__all__ = [
    "qdq", "combine_qdq_resum", "Quantizer", "QuantSpec", "load_recipe", "apply_recipe", "list_recipe_units",
    "save_calibration", "load_calibration", "MoeLayer", "eval", "calibrate", "metrics", "save_safetensors",
    "load_safetensors", "formats", "built_with_cuda", "cuda_device_count", "preset_names", "Recipe", "QuantizerConfig",
    "__version__",
]

__version__ = _C.version
formats = tuple(_C.formats())
built_with_cuda = _C.built_with_cuda()
QuantSpec = _C.QuantSpec
Recipe = _C.Recipe
QuantizerConfig = _C.QuantizerConfig
list_recipe_units = _C.list_recipe_units
preset_names = _C.preset_names


def cuda_device_count():
    """GPUs this build can use (0 without CUDA in the build, a driver or a GPU)."""
    return _C.cuda_device_count()


# The shipped recipe units travel inside an installed package (pip install): make them findable
# by name after any MOEFQ_RECIPE_PATH the user set.
_RECIPES = _os.path.join(_os.path.dirname(__file__), "recipes")
if _os.path.isdir(_RECIPES):
    _path = _os.environ.get("MOEFQ_RECIPE_PATH", "")
    if _RECIPES not in _path.split(_os.pathsep):
        _os.environ["MOEFQ_RECIPE_PATH"] = _path + _os.pathsep + _RECIPES if _path else _RECIPES


def qdq(x, format, amax=None, *, out=None, stream=None):
    """Fake-quantizes x (quantize, then dequantize) in `format` (one of moefq.formats), exactly as
    `moefq qdq` does: blocks run along the last dimension; bf16 or float32 in, the same dtype out
    (numpy: float32, or uint16 holding bf16 bits).

    amax: the global amax of fp8, nvfp4 and int8 (a finite number > 0, or a 1-element float32
    tensor on x's device); None: dynamic, max |x| over the whole tensor. The other formats ignore it.
    out: where the result goes (x itself for in place; same dtype, shape and device); default a new
    tensor of x's kind. Returns out. No autograd: the result of a torch x that requires grad does
    not (moefq.torch.DispatchQuantizer has the straight-through gradient), and an `out` that requires
    grad is refused while grad mode is on.
    """
    return _qdq(x, format, amax, out, stream, stored=False)


def _qdq(x, format, amax, out, stream, stored):
    """qdq; stored: amax is a quantizer's own, which may be 0 (see _tensors.check_amax)."""
    _t.check_tensor(x, "qdq: x")
    block, global_amax = _C.format_info(format, "qdq: format")
    s = _t.stream_of(x, stream)
    if out is None:
        out = _t.empty_like(x)
    _t.check_out(out, "qdq: out")
    number, tensor, dynamic = _t.amax_args(x, amax, global_amax, "qdq", stored)
    _C.qdq(_t.capsule(x, "qdq: x", s), _t.capsule(out, "qdq: out", s), format, number, tensor, dynamic, s)
    return out


def combine_qdq_resum(rows, format, amax=None, *, shared=None, topk_idx=None, topk_weights=None, out=None,
                      stream=None):
    """The combine quantizer as one operation, bit-identical to the C++ engine's: rows [K, T, H]
    bf16 (slot k of token t: the expert output, weighted by the router unless topk_weights is
    given), each active row QDQ'd along H in `format` (None: no QDQ, the plain combine), summed per
    token in fp32 from +0 in ascending slot order, `shared` [T, H] bf16 added last without QDQ,
    one rounding to bf16.

    amax: the global amax of fp8, nvfp4 and int8 (required: calibrate it; a finite number > 0 or a
    1-element float32 tensor on the rows' device). topk_idx: [T, K] integer ids, negative for a slot that is
    not routed (its row is not read); None: every slot is active (an all-zero row then adds nothing,
    so zero rows for unrouted slots give the same bits). On CUDA pass int32 indices to avoid a
    conversion (and without topk_idx an all-active index tensor is made each call).
    topk_weights: [T, K] float32 router weights for rows left unweighted (combine_weighting after):
    each active row, after its QDQ, is added as acc = fma(row, weight, acc) in fp32 (one rounding,
    as DeepEP's low-latency combine accumulates); None: the rows are already weighted
    (combine_weighting before).
    Returns out, [T, H] bf16 (numpy: uint16 bf16 bits).
    """
    return _combine_qdq_resum(rows, format, amax, shared, topk_idx, topk_weights, out, stream, stored=False)


def _combine_qdq_resum(rows, format, amax, shared, topk_idx, topk_weights, out, stream, stored):
    """combine_qdq_resum; stored: amax is a quantizer's own, which may be 0."""
    _t.check_tensor(rows, "combine_qdq_resum: rows")
    s = _t.stream_of(rows, stream)
    global_amax = False
    if format is not None:
        _, global_amax = _C.format_info(format, "combine_qdq_resum: format")
    if global_amax and amax is None:
        raise ValueError(f"combine_qdq_resum: {format} needs an amax (its global scale); give the calibrated value")
    shape = tuple(rows.shape)
    if len(shape) != 3:
        raise ValueError(f"combine_qdq_resum: rows has shape {list(shape)}; expected [K, T, H]")
    K, T, H = shape
    if topk_idx is not None:
        topk_idx = _t.as_int32(topk_idx, "combine_qdq_resum: topk_idx")
    elif _t.is_cuda(rows):
        if not _t.is_torch(rows):
            raise ValueError("combine_qdq_resum: CUDA rows that are not torch tensors need topk_idx (int32 [T, K])")
        topk_idx = _all_active(rows, T, K)
    if out is None:
        out = _t.empty(rows, (T, H))
    _t.check_out(out, "combine_qdq_resum: out")
    number, tensor, _ = _t.amax_args(rows, amax, global_amax, "combine_qdq_resum", stored)
    _C.combine(_t.capsule(rows, "combine_qdq_resum: rows", s), _t.capsule(out, "combine_qdq_resum: out", s), format,
               number, tensor, _t.optional_capsule(shared, "combine_qdq_resum: shared", s),
               _t.optional_capsule(topk_idx, "combine_qdq_resum: topk_idx", s),
               _t.optional_capsule(topk_weights, "combine_qdq_resum: topk_weights", s), s)
    return out


def _all_active(rows, T, K):
    import torch
    return torch.zeros((T, K), dtype=torch.int32, device=rows.device)


class Quantizer(_C.Quantizer):
    """A named fake quantizer (the C++ moefq::Quantizer): its spec, whether it is enabled, max
    calibration and the global amax.

    Quantizer("layers.0.mlp.experts.combine_quantizer", "nvfp4")    # amax from calibration
    Quantizer(name, "fp8", constant_amax=448.0)                      # a constant amax
    Quantizer(name, "fp8", amax_source="dynamic")                    # max |x| per call
    """

    def __init__(self, name, format=None, *, spec=None, amax_source=None, constant_amax=None, block_size=0,
                 enabled=True, amax=None):
        if spec is None:
            if format is None:
                raise ValueError(f"{name}: give a format (one of {', '.join(formats)}) or a spec")
            if amax_source is None:
                amax_source = "constant" if constant_amax is not None else "calibrated"
            spec = _C.QuantSpec(format, block_size, amax_source, constant_amax)
        super().__init__(name, spec, enabled)
        if amax is not None:
            self.set_amax(_t.real_number(amax, f"{name}: amax"))

    @property
    def format(self):
        return self.spec.format

    @property
    def amax(self):
        """The calibrated (or loaded, or set) amax, the constant one, or None (dynamic; mx formats;
        not calibrated yet)."""
        return _C.Quantizer.amax.fget(self)

    @amax.setter
    def amax(self, value):
        self.set_amax(_t.real_number(value, f"{self.name}: amax"))

    def enable(self, on=True):
        self.enabled = bool(on)
        return self

    def disable(self):
        self.enabled = False
        return self

    def collect(self, x, *, stream=None):
        """Folds max |x| into the calibration (CUDA tensors are copied to the host, in order on the
        current stream: calibration is an eager step). NaN or inf is an error naming the quantizer."""
        s = _t.stream_of(x, stream)
        _C.Quantizer.collect(self, _t.capsule(x, f"{self.name}: collect: x", s), s)

    @_contextlib.contextmanager
    def calibrate(self):
        """with q.calibrate(): q.collect(x) ... -- start, then finish (storing the max) on success.
        Any exception inside the block (bad data, KeyboardInterrupt) or from the finish (no data
        reached a quantizer that needs it) aborts the calibration: the quantizer is as before the
        block (its previous amax, not calibrating) and the exception propagates."""
        self.start_calibration()
        try:
            yield self
            self.finish_calibration()
        except BaseException:
            self.abort_calibration()
            raise

    def qdq(self, x, *, out=None, stream=None):
        """x through this quantizer: QDQ with its amax (stored, constant or dynamic) while enabled
        and not calibrating, else x unchanged (copied into out when out is given)."""
        if not self.enabled or self.calibrating:
            if out is None or out is x:
                return x
            return _copy_into(out, x)
        amax = None
        if self.spec.amax_source != "dynamic" and _C.format_info(self.format, self.name)[1]:
            amax = self.amax
            if amax is None:
                raise ValueError(f"{self.name}: no amax yet: calibrate it (start_calibration, collect, "
                                 "finish_calibration), load a calibration file or set amax")
        return _qdq(x, self.format, amax, out, stream, stored=True)

    def save(self, path):
        """Writes this quantizer's amax to a calibration file (the project's one format)."""
        save_calibration(path, [self])

    def load(self, path):
        load_calibration(path, [self])

    def __repr__(self):
        state = "enabled" if self.enabled else "disabled"
        return f"Quantizer({self.name!r}, {self.spec.describe()}, {state}, amax={self.amax})"

    def __reduce__(self):
        # copy.deepcopy, pickle and torch.save rebuild the quantizer from its spec, switch and amax.
        if self.calibrating:
            raise TypeError(f"{self.name}: cannot copy or pickle a quantizer while it calibrates; finish or abort "
                            "the calibration first")
        s = self.spec
        amax = self.amax if self.needs_calibration else None
        return (_rebuild_quantizer, (self.name, s.format, s.block_size, s.amax_source, s.constant_amax, self.enabled,
                                     amax))


def _rebuild_quantizer(name, format, block_size, amax_source, constant_amax, enabled, amax):
    return Quantizer(name, spec=_C.QuantSpec(format, block_size, amax_source, constant_amax), enabled=enabled,
                     amax=amax)


def _copy_into(out, x):
    if _t.is_torch(out):
        out.copy_(x)
    elif _t.is_numpy(out):
        out[...] = x
    else:
        raise TypeError(f"cannot copy into {type(out).__name__}")
    return out


def load_recipe(path_or_unit_name, recipe_root=""):
    """A recipe file in Model Optimizer's layout (unit, preset or complete recipe) or a shipped unit
    by name, imports expanded; recipe_root: where `imports:` paths are looked for first."""
    return _C.load_recipe(_os.fspath(path_or_unit_name), _os.fspath(recipe_root))


def _as_recipe(recipe):
    return recipe if isinstance(recipe, _C.Recipe) else load_recipe(recipe)


def apply_recipe(recipe, quantizer_names):
    """{name: QuantizerConfig} for the named quantizers (a recipe, a file or a unit name)."""
    if isinstance(quantizer_names, (str, bytes)):
        raise TypeError("apply_recipe: quantizer_names must be a list of names, got a "
                        f"{type(quantizer_names).__name__}")
    return _C.apply_recipe(_as_recipe(recipe), list(quantizer_names))


def save_calibration(path, quantizers):
    """Writes the quantizers' amax to a calibration file (written atomically)."""
    path = _C.check_output_path(_os.fspath(path), "save_calibration: path")
    _C.save_calibration(path, list(quantizers))


def load_calibration(path, quantizers):
    """Sets the amax of every quantizer that needs calibration from a calibration file; all or nothing."""
    _C.load_calibration(_os.fspath(path), list(quantizers))


class MoeLayer:
    """One fake-quantized MoE layer on R simulated expert-parallel ranks, with the weights `moefq eval`
    uses for the same model, layer and seed (a preset, a Hugging Face config.json, or a
    checkpoint directory with e4m3, bf16 or MXFP4 expert weights), on the CPU engine or the CUDA
    engine.

    The quantizers are `quantizer_names` (layers.{i}.mlp.experts.dispatch_quantizer and
    .combine_quantizer); both are disabled until configure(recipe). forward takes tokens [N, H]
    bf16 (N <= ranks x max_tokens, cut into R consecutive parts, one per rank) and returns the
    routed output plus the shared expert's (run on the unquantized x), as `moefq eval` adds them.
    staging: the activations into the expert GEMMs, "e4m3" (1x128 scales, the FP8 Mega-MoE engine)
    or "none" (bf16); None: as the model is served (e4m3 for e4m3 checkpoints, DeepSeek-V3/V4 and
    Kimi; none for bf16 checkpoints, Qwen3, Mixtral, OLMoE and GLM; an MXFP4 checkpoint's follows its
    architecture).
    """

    def __init__(self, preset=None, *, config=None, checkpoint=None, layer=0, ranks=1, max_tokens=256,
                 device="cpu", seed=1, synthetic="model", threads=0, recipe=None, combine_weighting="before",
                 staging=None):
        self._layer = _C.MoeLayer(preset or "", _os.fspath(config) if config else "",
                                  _os.fspath(checkpoint) if checkpoint else "", layer, ranks, max_tokens, device, seed,
                                  synthetic, threads, combine_weighting, "" if staging is None else staging)
        if recipe is not None:
            self.configure(recipe)

    config = property(lambda self: self._layer.config, doc="The model's MoE shape and routing rule (a dict).")
    source = property(lambda self: self._layer.source)
    ranks = property(lambda self: self._layer.ranks)
    max_tokens = property(lambda self: self._layer.max_tokens)
    layer = property(lambda self: self._layer.layer)
    device = property(lambda self: self._layer.device)
    quantizer_names = property(lambda self: self._layer.quantizer_names)
    combine_weighting = property(lambda self: self._layer.combine_weighting,
                                 doc="Where the router weight is applied: 'before' or 'after' the combine.")
    staging = property(lambda self: self._layer.staging,
                       doc="The activations into the expert GEMMs: 'e4m3' (1x128 scales) or 'none' (bf16).")

    def configure(self, recipe):
        """Configures both quantizers from a recipe (a Recipe, a file or a unit name; None: both off).
        A recipe whose combine_weighting is not the layer's is an error."""
        configs = {}
        if recipe is not None:
            recipe = _as_recipe(recipe)
            if recipe.combine_weighting not in (None, self.combine_weighting):
                raise ValueError(f"MoeLayer.configure: recipe {recipe.name} has combine_weighting: "
                                 f"{recipe.combine_weighting}, but the layer applies the router weight "
                                 f"{self.combine_weighting} the combine (MoeLayer(combine_weighting=...))")
            configs = apply_recipe(recipe, self.quantizer_names)
        self._layer.configure(configs)

    def dispatch_quantizer(self, rank=0):
        """A snapshot of rank `rank`'s dispatch quantizer (after calibration every rank holds the same amax)."""
        return self._layer.quantizer(0, rank)

    def combine_quantizer(self, rank=0):
        return self._layer.quantizer(1, rank)

    @property
    def dispatch_amax(self):
        return self.dispatch_quantizer().amax

    @property
    def combine_amax(self):
        return self.combine_quantizer().amax

    def rank_amax(self, which):
        """Each rank's own max of the last calibration ('dispatch' or 'combine', or 0 or 1), before the MAX."""
        return self._layer.rank_amax(which)

    def route(self, x, *, stream=None):
        """The layer's own router: (topk_idx [N, K] int32, topk_weights [N, K] float32)."""
        s = _t.stream_of(x, stream)
        n, k = int(x.shape[0]), self.config["top_k"]
        idx, w = _t.empty(x, (n, k), "int32"), _t.empty(x, (n, k), "float32")
        ws = None
        if _t.is_cuda(x):
            ws = _scratch(x, self._layer.route_workspace_bytes(n))
        self._layer.route(_t.capsule(x, "route: x", s), _t.capsule(idx, "route: topk_idx", s),
                          _t.capsule(w, "route: topk_weights", s), _t.optional_capsule(ws, "route: workspace", s), s)
        return idx, w

    def forward(self, x, topk_idx=None, topk_weights=None, *, out=None, include_shared=True, stream=None):
        """The layer's output for x [N, H] bf16 routed by (topk_idx, topk_weights) ([N, K] global
        expert ids, -1 inactive; router weights with the scaling folded in); None: the layer's own
        router. include_shared=False: the routed part alone."""
        s = _t.stream_of(x, stream)
        if topk_idx is None or topk_weights is None:
            topk_idx, topk_weights = self.route(x, stream=stream)
        topk_idx = _t.as_int32(topk_idx, "forward: topk_idx")
        if out is None:
            out = _t.empty_like(x)
        _t.check_out(out, "MoeLayer.forward: out")
        scratch = None
        if _t.is_cuda(x) and include_shared and self._layer.has_shared:
            scratch = _t.empty_like(x)
        self._layer.forward(_t.capsule(x, "forward: x", s), _t.capsule(topk_idx, "forward: topk_idx", s),
                            _t.capsule(topk_weights, "forward: topk_weights", s), _t.capsule(out, "forward: out", s),
                            _t.optional_capsule(scratch, "forward: scratch", s), include_shared, s)
        return out

    __call__ = forward

    def start_calibration(self):
        self._layer.start_calibration()

    def finish_calibration(self):
        """MAX over the ranks, then each quantizer stores its amax. An error (no data reached an
        enabled quantizer that needs calibration; NaN or inf in the data) leaves the layer
        calibrating: collect more, or abort_calibration()."""
        self._layer.finish_calibration()

    def abort_calibration(self):
        """Leaves a calibration without storing anything: both quantizers as start_calibration found
        them (their amax, not calibrating)."""
        self._layer.abort_calibration()

    def calibrate(self, batches):
        """Max calibration over the batches (each x, or a tuple (x, topk_idx, topk_weights)); both
        quantizers' amax are then MAX-reduced over the ranks. Returns (dispatch_amax, combine_amax).
        On any error (a bad batch, NaN or inf, no batches at all, KeyboardInterrupt) the calibration is
        aborted, the layer is as before the call, and the error propagates."""
        self.start_calibration()
        try:
            for b in batches:
                if isinstance(b, (tuple, list)):
                    self.forward(*b)
                else:
                    self.forward(b)
            self.finish_calibration()
        except BaseException:
            self.abort_calibration()
            raise
        return self.dispatch_amax, self.combine_amax

    def set_calibrated_amax(self, dispatch_amax, combine_amax):
        self._layer.set_calibrated_amax(_t.real_number(dispatch_amax, "set_calibrated_amax: dispatch_amax"),
                                        _t.real_number(combine_amax, "set_calibrated_amax: combine_amax"))

    def save_calibration(self, path):
        self._layer.save_calibration(_C.check_output_path(_os.fspath(path), "MoeLayer.save_calibration: path"))

    def load_calibration(self, path):
        self._layer.load_calibration(_os.fspath(path))

    def layout_checked(self, rank=0):
        """Whether rank's buffer passed the layout check (the combine quantizer read the right rows)."""
        return self._layer.layout_checked(rank)

    def synchronize(self, stream=None):
        """CUDA: waits for the stream and raises a layout mismatch that a captured graph recorded."""
        if self._layer.device != "cpu":
            import torch
            self._layer.synchronize(int(stream) if stream is not None else torch.cuda.current_stream().cuda_stream)

    def __repr__(self):
        return f"MoeLayer({self.source}, layer {self.layer}, {self.ranks} ranks, {self.device})"


def _scratch(like, nbytes):
    import torch
    return torch.empty(max(int(nbytes), 1), dtype=torch.uint8, device=like.device)


def _eval_options(options):
    o = dict(options)
    layers = o.get("layers")
    if layers is not None and not isinstance(layers, str):
        # Integers only (operator.index refuses 0.7 rather than truncate it to layer 0).
        try:
            ids = [_operator.index(layers)]
        except TypeError:
            ids = None
        try:
            ids = ids or [_operator.index(i) for i in layers]
        except TypeError:
            raise TypeError(f"layers: expected a string such as \"3-10\", an integer or a list of integers, got "
                            f"{layers!r}") from None
        o["layers"] = ",".join(map(str, ids))
    recipes = o.get("recipes")
    if isinstance(recipes, (str, _os.PathLike)):
        o["recipes"] = [_os.fspath(recipes)]
    elif recipes is not None:
        o["recipes"] = [_os.fspath(r) for r in recipes]
    for key in ("config", "checkpoint", "activations", "load_calibration", "recipe_root", "out"):
        if o.get(key) is not None:
            o[key] = _os.fspath(o[key])
    if o.get("out") == "":
        raise ValueError("out: empty path; give a directory name (or leave out out= to write no reports)")
    if o.get("progress") is True:
        import sys
        o["progress"] = lambda line: print("  " + line, file=sys.stderr)
    elif o.get("progress") is False:
        o["progress"] = None
    return o


def eval(**options):
    """`moefq eval` in-process: the report as a dict, the same JSON `moefq eval --out DIR` writes to
    DIR/report.json. Keywords (the CLI's options; None: left out): preset, config, checkpoint,
    layers ("3-10", an integer or a list of integers), activations, synthetic, recipes (a file or
    unit name, or a list of them), recipe_root (where their imports are looked for first), ranks,
    tokens, calib_batches, eval_batches, seed, device ("auto", "cpu", "cuda"), threads,
    combine_weighting, staging ("e4m3" or "none"; default: as the model is served), load_calibration,
    max_rel_l2, calibration ("max", "percentile:99.99", "mse" or a comma-separated list of them), link
    ("nvlink4", "ib400", ...) or link_gbps; out (also write report.json/.csv/.html there);
    progress (True: progress lines on stderr, or a callable taking each line). Any other keyword is
    a ValueError. Ctrl-C stops the run at its next progress step (KeyboardInterrupt), writing
    nothing."""
    return _json.loads(_C.eval_json(**_eval_options(options)))


def calibrate(save, **options):
    """`moefq calibrate --save FILE` in-process (eval's model options); returns each layer's amax."""
    return _C.calibrate(_os.fspath(save), **_eval_options(options))


def metrics(y, ref):
    """docs/numerics.md's error metrics of y against ref (CPU tensors of one dtype and shape): rel_l2,
    cosine, calc_diff, max_abs, snr_db, count, skipped_nonfinite."""
    return _C.metrics(_t.capsule(y, "metrics: y"), _t.capsule(ref, "metrics: ref"))


_ST_NUMPY = {"BF16": "uint16", "F32": "float32", "I32": "int32", "I64": "int64"}


def save_safetensors(path, tensors, metadata=None):
    """Writes CPU tensors {name: tensor} (bf16, float32, int32, int64; numpy uint16 is bf16) to a
    safetensors file, atomically (a temporary file renamed)."""
    path = _C.check_output_path(_os.fspath(path), "save_safetensors: path")
    items = [(str(name), _t.capsule(t, f"save_safetensors: tensor '{name}'")) for name, t in tensors.items()]
    _C.save_safetensors(path, items, {str(k): str(v) for k, v in (metadata or {}).items()})


def load_safetensors(path, framework="numpy"):
    """{name: array} of a safetensors file (copies): numpy arrays (BF16 as uint16 bit patterns), or
    torch tensors with framework="torch" (BF16 as torch.bfloat16). Other dtypes come back as bytes."""
    if framework not in ("numpy", "torch"):
        raise ValueError(f"load_safetensors: framework must be 'numpy' or 'torch', got {framework!r}")
    import numpy as np
    tensors, _ = _C.load_safetensors(_os.fspath(path))
    out = {}
    for name, dtype, shape, data in tensors:
        if dtype not in _ST_NUMPY:
            out[name] = data
            continue
        a = np.frombuffer(data, dtype=_ST_NUMPY[dtype]).reshape(shape).copy()
        if framework == "torch":
            import torch
            t = torch.from_numpy(a.view(np.int16) if dtype == "BF16" else a)
            out[name] = t.view(torch.bfloat16) if dtype == "BF16" else t
        else:
            out[name] = a
    return out
