"""causal.captured: the causal family's rule on the tensors a real model produced (``check --inputs``).

On every causal captured call, each document's out and dQ at or before t bitwise unchanged (beyond the
kernel's run-to-run noise) when its queries, keys, values and dO after t are replaced by huge values,
at :data:`CAUSAL_POSITIONS` positions t per document. The information-flow check over the calls is
:func:`flamia_verify.properties.checks.common.captured.flow_check` (isolation.captured runs it too).
"""

from __future__ import annotations

from flamia_verify.properties.cases import Case
from flamia_verify.properties.checks.common.captured import captured_calls, flow_check, no_capture
from flamia_verify.properties.perturb import doc_bounds, future_inputs
from flamia_verify.properties.registry import register

__all__ = ["CAUSAL_POSITIONS"]

#: positions t per document of causal.captured: the first query, the middle and the next-to-last
CAUSAL_POSITIONS = 3


@register(
    "causal.captured",
    "on every causal captured call: each document's out and dQ at or before t unchanged when its "
    "queries, keys, values and dO after t are replaced by huge values (bitwise, or beyond the kernel's "
    "run-to-run noise)",
    defaults=lambda recipe, dtype: {"changed_elements": 0},
    suites=(),
    cost=1.0,
)
def causal_captured(ctx):
    calls = [c for c in captured_calls(ctx) if c.causal]
    if not captured_calls(ctx):
        return no_capture(ctx)
    if not calls:
        return ctx.skip("no captured call is causal")

    def perturbations(case: Case, inp):
        for b, lq in enumerate(case.lens_q):
            if lq < 2:
                continue
            q0 = doc_bounds(case, b)[0]
            for t in sorted({0, (lq - 2) // 2, lq - 2})[:CAUSAL_POSITIONS]:
                yield (
                    {"document": b, "t": t},
                    future_inputs(inp, b, t, "huge", seed=case.seed * 101 + b),
                    lambda name, q0=q0, t=t: slice(q0, q0 + t + 1) if name in ("out", "dq") else None,
                    "the document's future was",
                )

    return flow_check(
        ctx,
        calls,
        perturbations,
        lambda n, runs: f"no position of {n} captured calls saw its future ({runs} perturbations)",
    )
