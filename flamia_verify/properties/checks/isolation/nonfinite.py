"""isolation.nonfinite: a NaN or Inf in one element of a document and head makes no element of another
document or head non-finite.

A NaN that reaches them went through a shared scale or a wrong index: an information flow (gating).
Inside its own document and head a NaN or Inf may reach elements that do not depend on it (0 x Inf in a
masked tile); those are counted by special.nonfinite, not failed. The poisoned runs are
:mod:`flamia_verify.properties.checks.common.nonfinite`'s (special.nonfinite reads the same runs).
"""

from __future__ import annotations

from flamia_verify.properties.checks.common.nonfinite import nonfinite_findings
from flamia_verify.properties.checks.common.verdict import verdict
from flamia_verify.properties.registry import register

__all__: list[str] = []


@register(
    "isolation.nonfinite",
    "a NaN (q, k, dO) or Inf (v) in one element of a document and head makes no element of another "
    "document or head non-finite (a NaN that crosses there went through a shared scale or a wrong index)",
    defaults=lambda recipe, dtype: {"spread_elements": 0},
    cost=0.1,
)
def nonfinite_spread(ctx):
    f = nonfinite_findings(ctx)
    return verdict(
        ctx,
        {"spread_elements": f["spread"], "poisoned_runs": f["runs"]},
        ok_message=f"NaN and Inf stay in their own document and head ({f['runs']} poisoned runs)",
        first=f["first_spread"],
    )
