"""interface.arguments: the parts of the calling convention that a call with contiguous tensors never
exercises.

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

The cases (:func:`~flamia_verify.properties.checks.common.cases.argument_cases`, which interface.lse and
special.degenerate run too) use GQA groups of 3, 4 and 5 (odd head counts), an empty document in the
middle, documents whose key count differs from their query count (with the same total and maximum on
both sides), a decode pack (one query per document) over keys spanning several 64-key tiles, and
head_dims 64 and 128 (where headdim^-0.5 is exact, so that softmax_scale=None means exactly the scale
the other calls pass).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from flamia_verify.properties.call_options import GRADS_OF, MAX_SEQLEN_PADS, OPTIONS, Judged, option
from flamia_verify.properties.cases import Case
from flamia_verify.properties.checks.common.cases import argument_cases
from flamia_verify.properties.checks.common.error_model import bound_of_call, normalized_error, wrong_shape
from flamia_verify.properties.checks.common.noise import run_noise
from flamia_verify.properties.checks.common.verdict import case_record, verdict
from flamia_verify.properties.compare import compare_beyond_noise, compare_bitwise
from flamia_verify.properties.harness import KernelCallError
from flamia_verify.properties.metrics import rel_rmse
from flamia_verify.properties.registry import register
from flamia_verify.properties.tolerances import ERROR_MODEL_FACTOR
from flamia_verify.settings import DTYPES

__all__ = ["LAYOUTS", "MAX_SEQLEN_PADS", "FP16_RANGE"]

#: the strided layouts of interface.arguments (the ``layout`` call option's other values)
LAYOUTS = option("layout").probe_values()
_PADS = option("max_seqlen_pad")


#: fp16 at the top of its range: near-uniform weights (q x 2^-9) over values of about 2^11 +- 2^8, so
#: that a row's unnormalised sum of p * v (up to 90 keys x 2^11 = 184,320) passes fp16's largest finite
#: value (65,504) while the output (about 2^11) and an fp32 accumulator are far from it
FP16_RANGE = (("scale_q", 2.0**-9), ("scale_v", 2.0**8), ("shift_v", 2.0**11))
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
        shape = wrong_shape(case, res.out)
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
        metrics, worst = bound_of_call(ctx, case, judged)
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
        metrics, worst = bound_of_call(other_ctx, case, tensors)
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
            metrics, worst = bound_of_call(fp16_ctx, case, tensors)
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
        f"{' and '.join(_PADS.value_words(p) for p in MAX_SEQLEN_PADS)}, strided cu_seqlens, autocast, the default dtype, "
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
