"""bound.captured: the bound family's rule on the tensors a real model produced (``check --inputs``).

Every element of every captured call's O (and, with a backward, dQ, dK, dV) within the recipe's rigorous
a-priori bound, as bound.*. The captured calls and their table's columns are
:mod:`flamia_verify.properties.checks.common.captured`'s.
"""

from __future__ import annotations

from flamia_verify.properties.cases import captured_call
from flamia_verify.properties.checks.common.captured import call_name, call_row, captured_calls, no_capture
from flamia_verify.properties.checks.common.error_model import bound_report
from flamia_verify.properties.checks.common.verdict import verdict
from flamia_verify.properties.registry import register

__all__: list[str] = []


@register(
    "bound.captured",
    "on every captured call: every element of O (and dQ, dK, dV) within the recipe's rigorous a-priori "
    "bound; no violation allowed",
    defaults=lambda recipe, dtype: {"violations": 0},
    suites=(),
    cost=1.0,
)
def bound_captured(ctx):
    calls = captured_calls(ctx)
    if not calls:
        return no_capture(ctx)
    tensors = ("out", "dq", "dk", "dv") if ctx.has_backward else ("out",)
    rows, first, total = [], None, 0
    for n, case in enumerate(calls):
        metrics, f, _, _ = bound_report(ctx, [case], tensors, inputs_label="captured calls")
        row = {**call_row(case), "violations": metrics["violations"], "tightness": metrics.get("tightness", 0.0)}
        rows.append(row)
        total += metrics["violations"]
        if f is not None and first is None:
            first = dict(f, **captured_call(case), summary=f"{call_name(row)}: {f.get('summary', '')}")
        ctx.progress((n + 1) / len(calls))
    return verdict(
        ctx,
        {"violations": total, "tightness": max(r["tightness"] for r in rows), "calls": len(rows)},
        ok_message=f"every element of {len(rows)} captured calls within the bound",
        first=first,
        details={"calls": rows},
    )
