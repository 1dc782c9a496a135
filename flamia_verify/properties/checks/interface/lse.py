"""interface.lse: the log-sum-exp a kernel returns beside its output.

    interface.lse         a kernel returning (out, lse, ...) with lse of FlashAttention's shape
                          (nheads, total_q): lse within the a-priori bound of the natural-log
                          log-sum-exp of the scaled scores, for every row that sees a key; -inf or
                          +inf (never finite) for a row that sees none

The cases: the first three base cases and the calling convention's packings
(:func:`~flamia_verify.properties.checks.common.cases.argument_cases`).
"""

from __future__ import annotations

import math

import torch

from flamia_verify.properties.cases import Case
from flamia_verify.properties.checks.common.cases import argument_cases
from flamia_verify.properties.checks.common.error_model import bounds_for, normalized_error
from flamia_verify.properties.checks.common.verdict import case_record, verdict
from flamia_verify.properties.compare import compare_within
from flamia_verify.properties.harness import lse_weights
from flamia_verify.properties.metrics import rel_rmse
from flamia_verify.properties.registry import register
from flamia_verify.properties.tolerances import ERROR_MODEL_FACTOR
from flamia_verify.reference import attention_backward, attention_forward

__all__ = ["lse_gradient_reference"]


@register(
    "interface.lse",
    "a returned log-sum-exp (the second item of a tuple output, shape (nheads, total_q)) within the "
    "a-priori bound of the natural-log log-sum-exp of the scaled scores; where it is in the graph, a loss on "
    "it alone gives the gradients of the log-sum-exp (within the error model of dQ and dK)",
    defaults=lambda recipe, dtype: {"violations": 0, "lse_gradient_errors": 0},
    cost=0.3,
)
def lse(ctx):
    cases = ctx.base_cases()[:3] + argument_cases(ctx)
    seen, violations, rows, first, worst_ratio, empty_rows = "", 0, 0, None, 0.0, 0
    for n, case in enumerate(cases):
        res = ctx.run(case)
        ctx.progress((n + 1) / len(cases))
        if res.lse is None:
            seen = seen or res.second_item
            if res.second_item.startswith("tensor") and _transposed(res.second_item, case):
                msg = (
                    f"the second output item has shape (total_q, nheads) = ({case.total_q}, {case.heads}); "
                    "FlashAttention's log-sum-exp is (nheads, total_q)"
                )
                return verdict(
                    ctx,
                    {"violations": case.total_q * case.heads},
                    ok_message="",
                    worst_case=case_record(case, summary=msg),
                    failures=[msg],
                )
            continue
        ref = ctx.reference(case)
        bound = bounds_for(ctx, case, grads=ctx.has_backward).lse
        x = res.lse.double().to(ref.lse.device).T  # (total_q, H) as the reference
        finite_bound = torch.isfinite(bound)
        r = torch.where(finite_bound, ref.lse, torch.zeros_like(ref.lse))
        b = torch.where(finite_bound, bound, torch.full_like(bound, math.inf))
        xx = torch.where(finite_bound, x, torch.zeros_like(x))
        m = compare_within(xx, r, b, what="|lse - reference lse|", rule="within the a-priori bound")
        rows += int(finite_bound.sum())
        # a row that sees no key has no log-sum-exp: -inf (the log of an empty sum) or FlashAttention's
        # +inf sentinel; a finite value would weigh the empty row into a merge of partial results
        blind = ref.lse == -math.inf
        finite_blind = blind & torch.isfinite(x)
        empty_rows += int(blind.sum())
        if bool(finite_blind.any()):
            violations += int(finite_blind.sum())
            if first is None:
                t, h = (int(i) for i in finite_blind.nonzero()[0])
                first = case_record(
                    case,
                    tensor="lse",
                    summary=f"{int(finite_blind.sum())} rows that see no key have a finite lse (token {t}, head {h}: "
                    f"{float(x[t, h]):.4g}); their lse must be -inf or +inf",
                )
        err = (xx - r).abs()
        ratio = torch.where(finite_bound, torch.nan_to_num(err / b.clamp_min(1e-300), nan=math.inf), 0.0)
        if ratio.numel():
            worst_ratio = max(worst_ratio, float(ratio.max()))
        if not m.ok:
            violations += m.mismatched
            if first is None:
                first = case_record(case, tensor="lse", mismatch=m.to_dict(), summary=m.summary())
    if not rows:
        what = f" (its second item: {seen})" if seen else ""
        return ctx.skip(f"the kernel returns no log-sum-exp of shape (nheads, total_q){what}")
    grad_errors, grad_note = 0, ""
    if ctx.has_backward:
        grad_errors, grad_note, grad_first = _lse_gradients(ctx, [c for c in cases if ctx.run(c).lse is not None][:2])
        first = first or grad_first
    return verdict(
        ctx,
        {"violations": violations, "lse_gradient_errors": grad_errors, "tightness": worst_ratio, "rows": rows},
        ok_message=f"lse of {rows} rows within the bound (natural log); tightness {worst_ratio:.3g}; "
        f"{empty_rows} rows that see no key with lse -inf or +inf{grad_note}",
        first=first,
    )


def _lse_gradients(ctx, cases: list[Case]) -> tuple[int, str, dict | None]:
    """A loss on the log-sum-exp alone (``loss=lse``): dQ and dK against the float64 gradients of
    sum(w * lse), held to the error model of dQ and dK (the same products of P with K and Q; a
    gradient dropped or misrouted has relative error about 1). A log-sum-exp outside the graph is
    allowed (FlashAttention's is): a loss on it then raises or gives nothing, never a wrong value."""
    errors, checked, first = 0, 0, None
    for case in cases:
        res = ctx.run(case.with_(call=(("loss", "lse"),)))
        if not res.lse_differentiable:
            return 0, "; the log-sum-exp is outside the graph (no gradient through it)", None
        inp = ctx.inputs(case)
        ref = lse_gradient_reference(inp, lse_weights(inp.do).double())
        for t, want in zip(("dq", "dk"), ref):
            got = getattr(res, t)
            norm = math.inf if got is None else normalized_error(ctx, case, t, rel_rmse(got, want.to(got.device)))
            checked += 1
            if norm > ERROR_MODEL_FACTOR:
                errors += 1
                if first is None:
                    first = case_record(
                        case,
                        tensor=t,
                        normalized_error=norm,
                        summary=f"{t} of a loss on the returned log-sum-exp has {norm:.3g} times the recipe's expected "
                        f"error of {t} (at most {ERROR_MODEL_FACTOR:g})"
                        + (" (no gradient arrived)" if got is None else ""),
                    )
    return errors, f"; dQ and dK of a loss on the log-sum-exp within the error model ({checked} tensors)", first


def lse_gradient_reference(inp, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 dQ, dK of sum(w * lse) (w: (nheads, total_q)) from the reference: dQ_i = scale w_i
    sum_j P_ij k_j is scale w times the attention output with V := K, and dK_j = scale sum_i w_i P_ij q_i
    is scale times the reference backward's dV for dO = w Q (GQA groups summed there; dV = 0 here).
    Rows that see no key (lse = -inf) have P = 0 and contribute nothing."""
    c = inp.case
    q, k = inp.q.double().cpu(), inp.k.double().cpu()
    cu_q, cu_k = inp.cu_q.cpu(), inp.cu_k.cpu()
    wt = w.cpu().T[..., None]  # (total_q, H, 1)
    kw = {"softmax_scale": c.scale, "causal": c.causal}
    out, lse = attention_forward(q, k, k, cu_q, cu_k, **kw)
    _, _, dv = attention_backward(wt * q, q, k, k, out, lse, cu_q, cu_k, **kw)
    return c.scale * wt * out, c.scale * dv


def _transposed(description: str, case: Case) -> bool:
    """A second item described as a (total_q, nheads) tensor (and the two differ)."""
    return case.total_q != case.heads and description.startswith(f"tensor ({case.total_q}, {case.heads})")
