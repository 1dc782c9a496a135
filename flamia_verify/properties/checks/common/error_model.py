"""What a case's error is judged against: the rounding model's prediction (:func:`normalized_error`,
the error over it) and the rigorous a-priori bound (:func:`bounds_for`, cached per case), with the
report of the elements outside it (:func:`bound_report`) that the bound, interface, consistency and
special families give.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch

from flamia_verify.properties.bounds import bounds_of
from flamia_verify.properties.cases import Case, cu_from_lens
from flamia_verify.properties.checks.common.verdict import case_record
from flamia_verify.properties.compare import compare_within
from flamia_verify.recipes.noise_model import predicted_errors
from flamia_verify.recipes.operands import Operand

__all__ = [
    "admission_summary",
    "bound_of_call",
    "bound_ratio",
    "bound_report",
    "bounds_for",
    "exact_weight_model",
    "normalized_error",
    "predicted",
    "wrong_shape",
]


# ----------------------------------------------------------------------------------------------
# the rounding model's prediction (error, bound.shapes, consistency.grad_forward_ratio, ...)
# ----------------------------------------------------------------------------------------------


def predicted(ctx, case) -> dict[str, float]:
    """The rounding model's relative RMSE of every tensor on this case (cached)."""

    def shared():  # on the run's first request: the model is built here, not on every lookup
        model = ctx.bound_model
        return ctx.across_runs(
            ("predicted", case),
            lambda: predicted_errors(ctx.inputs(case), ctx.reference(case), model, seed=case.seed),
            model=model,
        )

    return ctx.memo(("predicted", case), shared)


def normalized_error(ctx, case, tensor: str, rel: float) -> float:
    """``rel`` (a relative RMSE of ``tensor`` on ``case``) over the rounding model's prediction."""
    pred = predicted(ctx, case)[tensor]
    if pred <= 0:
        return 0.0 if rel == 0 else math.inf
    return rel / pred


# ----------------------------------------------------------------------------------------------
# the a-priori bound and its violations (bound, special, interface, consistency.homogeneity, state)
# ----------------------------------------------------------------------------------------------


def bounds_for(ctx, case, *, grads: bool, exact_weights: bool = False, nominal: bool = False):
    """The bound of a case (cached), with gradients when asked and the kernel has a backward;
    ``exact_weights``: under :func:`exact_weight_model` (only for cases whose weights are exact, such as uniform rows);
    ``nominal``: under the recipe's nominal model, without its admissions (what they add is reported, never judged)."""

    # how the tensors are passed (``case.call``) does not change the bound
    key = ("bound", replace(case, call=()))

    def shared():  # on the run's first request: the model is built here, not on every lookup
        model = ctx.bound_model
        if nominal:
            model = model.nominal()
        if exact_weights:
            model = exact_weight_model(model)
        return ctx.across_runs(
            key,
            lambda: bounds_of(ctx.inputs(case), ctx.reference(case), scale=case.scale, causal=case.causal, model=model),
            model=model,
        )

    return ctx.memo(key + (exact_weights, nominal), shared)


def exact_weight_model(model):
    """The recipe's model with P's relative rounding removed (u_P = 0; its underflow terms kept).

    Sound on inputs whose weights are exact: rows whose scores are all equal (the uniform key and query
    cases of :mod:`flamia_verify.properties.checks.bound.tensors`) have weights 1/n however P's elements
    are rounded, because every element of the row is rounded alike and the normalizer sums the rounded elements (to within fp32
    rounding, inside the bound's REL32 slack), and however the scores are rounded, because equal
    scores stay equal. Without the u_P |dS| slack that the bound otherwise must leave, the dQ (dK)
    bound of the uniform key (query) case is the rounding of the dS (dS^T) operand itself plus the
    rounding of D and the output: a dS format one bit coarser than the recipe (E5M2, u = 2^-3, under an E4M3 claim,
    u = 2^-4) leaves it."""
    return model.with_operands({Operand.P: replace(model[Operand.P], u=0.0)})


def bound_ratio(x: torch.Tensor, ref: torch.Tensor, bound: torch.Tensor) -> torch.Tensor:
    """|x - ref| / bound elementwise, float64: 0 where the error is 0, inf where it is NaN."""
    err = (x.detach().double().to(ref.device) - ref).abs()
    ratio = torch.where(err == 0, torch.zeros_like(err), err / bound.clamp_min(1e-300))
    return torch.nan_to_num(ratio, nan=float("inf"))


#: the token axis of each tensor (one, several), as the admission summary names it
_TOKENS = {"out": ("query", "queries"), "dq": ("query", "queries"), "dk": ("key", "keys"), "dv": ("key", "keys")}


def admission_summary(admissions, counts: dict) -> str:
    """The elements that only ``admissions`` accept, in a user's words: ``counts`` maps a tensor name
    to (elements, tokens, largest |error| among them, that error over the tensor's RMS)."""
    what = " and ".join(a.what for a in admissions)
    parts = [
        f"{n} element{'s' * (n != 1)} of {t} on {tok} {_TOKENS.get(t, ('token', 'tokens'))[tok != 1]} "
        f"(|error| up to {mx:.2g}, {share:.2g} of {t}'s RMS)"
        for t, (n, tok, mx, share) in counts.items()
        if n
    ]
    if not parts:
        return f"admitted {what}: no element needed it"
    nominal = "/".join(a.nominal_name for a in admissions)
    return f"admitted {what}: " + ", ".join(parts) + f" outside the {nominal} bound, inside this one"


def _admitted(x: torch.Tensor, r: torch.Tensor, within: torch.Tensor, nominal_bound: torch.Tensor):
    """(elements, tokens, max |error|, max |error| / RMS of the reference) of the elements inside the
    bound (``within``) but outside ``nominal_bound``."""
    err = (x.detach().double().to(r.device) - r).abs()
    adm = within & (err > nominal_bound) & (err > 0)
    n = int(adm.sum())
    if not n:
        return 0, 0, 0.0, 0.0
    mx = float(err[adm].max())
    rms = float(r.double().pow(2).mean().sqrt()) if r.numel() else 0.0
    return n, int(adm.flatten(1).any(1).sum()), mx, mx / rms if rms > 0 else math.inf


def bound_report(ctx, cases, tensors, *, inputs_label: str = "base cases", exact_weights: bool = False):
    """Count violations of the bound over ``cases`` for ``tensors``; metrics, worst case, details.

    Under a recipe with admissions (and not ``exact_weights``, whose model changes P) the elements
    that only the admissions accept are counted: metrics ``admitted_elements``, ``admitted_max_abs``,
    ``admitted_rms_share``, and the ok message says where they are."""
    violated, tight, first = 0, 0.0, None
    per_tensor = {t: 0 for t in tensors}
    tight_t = {t: 0.0 for t in tensors}
    admissions = () if exact_weights else ctx.bound_model.admissions
    admitted = {t: (0, 0, 0.0, 0.0) for t in tensors}
    series = None
    for n, case in enumerate(cases):
        res = ctx.run(case)
        ref = ctx.reference(case)
        grads = any(t != "out" for t in tensors)
        B = bounds_for(ctx, case, grads=grads, exact_weights=exact_weights)
        B0 = bounds_for(ctx, case, grads=grads, nominal=True) if admissions else None
        for t in tensors:
            x = getattr(res, t)
            if x is None:
                continue
            r = getattr(ref, t)
            b = getattr(B, t)
            cu = cu_from_lens(case.lens_q if t in ("out", "dq") else case.lens_k).tolist()
            m = compare_within(x, r, b, what=f"|{t} - reference|", rule="within the a-priori bound", cu_seqlens=cu)
            ratio = bound_ratio(x, r, b)
            if B0 is not None:
                got = _admitted(x, r, ratio <= 1, getattr(B0, t))
                n0, tok0, mx0, share0 = admitted[t]
                admitted[t] = (n0 + got[0], tok0 + got[1], max(mx0, got[2]), max(share0, got[3]))
            mx = float(ratio.max()) if ratio.numel() else 0.0
            if mx > tight_t[t]:
                tight_t[t] = mx
            if mx >= tight:
                tight = mx
                if ratio.numel():
                    series = {
                        "title": f"{t}: max |error| / bound per token ({case.describe()})",
                        "x_label": "token (packed)",
                        "y_label": "|error| / bound",
                        "ys": {t: [float(v) for v in ratio.flatten(1).amax(1).clamp_max(1e6).cpu().tolist()]},
                        "log_y": True,
                        "thresholds": {"bound": 1.0},
                    }
            if not m.ok:
                violated += m.mismatched
                per_tensor[t] += m.mismatched
                if first is None:
                    first = case_record(
                        case, tensor=t, recipe=ctx.recipe.name, mismatch=m.to_dict(), summary=m.summary()
                    )
        ctx.progress((n + 1) / len(cases))
    metrics = {"violations": violated, "tightness": tight}
    for t in tensors:
        metrics[f"tightness_{t}"] = tight_t[t]
        metrics[f"violations_{t}"] = per_tensor[t]
    details = {"series": [series]} if series else {}
    msg = f"no element outside the {ctx.recipe.name} bound on {len(cases)} {inputs_label}; tightness {tight:.3g}"
    if admissions:
        metrics["admitted_elements"] = sum(a[0] for a in admitted.values())
        metrics["admitted_max_abs"] = max(a[2] for a in admitted.values())
        metrics["admitted_rms_share"] = max(a[3] for a in admitted.values())
        if metrics["admitted_elements"]:
            msg += "; " + admission_summary(admissions, admitted)
    return metrics, first, details, msg


def wrong_shape(case: Case, out) -> str:
    """What is wrong with the shape of ``out`` on ``case`` ("" when it is (total_q, nheads, head_dim))."""
    want = (case.total_q, case.heads, case.headdim)
    if out is None or tuple(out.shape) == want:
        return ""
    return f"the output has shape {tuple(out.shape)}, not (total_q, nheads, head_dim) = {want}, on {case.describe()}"


def bound_of_call(ctx, case: Case, tensors) -> tuple[dict, dict | None]:
    """bound_report's metrics and first violation on one call of ``case``, without its progress (the
    checks that call it, interface.arguments and special.degenerate, report their own); an output of the
    wrong shape counts as a violation of every element."""
    shape = wrong_shape(case, ctx.run(case).out)
    if shape:  # nothing to hold to a bound
        return {"violations": max(1, case.total_q * case.heads * case.headdim)}, case_record(case, summary=shape)
    saved, ctx.on_fraction = ctx.on_fraction, None
    try:
        metrics, worst, _, _ = bound_report(ctx, [case], tensors)
    finally:
        ctx.on_fraction = saved
    return metrics, worst
