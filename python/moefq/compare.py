"""`moefq compare` (python3 -m moefq.compare, moefq-compare): the whole-model cost of each
dispatch/combine recipe on a causal language model, measured as llama.cpp's perplexity tool does
with --kl-divergence: the unquantized model's next-token log-probabilities are the reference, and
each fake-quantized run reports its KL divergence from them (mean, percentiles, max), how often the
top token stays the same, its perplexity and the ratio and difference to the original's; per MoE
block the relative L2 of its output against the original model's; the wire bytes per token as
`moefq eval` reports them. --sensitivity quantizes one layer at a time and ranks the layers;
--max-kl picks the cheapest per-layer assignment within a KL budget and verifies it with one full
run. docs/compare.md describes every number.

The library function is run_compare(model, tokens, ...) on a model object (any causal LM whose
forward takes token ids [1, T] and returns logits [1, T, V], or an object with .logits, whose MoE
blocks moefq.hf finds); the command line loads a transformers model directory around it.
"""

import argparse
import hashlib
import json
import math
import os
import shutil
import sys
import tempfile
import time

import numpy as np

from . import _compare_stats as stats

__all__ = ["run_compare", "default_recipes", "load_tokens", "save_reference", "load_reference", "CompareError",
           "wire_bytes_per_row", "main"]

REFERENCE_KIND = "moefq compare reference"
REFERENCE_VERSION = 1
REPORT_FILES = ("report.json", "report.csv", "report.html")
SCORING = ("only the second half of each chunk is scored (positions ctx/2 .. ctx-2 predicting the next token), "
           "as llama.cpp's perplexity does, so every scored token has at least ctx/2 tokens of context")


class CompareError(ValueError):
    """Bad input to moefq compare: one line, exit status 2 on the command line."""


def _C():
    from . import _moefq
    return _moefq


def wire_bytes_per_row(fmt, cols):
    """Bytes one row of `cols` elements takes on the wire in format `fmt` (None: bf16), scales
    included: the figure `moefq eval` reports per token per destination rank."""
    return float(_C().wire_bytes_per_row(fmt, int(cols)))


# ---------------------------------------------------------------------------------------------
# Recipes


class _NamedRecipe:
    """A recipe of the sweep: its name (the file stem, the unit name or the sweep's name) and the
    loaded moefq.Recipe (None: both quantizers off)."""

    def __init__(self, name, recipe):
        self.name, self.recipe = name, recipe

    def __repr__(self):
        return f"recipe {self.name}"


def _parse_recipe(text, name):
    return _C().parse_recipe_text(text, name, "")


def default_recipes():
    """`moefq eval`'s default sweep without `none` (the both-off run is always made):
    {dispatch, combine, both} x {fp8, nvfp4, mxfp8, mxfp4}, built from the shipped units."""
    out = []
    for f in ("fp8", "nvfp4", "mxfp8", "mxfp4"):
        for side in ("dispatch", "combine", "both"):
            units = f"moe_dispatch_{f}, moe_combine_{f}" if side == "both" else f"moe_{side}_{f}"
            name = f"{side}_{f}"
            out.append(_NamedRecipe(name, _parse_recipe(f"$import: [{units}]\nalgorithm: max\n", name)))
    return out


# Calibration: max calibration passes the data through unquantized, so the amax one pass collects
# serves every format; this recipe turns both quantizers on with a format that needs an amax.
_CALIBRATION_RECIPE = "$import: [moe_dispatch_fp8, moe_combine_fp8]\nalgorithm: max\n"


def _load_recipes(recipes, recipe_root):
    """[_NamedRecipe] of the names (files, unit names, the default sweep's names such as both_nvfp4,
    moefq.Recipe objects); None: the default sweep. `none` is dropped (the both-off run is always
    made)."""
    import moefq
    if recipes is None:
        return default_recipes()
    if isinstance(recipes, (str, os.PathLike)):
        recipes = [recipes]
    out, names = [], set()
    sweep = {x.name: x for x in default_recipes()}
    for r in recipes:
        if not isinstance(r, (_NamedRecipe, moefq.Recipe)):
            r = os.fspath(r)
            if r == "none":
                continue
            if r in sweep and not os.path.exists(r):   # a name of the default sweep: both_nvfp4, ...
                r = sweep[r]
        if isinstance(r, _NamedRecipe):
            nr = r
        elif isinstance(r, moefq.Recipe):
            nr = _NamedRecipe(r.name, r)
        else:
            try:
                rec = moefq.load_recipe(r, recipe_root)
            except (ValueError, RuntimeError) as e:
                msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                raise CompareError(msg if r in msg else f"recipe '{r}': {msg}") from None
            nr = _NamedRecipe(rec.name, rec)
        if nr.name in names:
            raise CompareError(f"two recipes are named '{nr.name}' (recipes are named by their file stem); "
                               "give each a distinct file name")
        names.add(nr.name)
        out.append(nr)
    return out


def _formats(recipe, names):
    """{quantizer name: (format or None, needs a calibrated amax)} for `names` under `recipe`."""
    import moefq
    if recipe is None:
        return {n: (None, False) for n in names}
    cfgs = moefq.apply_recipe(recipe, list(names))
    out = {}
    for n in names:
        c = cfgs[n]
        on = bool(c.enable and c.configured)
        fmt = c.spec.format if on else None
        needs = on and fmt in ("fp8", "nvfp4", "int8") and c.spec.amax_source == "calibrated"
        out[n] = (fmt, needs)
    return out


# ---------------------------------------------------------------------------------------------
# Tokens and the reference file


def load_tokens(path):
    """Token ids from a file: .npy (a 1-D integer array), .pt/.pth (a 1-D integer torch tensor or a
    list), anything else text holding whitespace-separated integers. Returns int64 [N]."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise CompareError(f"--tokens {path}: no such file")
    ext = os.path.splitext(path)[1].lower()
    try:
        if ext == ".npy":
            a = np.load(path, allow_pickle=False)
        elif ext in (".pt", ".pth"):
            import torch
            a = torch.load(path, map_location="cpu")
            a = a.numpy() if hasattr(a, "numpy") else np.asarray(a)
        else:
            with open(path, encoding="utf-8") as f:
                words = f.read().split()
            a = np.array([int(w) for w in words], dtype=np.int64)
    except (ValueError, OSError, RuntimeError) as e:
        raise CompareError(f"--tokens {path}: not a token file ({e}); expected .npy, .pt, or whitespace-separated "
                           "integers") from None
    a = np.asarray(a)
    if a.ndim != 1 or not np.issubdtype(a.dtype, np.integer):
        raise CompareError(f"--tokens {path}: expected a 1-D array of integer token ids, got {a.dtype} of shape "
                           f"{list(a.shape)}")
    return a.astype(np.int64)


def _sha256(*parts):
    h = hashlib.sha256()
    for p in parts:
        h.update(p if isinstance(p, bytes) else str(p).encode())
        h.update(b"\0")
    return h.hexdigest()


def model_fingerprint(model):
    """A hash of the model: its config (when it has one: its fields as JSON), and per parameter its
    name, shape, dtype and checksums (sum and sum of |w| in float64, 6 significant digits), so that
    another model of the same config (other weights, another dtype) does not match."""
    import torch
    cfg = getattr(model, "config", None)
    text = ""
    if cfg is not None:
        # The config's fields without where it was loaded from (_name_or_path), other private state
        # and the library's version: the same model copied elsewhere matches.
        try:
            d = cfg.to_dict()
        except (AttributeError, TypeError):
            d = dict(vars(cfg))
        d = {k: v for k, v in d.items() if not k.startswith("_") and k != "transformers_version"}
        text = json.dumps(d, sort_keys=True, default=str)
    parts = [type(model).__name__, text]
    with torch.no_grad():
        for name, p in model.named_parameters():
            # In slices of 16M elements: no float64 copy of a whole (fused experts) weight at once.
            total = absolute = 0.0
            for part in p.detach().reshape(-1).split(1 << 24):
                d = part.double()
                total += float(d.sum())
                absolute += float(d.abs().sum())
            parts.append(f"{name}:{list(p.shape)}:{p.dtype}:{total:.6e}:{absolute:.6e}")
    return _sha256(*parts)


def _fingerprint(model_hash, chunk_tokens, ctx, chunks, vocab):
    return {"model": model_hash, "tokens": _sha256(np.ascontiguousarray(chunk_tokens, dtype=np.int64).tobytes()),
            "ctx": int(ctx), "chunks": int(chunks), "vocab": None if vocab is None else int(vocab)}


def save_reference(path, logprobs, tokens, fingerprint):
    """The reference file: a safetensors file with `logprobs` [scored tokens, V] float32 (the
    original model's log-probabilities of the scored positions, chunk after chunk), `tokens` (the
    scored chunks' token ids, int64) and the fingerprint in its metadata. Written atomically."""
    import moefq
    moefq.save_safetensors(os.fspath(path), {"logprobs": np.ascontiguousarray(logprobs, dtype=np.float32),
                                             "tokens": np.ascontiguousarray(tokens, dtype=np.int64)},
                           {"kind": REFERENCE_KIND, "version": str(REFERENCE_VERSION),
                            "fingerprint": json.dumps(fingerprint, sort_keys=True)})


def _read_metadata(path):
    """A safetensors file's __metadata__ (the header is JSON after an 8-byte little-endian length)."""
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise CompareError(f"--reference {path}: not a moefq compare reference file (too short)")
        n = int.from_bytes(head, "little")
        if n <= 0 or n > 100_000_000:
            raise CompareError(f"--reference {path}: not a moefq compare reference file")
        try:
            return json.loads(f.read(n)).get("__metadata__") or {}
        except (ValueError, UnicodeDecodeError):
            raise CompareError(f"--reference {path}: not a moefq compare reference file") from None


def load_reference(path, fingerprint=None):
    """(logprobs float32 [N, V], tokens int64, fingerprint) of a reference file. With `fingerprint`,
    a file made for another model, text, context, chunk count or vocabulary is refused, naming what
    differs."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise CompareError(f"--reference {path}: no such file")
    meta = _read_metadata(path)
    if meta.get("kind") != REFERENCE_KIND:
        raise CompareError(f"--reference {path}: not a moefq compare reference file")
    if meta.get("version") != str(REFERENCE_VERSION):
        raise CompareError(f"--reference {path}: version {meta.get('version')}, this moefq reads version "
                           f"{REFERENCE_VERSION}")
    stored = json.loads(meta.get("fingerprint", "{}"))
    if fingerprint is not None:
        check_reference(path, stored, fingerprint)
    import moefq
    t = moefq.load_safetensors(path)
    if "logprobs" not in t or "tokens" not in t:
        raise CompareError(f"--reference {path}: lacks the logprobs or tokens tensor")
    return t["logprobs"], t["tokens"], stored


_WHAT = {"model": "another model (config or weights)", "tokens": "another text (token ids)",
         "ctx": "another context (--ctx)", "chunks": "another number of chunks (--chunks)",
         "vocab": "another vocabulary"}


def check_reference(path, stored, wanted):
    diff = [k for k in ("model", "tokens", "ctx", "chunks", "vocab")
            if k in wanted and wanted[k] is not None and stored.get(k) != wanted[k]]
    if diff:
        detail = "; ".join(_WHAT[k] + (f": {stored.get(k)} vs {wanted[k]}" if k in ("ctx", "chunks", "vocab") else "")
                           for k in diff)
        raise CompareError(f"--reference {path}: made for {detail}; make a new one with --save-reference")


# ---------------------------------------------------------------------------------------------
# Progress


class _Progress:
    """Lines on stderr: the step, the elapsed time and an estimate of what is left (after the first
    step; at most one line every 2 s, and the last)."""

    def __init__(self, total, enabled):
        self.total, self.done, self.enabled = max(int(total), 1), 0, enabled
        self.t0 = time.monotonic()
        self.last = -1e9

    def add(self, n):
        self.total += n

    def step(self, what):
        self.done += 1
        if not self.enabled:
            return
        now = time.monotonic()
        if now - self.last < 2.0 and self.done < self.total and self.done > 1:
            return
        self.last = now
        el = now - self.t0
        eta = f", eta {_fmt_s(el / self.done * (self.total - self.done))}" if self.done < self.total else ""
        print(f"  [{self.done}/{self.total}] {what} ({_fmt_s(el)}{eta})", file=sys.stderr, flush=True)


def _fmt_s(s):
    return f"{s:.1f} s" if s < 120 else f"{s / 60:.1f} min"


# ---------------------------------------------------------------------------------------------
# The runs


def _logits_of(out):
    if hasattr(out, "logits"):
        return out.logits
    if isinstance(out, (tuple, list)):
        return out[0]
    return out


def _block_output(out):
    return out[0] if isinstance(out, (tuple, list)) else out


class _Run:
    """One model variant (the both-off run, a recipe, one layer under a recipe, an assignment) and
    what its chunks accumulated."""

    def __init__(self, name, kind, spec, *, recipe=None, layer=None, assignment=None):
        self.name, self.kind, self.spec = name, kind, spec
        self.recipe, self.layer, self.assignment = recipe, layer, assignment
        self.kl, self.same, self.nll, self.nll_ref = [], [], [], []
        self.err2, self.ref2 = {}, {}
        self.seconds = 0.0

    def figures(self):
        cat = np.concatenate
        return stats.summarize(cat(self.kl), cat(self.same), cat(self.nll), cat(self.nll_ref))

    def block_rel_l2(self):
        return {int(l): (math.sqrt(self.err2[l] / self.ref2[l]) if self.ref2[l] > 0 else
                         (0.0 if self.err2[l] == 0 else float("inf"))) for l in sorted(self.err2)}


class _Comparer:
    def __init__(self, model, tokens, *, ctx, chunks, calib_chunks, recipes, combine_weighting, reference,
                 save_reference_path, sensitivity, max_kl, progress, model_name, recipe_root):
        import torch
        from . import hf
        self.torch, self.hf = torch, hf
        self.model = model
        self.t_start = time.monotonic()
        self.progress_on = progress
        self.model_name = model_name or type(model).__name__
        if ctx < 4:
            raise CompareError(f"--ctx {ctx}: must be at least 4 (half of each chunk is scored)")
        tokens = np.asarray(tokens, dtype=np.int64).reshape(-1)
        n = tokens.size
        if n < ctx:
            raise CompareError(f"the text is {n} tokens, shorter than one chunk of --ctx {ctx}")
        fit = n // ctx
        if calib_chunks < 0:
            raise CompareError(f"--calib-chunks {calib_chunks}: must be >= 0")
        if chunks is None:
            chunks = fit - calib_chunks
            if chunks < 1:
                raise CompareError(f"the text is {n} tokens: {fit} chunk(s) of --ctx {ctx}, not enough for "
                                   f"--calib-chunks {calib_chunks} plus one scored chunk")
        if chunks < 1:
            raise CompareError(f"--chunks {chunks}: must be >= 1")
        if (chunks + calib_chunks) * ctx > n:
            raise CompareError(f"the text is {n} tokens: --chunks {chunks} + --calib-chunks {calib_chunks} of --ctx "
                               f"{ctx} need {(chunks + calib_chunks) * ctx}")
        self.ctx, self.chunks, self.calib_chunks = int(ctx), int(chunks), int(calib_chunks)
        self.first = ctx // 2
        self.scored_per_chunk = ctx - 1 - self.first
        self.chunk_tokens = tokens[: chunks * ctx].reshape(chunks, ctx)
        self.calib_tokens = tokens[chunks * ctx:(chunks + calib_chunks) * ctx].reshape(calib_chunks, ctx)

        self.blocks = hf.find_moe_blocks(model)
        if not self.blocks:
            raise CompareError(f"the model ({type(model).__name__}) has no MoE block moefq can quantize")
        self.layers = sorted(self.blocks)
        torch_ = self.torch
        for l, b in self.blocks.items():
            p = next(b.parameters(), None)
            if p is not None and p.dtype != torch_.bfloat16:
                raise CompareError(f"the MoE block of layer {l} holds {str(p.dtype).replace('torch.', '')} weights; "
                                   "moefq computes MoE blocks in bf16: load the model in bfloat16 (--dtype bfloat16)")
        paths = {id(m): name for name, m in model.named_modules()}
        self.paths = {l: paths[id(b)] for l, b in self.blocks.items()}
        self.qnames = {l: (f"{p}.experts.dispatch_quantizer", f"{p}.experts.combine_quantizer")
                       for l, p in self.paths.items()}
        self.all_qnames = [n for l in self.layers for n in self.qnames[l]]
        self.param = next(model.parameters())
        self.device = self.param.device
        # transformers' forward keeps a KV cache unless told not to: memory a scoring pass never uses.
        import inspect
        try:
            params = inspect.signature(model.forward).parameters
        except (TypeError, ValueError):
            params = {}
        self.forward_kwargs = {"use_cache": False} if "use_cache" in params else {}

        self.recipes = _load_recipes(recipes, recipe_root)
        self.combine_weighting = combine_weighting
        self.cw_of = {}
        for r in self.recipes:
            cw = r.recipe.combine_weighting
            if combine_weighting is not None and cw is not None and cw != combine_weighting:
                raise CompareError(f"recipe '{r.name}' sets combine_weighting {cw}, the run uses {combine_weighting}; "
                                   "one combine weighting per recipe run")
            self.cw_of[r.name] = cw or combine_weighting or "before"
        self.formats = {}
        for r in self.recipes:
            f = _formats(r.recipe, self.all_qnames)
            if not any(fmt for fmt, _ in f.values()):
                raise CompareError(f"recipe '{r.name}' enables no quantizer of this model's MoE blocks (names such "
                                   f"as {self.qnames[self.layers[0]][1]})")
            if any(needs for _, needs in f.values()) and calib_chunks == 0:
                raise CompareError(f"recipe '{r.name}' needs a calibrated amax: give --calib-chunks >= 1")
            self.formats[r.name] = f

        if sensitivity is True:
            sensitivity = [r.name for r in self.recipes]
        elif sensitivity:
            known = {r.name for r in self.recipes}
            sensitivity = [s if isinstance(s, str) else s.name for s in sensitivity]
            for s in sensitivity:
                if s not in known:
                    raise CompareError(f"--sensitivity {s}: not one of the recipes of the run "
                                       f"({', '.join(sorted(known))})")
        self.sensitivity = list(sensitivity or [])
        if max_kl is not None:
            if not (isinstance(max_kl, (int, float)) and math.isfinite(max_kl) and max_kl >= 0):
                raise CompareError(f"--max-kl {max_kl}: must be a finite number >= 0")
            if not self.sensitivity:
                self.sensitivity = [r.name for r in self.recipes]
            if len({self.cw_of[r] for r in self.sensitivity}) > 1:
                raise CompareError("--max-kl: the recipes to pick from use both combine weightings (one model runs "
                                   "one); name recipes of one with --sensitivity R ...")
        self.max_kl = max_kl
        self.recipe_by_name = {r.name: r for r in self.recipes}

        vocab = None
        emb = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        if emb is not None and getattr(emb, "weight", None) is not None:
            vocab = int(emb.weight.shape[0])
        elif getattr(getattr(model, "config", None), "vocab_size", None):
            vocab = int(model.config.vocab_size)
        if vocab is not None and (tokens.min() < 0 or tokens.max() >= vocab):
            raise CompareError(f"token ids must lie in [0, {vocab}) (the model's vocabulary); found "
                               f"{int(tokens.min())}..{int(tokens.max())}")
        self.fingerprint = _fingerprint(model_fingerprint(model), self.chunk_tokens, ctx, chunks, vocab)
        self.reference_path = None if reference is None else os.fspath(reference)
        self.ref_logprobs = None
        if self.reference_path is not None:
            lp, tok, _ = load_reference(self.reference_path, self.fingerprint)
            if lp.shape[0] != chunks * self.scored_per_chunk:
                raise CompareError(f"--reference {self.reference_path}: holds {lp.shape[0]} scored tokens, "
                                   f"this run scores {chunks * self.scored_per_chunk}")
            self.ref_logprobs = lp.reshape(chunks, self.scored_per_chunk, -1)
        self.save_reference_path = None if save_reference_path is None else os.fspath(save_reference_path)
        self.saved_logprobs = [] if self.save_reference_path else None
        self.hidden = {}
        self.vocab = vocab
        self.timings = {}

    # -- one forward

    def _forward(self, ids, hook_blocks=None, sink=None):
        """logits [T, V] of one chunk; hook_blocks {layer: module} report their outputs to sink."""
        torch = self.torch
        handles = []
        if hook_blocks:
            for l, b in hook_blocks.items():
                def hook(mod, inp, out, l=l):
                    y = _block_output(out)
                    self.hidden[l] = int(y.shape[-1])
                    if sink is not None:
                        sink(l, y)
                handles.append(b.register_forward_hook(hook))
        try:
            with torch.no_grad():
                x = torch.as_tensor(ids, dtype=torch.long, device=self.device).reshape(1, -1)
                logits = _logits_of(self.model(x, **self.forward_kwargs))
        finally:
            for h in handles:
                h.remove()
        if logits.dim() != 3 or logits.shape[0] != 1 or logits.shape[1] != len(ids):
            raise CompareError(f"the model returned logits of shape {list(logits.shape)}; expected [1, {len(ids)}, V]")
        if self.vocab is None:
            self.vocab = int(logits.shape[-1])
            self.fingerprint["vocab"] = self.vocab
        elif logits.shape[-1] != self.vocab:
            raise CompareError(f"the model returned {logits.shape[-1]} logits per token; its vocabulary is "
                               f"{self.vocab}")
        return logits[0]

    def _scored_logprobs(self, logits):
        """float32 [scored, V] on the model's device: log-softmax (in float64) of the scored positions."""
        return self.torch.log_softmax(logits[self.first:self.ctx - 1].double(), dim=-1).float()

    # -- the reference

    def _reference_chunk(self, c, want_blocks=True):
        """(logprobs [scored, V] float32, {layer: block output} of the original model or None)."""
        if self.ref_logprobs is not None:
            return self.torch.from_numpy(np.ascontiguousarray(self.ref_logprobs[c])).to(self.device), None
        outs = {}
        logits = self._forward(self.chunk_tokens[c], self.blocks if want_blocks else None,
                               lambda l, y: outs.__setitem__(l, y.detach().clone()))
        return self._scored_logprobs(logits), (outs if want_blocks else None)

    # -- patching

    def _calibrate(self, progress):
        """{combine weighting: {quantizer name: amax}}: one max calibration per combine weighting in
        use (the amax do not depend on the format)."""
        out = {}
        needed = sorted({self.cw_of[r.name] for r in self.recipes
                         if any(needs for _, needs in self.formats[r.name].values())})
        rec = _parse_recipe(_CALIBRATION_RECIPE, "calibration")
        for cw in needed:
            t0 = time.monotonic()

            def loop(model, cw=cw):
                for i, ids in enumerate(self.calib_tokens):
                    self._forward(ids)
                    progress.step(f"calibration ({cw}) chunk {i + 1}/{self.calib_chunks}")

            q = self.hf.quantize_moe(self.model, rec, loop, combine_weighting=cw)
            try:
                out[cw] = {k: v for k, v in q.amax().items() if v is not None}
            finally:
                self.hf.restore_moe(self.model)
            self.timings[f"calibration_{cw}"] = time.monotonic() - t0
        return out

    def _patch(self, run):
        """quantize_moe for a run; returns {layer: patched block module}."""
        kind, spec = run.spec
        hf = self.hf
        if kind == "none":
            q = hf.quantize_moe(self.model, None)
        else:
            cw, calib = spec["cw"], self.amax.get(spec["cw"])
            calib = {n: a for n, a in (calib or {}).items() if n in spec["needs"]}
            kw = {"combine_weighting": cw}
            if calib:
                kw["calibration"] = calib
            if kind == "recipe":
                q = hf.quantize_moe(self.model, spec["recipe"], **kw)
            elif kind == "layer":
                q = hf.quantize_moe(self.model, spec["recipe"], layers=[spec["layer"]], **kw)
            else:
                q = hf.quantize_moe(self.model, spec["assignment"], **kw)
        return {int(rec.layer): rec.block for rec in q.blocks}

    def _spec_for(self, recipes_by_layer):
        """A run's spec for {layer: recipe name or None}: the recipes, the combine weighting, which
        quantizers need a calibrated amax."""
        cws = {self.cw_of[r] for r in recipes_by_layer.values() if r}
        if len(cws) > 1:
            raise CompareError("an assignment mixes recipes of both combine weightings")
        needs = set()
        for l, r in recipes_by_layer.items():
            if r:
                for n in self.qnames[l]:
                    if self.formats[r][n][1]:
                        needs.add(n)
        return {"cw": cws.pop() if cws else (self.combine_weighting or "before"), "needs": needs}

    def _make_runs(self):
        runs = [_Run("none", "none", ("none", None))]
        for r in self.recipes:
            spec = self._spec_for({l: r.name for l in self.layers})
            spec["recipe"] = r.recipe
            runs.append(_Run(r.name, "recipe", ("recipe", spec), recipe=r.name))
        for name in self.sensitivity:
            for l in self.layers:
                spec = self._spec_for({l: name})
                spec.update(recipe=self.recipe_by_name[name].recipe, layer=l)
                runs.append(_Run(f"{name}@{l}", "layer", ("layer", spec), recipe=name, layer=l))
        return runs

    def _assignment_run(self, name, assign):
        spec = self._spec_for(assign)
        spec["assignment"] = {l: (self.recipe_by_name[r].recipe if r else None) for l, r in assign.items()}
        return _Run(name, "assignment", ("assignment", spec), assignment=dict(assign))

    def _validate(self, runs):
        """Patches and restores once per recipe run before the long loop: a recipe the model cannot
        take fails here, before any scored forward."""
        for run in runs:
            if run.kind in ("none", "recipe"):
                try:
                    self._patch(run)
                except ValueError as e:
                    raise CompareError(f"recipe '{run.name}': the model cannot take it: {e}") from None
                finally:
                    self.hf.restore_moe(self.model)

    def _execute(self, runs, progress, keep_reference=False):
        """Every run over every scored chunk, chunk by chunk (the original model once per chunk)."""
        for c in range(self.chunks):
            t0 = time.monotonic()
            ref_lp, ref_blocks = self._reference_chunk(c)
            self.timings["original"] = self.timings.get("original", 0.0) + time.monotonic() - t0
            if keep_reference and self.saved_logprobs is not None:
                self.saved_logprobs.append(ref_lp.cpu().numpy())
            if self.ref_logprobs is None:
                progress.step(f"chunk {c + 1}/{self.chunks} original")
            targets = self.chunk_tokens[c][self.first + 1:]
            for run in runs:
                t0 = time.monotonic()
                try:
                    mods = self._patch(run)
                    sink = None
                    if ref_blocks is not None:
                        def sink(l, y, run=run):
                            r = ref_blocks[l]
                            e = float((y.double() - r.double()).pow(2).sum())
                            run.err2[l] = run.err2.get(l, 0.0) + e
                            run.ref2[l] = run.ref2.get(l, 0.0) + float(r.double().pow(2).sum())
                    logits = self._forward(self.chunk_tokens[c], mods, sink)
                finally:
                    self.hf.restore_moe(self.model)
                kl, same, nll, nll_ref = stats.token_stats(ref_lp, self._scored_logprobs(logits), targets)
                run.kl.append(kl)
                run.same.append(same)
                run.nll.append(nll)
                run.nll_ref.append(nll_ref)
                run.seconds += time.monotonic() - t0
                progress.step(f"chunk {c + 1}/{self.chunks} {run.name}")

    # -- wire bytes

    def _wire(self, recipe_by_layer):
        """(dispatch, combine) bytes per token per destination rank, the mean over the MoE layers."""
        d = c = 0.0
        for l in self.layers:
            H = self.hidden.get(l) or self._hidden_size()
            r = recipe_by_layer.get(l)
            f = self.formats[r] if r else None
            dn, cn = self.qnames[l]
            d += wire_bytes_per_row(f[dn][0] if f else None, H)
            c += wire_bytes_per_row(f[cn][0] if f else None, H)
        n = len(self.layers)
        return d / n, c / n

    def _hidden_size(self):
        h = getattr(getattr(self.model, "config", None), "hidden_size", None)
        if h is None:
            raise CompareError("cannot tell the MoE blocks' hidden size (no block ran and the config has none)")
        return int(h)

    def _layer_formats(self, recipe):
        f = self.formats[recipe]
        ds = sorted({str(f[self.qnames[l][0]][0]) for l in self.layers})
        cs = sorted({str(f[self.qnames[l][1]][0]) for l in self.layers})
        fix = lambda s: None if s == ["None"] else (s[0] if len(s) == 1 else "mixed")
        return fix(ds), fix(cs)

    # -- the pick

    def _greedy(self, sens, off_kl, target, start=None):
        """The cheapest assignment {layer: recipe or None} whose estimated KL (the sum of the layers'
        one-layer KL; a layer left unquantized counts the both-off run's KL / layers) is within
        target: every layer starts on its cheapest recipe, then the move with the most KL saved per
        wire byte added is made until the estimate fits."""
        layers = self.layers
        opts = {}
        for l in layers:
            o = [(self._layer_wire(l, r), sens[r][l], r) for r in sens]
            o.append((self._layer_wire(l, None), off_kl / len(layers), None))
            opts[l] = sorted(o, key=lambda t: (t[0], t[1]))
        assign = dict(start) if start else {l: opts[l][0][2] for l in layers}

        def cur(l):
            return next(t for t in opts[l] if t[2] == assign[l])

        est = sum(cur(l)[1] for l in layers)
        while est > target:
            best = None
            for l in layers:
                b0, k0, _ = cur(l)
                for b, k, r in opts[l]:
                    if b > b0 and k < k0:
                        eff = (k0 - k) / (b - b0)
                        if best is None or eff > best[0]:
                            best = (eff, l, r, k0 - k)
            if best is None:
                break
            _, l, r, gain = best
            assign[l] = r
            est -= gain
        return assign, est

    def _layer_wire(self, l, recipe):
        H = self.hidden.get(l) or self._hidden_size()
        if recipe is None:
            return 4.0 * H
        f = self.formats[recipe]
        dn, cn = self.qnames[l]
        return wire_bytes_per_row(f[dn][0], H) + wire_bytes_per_row(f[cn][0], H)

    def describe_assignment(self, assign):
        """'combine_nvfp4 on every MoE layer except layers 0, 1 (combine_fp8) and 58 (bf16)'; bf16:
        both quantizers off."""
        label = lambda r: r if r else "bf16"
        counts = {}
        for l in self.layers:
            counts[assign[l]] = counts.get(assign[l], 0) + 1
        base = max(counts, key=lambda r: (counts[r], r is not None))
        others = {}
        for l in self.layers:
            if assign[l] != base:
                others.setdefault(assign[l], []).append(l)
        text = f"{label(base)} on every MoE layer"
        if not others:
            return text
        parts = [f"{', '.join(map(str, ls))} ({label(r)})" for r, ls in others.items()]
        return text + " except layer" + ("s " if sum(map(len, others.values())) > 1 else " ") + _join_words(parts)

    def _pick(self, runs, progress, off_kl):
        sens = {}
        for run in runs:
            if run.kind == "layer":
                sens.setdefault(run.recipe, {})[run.layer] = run.figures()["kl"]["mean"]
        target, assign, tries, verified = self.max_kl, None, [], None
        for attempt in range(4):
            before = assign
            assign, est = self._greedy(sens, off_kl, target, assign)
            if assign == before:
                break  # no move left that the estimate favours: fall back below
            run = self._assignment_run(f"pick{attempt + 1}" if attempt else "pick", assign)
            progress.add(self.chunks * (1 if self.ref_logprobs is not None else 2))
            self._execute([run], progress)
            kl = run.figures()["kl"]["mean"]
            tries.append({"assignment": {str(l): assign[l] for l in self.layers}, "estimated_kl": est,
                          "measured_kl": kl})
            verified = run
            if kl <= self.max_kl or all(assign[l] is None for l in self.layers):
                break
            target = target * self.max_kl / kl if kl > 0 else target / 2
        if verified.figures()["kl"]["mean"] > self.max_kl:
            # The greedy ran out of tries: every layer unquantized is the both-off run, within the
            # budget (checked before).
            assign = {l: None for l in self.layers}
            verified = None
        return {"max_kl": self.max_kl, "met": True, "assignment": {str(l): assign[l] for l in self.layers},
                "description": self.describe_assignment(assign), "tries": tries,
                "verified_run": verified.name if verified else "none"}, verified

    # -- the whole comparison

    def run(self):
        runs = self._make_runs()
        orig = 0 if self.ref_logprobs is not None else 1
        # With a budget the both-off run goes first, alone: when even it exceeds the budget, no
        # assignment can meet it, and the run stops before the long part.
        phases = [runs[:1], runs[1:]] if self.max_kl is not None and len(runs) > 1 else [runs]
        n_cw = len({self.cw_of[r.name] for r in self.recipes if any(n for _, n in self.formats[r.name].values())})
        progress = _Progress(self.chunks * (len(runs) + orig * len(phases)) + n_cw * self.calib_chunks,
                             self.progress_on)
        self.amax = self._calibrate(progress)
        self._validate(runs)
        t0 = time.monotonic()
        off = runs[0]
        for i, phase in enumerate(phases):
            self._execute(phase, progress, keep_reference=i == 0)
            off_kl = off.figures()["kl"]["mean"]
            if self.max_kl is not None and off_kl > self.max_kl:
                raise CompareError(f"--max-kl {self.max_kl:g}: no assignment meets it; the best reachable is "
                                   f"{off_kl:.6g}, every layer unquantized (the kernel's summation order alone)")
        self.timings["scored_runs"] = time.monotonic() - t0
        pick = verified = None
        if self.max_kl is not None:
            pick, verified = self._pick(runs, progress, off_kl)
            if verified is None:
                pick["verified_run"] = "none"
        if self.saved_logprobs is not None:
            save_reference(self.save_reference_path, np.concatenate(self.saved_logprobs, axis=0),
                           self.chunk_tokens.reshape(-1), self.fingerprint)
        return self._report(runs, pick, verified)

    def _run_entry(self, run):
        f = run.figures()
        if run.kind == "none":
            by_layer, fmts = {}, (None, None)
        elif run.kind == "recipe":
            by_layer, fmts = {l: run.recipe for l in self.layers}, self._layer_formats(run.recipe)
        elif run.kind == "layer":
            by_layer, fmts = {run.layer: run.recipe}, self._layer_formats(run.recipe)
        else:
            by_layer, fmts = run.assignment, ("mixed", "mixed")
        d, c = self._wire(by_layer)
        H = [self.hidden.get(l) or self._hidden_size() for l in self.layers]
        bf16 = 4.0 * sum(H) / len(H)
        e = {"name": run.name, "kind": run.kind, "recipe": run.recipe, "layer": run.layer,
             "dispatch_format": fmts[0], "combine_format": fmts[1],
             "dispatch_wire_bytes_per_token": d, "combine_wire_bytes_per_token": c,
             "wire_bytes_per_token": d + c, "wire_saving_vs_bf16": 1.0 - (d + c) / bf16,
             "block_rel_l2": {str(l): v for l, v in run.block_rel_l2().items()} if run.err2 else None,
             "kl_histogram": stats.kl_histogram(np.concatenate(run.kl)), "seconds": run.seconds,
             "seconds_per_chunk": run.seconds / self.chunks}
        if run.assignment is not None:
            e["assignment"] = {str(l): run.assignment[l] for l in self.layers}
        e.update(f)
        return e

    def _report(self, runs, pick, verified):
        import moefq
        # The both-off run, then the recipes best first by mean KL (ties keep the sweep order), then
        # the verified pick.
        entries = [self._run_entry(r) for r in runs if r.kind != "layer"]
        entries = entries[:1] + sorted(entries[1:], key=lambda e: _sort_key(e["kl"]["mean"]))
        if verified is not None:
            entries.append(self._run_entry(verified))
        sens = {}
        for r in runs:
            if r.kind == "layer":
                f = r.figures()
                sens.setdefault(r.recipe, []).append({
                    "layer": r.layer, "kl_mean": f["kl"]["mean"], "kl_error": f["kl"]["error"],
                    "kl_p99": f["kl"]["p99"], "same_top1": f["same_top1"]["fraction"],
                    "ppl_ratio": f["ppl_ratio"]["value"],
                    "block_rel_l2": r.block_rel_l2().get(r.layer) if r.err2 else None})
        for rows in sens.values():
            rows.sort(key=lambda x: _sort_key(-x["kl_mean"]))
            for i, x in enumerate(rows):
                x["rank"] = i + 1
        off = next(e for e in entries if e["kind"] == "none")
        cheapest = None
        if self.max_kl is not None:
            ok = [e for e in entries if e["kind"] in ("none", "recipe") and e["kl"]["mean"] <= self.max_kl]
            if ok:
                cheapest = min(ok, key=lambda e: (e["wire_bytes_per_token"], e["kl"]["mean"]))["name"]
        return {
            "tool": "moefq compare", "version": moefq.__version__,
            "generated": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "config": {"model": self.model_name, "model_class": type(self.model).__name__,
                       "device": str(self.device), "dtype": str(self.param.dtype).replace("torch.", ""),
                       "ctx": self.ctx, "chunks": self.chunks, "calib_chunks": self.calib_chunks,
                       "scored_tokens_per_chunk": self.scored_per_chunk,
                       "scored_tokens": self.chunks * self.scored_per_chunk, "scoring": SCORING,
                       "moe_layers": self.layers, "hidden": {str(l): self.hidden.get(l) for l in self.layers},
                       "vocab": self.vocab, "recipes": [r.name for r in self.recipes],
                       "combine_weighting": {r.name: self.cw_of[r.name] for r in self.recipes},
                       "calibration": "max calibration once per combine weighting on --calib-chunks chunks after the "
                                      "scored ones; the amax serve every recipe",
                       "reference": {"loaded": self.reference_path, "saved": self.save_reference_path,
                                     "fingerprint": self.fingerprint},
                       "sensitivity": self.sensitivity, "max_kl": self.max_kl},
            "calibration": self.amax,
            "original": {"ppl": off["ppl_ref"]},
            "runs": entries,
            "sort": "runs: none first, then the recipes best first by mean KL, then the verified pick; sensitivity: "
                    "most sensitive layer first",
            "sensitivity": sens,
            "cheapest_recipe_within_budget": cheapest,
            "pick": pick,
            "timings": self.timings,
            "wall_seconds": time.monotonic() - self.t_start,
        }


def _sort_key(v):
    return (0, v) if math.isfinite(v) else (1, 0.0)


def _join_words(ws):
    return ws[0] if len(ws) == 1 else ", ".join(ws[:-1]) + " and " + ws[-1]


# ---------------------------------------------------------------------------------------------
# The library function


def check_out_dir(out):
    """--out: a new or empty directory, or one holding only earlier reports (checked before work)."""
    out = os.fspath(out)
    if not out:
        raise CompareError("--out: empty")
    if os.path.exists(out):
        if not os.path.isdir(out):
            raise CompareError(f"--out {out}: exists and is not a directory")
        extra = [f for f in os.listdir(out) if f not in REPORT_FILES]
        if extra:
            raise CompareError(f"--out {out}: holds other files than an earlier report ({extra[0]}); give a new or "
                               "empty directory")
    parent = os.path.dirname(os.path.abspath(out))
    if not os.path.isdir(parent):
        raise CompareError(f"--out {out}: its parent directory does not exist")
    if not os.access(parent, os.W_OK):
        raise CompareError(f"--out {out}: its parent directory cannot be written")


def check_output_file(path, flag):
    """The check every moefq command makes of an output file before any work (a directory, a special
    file, a mount point, a name too long, a folder that cannot take a temporary), as CompareError."""
    try:
        _C().check_output_path(os.fspath(path), flag)
    except ValueError as e:
        raise CompareError(str(e)) from None


def write_reports(report, out):
    """report.json, report.csv, report.html into a temporary directory beside `out`, then renamed
    into place: the three appear together or not at all."""
    from . import _compare_report as rep
    out = os.path.abspath(os.fspath(out))
    parent = os.path.dirname(out)
    tmp = tempfile.mkdtemp(prefix="." + os.path.basename(out) + ".tmp", dir=parent)
    try:
        with open(os.path.join(tmp, "report.json"), "w") as f:
            json.dump(_json_safe(report), f, indent=1)
        with open(os.path.join(tmp, "report.csv"), "w") as f:
            f.write(rep.csv_text(report))
        with open(os.path.join(tmp, "report.html"), "w") as f:
            f.write(rep.html_text(report))
        old = None
        if os.path.exists(out):
            old = tempfile.mkdtemp(prefix="." + os.path.basename(out) + ".old", dir=parent)
            os.rmdir(old)
            os.rename(out, old)
        os.rename(tmp, out)
        if old:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _json_safe(x):
    """Non-finite numbers as the strings "inf", "-inf", "nan" (as moefq eval's report)."""
    if isinstance(x, float) and not math.isfinite(x):
        return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")
    if isinstance(x, dict):
        return {str(k): _json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_json_safe(v) for v in x]
    return x


def run_compare(model, tokens, *, ctx=512, chunks=None, calib_chunks=2, recipes=None, combine_weighting=None,
                reference=None, save_reference=None, sensitivity=None, max_kl=None, out=None, progress=False,
                table=False, model_name=None, recipe_root=""):
    """Compares `model` (a causal LM already on its device and dtype) with itself fake-quantized by
    each recipe on `tokens` (1-D token ids; chunks of `ctx`, the second half of each scored).

    chunks: the scored chunks (None: as many as the tokens hold after the calibration chunks);
    calib_chunks: the chunks after them that calibrate the quantizers (max calibration, once per
    combine weighting, reused by every recipe). recipes: files, unit names or moefq.Recipe objects
    (None: `moefq eval`'s default sweep). reference: a reference file to read the original model's
    log-probabilities from (refused when made for another model, tokens, ctx, chunks or vocabulary);
    save_reference: where to write them. sensitivity: True (every recipe) or recipe names: each
    layer quantized alone and ranked by KL. max_kl: the KL budget of the per-layer pick (implies
    sensitivity). out: a directory for report.json/.csv/.html. progress: lines with an ETA on
    stderr; table: the table on stdout. Returns the report (a dict). Bad input: CompareError (a
    ValueError), with nothing written."""
    if out is not None:
        check_out_dir(out)
    if save_reference is not None:
        check_output_file(save_reference, "--save-reference")
    if combine_weighting not in (None, "before", "after"):
        raise CompareError(f"--combine-weighting {combine_weighting}: expected before or after")
    model.eval()
    cmp_ = _Comparer(model, tokens, ctx=int(ctx), chunks=None if chunks is None else int(chunks),
                     calib_chunks=int(calib_chunks), recipes=recipes, combine_weighting=combine_weighting,
                     reference=reference, save_reference_path=save_reference, sensitivity=sensitivity, max_kl=max_kl,
                     progress=progress, model_name=model_name, recipe_root=recipe_root)
    report = cmp_.run()
    if table:
        from . import _compare_report as rep
        print(rep.table_text(report))
    if out is not None:
        write_reports(report, out)
    return report


# ---------------------------------------------------------------------------------------------
# The command line


def _parser():
    p = argparse.ArgumentParser(
        prog="moefq compare",
        description="The whole-model cost of each dispatch/combine recipe on a transformers causal LM: KL "
                    "divergence from the original model, same top-1, perplexity, per-layer sensitivity and a "
                    "per-layer pick within a KL budget (docs/compare.md).")
    p.add_argument("--model", required=True, metavar="DIR",
                   help="a local transformers model directory (nothing is downloaded)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--text", metavar="FILE", help="a text file, tokenized with the model's tokenizer")
    src.add_argument("--tokens", metavar="FILE", help="token ids: .npy, .pt, or whitespace-separated integers")
    p.add_argument("--ctx", type=int, default=512, help="tokens per chunk (default 512); the second half is scored")
    p.add_argument("--chunks", type=int, default=None, help="scored chunks (default: all the text holds)")
    p.add_argument("--calib-chunks", type=int, default=2, help="calibration chunks after the scored ones (default 2)")
    p.add_argument("--recipes", nargs="+", metavar="RECIPE",
                   help="recipe files, unit names or the sweep's names (both_nvfp4, ...); default: moefq eval's sweep")
    p.add_argument("--recipe-root", default="", metavar="DIR", help="where recipe imports are looked up first")
    p.add_argument("--combine-weighting", choices=("before", "after"), default=None)
    p.add_argument("--device", default="auto", help="auto (cuda when a GPU is visible), cpu, cuda or cuda:N")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32", "auto"),
                   help="the model's dtype (default bfloat16; auto: the checkpoint's)")
    p.add_argument("--out", metavar="DIR", help="write report.json, report.csv, report.html there")
    p.add_argument("--save-reference", metavar="FILE", help="save the original model's log-probabilities")
    p.add_argument("--reference", metavar="FILE",
                   help="read the original model's log-probabilities instead of running it")
    p.add_argument("--sensitivity", nargs="*", metavar="RECIPE", default=None,
                   help="quantize one layer at a time with these recipes (none named: every recipe), rank the layers")
    p.add_argument("--max-kl", type=float, default=None, metavar="X",
                   help="the cheapest per-layer assignment with mean KL <= X, verified by a full run")
    p.add_argument("--seed", type=int, default=0, help="torch's seed (default 0)")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    return p


def _fail(msg):
    print(f"moefq compare: {msg}", file=sys.stderr)
    return 2


def _resolve_device(device):
    import torch
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        return device
    if device == "cuda" or device.startswith("cuda:"):
        if not torch.cuda.is_available():
            raise CompareError(f"--device {device}: no GPU is visible (torch.cuda.is_available() is False)")
        import moefq
        if not moefq.built_with_cuda:
            raise CompareError(f"--device {device}: this moefq was built without CUDA")
        if device.startswith("cuda:"):
            try:
                i = int(device[5:])
            except ValueError:
                raise CompareError(f"--device {device}: expected cuda:N") from None
            if not 0 <= i < torch.cuda.device_count():
                raise CompareError(f"--device {device}: {torch.cuda.device_count()} GPU(s) visible")
        return device
    raise CompareError(f"--device {device}: expected auto, cpu, cuda or cuda:N")


def _check_model_dir(d):
    if not os.path.isdir(d):
        raise CompareError(f"--model {d}: not a directory")
    if not os.path.isfile(os.path.join(d, "config.json")):
        raise CompareError(f"--model {d}: not a model directory (no config.json)")


def _load_model(d, device, dtype):
    try:
        import transformers
    except ImportError:
        raise CompareError("transformers is not installed (moefq compare --model loads models with it); from Python, "
                           "call moefq.compare.run_compare(model, tokens) on a model you built") from None
    import torch
    kw = {"local_files_only": True}
    if dtype != "auto":
        # transformers 5 names it dtype; 4.x torch_dtype.
        major = int(transformers.__version__.split(".")[0])
        kw["dtype" if major >= 5 else "torch_dtype"] = getattr(torch, dtype)
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(d, **kw)
    except (OSError, ValueError, KeyError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CompareError(f"--model {d}: not a model transformers can load ({first})") from None
    if dtype != "auto":
        model = model.to(getattr(torch, dtype))
    return model.to(device).eval()


def _tokenize(d, path):
    if not os.path.isfile(path):
        raise CompareError(f"--text {path}: no such file")
    import transformers
    try:
        tok = transformers.AutoTokenizer.from_pretrained(d, local_files_only=True)
    except Exception:  # noqa: BLE001 (whatever stops the tokenizer from loading: there is none to use)
        raise CompareError(f"--model {d}: has no tokenizer to read --text with; give --tokens instead") from None
    with open(path, encoding="utf-8") as f:
        text = f.read()
    return np.asarray(tok(text, add_special_tokens=True)["input_ids"], dtype=np.int64)


def main(argv=None):
    args = _parser().parse_args(argv)
    try:
        import torch
        torch.manual_seed(args.seed)
        # Checks that need no model first, so bad input costs nothing.
        _check_model_dir(args.model)
        if args.out is not None:
            check_out_dir(args.out)
        if args.save_reference is not None:
            check_output_file(args.save_reference, "--save-reference")
        if args.reference is not None and not os.path.isfile(args.reference):
            raise CompareError(f"--reference {args.reference}: no such file")
        if args.max_kl is not None and not (math.isfinite(args.max_kl) and args.max_kl >= 0):
            raise CompareError(f"--max-kl {args.max_kl}: must be a finite number >= 0")
        tokens = None
        if args.tokens is not None:
            tokens = load_tokens(args.tokens)
            if tokens.size < args.ctx:
                raise CompareError(f"--tokens {args.tokens}: {tokens.size} tokens, shorter than one chunk of "
                                   f"--ctx {args.ctx}")
        device = _resolve_device(args.device)
        if args.recipes:
            _load_recipes(args.recipes, args.recipe_root)
        model = _load_model(args.model, device, args.dtype)
        if tokens is None:
            tokens = _tokenize(args.model, args.text)
            if tokens.size < args.ctx:
                raise CompareError(f"--text {args.text}: {tokens.size} tokens, shorter than one chunk of --ctx "
                                   f"{args.ctx}")
        sensitivity = None if args.sensitivity is None else (args.sensitivity or True)
        t0 = time.monotonic()
        run_compare(model, tokens, ctx=args.ctx, chunks=args.chunks, calib_chunks=args.calib_chunks,
                    recipes=args.recipes, combine_weighting=args.combine_weighting, reference=args.reference,
                    save_reference=args.save_reference, sensitivity=sensitivity, max_kl=args.max_kl, out=args.out,
                    progress=not args.quiet, table=True, model_name=os.path.basename(os.path.abspath(args.model)),
                    recipe_root=args.recipe_root)
        print(f"done in {time.monotonic() - t0:.1f} s")
        return 0
    except ValueError as e:  # CompareError, and moefq's own refusals (a recipe the model cannot take)
        return _fail(str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__)
    except KeyboardInterrupt:
        return _fail("interrupted; nothing written")


if __name__ == "__main__":
    sys.exit(main())
