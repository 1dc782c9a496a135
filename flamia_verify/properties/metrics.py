"""Error statistics of a kernel's tensor against the float64 reference, and the plot data built on them.

All statistics are computed in float64 over the finite reference entries:

    rel_rmse   ||x - r||_2 / ||r||_2
    max_abs    max |x - r|
    cosine     <x, r> / (||x|| ||r||)
    sqnr_db    10 log10(||r||^2 / ||x - r||^2)
    mean_bias  mean(x - r) / rms(x - r)              (signed; ~ N(0, 1/n) for unbiased errors)
    shrinkage  <x - r, r> / (||x - r|| ||r||)        (cosine of the error with the reference;
                                                      negative: the kernel shrinks the tensor)
"""

from __future__ import annotations

import math

import torch

__all__ = [
    "error_stats",
    "rel_rmse",
    "per_position_error",
    "log_histogram",
    "finite_or_str",
]

_TINY = 1e-300


def finite_or_str(x: float) -> float | str:
    if math.isnan(x):
        return "nan"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    return float(x)


def rel_rmse(x: torch.Tensor, ref: torch.Tensor) -> float:
    x, ref = x.detach().double().to(ref.device), ref.detach().double()
    den = torch.linalg.vector_norm(ref)
    num = torch.linalg.vector_norm(x - ref)
    if float(den) == 0.0:
        return 0.0 if float(num) == 0.0 else math.inf
    return float(num / den)


def error_stats(x: torch.Tensor, ref: torch.Tensor) -> dict[str, float]:
    """The statistics of the module docstring (floats; inf/nan when the kernel is non-finite)."""
    x = x.detach().double().to(ref.device)
    ref = ref.detach().double()
    n = ref.numel()
    if n == 0:
        return {
            "rel_rmse": 0.0,
            "max_abs": 0.0,
            "cosine": 1.0,
            "sqnr_db": math.inf,
            "mean_bias": 0.0,
            "shrinkage": 0.0,
            "nonfinite": 0,
            "elements": 0,
        }
    nonfinite = int((~torch.isfinite(x)).sum())
    e = x - ref
    e_norm = float(torch.linalg.vector_norm(e))
    r_norm = float(torch.linalg.vector_norm(ref))
    x_norm = float(torch.linalg.vector_norm(x))
    stats = {
        "rel_rmse": e_norm / r_norm if r_norm > 0 else (0.0 if e_norm == 0 else math.inf),
        "max_abs": float(e.abs().max()) if nonfinite == 0 else math.inf,
        "cosine": float((x * ref).sum()) / max(x_norm * r_norm, _TINY)
        if r_norm > 0 and x_norm > 0
        else (1.0 if e_norm == 0 else 0.0),
        "sqnr_db": 10 * math.log10(r_norm**2 / e_norm**2)
        if e_norm > 0 and r_norm > 0
        else (math.inf if e_norm == 0 else -math.inf),
        "mean_bias": float(e.mean()) / max(e_norm / math.sqrt(n), _TINY) if e_norm > 0 else 0.0,
        "shrinkage": float((e * ref).sum()) / max(e_norm * r_norm, _TINY) if e_norm > 0 and r_norm > 0 else 0.0,
        "nonfinite": nonfinite,
        "elements": n,
    }
    if nonfinite:
        for key in ("rel_rmse", "cosine", "sqnr_db", "mean_bias", "shrinkage"):
            stats[key] = (
                math.nan
                if key in ("cosine", "mean_bias", "shrinkage")
                else (math.inf if key == "rel_rmse" else -math.inf)
            )
    return stats


def per_position_error(x: torch.Tensor, ref: torch.Tensor) -> list[float | str]:
    """RMS error of every token (over heads and channels), relative to the tensor's RMS."""
    x = x.detach().double().to(ref.device)
    ref = ref.detach().double()
    if ref.numel() == 0:
        return []
    rms_ref = float(ref.pow(2).mean().sqrt())
    per_tok = (x - ref).pow(2).flatten(1).mean(dim=1).sqrt()
    per_tok = per_tok / max(rms_ref, _TINY)
    return [finite_or_str(v) for v in per_tok.cpu().tolist()]


def log_histogram(errors: dict[str, torch.Tensor], *, bins_per_decade: int = 4, title: str = "") -> dict:
    """A ``details["histograms"]`` entry: counts of log10 |error| (relative to each tensor's RMS
    reference) on shared log-spaced bins. ``errors`` maps a label to relative errors."""
    logs = {}
    lo, hi = math.inf, -math.inf
    for label, e in errors.items():
        a = e.detach().double().abs().flatten()
        a = a[torch.isfinite(a) & (a > 0)]
        if a.numel():
            la = torch.log10(a)
            lo, hi = min(lo, float(la.min())), max(hi, float(la.max()))
        logs[label] = a
    if not math.isfinite(lo):
        lo, hi = -8.0, 0.0
    lo = math.floor(lo * bins_per_decade) / bins_per_decade
    hi = math.ceil(hi * bins_per_decade) / bins_per_decade + 1.0 / bins_per_decade
    n = max(1, int(round((hi - lo) * bins_per_decade)))
    edges = [10 ** (lo + i / bins_per_decade) for i in range(n + 1)]
    counts = {}
    for label, a in logs.items():
        if a.numel():
            idx = ((torch.log10(a) - lo) * bins_per_decade).floor().clamp(0, n - 1).long()
            c = torch.bincount(idx, minlength=n)
            counts[label] = [int(v) for v in c.tolist()]
        else:
            counts[label] = [0] * n
    return {
        "title": title,
        "x_label": "|error| / RMS(reference)",
        "y_label": "elements",
        "bin_edges": edges,
        "counts": counts,
        "log_x": True,
        "log_y": True,
    }
