"""special: the inputs where low-precision kernels break in practice.

Every special check runs the kernel (forward and backward) on structured cases and requires

* no element outside the recipe's rigorous bound (bound family; it includes underflow, saturation
  and per-tensor scales, so it holds at any magnitude a correct kernel supports),
* finite outputs and gradients,
* the convention: a query row that sees no key outputs exactly 0 and gets exactly 0 gradient, and a
  key that no query sees gets exactly 0 dK and dV.

    special.zero_blocks       32+ zero tokens in a row (q, k, v), and a document that is all zeros
    special.magnitudes        V x 2^+-100 (bf16; scaled to the dtype's range), V near 2^-9 (E4M3's
                              smallest subnormal), V rows of 464 (just above E4M3's 448), q and k x 2^-9,
                              the upstream gradient dO x 2^-40, 2^-20, 2^+20 (softmax_scale 0.5 and 2
                              times the default on two of them), V x 2^-121 (MX blocks at E8M0's
                              smallest scale 2^-127; bf16 and fp32 inputs)
    special.outlier_channels  two channels of v x 100 and of k x 100/sqrt(d) (O's error / BF16's reported:
                              outlier keys make the scores peaked, which amplifies FP8 score errors
                              beyond the Gaussian model, 66x BF16 measured for correct MXFP8)
    special.attention_sink    the first key takes most of the probability, the rest far below it; the
                              same with the sink late in the document (key 3 Lk / 4: the rows that see
                              it find their maximum in a late key tile), and in a causal document past
                              2048 keys per row (4096 in the standard suite, 8192 on a GPU)
    special.constant_rows     all keys equal (uniform attention), all queries equal, all values and dO
                              rows equal (also with q, k on the MX-exact grid: a tight bound on dV)
    special.negative_scores   every score about -1000 with a spread of a few units
    special.short_documents   documents of length 0 and 1, Lq > Lk (rows that see nothing), Lq < Lk
"""

from __future__ import annotations

import math

import torch

from flamia_verify.properties.cases import Case, long_document
from flamia_verify.properties.checks.common.cases import GRID_QK
from flamia_verify.properties.checks.common.error_model import bound_report
from flamia_verify.properties.checks.common.verdict import case_record, verdict
from flamia_verify.properties.metrics import rel_rmse
from flamia_verify.properties.registry import register

__all__ = ["convention_violations"]


def convention_violations(ctx, case: Case, res) -> tuple[int, dict | None]:
    """Elements that break "no visible key -> exactly 0 output and gradient"."""
    bad, first = 0, None
    cq, ck = [0], [0]
    for a, b in zip(case.lens_q, case.lens_k):
        cq.append(cq[-1] + a)
        ck.append(ck[-1] + b)
    for b, (lq, lk) in enumerate(zip(case.lens_q, case.lens_k)):
        off = lk - lq
        if case.causal:
            dead_q = [i for i in range(lq) if i + off < 0]
            dead_k = [j for j in range(lk) if j - off > lq - 1]
        else:
            dead_q = list(range(lq)) if lk == 0 else []
            dead_k = list(range(lk)) if lq == 0 else []
        for name, dead, base in (
            ("out", dead_q, cq[b]),
            ("dq", dead_q, cq[b]),
            ("dk", dead_k, ck[b]),
            ("dv", dead_k, ck[b]),
        ):
            x = getattr(res, name)
            if x is None or not dead:
                continue
            rows = x[[base + i for i in dead]]
            nz = int((rows != 0).sum())
            if nz:
                bad += nz
                if first is None:
                    first = case_record(
                        case,
                        tensor=name,
                        document=b,
                        rows=[base + i for i in dead][:8],
                        problem=f"{name} of {len(dead)} row(s) that see nothing is not exactly 0 ({nz} elements)",
                    )
    return bad, first


def _special(ctx, cases, *, label: str, extra_metrics=None):
    cases = cases[: ctx.settings.special_cases]
    tensors = ("out", "dq", "dk", "dv") if ctx.has_backward else ("out",)
    metrics, first, details, msg = bound_report(ctx, cases, tensors, inputs_label=label)
    nonfinite, conv, conv_first = 0, 0, None
    for case in cases:
        res = ctx.run(case)
        for t in tensors:
            x = getattr(res, t)
            if x is not None:
                nonfinite += int((~torch.isfinite(x)).sum())
        n, f = convention_violations(ctx, case, res)
        conv += n
        conv_first = conv_first or f
    out = {
        "violations": metrics["violations"],
        "nonfinite": nonfinite,
        "convention_violations": conv,
        "tightness": metrics["tightness"],
        "cases": len(cases),
    }
    # elements that only an admitted format accepts (the BF16 recipe's FP16 probabilities), reported
    out.update({k: v for k, v in metrics.items() if k.startswith("admitted_")})
    out.update(extra_metrics or {})
    extra = []
    if first:
        extra.append(first["summary"])
    if conv_first:
        extra.append(conv_first["problem"])
    wc = first or conv_first or case_record(cases[0])
    return verdict(ctx, out, ok_message=msg, worst_case=wc, details=details, failures=extra)


_SPECIAL_TH = lambda recipe, dtype: {"violations": 0, "nonfinite": 0, "convention_violations": 0}  # noqa: E731


@register(
    "special.zero_blocks",
    "runs of 32+ zero tokens in q, k, v and an all-zero document: finite, within the bound "
    "(0/0 in a block scale is the classic bug)",
    defaults=_SPECIAL_TH,
    cost=0.7,
)
def zero_blocks(ctx):
    L = ctx.settings.special_len
    cases = [
        ctx.case((L,), overrides=(("zero_q", (16, 80)), ("zero_k", (16, 80)), ("zero_v", (16, 80))), seed_offset=51),
        ctx.case(
            (L, 40),
            overrides=(("zero_k", (0, 40)), ("zero_v", (0, L + 40)), ("zero_q", (L, L + 40))),
            causal=False,
            seed_offset=52,
        ),
        ctx.case(
            (64, 33),
            overrides=(("zero_q", (0, 97)), ("zero_k", (0, 97)), ("zero_v", (0, 97)), ("zero_do", (0, 97))),
            seed_offset=53,
        ),
    ]
    return _special(ctx, cases, label="zero-block cases")


#: V x 2^-121: block amaxes near 2^-119.5 < 448 * 2^-127, so RCEIL and FLOOR both clamp the scale to 2^-127
E8M0_MIN_CASE = -121


def _magnitude_exponents(dtype) -> tuple[int, int]:
    fi = torch.finfo(dtype)
    hi = min(100, int(math.floor(math.log2(fi.max))) - 8)
    lo = max(-100, int(math.ceil(math.log2(fi.tiny))) + 8)
    return hi, lo


@register(
    "special.magnitudes",
    "V scaled by 2^+-100, near E4M3's smallest subnormal (2^-9), rows of 464 (above E4M3's "
    "max 448); q, k x 2^-9; the upstream gradient dO x 2^-40, 2^-20, 2^+20; V x 2^-121 (E8M0's smallest "
    "scale, bf16/fp32 inputs): finite, within the bound",
    defaults=_SPECIAL_TH,
    cost=1.0,
)
def magnitudes(ctx):
    L = ctx.settings.special_len
    hi, lo = _magnitude_exponents(ctx.dtype)
    do_lo, do_mid, do_hi = max(-40, lo), max(-20, lo), min(20, hi)
    d = ctx.settings.headdim
    cases = [
        ctx.case((L,), overrides=(("scale_v", 2.0**hi), ("scale_q", 2.0**-9), ("scale_k", 2.0**-9)), seed_offset=61),
        ctx.case((L, 33), overrides=(("scale_v", 2.0**lo),), causal=False, seed_offset=62),
        ctx.case((L,), overrides=(("fill_v", (10, 50, 464.0)), ("scale_v", 2.0**-9)) + GRID_QK, seed_offset=66),
        ctx.case((L,), overrides=(("scale_v", 2.0**-9),), seed_offset=63),
        ctx.case((L,), overrides=(("fill_v", (10, 50, 464.0)),), seed_offset=64),
        # the upstream gradient: small in training (loss scaling, 1/tokens), large after a loss scale;
        # powers of two, so dO and the reference gradients scale exactly and the bound with them
        ctx.case((L,), overrides=(("scale_do", 2.0**do_lo),), seed_offset=67),
        ctx.case(
            (L, 33),
            overrides=(("scale_do", 2.0**do_mid),),
            causal=False,
            heads=2,
            heads_k=1,
            softmax_scale=0.5 * d**-0.5,
            seed_offset=68,
        ),
        ctx.case((L,), overrides=(("scale_do", 2.0**do_hi),), softmax_scale=2.0 * d**-0.5, seed_offset=69),
    ]
    if math.log2(torch.finfo(ctx.dtype).tiny) + 5 <= E8M0_MIN_CASE:
        # V blocks whose MX scale is E8M0's smallest, 2^-127 (byte 0): a decoder that builds the scale
        # from the byte as b << 23 reads 0 there (an fp32 subnormal). Dtypes whose normal range ends
        # above 2^-126 (fp16) cannot hold such a block.
        cases.append(ctx.case((L,), overrides=(("scale_v", 2.0**E8M0_MIN_CASE),) + GRID_QK, seed_offset=70))
    return _special(ctx, cases, label="magnitude cases")


@register(
    "special.outlier_channels",
    "two channels of v x 100 (and of k x 100/sqrt(d)): finite, within the bound; O's "
    "error relative to a BF16 run is reported",
    defaults=_SPECIAL_TH,
    cost=0.7,
)
def outlier_channels(ctx):
    L = ctx.settings.special_len
    cases = [
        ctx.case((L,), distribution="outliers", seed_offset=71),
        ctx.case((30, L), distribution="outliers", causal=False, heads=2, heads_k=1, seed_offset=72),
        ctx.case((L,), distribution="outliers", overrides=GRID_QK, seed_offset=73),
    ][: ctx.settings.special_cases]
    ratio = 0.0
    for case in cases:
        ref = ctx.reference(case)
        e_k = rel_rmse(ctx.run(case).out, ref.out)
        e_b = rel_rmse(ctx.baseline(case).out, ref.out)
        ratio = max(ratio, e_k / e_b if e_b > 0 else (0.0 if e_k == 0 else math.inf))
    return _special(ctx, cases, label="outlier-channel cases", extra_metrics={"ratio_to_bf16": ratio})


@register(
    "special.attention_sink",
    "a sink key that takes most of the probability while the rest sits far below it, at the first key, at "
    "key 3 Lk / 4 (the row maximum in a late key tile), and in a causal document past 2048 keys per row: "
    "within the bound (underflow of the small probabilities is bounded, not free)",
    defaults=_SPECIAL_TH,
    cost=0.7,
)
def attention_sink(ctx):
    L = ctx.settings.special_len
    lq, lk = long_document(ctx.settings.name, ctx.device)
    cases = [
        ctx.case((L,), distribution="sink", overrides=GRID_QK, seed_offset=84),
        ctx.case((L, 40), distribution="sink", heads=2, heads_k=1, seed_offset=82),
        ctx.case(
            (L, 40), distribution="sink", heads=2, heads_k=1, overrides=(("scale_k", 2.0),) + GRID_QK, seed_offset=85
        ),
        ctx.case((L,), distribution="sink", seed_offset=81),
        ctx.case((L,), distribution="sink", overrides=(("scale_k", 2.0),), seed_offset=83),
        # the sink late: rows that see it find their maximum in a late key tile (a jump a lazy or
        # missing rescale mishandles), not in the first
        ctx.case((L,), distribution="late_sink", seed_offset=86),
        ctx.case((L, 40), distribution="late_sink", heads=2, heads_k=1, causal=False, seed_offset=87),
        # rows past 2048 keys (4096, 8192 on a GPU) whose mass sits on one key: the other probabilities,
        # each far below 1 / Lk, are where underflow takes mass in long rows
        ctx.case((lq,), (lk,), distribution="sink", heads=2, heads_k=1, seed_offset=88),
    ]
    return _special(ctx, cases, label="attention-sink cases")


@register(
    "special.constant_rows",
    "all keys equal (uniform attention), all queries equal, all values equal: finite, within the bound",
    defaults=_SPECIAL_TH,
    cost=0.7,
)
def constant_rows(ctx):
    L = ctx.settings.special_len
    cases = [
        ctx.case((L,), overrides=(("const_k", True),), seed_offset=91),
        ctx.case((L,), overrides=(("const_q", True),), seed_offset=92),
        ctx.case((L, 33), overrides=(("const_v", True), ("const_do", True)), causal=False, seed_offset=93),
        # q and k on the MX-exact grid: exact scores, so the bound on dV = P^T dO is tight and a constant
        # dO block that a kernel flushes to 0 (dV = 0) falls outside it
        ctx.case((L, 33), overrides=(("const_v", True), ("const_do", True)) + GRID_QK, causal=False, seed_offset=94),
    ]
    return _special(ctx, cases, label="constant-row cases")


@register(
    "special.negative_scores",
    "rows whose every score is about -1000: finite, within the bound (a kernel that "
    "skips the row maximum underflows to 0/0)",
    defaults=_SPECIAL_TH,
    cost=0.7,
)
def negative_scores(ctx):
    L = ctx.settings.special_len
    cases = [
        ctx.case((L,), overrides=(("negscore_q", 120.0),), seed_offset=101),
        ctx.case((L, 20), overrides=(("negscore_q", 120.0),), causal=False, seed_offset=102),
    ]
    return _special(ctx, cases, label="deeply negative score cases")


@register(
    "special.short_documents",
    "documents of length 0 and 1, Lq > Lk (rows that see no key: exactly 0 output and gradient) and Lq < Lk",
    defaults=_SPECIAL_TH,
    cost=0.7,
)
def short_documents(ctx):
    cases = [
        ctx.case(
            (1, 0, 1, 5, 0, 1, 3),
            (1, 3, 0, 2, 0, 1, 9),
            heads=2,
            heads_k=1,
            causal=True,
            overrides=GRID_QK,
            seed_offset=114,
        ),
        ctx.case((1, 0, 1, 5, 0, 1, 3), (1, 3, 0, 2, 0, 1, 9), heads=2, heads_k=1, causal=False, seed_offset=112),
        ctx.case((1,) * 12 + (40,), heads=2, causal=True, seed_offset=113),
        ctx.case((1, 0, 1, 5, 0, 1, 3), (1, 3, 0, 2, 0, 1, 9), heads=2, heads_k=1, causal=True, seed_offset=111),
    ]
    return _special(ctx, cases, label="short-document cases")
