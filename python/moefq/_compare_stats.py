"""The statistics of `moefq compare` (docs/compare.md): per-token KL divergence, top-1 agreement and
negative log-likelihood against a reference model's log-probabilities, and the summaries
llama.cpp's perplexity tool prints with --kl-divergence (mean with its standard error, percentiles,
the perplexity ratio and difference with an uncertainty that accounts for the correlation of the
two models' per-token log-likelihoods). The per-token figures come from numpy arrays or torch
tensors (computed on their device)."""

import math

import numpy as np

# The per-token KL percentiles reported (fractions; linear interpolation between order statistics).
KL_PERCENTILES = {"p50": 0.5, "p90": 0.9, "p99": 0.99, "p99_9": 0.999}


def token_stats(ref_logprobs, logprobs, targets):
    """Per scored token, from log-probabilities [N, V] (float32; the reference's and the model's)
    and the next tokens [N]: (kl [N] float64, same_top1 [N] bool, nll [N] float64, nll_ref [N]
    float64), numpy arrays. KL(ref || model) = sum_v p_ref(v) (log p_ref(v) - log p(v)), summed in
    float64 over the whole vocabulary (no cut-off: identical inputs give exactly 0). Torch tensors
    are computed where they lie (a GPU) and only the per-token figures come back."""
    torch = _torch_if(logprobs)
    if torch is not None:
        lp = logprobs.float()
        ref = torch.as_tensor(ref_logprobs, device=lp.device).float()
        t = torch.as_tensor(np.asarray(targets, dtype=np.int64), device=lp.device)
        _check_shapes(tuple(ref.shape), tuple(lp.shape), tuple(t.shape))
        ref64, lp64 = ref.double(), lp.double()
        kl = (ref64.exp() * (ref64 - lp64)).sum(dim=1)
        same = ref.argmax(dim=1) == lp.argmax(dim=1)
        rows = torch.arange(t.numel(), device=lp.device)
        out = (kl, same, -lp64[rows, t], -ref64[rows, t])
        return tuple(x.cpu().numpy() for x in out)
    ref = np.asarray(ref_logprobs, dtype=np.float32)
    lp = np.asarray(logprobs, dtype=np.float32)
    t = np.asarray(targets, dtype=np.int64)
    _check_shapes(ref.shape, lp.shape, t.shape)
    ref64, lp64 = ref.astype(np.float64), lp.astype(np.float64)
    kl = np.sum(np.exp(ref64) * (ref64 - lp64), axis=1)
    same = np.argmax(ref, axis=1) == np.argmax(lp, axis=1)
    rows = np.arange(t.size)
    return kl, same, -lp64[rows, t], -ref64[rows, t]


def _torch_if(x):
    try:
        import torch
    except ImportError:
        return None
    return torch if isinstance(x, torch.Tensor) else None


def _check_shapes(ref, lp, t):
    if ref != lp or len(ref) != 2:
        raise ValueError(f"token_stats: log-probabilities of shapes {list(ref)} and {list(lp)}; expected two [N, V]")
    if t != (ref[0],):
        raise ValueError(f"token_stats: targets of shape {list(t)}; expected [{ref[0]}]")


def mean_and_error(x):
    """(mean, standard error of the mean): sqrt((mean(x^2) - mean(x)^2) / (n - 1)); 0 below 2 values."""
    x = np.asarray(x, dtype=np.float64)
    n = x.size
    if n == 0:
        return float("nan"), float("nan")
    m = float(np.mean(x))
    var = float(np.mean(x * x)) - m * m
    return m, (math.sqrt(var / (n - 1)) if n > 1 and var > 0 else 0.0)


def covariance_of_means(a, b):
    """The covariance of the two means: (mean(ab) - mean(a) mean(b)) / (n - 1); 0 below 2 values."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    n = a.size
    if n < 2:
        return 0.0
    return (float(np.mean(a * b)) - float(np.mean(a)) * float(np.mean(b))) / (n - 1)


def percentile(x, fraction):
    """The fraction-quantile with linear interpolation between the sorted values (numpy's default,
    llama.cpp's rule)."""
    return float(np.quantile(np.asarray(x, dtype=np.float64), fraction)) if np.size(x) else float("nan")


def summarize(kl, same, nll, nll_ref):
    """The figures of one run against the reference, from token_stats' arrays (concatenated over
    the chunks): a dict of kl (mean, error, percentiles, max, min), same_top1 (fraction, binomial
    error sqrt(p (1 - p) / (n - 1))), ppl and ppl_ref (each exp(mean nll) with error ppl * se), the
    correlation of the two nll series, ln_ppl_ratio, ppl_ratio and ppl_diff with their errors.

    Errors (llama.cpp's): with s, s_ref the standard errors of the two mean nll and c their
    covariance, ln(PPL/PPL_ref) = mean nll - mean nll_ref has the error sqrt(s^2 + s_ref^2 - 2c);
    the ratio exp(that) has ratio * that error; PPL - PPL_ref has
    sqrt(u^2 + u_ref^2 - 2 PPL PPL_ref c) with u = PPL s, u_ref = PPL_ref s_ref."""
    kl = np.asarray(kl, dtype=np.float64)
    n = int(kl.size)
    kl_mean, kl_err = mean_and_error(kl)
    out = {"tokens": n, "kl": {"mean": kl_mean, "error": kl_err}}
    for key, f in KL_PERCENTILES.items():
        out["kl"][key] = percentile(kl, f)
    out["kl"]["max"] = float(np.max(kl)) if n else float("nan")
    out["kl"]["min"] = float(np.min(kl)) if n else float("nan")
    p = float(np.mean(same)) if n else float("nan")
    out["same_top1"] = {"fraction": p, "error": math.sqrt(p * (1 - p) / (n - 1)) if n > 1 else 0.0}
    m, s = mean_and_error(nll)
    m_ref, s_ref = mean_and_error(nll_ref)
    c = covariance_of_means(nll, nll_ref)
    ppl, ppl_ref = math.exp(m), math.exp(m_ref)
    u, u_ref = ppl * s, ppl_ref * s_ref
    ln_ratio = m - m_ref
    ln_err = math.sqrt(max(s * s + s_ref * s_ref - 2 * c, 0.0))
    out["ppl"] = {"value": ppl, "error": u}
    out["ppl_ref"] = {"value": ppl_ref, "error": u_ref}
    out["nll_correlation"] = c / (s * s_ref) if s > 0 and s_ref > 0 else float("nan")
    out["ln_ppl_ratio"] = {"value": ln_ratio, "error": ln_err}
    out["ppl_ratio"] = {"value": math.exp(ln_ratio), "error": math.exp(ln_ratio) * ln_err}
    diff_var = u * u + u_ref * u_ref - 2 * ppl * ppl_ref * c
    out["ppl_diff"] = {"value": ppl - ppl_ref, "error": math.sqrt(max(diff_var, 0.0))}
    return out


def kl_histogram(kl, lo=-8.0, hi=2.0, bins=40):
    """The per-token KL distribution for the report: counts over log10(KL) in `bins` equal bins from
    lo to hi; KL <= 10^lo (0 and the tiny negatives of rounding included) counts in the first bin,
    above 10^hi in the last."""
    kl = np.asarray(kl, dtype=np.float64)
    x = np.log10(np.maximum(kl, 10.0 ** lo))
    counts, edges = np.histogram(np.clip(x, lo, hi), bins=bins, range=(lo, hi))
    return {"log10_edges": [float(e) for e in edges], "counts": [int(c) for c in counts]}
