"""error.captured: the error family's rule on the tensors a real model produced (``check --inputs``).

Every captured call's O (and, with a backward, dQ, dK, dV) against the float64 reference: the
normalized error (relative RMSE over the recipe's rounding model on these very inputs) <= 2, as
error.*; the ratio to a BF16 run is reported beside it. The captured calls and their table's columns
are :mod:`flamia_verify.properties.checks.common.captured`'s.
"""

from __future__ import annotations

import math

from flamia_verify.properties.cases import captured_call
from flamia_verify.properties.checks.common.captured import call_name, call_row, captured_calls, no_capture
from flamia_verify.properties.checks.common.error_model import normalized_error
from flamia_verify.properties.checks.common.verdict import case_record, verdict, violations
from flamia_verify.properties.metrics import error_stats
from flamia_verify.properties.registry import register
from flamia_verify.properties.tolerances import ERROR_MODEL_FACTOR

__all__: list[str] = []


@register(
    "error.captured",
    "on every captured call: O (and dQ, dK, dV) against the float64 reference, relative RMSE over the "
    "recipe's rounding model on the recorded tensors <= 2",
    defaults=lambda recipe, dtype: {"normalized_error": ERROR_MODEL_FACTOR},
    adjustable=("normalized_error",),
    suites=(),
    cost=1.0,
)
def error_captured(ctx):
    calls = captured_calls(ctx)
    if not calls:
        return no_capture(ctx)
    tensors = ("out", "dq", "dk", "dv") if ctx.has_backward else ("out",)
    rows, worst, worst_norm = [], None, -1.0
    for n, case in enumerate(calls):
        res, ref, base = ctx.run(case), ctx.reference(case), ctx.baseline(case)
        row = call_row(case)
        for t in tensors:
            x, r, b = getattr(res, t), getattr(ref, t), getattr(base, t)
            if x is None:
                continue
            st, bst = error_stats(x, r), error_stats(b, r)
            norm = normalized_error(ctx, case, t, st["rel_rmse"])
            ratio = (
                st["rel_rmse"] / bst["rel_rmse"] if bst["rel_rmse"] > 0 else (1.0 if st["rel_rmse"] == 0 else math.inf)
            )
            row[f"{t}_rel_rmse"], row[f"{t}_normalized_error"], row[f"{t}_ratio_to_bf16"] = st["rel_rmse"], norm, ratio
            if not math.isfinite(norm) or norm > worst_norm:
                worst_norm = norm if math.isfinite(norm) else math.inf
                worst = case_record(
                    case,
                    **captured_call(case),
                    tensor=t,
                    summary=f"{call_name(row)}: {t} normalized error {norm:.3g} (relative RMSE {st['rel_rmse']:.3g}, "
                    f"{ratio:.3g}x a BF16 run's)",
                )
        rows.append(row)
        ctx.progress((n + 1) / len(calls))
    metrics = {
        "normalized_error": max(r.get(f"{t}_normalized_error", 0.0) for r in rows for t in tensors),
        "rel_rmse": max(r.get(f"{t}_rel_rmse", 0.0) for r in rows for t in tensors),
        "ratio_to_bf16": max(r.get(f"{t}_ratio_to_bf16", 0.0) for r in rows for t in tensors),
        "calls": len(rows),
    }
    broken = violations(metrics, ctx.th)
    return verdict(
        ctx,
        metrics,
        ok_message=f"{len(rows)} captured calls within the error model (worst: {worst['summary'] if worst else '-'})",
        failures=[f"worst {worst['summary']}"] if broken and worst else [],
        worst_case=worst or {},
        details={"calls": rows},
    )
