"""interface: the parts of the calling convention that a call with contiguous tensors never exercises.

    interface.arguments   the same inputs handed over the other ways the convention allows:
                          q, k, v as views into one fused QKV buffer (k, v into one KV buffer when
                          the lengths differ), as views of transposed (H, T, D) storage, at a nonzero
                          storage offset; softmax_scale=None for the default scale; max_seqlen_q and
                          max_seqlen_k above the true maxima; cu_seqlens_q and cu_seqlens_k as
                          strided views at an offset; the other input dtype (bf16 <-> fp16); fp16
                          near the top of its range (row sums of p * v past 65,504, the output not);
                          only q, or only k and v, requiring grad (each asked-for gradient arrives);
                          the output edited in place before the backward (autograd refuses, or the
                          gradients are the unedited call's); forwards under torch.no_grad() and
                          torch.inference_mode() (both dtypes), where kernels take inference paths.
                          Every result within the recipe's a-priori bound, and one that differs from
                          the plain call's (the first two packings) within the error checks' rule
                          (relative RMSE at most 2 times the rounding model's); another pack's call
                          between a forward and its backward moves no bit (an information flow)
    interface.arguments_bitwise
                          (reproducibility) the calls that hand over the plain call's numbers: max_seqlen
                          above the true maxima, strided cu_seqlens views, autocast, torch's default
                          dtype, create_graph give the plain call's bits (max_seqlen is an upper bound
                          for sizing a launch, never an input of the arithmetic; a pad-to-max design
                          rounds differently and is still correct)
    special.degenerate    (robustness) softmax_scale=0, a negative softmax_scale on sign-flipped queries
                          with widely spread scores, and packs with no query (two empty query documents,
                          one against keys) and with no token: within the bound, or refused with an
                          exception
    interface.lse         a kernel returning (out, lse, ...) with lse of FlashAttention's shape
                          (nheads, total_q): lse within the a-priori bound of the natural-log
                          log-sum-exp of the scaled scores, for every row that sees a key; -inf or
                          +inf (never finite) for a row that sees none

The cases use GQA groups of 3, 4 and 5 (odd head counts), an empty document in the middle, documents
whose key count differs from their query count (with the same total and maximum on both sides), a
decode pack (one query per document) over keys spanning several 64-key tiles, and head_dims 64 and 128
(where headdim^-0.5 is exact, so that softmax_scale=None means exactly the scale the other calls pass).
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch

from flamia_verify.properties.call_options import GRADS_OF, MAX_SEQLEN_PADS, OPTIONS, Judged, option
from flamia_verify.properties.cases import Case
from flamia_verify.properties.compare import compare_beyond_noise, compare_bitwise, compare_within
from flamia_verify.properties.harness import KernelCallError, lse_weights
from flamia_verify.properties.helpers import bound_report, bounds_for, case_record, normalized_error, run_noise, verdict
from flamia_verify.properties.metrics import rel_rmse
from flamia_verify.properties.registry import register
from flamia_verify.properties.tolerances import ERROR_MODEL_FACTOR
from flamia_verify.reference import attention_backward, attention_forward
from flamia_verify.settings import DTYPES

__all__ = ["argument_cases", "empty_packs", "LAYOUTS", "MAX_SEQLEN_PADS", "FP16_RANGE"]

#: the strided layouts of interface.arguments (the ``layout`` call option's other values)
LAYOUTS = option("layout").probe_values()
_PADS = option("max_seqlen_pad").with_words("{value}")


#: fp16 at the top of its range: near-uniform weights (q x 2^-9) over values of about 2^11 +- 2^8, so
#: that a row's unnormalised sum of p * v (up to 90 keys x 2^11 = 184,320) passes fp16's largest finite
#: value (65,504) while the output (about 2^11) and an fp32 accumulator are far from it
FP16_RANGE = (("scale_q", 2.0**-9), ("scale_v", 2.0**8), ("shift_v", 2.0**11))
#: the sign-flipped queries' magnitude in the negative-softmax_scale call: scores of standard deviation
#: 32, so that a row's scores spread over more than exp's range (about 88 in fp32) before the maximum
NEG_Q = 32.0


def argument_cases(ctx) -> list[Case]:
    """Three packings: equal lengths with 6:2 GQA (group 3) and an empty document, head_dim 64 (q, k, v
    fused into one QKV buffer); Lq != Lk in both directions with 5:1 GQA, head_dim 128, whose key split
    differs from the query split while the totals (128) and the maxima (77) agree, so that a kernel
    reading cu_seqlens_q or max_seqlen_q for the keys goes wrong (q, k, v fused into one buffer);
    decode, one query per document against up to 4200 keys (max_seqlen_q = 1; key counts of one 64-key
    tile, of two and three tiles with a partial last one, and past 4096), 4:1 GQA, head_dim 80 (k, v
    fused into one KV buffer; softmax_scale=None must mean 80^-0.5 there too: judged by the bound, not
    bitwise). The first two are also called with softmax_scale=0.0 (uniform weights)."""
    return [
        ctx.case((37, 0, 64, 90), heads=6, heads_k=2, headdim=64, causal=True, seed_offset=601),
        ctx.case(
            (50, 1, 77),
            (77, 27, 24),
            heads=5,
            heads_k=1,
            headdim=128,
            causal=True,
            distribution="shifted",
            seed_offset=602,
        ),
        # decode: one query per document (max_seqlen_q = 1) against many keys, an empty document
        ctx.case((1, 1, 0, 1, 1), (64, 97, 5, 4200, 130), heads=4, heads_k=1, headdim=80, causal=True, seed_offset=603),
    ]


def empty_packs(ctx) -> list[Case]:
    """Packs the convention allows that hold no query: two empty query documents against 3 and 0 keys
    (out is (0, H, D); dK and dV are exactly 0), and a pack of no token at all."""
    return [
        ctx.case((0, 0), (3, 0), heads=4, heads_k=2, causal=False, seed_offset=604),
        ctx.case((0,), heads=4, heads_k=2, causal=True, seed_offset=605),
    ]


def _wrong_shape(case: Case, out) -> str:
    """What is wrong with the shape of ``out`` on ``case`` ("" when it is (total_q, nheads, head_dim))."""
    want = (case.total_q, case.heads, case.headdim)
    if out is None or tuple(out.shape) == want:
        return ""
    return f"the output has shape {tuple(out.shape)}, not (total_q, nheads, head_dim) = {want}, on {case.describe()}"


def _bound_of(ctx, case: Case, tensors) -> tuple[dict, dict | None]:
    """bound_report's metrics and first violation on one case, without its progress (this check
    reports its own)."""
    shape = _wrong_shape(case, ctx.run(case).out)
    if shape:  # nothing to hold to a bound
        return {"violations": max(1, case.total_q * case.heads * case.headdim)}, case_record(case, summary=shape)
    saved, ctx.on_fraction = ctx.on_fraction, None
    try:
        metrics, worst, _, _ = bound_report(ctx, [case], tensors)
    finally:
        ctx.on_fraction = saved
    return metrics, worst


#: the options whose calls hand over the plain call's numbers, whose bits are compared with its bits. Their
#: bitwise equality is a reproducibility property (max_seqlen is an upper bound for sizing a launch,
#: autocast and the default dtype are the caller's mode, create_graph and the cu_seqlens layout are how
#: values are handed over: none of them is a value), judged by interface.arguments_bitwise; their
#: accuracy is gating: where the bits differ, interface.arguments holds the result to the error checks'
#: rule, as any other call. The FLOW options' bits must equal the plain call's because a difference is an
#: information flow: another pack's forward and backward between this call's must not move a bit of this
#: call's gradients (gating).
_BITWISE = {o.key: o for o in OPTIONS if o.judged is Judged.BITWISE}
_FLOW = {o.key: o for o in OPTIONS if o.judged is Judged.FLOW}
_REFUSALS = {o.key: o for o in OPTIONS if o.refused is not None}


#: the calls of interface.arguments that only a kernel with a backward gets, as its message names them
_BACKWARD_CALLS = (
    "only q or only k, v requiring grad, the output edited in place, a second backward, a broadcast dO, "
    "another call between forward and backward, create_graph, "
)


def _call_words(call) -> str:
    return ", ".join(f"{k}={v}" for k, v in call) or "the plain call"


def _other_dtype(name: str) -> str:
    return "fp16" if name != "fp16" else "bf16"


def _argument_jobs(ctx, bases: list[Case]) -> list[tuple[Case, tuple[tuple[str, object], ...]]]:
    """(case, call) of every call interface.arguments makes with the run's dtype: each option's probe
    values on its share of the packings, in the order of call_options.OPTIONS; the options that change
    the backward only on a kernel with one. ``upstream=broadcast`` needs a dO with equal rows."""
    jobs: list[tuple[Case, tuple[tuple[str, object], ...]]] = []
    for opt in OPTIONS:
        if opt.needs_backward and not ctx.has_backward:
            continue
        for base in bases[: opt.bases]:
            if opt.key == "upstream":  # one row of dO broadcast: the case's rows must be equal
                base = base.with_(overrides=base.overrides + (("const_do", True),))
            jobs += [(base, ((opt.key, value),)) for value in opt.probe_values()]
    return jobs


def negative_scale_case(bases: list[Case]) -> Case:
    """A negative softmax_scale with sign-flipped queries: the same attention as scale > 0, with scores
    spread over about 150 (a kernel must take its row maximum after the scale). No model uses a
    negative scale: special.degenerate asks it (robustness); measured on an H100, cuDNN's and
    FlashAttention's SDPA return NaN there."""
    return bases[1].with_(softmax_scale=-bases[1].scale, overrides=bases[1].overrides + (("scale_q", -NEG_Q),))


def _argument_findings(ctx) -> dict:
    """Every call of interface.arguments, made once for both of its verdicts: what gates (bound and
    error-model violations, failed calls, interleaved calls that move bits) and what is reproducibility
    (the bits of the calls in ``_BITWISE``)."""
    return ctx.memo(("argument-findings",), lambda: _run_argument_calls(ctx))


def _run_argument_calls(ctx) -> dict:
    tensors = ("out", "dq", "dk", "dv") if ctx.has_backward else ("out",)
    violations, layout_mismatches, failed, calls = 0, 0, 0, 0
    error_violations = 0
    bit_mismatches = {o.metric: 0 for o in _BITWISE.values()}
    flow_mismatches = {o.metric: 0 for o in _FLOW.values()}
    refused = {o.refused_metric: 0 for o in _REFUSALS.values()}
    first, first_bits, declined = None, None, ""
    bases = argument_cases(ctx)
    jobs = _argument_jobs(ctx, bases)
    for n, (base, call) in enumerate(jobs):
        case = base.with_(call=call)
        calls += 1
        key, value = call[0] if call else ("", None)
        try:
            res = ctx.run(case)
        except KernelCallError as err:
            opt = _REFUSALS.get(key)
            if opt is not None and opt.refused is not None and opt.refused(err):  # a loud limit, not a wrong result
                refused[opt.refused_metric] += 1
                continue
            failed += 1
            if first is None:
                first = case_record(
                    case,
                    call=dict(call),
                    summary=f"the kernel raised on {case.describe()}: {err.summary}",
                    traceback=err.traceback,
                )
            continue
        shape = _wrong_shape(case, res.out)
        if shape:
            failed += 1
            if first is None:
                first = case_record(case, call=dict(call), summary=shape)
            continue
        ref_run = ctx.run(base)
        judged: tuple[str, ...] = tensors
        if key == "out_edit":  # the output itself was edited: its gradients are what must not change
            judged = tuple(t for t in tensors if t != "out")
            res = replace(res, out=ref_run.out)
        if res.detached_grads:  # create_graph=True: a gradient outside the graph is a silent constant
            failed += 1
            if first is None:
                first = case_record(
                    case,
                    call=dict(call),
                    summary=f"with create_graph=True, {', '.join(res.detached_grads)} came back detached from the "
                    "graph: a loss on them (a gradient penalty) silently adds a constant; a backward that is not "
                    "differentiable must say so (torch.autograd.function.once_differentiable)",
                )
        if key == "grad":  # every gradient asked for arrives
            missing = [t for t in GRADS_OF[str(value)] if getattr(res, t) is None]
            if missing:
                failed += 1
                if first is None:
                    first = case_record(
                        case,
                        call=dict(call),
                        summary=f"with only {'q' if value == 'q' else 'k and v'} requiring grad, "
                        f"{', '.join(missing)} did not arrive",
                    )
        changed = []
        # another call's values reaching this one is a flow: judged beyond the kernel's own run-to-run
        # noise (None for a repeatable kernel: bitwise), as the causal and isolation checks judge it
        noise = run_noise(ctx, ("case", base), ref_run, lambda: ctx.run(base, cache=False)) if key in _FLOW else {}  # noqa: B023 (run_noise calls it at once)
        for t, x in res.tensors().items():
            if key in _FLOW:
                m = compare_beyond_noise(
                    x, ref_run.tensors()[t], noise.get(t), what=f"{t} {_call_words(call)}", against="the plain call"
                )
            else:
                m = compare_bitwise(x, ref_run.tensors()[t], what=f"{t} {_call_words(call)}", against="the plain call")
            if m.ok:
                continue
            changed.append(t)
            if key in _BITWISE or key in _FLOW:  # the same numbers handed over
                judged_by = (_BITWISE | _FLOW)[key]
                record = case_record(
                    case,
                    tensor=t,
                    call=dict(call),
                    mismatch=m.to_dict(),
                    summary=f"{m.summary()} ({judged_by.mismatch_words(value)})",
                )
                if key in _FLOW:
                    flow_mismatches[judged_by.metric] += m.mismatched
                    first = first or record
                else:
                    bit_mismatches[judged_by.metric] += m.mismatched
                    first_bits = first_bits or record
        if key not in _BITWISE and key not in _FLOW:
            layout_mismatches += len(changed)
        # another result than the plain call's must be as accurate as the error checks require (the
        # a-priori bound of a gradient can exceed the gradient itself: a zero dQ can be within it)
        if changed and (base in bases[:2] or key == "upstream"):
            for t in changed:
                norm = normalized_error(ctx, base, t, rel_rmse(getattr(res, t), getattr(ctx.reference(base), t)))
                if norm > ERROR_MODEL_FACTOR:
                    error_violations += 1
                    if first is None:
                        first = case_record(
                            case,
                            tensor=t,
                            call=dict(call),
                            normalized_error=norm,
                            summary=f"{t} with {_call_words(call)} has {norm:.3g} times the recipe's expected "
                            f"error (at most {ERROR_MODEL_FACTOR:g}), unlike the plain call",
                        )
        metrics, worst = _bound_of(ctx, case, judged)
        violations += metrics["violations"]
        if worst is not None and first is None:
            first = dict(worst, call=dict(call))
        ctx.progress((n + 1) / (len(jobs) + 1))
    # the other input dtype: judged by the recipe's bound for that dtype; declining it is allowed
    other = _other_dtype(ctx.dtype_str)
    other_ctx = replace(ctx, dtype=DTYPES[other])
    other_jobs = [base.with_(dtype=other) for base in bases]
    other_jobs += [case.with_(call=(("grad_mode", "no_grad"),)) for case in other_jobs]  # its inference paths
    for case in other_jobs:
        calls += 1
        try:
            res = other_ctx.run(case)
        except KernelCallError as err:
            if case.call:  # took the training call and not the forward-only one
                failed += 1
                if first is None:
                    first = case_record(
                        case,
                        summary=f"the kernel raised on {case.describe()}: {err.summary}",
                        traceback=err.traceback,
                    )
                continue
            declined = f"the kernel declines {other} inputs ({err.summary})"
            break
        bad_dtype = res.out.dtype not in (DTYPES[other], torch.float32, torch.float64)
        if bad_dtype and first is None:
            first = case_record(case, summary=f"{other} inputs gave out of dtype {res.out.dtype}")
        metrics, worst = _bound_of(other_ctx, case, tensors)
        violations += metrics["violations"] + int(bad_dtype)
        if worst is not None and first is None:
            first = dict(worst, dtype=other)
    # fp16 near the top of its range (in whichever of the two dtypes is fp16, unless it was declined):
    # the sums an fp16 accumulator would hold overflow, the result does not
    fp16_ctx = ctx if ctx.dtype_str == "fp16" else other_ctx if not declined else None
    if fp16_ctx is not None:
        case = bases[0].with_(dtype="fp16", overrides=FP16_RANGE)
        calls += 1
        try:
            fp16_ctx.run(case)
        except KernelCallError as err:
            failed += 1
            if first is None:
                first = case_record(
                    case,
                    summary=f"the kernel raised on {case.describe()}: {err.summary}",
                    traceback=err.traceback,
                )
        else:
            metrics, worst = _bound_of(fp16_ctx, case, tensors)
            violations += metrics["violations"]
            if worst is not None and first is None:
                first = dict(worst, dtype="fp16", values="fp16 range (v about 2^11, near-uniform weights)")
    ctx.progress(1.0)
    return {
        "violations": violations,
        "error_violations": error_violations,
        "failed_calls": failed,
        "flow_mismatches": flow_mismatches,
        "bit_mismatches": bit_mismatches,
        **refused,
        "strided_bitwise_changes": layout_mismatches,
        "calls": calls,
        "first": first,
        "first_bits": first_bits,
        "declined": declined,
        "other": other,
        "fp16": fp16_ctx is not None,
    }


@register(
    "interface.arguments",
    "the same inputs as fused-QKV views, transposed storage and offset views, with softmax_scale=None, "
    "with max_seqlen above the true maximum, with strided cu_seqlens views, inside torch.autocast, with torch's "
    "default dtype set to the inputs', with only q or only k, v requiring grad, with the output edited in place "
    "before the backward, with the backward run twice on one graph, with dO broadcast over the tokens (stride "
    "0), with another call between the forward and the backward, with create_graph=True (or refused with an "
    "exception), under no_grad and inference_mode, in the other input dtype and in fp16 near the top of its "
    "range: within the recipe's bound (and its error model where the bits differ from the plain call's), and "
    "unchanged by an interleaved call (bitwise, or beyond the kernel's run-to-run noise)",
    defaults=lambda recipe, dtype: {
        "violations": 0,
        **{o.metric: 0 for o in _FLOW.values()},
        "error_violations": 0,
        "failed_calls": 0,
    },
    cost=1.5,
)
def arguments(ctx):
    f = _argument_findings(ctx)
    metrics = {
        "violations": f["violations"],
        **f["flow_mismatches"],
        "error_violations": f["error_violations"],
        "failed_calls": f["failed_calls"],
        "refused_output_edits": f["refused_output_edits"],
        "refused_second_backwards": f["refused_second_backwards"],
        "refused_create_graph": f["refused_create_graph"],
        "strided_bitwise_changes": f["strided_bitwise_changes"],
        "calls": f["calls"],
    }
    other = f["other"]
    ok = (
        f"{f['calls']} calls (fused/transposed/offset views, softmax_scale=None, max_seqlen + "
        f"{' and '.join(_PADS.mismatch_words(p) for p in MAX_SEQLEN_PADS)}, strided cu_seqlens, autocast, the default dtype, "
        f"{_BACKWARD_CALLS if ctx.has_backward else ''}"
        f"no_grad and inference_mode forwards, {other}"
        f"{', fp16 near its range' if f['fp16'] else ''}) within the bound, and within the error model where "
        "their bits differ" + ("; an interleaved call changes no bit" if ctx.has_backward else "")
    )
    if f["declined"]:
        ok += f"; {f['declined']}"
    changed_bits = sum(f["bit_mismatches"].values())
    if changed_bits:
        ok += f"; {changed_bits} elements differ bitwise from the plain call (interface.arguments_bitwise)"
    if f["strided_bitwise_changes"]:
        ok += f"; strided views change the bits of {f['strided_bitwise_changes']} tensors (within the bound)"
    if f["refused_second_backwards"]:
        ok += f"; the kernel refuses a second backward through one graph ({f['refused_second_backwards']} calls)"
    if f["refused_create_graph"]:
        ok += f"; the kernel refuses a backward with create_graph=True ({f['refused_create_graph']} calls)"
    if f["refused_output_edits"]:
        ok += (
            f"; autograd refuses the backward after an in-place edit of the output ({f['refused_output_edits']} calls)"
        )
    first = f["first"]
    bad = f["violations"] or any(f["flow_mismatches"].values()) or f["error_violations"] or f["failed_calls"]
    failures = [first["summary"]] if first and bad else []
    return verdict(ctx, metrics, ok_message=ok, worst_case=first or {}, failures=failures)


@register(
    "interface.arguments_bitwise",
    "the calls of interface.arguments that hand over the plain call's numbers (max_seqlen above the true "
    "maximum, strided cu_seqlens views, the forward inside torch.autocast, torch's default dtype set to the "
    "inputs', create_graph=True) give the plain call's bits",
    defaults=lambda recipe, dtype: {o.metric: 0 for o in _BITWISE.values()},
    cost=0.1,
    verdict="reproducibility",
)
def arguments_bitwise(ctx):
    f = _argument_findings(ctx)
    calls = "max_seqlen, the cu_seqlens layout, autocast, the default dtype" + (
        " and create_graph" if ctx.has_backward else ""
    )
    return verdict(
        ctx,
        dict(f["bit_mismatches"]),
        ok_message=f"{calls} change no bit of the plain call's results",
        first=f["first_bits"],
    )


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
        metrics, worst = _bound_of(ctx, case, tensors)
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
