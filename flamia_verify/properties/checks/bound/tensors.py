"""bound: every element of O, dQ, dK, dV stays inside the rigorous a-priori bound of the recipe.

The bound (flamia_verify.recipes.bounds, derived in docs/checks.md) takes every rounding of the
recipe's formats at its worst: unit roundoff, underflow of subnormal elements, saturation (FLOOR),
per-tensor scales, fp32 accumulation and the rounding of the outputs. A correct kernel can never
exceed it; no violation is allowed. ``tightness`` = max |error| / bound says how much of the bound a
kernel uses (the forward of a BF16 kernel uses about half; FP8 kernels a few percent: the bound
assumes every score error at its worst at once). The cases include inputs whose q and k lie on the
MX-exact E4M3 grid: with exact scores the bound is tight on the rounding of V, P and dO.

A recipe that admits a second format for some operands (the BF16 recipe: P and P^T in FP16, whose
underflow floor BF16 does not have) is judged under the model that covers both; the elements that
only the admission accepts are counted against the nominal model and named in the report
(``admitted_elements``, :func:`~flamia_verify.properties.checks.common.error_model.admission_summary`; docs/checks.md,
"FP16 probabilities in a BF16 recipe").
"""

from __future__ import annotations

import math

import torch

from flamia_verify.properties.cases import Case, dimension_cases, long_document
from flamia_verify.properties.checks.common.cases import bias_cases
from flamia_verify.properties.checks.common.error_model import bound_report, normalized_error
from flamia_verify.properties.checks.common.verdict import case_record, verdict
from flamia_verify.properties.harness import KernelCallError
from flamia_verify.properties.metrics import error_stats
from flamia_verify.properties.registry import register
from flamia_verify.properties.tolerances import ERROR_MODEL_FACTOR
from flamia_verify.recipes.operands import Operand
from flamia_verify.settings import OFF_DEFAULT_SCALE

__all__ = ["one_hot_keys_case", "uniform_keys_case", "uniform_queries_case", "shape_cases"]

LN2 = math.log(2.0)


def _cases(ctx):
    """The base cases, the dimension cases of the error family (head_dims that are not multiples of 16,
    late row maxima, heads 100x apart, rows past 2048 keys: :func:`~flamia_verify.properties.cases.dimension_cases`)
    with the long document once more with Gaussian values (rows of uniform weights below 2^-11 each:
    where an unscaled P^T underflows, which the bound admits for recipes that allow it and the error
    model does not describe), and the bias cases whose q and k lie on the MX-exact grid: there the
    scores are exact, the bound loses the slack of worst-case score errors and bites on V, P and dO;
    with q x 16 the rows are nearly one-hot (O_i ~ V_j) and the bound nearly V's own rounding."""
    one_hot = ctx.case(
        (96,),
        distribution="shifted",
        overrides=(("scale_q", 16.0), ("grid_q", True), ("grid_k", True)),
        seed_offset=3001,
    )
    wide = dimension_cases(ctx.settings.name, seed=ctx.seed, dtype=ctx.dtype_str, device=ctx.device)
    lq, lk = long_document(ctx.settings.name, ctx.device)
    uniform_long = ctx.case((lq,), (lk,), heads=2, heads_k=1, headdim=64, causal=True, seed_offset=5010)
    return ctx.base_cases() + wide + [uniform_long] + bias_cases(ctx) + [one_hot, one_hot_keys_case(ctx)]


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
    return verdict(
        ctx,
        metrics,
        ok_message=msg,
        first=first,
        details=details,
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
    return verdict(
        ctx,
        metrics,
        ok_message=msg,
        first=first,
        details=details,
    )


#: a head_dim past 256, where kernels fall back or refuse (DeepSeek's MLA decode has 512 and 576)
WIDE_HEADDIM = 512


#: a causal document's length in bound.shapes past 1024 keys per row (the limit of warp-per-row softmax
#: kernels; longer rows take a block-softmax path with its own masking)
LONG_ROWS = 1040


def shape_cases(ctx) -> list[Case]:
    """The shapes the base packings do not reach: GQA groups of 3, 5, 6, 7 and 8 (odd head counts, an
    odd number of kv heads above one; 16 query heads, more than one tile of 8 heads), a non-default
    softmax_scale at a head_dim other than 64 and 128,
    head_dims 80, 96, 192 and 256 (not multiples of 64; 80 and 96 not of 32 either, so an MX block
    straddles the end of a row) and 512 with peaked rows (a kernel may refuse it: a fallback path must
    still be right), one causal document longer than every tile (``layout_long``) and one of
    ``LONG_ROWS`` queries and keys, past the 1024-key rows where per-row softmax fast paths end."""
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
        # rows past 1024 keys, where per-row softmax fast paths end and long rows take another path
        ctx.case((LONG_ROWS, 7), heads=1, headdim=64, causal=True, seed_offset=1108),
        ctx.case((24, 9), heads=24, heads_k=3, headdim=64, causal=True, seed_offset=1106),
        # past the fused kernels' 256 (a kernel may refuse it, never compute it otherwise)
        ctx.case((24, 17), heads=4, heads_k=2, headdim=WIDE_HEADDIM, distribution="peaked", seed_offset=1107),
    ]


@register(
    "bound.shapes",
    "every element of O, dQ, dK, dV within the recipe's bound, and their error within the recipe's error "
    "model, on the shapes the base packings do not reach: GQA groups of 3, 5, 6, 7 and 8, odd kv heads, "
    "head_dims 80, 96, 192, 256 and 512 (which a kernel may refuse), a causal document longer than every tile "
    "and one past 1024 keys per row",
    defaults=lambda recipe, dtype: {"violations": 0, "normalized_error": ERROR_MODEL_FACTOR},
    adjustable=("normalized_error",),
    cost=1.0,
)
def bound_shapes(ctx):
    tensors = ("out", "dq", "dk", "dv") if ctx.has_backward else ("out",)
    cases, refused = [], ""
    for case in shape_cases(ctx):
        if case.headdim > 256:  # a head_dim above the common limit may be refused with an error
            try:
                ctx.run(case)
            except KernelCallError as err:
                refused = f"the kernel refuses head_dim {case.headdim} ({err.summary})"
                continue
        cases.append(case)
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
    if refused:
        msg += f"; {refused}"
    return verdict(
        ctx,
        metrics,
        ok_message=msg,
        worst_case=first or {},
        details=details,
        failures=failures,
    )
