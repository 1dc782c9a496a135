"""special.nonfinite: a NaN or Inf in one input element reaches every output and gradient element that
depends on it (non-finite there: not hidden).

A kernel that applies nan_to_num, clamps, or masks NaN turns a diverging training run into a silent
one. Robustness: a NaN already in q is an input no healthy training step produces, so a kernel that
hides it is reported, gating only when robustness is required. The poisoned runs, and what depends on
each poisoned element, are :mod:`flamia_verify.properties.checks.common.nonfinite`'s (isolation.nonfinite
reads the same runs).
"""

from __future__ import annotations

from flamia_verify.properties.checks.common.nonfinite import nonfinite_findings
from flamia_verify.properties.checks.common.verdict import verdict
from flamia_verify.properties.registry import register

__all__: list[str] = []


@register(
    "special.nonfinite",
    "a NaN (q, k, dO) or Inf (v) in one element reaches every output and gradient element that depends "
    "on it in the float64 reference (non-finite there: not hidden); inputs no training run produces",
    defaults=lambda recipe, dtype: {"hidden_elements": 0},
    cost=0.8,
    verdict="robustness",
)
def nonfinite(ctx):
    f = nonfinite_findings(ctx)
    return verdict(
        ctx,
        {"hidden_elements": f["hidden"], "spread_in_document": f["in_doc"], "poisoned_runs": f["runs"]},
        ok_message=(
            f"NaN and Inf reach every element that depends on them ({f['runs']} poisoned runs; {f['in_doc']} "
            "non-dependent elements of their own document and head became non-finite)"
        ),
        first=f["first_hidden"],
    )
