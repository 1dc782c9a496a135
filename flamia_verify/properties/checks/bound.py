"""bound: every element of O, dQ, dK, dV stays inside the rigorous a-priori bound of the recipe.

The bound (flamia_verify.kernels.bounds, derived in docs/checks.md) takes every rounding of the
recipe's formats at its worst: unit roundoff, underflow of subnormal elements, saturation (FLOOR),
per-tensor scales, fp32 accumulation and the rounding of the outputs. A correct kernel can never
exceed it; no violation is allowed. ``tightness`` = max |error| / bound says how much of the bound a
kernel uses (the forward of a BF16 kernel uses about half; FP8 kernels a few percent: the bound
assumes every score error at its worst at once). The cases include inputs whose q and k lie on the
MX-exact E4M3 grid: with exact scores the bound is tight on the rounding of V, P and dO.

A recipe that admits a second format for some operands (the BF16 recipe: P and P^T in FP16, whose
underflow floor BF16 does not have) is judged under the model that covers both; the elements that
only the admission accepts are counted against the nominal model and named in the report
(``admitted_elements``, :func:`admission_summary`; docs/checks.md, "FP16 probabilities in a BF16 recipe").
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch

from flamia_verify.kernels.operands import Operand
from flamia_verify.properties.cases import Case, cu_from_lens
from flamia_verify.properties.checks.common import bounds_of, case_record
from flamia_verify.properties.compare import compare_within
from flamia_verify.properties.registry import register
from flamia_verify.properties.tolerances import ERROR_MODEL_FACTOR
from flamia_verify.settings import OFF_DEFAULT_SCALE

__all__ = [
    "bounds_for",
    "bound_ratio",
    "bound_report",
    "one_hot_keys_case",
    "uniform_keys_case",
    "uniform_queries_case",
    "exact_weight_model",
    "admission_summary",
]

LN2 = math.log(2.0)


def bounds_for(ctx, case, *, grads: bool, exact_weights: bool = False, nominal: bool = False):
    """The bound of a case (cached), with gradients when asked and the kernel has a backward;
    ``exact_weights``: under :func:`exact_weight_model` (only for cases whose weights are exact, such as uniform rows);
    ``nominal``: under the recipe's nominal model, without its admissions (what they add is reported, never judged)."""

    def compute():
        inp = ctx.inputs(case)
        ref = ctx.reference(case)
        model = ctx.bound_model
        if nominal:
            model = model.nominal()
        if exact_weights:
            model = exact_weight_model(model)
        return bounds_of(inp, ref, scale=case.scale, causal=case.causal, model=model)

    # how the tensors are passed (``case.call``) does not change the bound
    return ctx.memo(("bound", replace(case, call=()), exact_weights, nominal), compute)


def exact_weight_model(model):
    """The recipe's model with P's relative rounding removed (u_P = 0; its underflow terms kept).

    Sound on inputs whose weights are exact: rows whose scores are all equal (:func:`uniform_keys_case`,
    :func:`uniform_queries_case`) have weights 1/n however P's elements are rounded, because every
    element of the row is rounded alike and the normalizer sums the rounded elements (to within fp32
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
    violations, tight, first = 0, 0.0, None
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
                violations += m.mismatched
                per_tensor[t] += m.mismatched
                if first is None:
                    first = case_record(case, tensor=t, recipe=ctx.recipe, mismatch=m.to_dict(), summary=m.summary())
        ctx.progress((n + 1) / len(cases))
    metrics = {"violations": violations, "tightness": tight}
    for t in tensors:
        metrics[f"tightness_{t}"] = tight_t[t]
        metrics[f"violations_{t}"] = per_tensor[t]
    details = {"series": [series]} if series else {}
    msg = f"no element outside the {ctx.recipe} bound on {len(cases)} {inputs_label}; tightness {tight:.3g}"
    if admissions:
        metrics["admitted_elements"] = sum(a[0] for a in admitted.values())
        metrics["admitted_max_abs"] = max(a[2] for a in admitted.values())
        metrics["admitted_rms_share"] = max(a[3] for a in admitted.values())
        if metrics["admitted_elements"]:
            msg += "; " + admission_summary(admissions, admitted)
    return metrics, first, details, msg


def _cases(ctx):
    """The base cases, and the bias cases whose q and k lie on the MX-exact grid: there the scores
    are exact, the bound loses the slack of worst-case score errors and bites on V, P and dO; with
    q x 16 the rows are nearly one-hot (O_i ~ V_j) and the bound nearly V's own rounding."""
    from flamia_verify.properties.checks.bias import bias_cases

    one_hot = ctx.case(
        (96,),
        distribution="shifted",
        overrides=(("scale_q", 16.0), ("grid_q", True), ("grid_k", True)),
        seed_offset=3001,
    )
    return ctx.base_cases() + bias_cases(ctx) + [one_hot, one_hot_keys_case(ctx)]


def one_hot_keys_case(ctx):
    """Keys one-hot (k_j = e_(j mod d)) in documents of at most d keys, integer queries and
    softmax_scale = ln 2: every score is an integer in log2 units, so FLAMIA's P blocks and
    FlashAttention's 2^(s - m) are exact powers of two, and dQ_i[j mod d] = s dS_ij reads one
    entry of dS with no sum. V and dO on the MX-exact grid keep dP exact up to fp32 sums. The dQ
    bound then bites on the rounding of the dS operand itself: a kernel that rounds dS more coarsely
    than its recipe says (NVFP4 under an MXFP8 claim) leaves it."""
    d = ctx.settings.headdim
    return ctx.case(
        (3 * d // 4, d, d // 2 + 1),
        softmax_scale=LN2,
        overrides=(("scale_q", 1.5), ("int_q", True), ("onehot_k", 1.0), ("grid_v", True), ("grid_do", True)),
        seed_offset=3002,
    )


def uniform_keys_case(ctx):
    """Keys one-hot (k_j = e_(j mod d)) in documents of at most d keys and every query constant across
    its channels (an integer): all scores of a row are equal, so the row's weights are exactly uniform
    (1/n over its visible keys) however the scores are rounded, whether softmax_scale is applied
    after the QK^T GEMM or folded into Q before Q is rounded (the non-default scale 0.0883 makes the
    two differ). dQ_i[j mod d] = s dS_ij reads one entry of dS with no sum; V and dO on the MX-exact
    grid keep dP exact up to fp32 sums."""
    d = ctx.settings.headdim
    return ctx.case(
        (3 * d // 4, d, d // 2 + 1),
        softmax_scale=OFF_DEFAULT_SCALE,
        overrides=(
            ("scale_q", 1.5),
            ("rowconst_q", True),
            ("int_q", True),
            ("onehot_k", 1.0),
            ("grid_v", True),
            ("grid_do", True),
        ),
        seed_offset=3004,
    )


def uniform_queries_case(ctx):
    """The mirror of :func:`uniform_keys_case`: queries one-hot (q_i = e_(i mod d)) in documents of at
    most d queries and every key the same integer vector: S_ij = k[i mod d] is constant along a row,
    the weights are exactly uniform and dK_j[i mod d] = s dS_ij reads one entry of dS^T."""
    d = ctx.settings.headdim
    return ctx.case(
        (3 * d // 4, d, d // 2 + 1),
        (3 * d // 4 + 5, d + 7, d // 2 + 9),
        softmax_scale=OFF_DEFAULT_SCALE,
        overrides=(
            ("scale_k", 1.5),
            ("const_k", True),
            ("int_k", True),
            ("onehot_q", 1.0),
            ("grid_v", True),
            ("grid_do", True),
        ),
        seed_offset=3005,
    )


def _share_above_u(ctx, case, tensor: str, u: float) -> float:
    """Share of the read entries (reference != 0) of ``tensor`` whose relative error exceeds u."""
    res, ref = ctx.run(case), ctx.reference(case)
    x = getattr(res, tensor)
    if x is None:
        return 0.0
    r = getattr(ref, tensor)
    nz = r != 0
    if not bool(nz.any()):
        return 0.0
    rel = ((x.detach().double().to(r.device) - r).abs() / r.abs().clamp_min(1e-300))[nz]
    return float((torch.nan_to_num(rel, nan=math.inf) > u).double().mean())


@register(
    "bound.out",
    "every element of O within the rigorous a-priori bound of the recipe's formats (unit roundoff, "
    "underflow, saturation, fp32 accumulation); no violation allowed; tightness reported",
    defaults=lambda recipe, dtype: {"violations": 0},
    cost=1.0,
)
def bound_out(ctx):
    metrics, first, details, msg = bound_report(ctx, _cases(ctx), ("out",))
    return ctx.judged(
        metrics,
        ok_message=msg,
        worst_case=first or {},
        details=details,
        extra_failures=[first["summary"]] if first else [],
    )


@register(
    "bound.grad",
    "every element of dQ, dK, dV within the rigorous a-priori bound propagated through the "
    "FlashAttention backward (recompute, dP, D, dS, the three gradient GEMMs); on one-hot key (query) "
    "cases with exactly uniform weights, dQ (dK) within the bound that leaves P no rounding: the dS "
    "(dS^T) operand's own format is resolved",
    defaults=lambda recipe, dtype: {"violations": 0, "exact_weight_violations": 0},
    needs_backward=True,
    cost=1.0,
)
def bound_grad(ctx):
    metrics, first, details, msg = bound_report(ctx, _cases(ctx), ("dq", "dk", "dv"))
    # exact-weight cases: dQ reads dS (one-hot keys), dK reads dS^T (one-hot queries)
    model = ctx.bound_model
    exact_viol, exact_tight, exact_first = 0, 0.0, None
    for case, tensor, u in (
        (uniform_keys_case(ctx), "dq", model[Operand.DS].u),
        (uniform_queries_case(ctx), "dk", model[Operand.DST].u),
    ):
        m, f, _, _ = bound_report(ctx, [case], (tensor,), exact_weights=True)
        exact_viol += m["violations"]
        exact_tight = max(exact_tight, m["tightness"])
        if exact_first is None and f is not None:
            exact_first = dict(f, bound="exact weights (u_P = 0)")
        metrics[f"share_above_u_{'ds' if tensor == 'dq' else 'dst'}"] = _share_above_u(ctx, case, tensor, u)
    metrics["exact_weight_violations"] = exact_viol
    metrics["exact_weight_tightness"] = exact_tight
    msg += f"; exact-weight dS/dS^T cases tightness {exact_tight:.3g}"
    first = first or exact_first
    return ctx.judged(
        metrics,
        ok_message=msg,
        worst_case=first or {},
        details=details,
        extra_failures=[first["summary"]] if first else [],
    )


def shape_cases(ctx) -> list[Case]:
    """The shapes the base packings do not reach: GQA groups of 3, 5, 6, 7 and 8 (odd head counts, an
    odd number of kv heads above one; 16 query heads, more than one tile of 8 heads), a non-default
    softmax_scale at a head_dim other than 64 and 128,
    head_dims 80, 96, 192 and 256 (not multiples of 64; 80 and 96 not of 32 either, so an MX block
    straddles the end of a row), and one causal document longer than every tile (``layout_long``)."""
    long_len = ctx.settings.layout_long
    return [
        ctx.case(
            (37, 64), heads=12, heads_k=2, headdim=80, causal=True, seed_offset=1101, softmax_scale=OFF_DEFAULT_SCALE
        ),
        ctx.case(
            (45, 20), (50, 20), heads=5, heads_k=1, headdim=96, causal=True, distribution="shifted", seed_offset=1102
        ),
        ctx.case((33, 9), heads=7, heads_k=1, headdim=192, causal=False, seed_offset=1103),
        ctx.case((30, 21), heads=9, heads_k=3, headdim=256, causal=True, distribution="heavy_tail", seed_offset=1104),
        ctx.case((long_len,), heads=3, heads_k=1, headdim=128, causal=True, seed_offset=1105),
        ctx.case((24, 9), heads=16, heads_k=2, headdim=64, causal=True, seed_offset=1106),
    ]


@register(
    "bound.shapes",
    "every element of O, dQ, dK, dV within the recipe's bound, and their error within the recipe's error "
    "model, on the shapes the base packings do not reach: GQA groups of 3, 5, 6, 7 and 8, odd kv heads, "
    "head_dims 80, 96, 192 and 256, a causal document longer than every tile",
    defaults=lambda recipe, dtype: {"violations": 0, "normalized_error": ERROR_MODEL_FACTOR},
    adjustable=("normalized_error",),
    cost=1.0,
)
def bound_shapes(ctx):
    from flamia_verify.properties.checks.error import normalized_error
    from flamia_verify.properties.metrics import error_stats

    tensors = ("out", "dq", "dk", "dv") if ctx.has_backward else ("out",)
    cases = shape_cases(ctx)
    metrics, first, details, msg = bound_report(ctx, cases, tensors, inputs_label="shape cases")
    # the rigorous bound takes every rounding at its worst and is loose; the error model (the error
    # family's test, on these shapes) resolves what it leaves, e.g. a scale dropped at one head_dim
    worst_norm, worst_at = 0.0, None
    for case in cases:
        res, ref = ctx.run(case), ctx.reference(case)
        for t in tensors:
            x = getattr(res, t)
            if x is None:
                continue
            norm = normalized_error(ctx, case, t, error_stats(x, getattr(ref, t))["rel_rmse"])
            if norm > worst_norm or worst_at is None:
                worst_norm, worst_at = norm, (case, t)
    metrics["normalized_error"] = worst_norm
    failures = [first["summary"]] if first else []
    if worst_at is not None and worst_norm > ctx.th.get("normalized_error", math.inf):
        case, t = worst_at
        summary = f"{t} on {case.describe()}: error {worst_norm:.3g} times the recipe's model"
        first = first or case_record(case, tensor=t, normalized_error=worst_norm, summary=summary)
    msg += f"; error {worst_norm:.3g} of the recipe's model at worst"
    return ctx.judged(
        metrics,
        ok_message=msg,
        worst_case=first or {},
        details=details,
        extra_failures=failures,
    )
