"""special.degenerate: the calls the convention allows that no training run makes.

    special.degenerate    (robustness) softmax_scale=0, a negative softmax_scale on sign-flipped queries
                          with widely spread scores, and packs with no query (two empty query documents,
                          one against keys) and with no token: within the bound, or refused with an
                          exception

The calls are made on the calling convention's packings
(:func:`~flamia_verify.properties.checks.common.cases.argument_cases`) and on packs of their own.
"""

from __future__ import annotations

from flamia_verify.properties.cases import Case
from flamia_verify.properties.checks.common.cases import argument_cases
from flamia_verify.properties.checks.common.error_model import bound_of_call
from flamia_verify.properties.checks.common.verdict import verdict
from flamia_verify.properties.harness import KernelCallError
from flamia_verify.properties.registry import register

__all__ = ["NEG_Q", "empty_packs", "negative_scale_case"]

#: the sign-flipped queries' magnitude in the negative-softmax_scale call: scores of standard deviation
#: 32, so that a row's scores spread over more than exp's range (about 88 in fp32) before the maximum
NEG_Q = 32.0


def empty_packs(ctx) -> list[Case]:
    """Packs the convention allows that hold no query: two empty query documents against 3 and 0 keys
    (out is (0, H, D); dK and dV are exactly 0), and a pack of no token at all."""
    return [
        ctx.case((0, 0), (3, 0), heads=4, heads_k=2, causal=False, seed_offset=604),
        ctx.case((0,), heads=4, heads_k=2, causal=True, seed_offset=605),
    ]


def negative_scale_case(bases: list[Case]) -> Case:
    """A negative softmax_scale with sign-flipped queries: the same attention as scale > 0, with scores
    spread over about 150 (a kernel must take its row maximum after the scale). No model uses a
    negative scale: special.degenerate asks it (robustness); measured on an H100, cuDNN's and
    FlashAttention's SDPA return NaN there."""
    return bases[1].with_(softmax_scale=-bases[1].scale, overrides=bases[1].overrides + (("scale_q", -NEG_Q),))


@register(
    "special.degenerate",
    "inputs no training run produces: softmax_scale=0 (every visible key weighs the same), a negative "
    "softmax_scale (with sign-flipped queries) and packs without any query (two empty query documents "
    "against keys, a pack of no token): within the recipe's bound, or refused with an exception",
    defaults=lambda recipe, dtype: {"violations": 0},
    cost=0.3,
    verdict="robustness",
)
def degenerate(ctx):
    tensors = ("out", "dq", "dk", "dv") if ctx.has_backward else ("out",)
    bases = argument_cases(ctx)
    # softmax_scale=0.0: a value, not "use the default"; a negative scale; a pack without queries, and
    # one without any token
    jobs = [base.with_(softmax_scale=0.0, call=(("scale_arg", "value"),)) for base in bases[:2]]
    jobs.append(negative_scale_case(bases))
    jobs += empty_packs(ctx)
    violations, refused, first = 0, [], None
    for n, case in enumerate(jobs):
        try:
            ctx.run(case)
        except KernelCallError as err:
            refused.append(f"{case.describe()}: {err.summary}")
            continue
        metrics, worst = bound_of_call(ctx, case, tensors)
        violations += metrics["violations"]
        if worst is not None and first is None:
            first = worst
        ctx.progress((n + 1) / len(jobs))
    ok = f"{len(jobs) - len(refused)} calls (softmax_scale=0 and < 0, packs without queries) within the bound"
    if refused:
        ok += f"; {len(refused)} refused with an exception (allowed): {refused[0]}"
    return verdict(
        ctx, {"violations": violations, "refused_calls": len(refused), "calls": len(jobs)}, ok_message=ok, first=first
    )
