"""determinism: repeated runs on the same inputs give bitwise identical outputs and gradients.

Kernels that accumulate dK/dV with atomics are not run-to-run reproducible by design; the option
``warn_only`` turns a failure into a pass whose message starts with "warning:" (the mismatch counts
stay in the metrics).
"""

from __future__ import annotations

from flamia_verify.properties.checks.common import case_record
from flamia_verify.properties.compare import compare_bitwise
from flamia_verify.properties.registry import register

__all__ = []


@register(
    "determinism.repeat",
    "repeated runs on the same inputs give bitwise identical out, dQ, dK, dV (option warn_only for "
    "atomics-based kernels)",
    defaults=lambda recipe, dtype: {"mismatched_elements": 0},
    options={"warn_only": False},
    cost=1.0,
)
def repeat(ctx):
    cases = ctx.base_cases()[:3]
    repeats = max(2, ctx.settings.repeats)
    mismatched, first, runs = 0, None, 0
    for n, case in enumerate(cases):
        first_run = ctx.run(case)
        for _ in range(repeats - 1):
            again = ctx.run(ctx.inputs(case))
            runs += 1
            for name, x in again.tensors().items():
                m = compare_bitwise(x, first_run.tensors()[name], what=f"{name}, run vs first run")
                if not m.ok:
                    mismatched += m.mismatched
                    if first is None:
                        first = case_record(case, tensor=name, repeats=repeats, mismatch=m.to_dict(), summary=m.summary())
        ctx.progress((n + 1) / len(cases))
    metrics = {"mismatched_elements": mismatched, "repeats": repeats, "cases": len(cases)}
    if mismatched and ctx.opt.get("warn_only"):
        return ctx.result("pass", metrics, message=f"warning: not bitwise reproducible ({first['summary']}); "
                          "accepted by warn_only", worst_case=first)
    return ctx.judged(metrics, ok_message=f"bitwise identical over {repeats} runs of {len(cases)} cases",
                      worst_case=first or {}, extra_failures=[first["summary"]] if first else [])
