"""The a-priori bound of a case's inputs: :func:`bounds_of`, the elementwise bounds of O and of the
gradients under a recipe's bound model (:func:`flamia_verify.recipes.bounds.attention_bounds` on a
case's tensors and its float64 reference).

The fuzzer's search judges every example by it; the checks use it directly where they build their own
inputs (the many-document packs of isolation.layout, the probes of bound.rounding) and, cached per case,
through :func:`flamia_verify.properties.checks.common.error_model.bounds_for`. It sits below the search
and the checks, so that both can use it.
"""

from __future__ import annotations

from flamia_verify.properties.cases import Inputs
from flamia_verify.recipes.bounds import BoundResult, RecipeBoundModel, attention_bounds

__all__ = ["bounds_of"]


def bounds_of(
    inp: Inputs, ref, *, scale: float, causal: bool, model: RecipeBoundModel, grads: bool = True
) -> BoundResult:
    """The elementwise bounds of O (and of the gradients, with ``grads``) on inputs ``inp`` whose
    float64 reference is ``ref`` (out, dq, dk, dv), under ``model``."""
    return attention_bounds(
        inp.q,
        inp.k,
        inp.v,
        inp.do if grads else None,
        inp.cu_q.tolist(),
        inp.cu_k.tolist(),
        scale=scale,
        causal=causal,
        model=model,
        ref_out=ref.out,
        ref_grads=(ref.dq, ref.dk, ref.dv) if grads else None,
    )
