"""isolation.captured: the isolation family's rule on the tensors a real model produced (``check --inputs``).

On every captured call of 2+ documents, each document's out, dQ, dK, dV unchanged (bitwise, or beyond
the kernel's run-to-run noise) when every other document is replaced by huge values. The
information-flow check over the calls is :func:`flamia_verify.properties.checks.common.captured.flow_check`
(causal.captured runs it too).
"""

from __future__ import annotations

from flamia_verify.properties.cases import Case
from flamia_verify.properties.checks.common.captured import captured_calls, flow_check, no_capture
from flamia_verify.properties.perturb import doc_bounds, replace_others
from flamia_verify.properties.registry import register

__all__: list[str] = []


@register(
    "isolation.captured",
    "on every captured call of 2+ documents: each document's out, dQ, dK, dV unchanged when every other "
    "document is replaced by huge values (bitwise, or beyond the kernel's run-to-run noise)",
    defaults=lambda recipe, dtype: {"changed_elements": 0},
    suites=(),
    cost=1.0,
)
def isolation_captured(ctx):
    all_calls = captured_calls(ctx)
    if not all_calls:
        return no_capture(ctx)
    calls = [c for c in all_calls if sum(1 for a, k in zip(c.lens_q, c.lens_k) if a or k) >= 2]
    if not calls:
        return ctx.skip("no captured call packs two or more documents")

    def perturbations(case: Case, inp):
        for b, lq in enumerate(case.lens_q):
            if lq == 0:
                continue
            q0, q1, k0, k1 = doc_bounds(case, b)
            yield (
                {"document": b},
                replace_others(inp, b, "huge", seed=case.seed * 103 + b),
                lambda name, q0=q0, q1=q1, k0=k0, k1=k1: slice(q0, q1) if name in ("out", "dq") else slice(k0, k1),
                "the other documents were",
            )

    return flow_check(
        ctx,
        calls,
        perturbations,
        lambda n, runs: f"every document of {n} captured calls unchanged by its neighbours ({runs} perturbations)",
    )
