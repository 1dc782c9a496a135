"""error: how far O, dQ, dK, dV are from the float64 reference, and how many times a BF16 run's error.

Each check runs the suite's base cases (shared with bound, bias and consistency.grad_forward_ratio)
and its dimension cases (:func:`~flamia_verify.properties.cases.dimension_cases`: head_dims that are
not multiples of 16, rows whose maximum lies late, heads 100x apart, a causal document past 2048
keys per row, 4096 in the standard suite, 8192 on a GPU), and the built-in BF16 kernel
(FlashAttention-2 numerics) on the same inputs.

Threshold (docs/checks.md "error"): the recipe's expected error on the same inputs, ``pred``, is
measured by running float64 attention with the first-order rounding model (every operand the
recipe rounds multiplied by 1 + e, e uniform on [-u, u]; flamia_verify.recipes.noise_model), so
the amplification of rounding by large scores, heavy tails or low rank is part of it;

    normalized_error = rel_rmse / pred <= 2

(the factor 2 covers the model's independence assumption; correct kernels measure 0.4-1.2).
``ratio_to_bf16`` (rel_rmse over the BF16 run's on the same inputs) is reported beside it: the
number people quote.
"""

from __future__ import annotations

import math
from itertools import accumulate
from typing import Any

import torch

from flamia_verify.properties.cases import Case, dimension_cases
from flamia_verify.properties.checks.common.error_model import normalized_error, predicted
from flamia_verify.properties.checks.common.verdict import case_record, verdict
from flamia_verify.properties.metrics import error_stats, log_histogram, per_position_error
from flamia_verify.properties.registry import register
from flamia_verify.properties.tolerances import ERROR_MODEL_FACTOR
from flamia_verify.results import json_number

__all__ = ["worst_element"]

_LABEL = {"out": "O", "dq": "dQ", "dk": "dK", "dv": "dV"}


def _defaults(tensor):
    def f(recipe, dtype):
        return {"normalized_error": ERROR_MODEL_FACTOR}

    return f


def _cases(ctx):
    """The base cases and the dimension cases (one seed each)."""
    wide = dimension_cases(ctx.settings.name, seed=ctx.seed, dtype=ctx.dtype_str, device=ctx.device)
    return ctx.base_cases() + wide


def worst_element(
    x: torch.Tensor, ref: torch.Tensor, case: Case, tensor: str, *, baseline: torch.Tensor | None = None
) -> dict:
    """Location of the largest absolute error with the kernel's and the reference's values."""
    x64, r64 = x.detach().double().to(ref.device), ref.detach().double()
    if r64.numel() == 0:
        return {}
    err = (x64 - r64).abs()
    err = torch.nan_to_num(err, nan=float("inf"))
    flat = int(torch.argmax(err.reshape(-1)))
    shape = tuple(r64.shape)
    idx = []
    rem = flat
    for size in reversed(shape):
        idx.append(rem % size)
        rem //= size
    idx.reverse()
    cu = [0, *accumulate(case.lens_q if tensor in ("out", "dq") else case.lens_k)]
    doc = next((b for b in range(len(cu) - 1) if cu[b] <= idx[0] < cu[b + 1]), None)
    rec = {
        "tensor": tensor,
        "token": idx[0],
        "head": idx[1],
        "channel": idx[2],
        "document": doc,
        "position": idx[0] - cu[doc] if doc is not None else None,
        "kernel": json_number(x64.reshape(-1)[flat]),
        "reference": json_number(r64.reshape(-1)[flat]),
        "abs_error": json_number(err.reshape(-1)[flat]),
    }
    if baseline is not None:
        rec["bf16"] = json_number(baseline.detach().double().reshape(-1)[flat])
    return rec


def _error_check(ctx, tensor: str):
    cases = _cases(ctx)
    rows = []
    worst: Any = None  # the row of the largest normalized error
    for n, case in enumerate(cases):
        res = ctx.run(case)
        ref = ctx.reference(case)
        base = ctx.baseline(case)
        x, r, b = getattr(res, tensor), getattr(ref, tensor), getattr(base, tensor)
        if x is None:
            return ctx.skip(f"the kernel returned no {tensor}")
        if x.shape != r.shape:
            raise ValueError(f"{tensor} has shape {tuple(x.shape)}, expected {tuple(r.shape)}")
        st = error_stats(x, r)
        bst = error_stats(b, r)
        ratio = st["rel_rmse"] / bst["rel_rmse"] if bst["rel_rmse"] > 0 else (1.0 if st["rel_rmse"] == 0 else math.inf)
        norm = normalized_error(ctx, case, tensor, st["rel_rmse"])
        row = dict(
            case=case, stats=st, bf16=bst, ratio=ratio, norm=norm, pred=predicted(ctx, case)[tensor], x=x, r=r, b=b
        )
        rows.append(row)
        if worst is None or _key(row) > _key(worst):
            worst = row
        ctx.progress((n + 1) / len(cases))
    metrics = {
        "normalized_error": max(r["norm"] for r in rows),
        "rel_rmse": max(r["stats"]["rel_rmse"] for r in rows),
        "ratio_to_bf16": max(r["ratio"] for r in rows),
        "max_abs": max(r["stats"]["max_abs"] for r in rows),
        "cosine": min(r["stats"]["cosine"] for r in rows),
        "sqnr_db": min(r["stats"]["sqnr_db"] for r in rows),
        "bf16_rel_rmse": max(r["bf16"]["rel_rmse"] for r in rows),
        "predicted_rel_rmse": max(r["pred"] for r in rows),
        "nonfinite": sum(r["stats"]["nonfinite"] for r in rows),
        "cases": len(rows),
    }
    w = worst
    worst_case = case_record(
        w["case"],
        tensor=tensor,
        rel_rmse=w["stats"]["rel_rmse"],
        bf16_rel_rmse=w["bf16"]["rel_rmse"],
        ratio_to_bf16=w["ratio"],
        normalized_error=w["norm"],
        predicted_rel_rmse=w["pred"],
        worst_element=worst_element(w["x"], w["r"], w["case"], tensor, baseline=w["b"]),
    )
    label = _LABEL[tensor]
    details = {
        "series": [
            {
                "title": f"{label} error against token position ({w['case'].describe()})",
                "x_label": "token (packed)",
                "y_label": "RMS error / RMS reference",
                "ys": {"kernel": per_position_error(w["x"], w["r"]), "bf16": per_position_error(w["b"], w["r"])},
                "log_y": True,
            }
        ],
        "histograms": [
            log_histogram(
                {
                    "kernel": (w["x"].double() - w["r"]) / max(float(w["r"].pow(2).mean().sqrt()), 1e-300),
                    "bf16": (w["b"].double() - w["r"]) / max(float(w["r"].pow(2).mean().sqrt()), 1e-300),
                },
                title=f"|{label} error| distribution",
            )
        ],
        "per_case": [
            {
                "case": r["case"].describe(),
                "rel_rmse": r["stats"]["rel_rmse"],
                "bf16_rel_rmse": r["bf16"]["rel_rmse"],
                "ratio_to_bf16": r["ratio"],
                "predicted_rel_rmse": r["pred"],
                "normalized_error": r["norm"],
                "sqnr_db": r["stats"]["sqnr_db"],
            }
            for r in rows
        ],
    }
    extra = []
    if metrics["nonfinite"]:
        extra.append(f"{metrics['nonfinite']} non-finite {label} elements on finite inputs")
    return verdict(
        ctx,
        metrics,
        ok_message=(
            f"{label}: rel RMSE {metrics['rel_rmse']:.3g} ({metrics['ratio_to_bf16']:.3g}x BF16), "
            f"{metrics['normalized_error']:.2g}x the recipe's model, over {len(rows)} cases"
        ),
        worst_case=worst_case,
        details=details,
        failures=extra,
    )


def _key(row) -> float:
    v = row["norm"]
    return math.inf if v != v else v


@register(
    "error.out",
    "relative RMSE, max abs, cosine and SQNR of O against the float64 reference; ratio to a BF16 run",
    defaults=_defaults("out"),
    adjustable=("normalized_error",),
    cost=2.0,
)
def error_out(ctx):
    return _error_check(ctx, "out")


@register(
    "error.dq",
    "the error statistics of dQ (ratio to a BF16 run on the same inputs)",
    defaults=_defaults("dq"),
    adjustable=("normalized_error",),
    needs_backward=True,
    cost=0.5,
)
def error_dq(ctx):
    return _error_check(ctx, "dq")


@register(
    "error.dk",
    "the error statistics of dK (ratio to a BF16 run on the same inputs)",
    defaults=_defaults("dk"),
    adjustable=("normalized_error",),
    needs_backward=True,
    cost=0.5,
)
def error_dk(ctx):
    return _error_check(ctx, "dk")


@register(
    "error.dv",
    "the error statistics of dV (ratio to a BF16 run on the same inputs)",
    defaults=_defaults("dv"),
    adjustable=("normalized_error",),
    needs_backward=True,
    cost=0.5,
)
def error_dv(ctx):
    return _error_check(ctx, "dv")
