"""interface: the calling convention (shapes, dtypes, tuple outputs, untouched inputs, a backward)."""

from __future__ import annotations

import torch

from flamia_verify.properties.checks.common import case_record
from flamia_verify.properties.compare import compare_bitwise
from flamia_verify.properties.harness import KernelCallError
from flamia_verify.properties.registry import register

__all__ = []

#: torch's autograd engine, when a backward returns a gradient it cannot take for its input (a shape no
#: sum reduces to the input's, another device or layout)
_AUTOGRAD_REJECTS = "returned an invalid gradient at index"


def _allowed_out_dtypes(dtype):
    """The input dtype, or a wider float that holds it exactly (the float64 reference returns float64)."""
    return {dtype, torch.float32, torch.float64} if dtype in (torch.bfloat16, torch.float16) else {dtype, torch.float64}


def _cases(ctx):
    return [
        ctx.case((16,), heads=2, heads_k=2, causal=True),
        ctx.case((5, 0, 17), (9, 0, 12), heads=4, heads_k=2, causal=True, seed_offset=1),
        ctx.case((7, 1, 20), heads=2, heads_k=1, causal=False, seed_offset=2),
    ]


@register(
    "interface.output",
    "out has shape (total_q, nheads, headdim), q's dtype (or a wider float) and device, for dense, varlen, "
    "GQA and Lq != Lk calls; a tuple output is read by its first item",
    defaults=lambda recipe, dtype: {"bad_outputs": 0},
    cost=0.5,
)
def output(ctx):
    problems, tuple_output = [], False
    cases = _cases(ctx)
    for n, case in enumerate(cases):
        res = ctx.run(case, backward=False)
        inp = ctx.inputs(case)
        tuple_output |= res.tuple_output
        want = (case.total_q, case.heads, case.headdim)
        if tuple(res.out.shape) != want:
            problems.append(case_record(case, problem=f"out has shape {tuple(res.out.shape)}, expected {want}"))
        elif res.out.dtype not in _allowed_out_dtypes(inp.q.dtype):
            problems.append(case_record(case, problem=f"out has dtype {res.out.dtype}, expected {inp.q.dtype} (or wider)"))
        elif res.out.device != inp.q.device:
            problems.append(case_record(case, problem=f"out is on {res.out.device}, inputs on {inp.q.device}"))
        ctx.progress((n + 1) / len(cases))
    metrics = {"bad_outputs": len(problems), "cases": len(cases), "tuple_output": tuple_output}
    return ctx.judged(
        metrics,
        ok_message=f"shape, dtype and device right on {len(cases)} calls" + (" (tuple output)" if tuple_output else ""),
        worst_case=problems[0] if problems else {},
        extra_failures=[p["problem"] for p in problems[:1]],
    )


@register(
    "interface.inputs_unmodified",
    "q, k, v, cu_seqlens_q, cu_seqlens_k and the upstream gradient are bitwise unchanged after the "
    "forward and the backward (an in-place write is a finding)",
    defaults=lambda recipe, dtype: {"modified_inputs": 0},
    cost=0.5,
)
def inputs_unmodified(ctx):
    found = []
    cases = _cases(ctx)[:2]
    for n, case in enumerate(cases):
        inp = ctx.inputs(case)
        res = ctx.run(inp)  # explicit inputs: never cached; the harness passes fresh copies
        originals = {"q": inp.q, "k": inp.k, "v": inp.v, "cu_seqlens_q": inp.cu_q, "cu_seqlens_k": inp.cu_k, "do": inp.do}
        for name, passed in (res.passed or {}).items():
            m = compare_bitwise(passed, originals[name], what=name)
            if not m.ok:
                found.append(case_record(case, tensor=name, mismatch=m.to_dict(), summary=m.summary()))
        ctx.progress((n + 1) / len(cases))
    names = sorted({f["tensor"] for f in found})
    metrics = {"modified_inputs": len(names)}
    return ctx.judged(
        metrics,
        ok_message="inputs bitwise unchanged after forward and backward",
        worst_case=found[0] if found else {},
        extra_failures=[f"the kernel wrote into {', '.join(names)}: {found[0]['summary']}"] if found else [],
    )


@register(
    "interface.backward",
    "gradients reach q, k and v with their shapes and dtypes (GQA: dk, dv summed per kv head); a "
    "forward-only kernel is detected and its gradient checks skipped",
    defaults=lambda recipe, dtype: {"bad_gradients": 0},
    cost=0.5,
)
def backward(ctx):
    if not ctx.has_backward:
        return ctx.skip(f"forward-only kernel: {ctx.backward.reason}; gradient checks are skipped")
    problems = []
    cases = _cases(ctx)
    for n, case in enumerate(cases):
        try:
            res = ctx.run(case)
        except KernelCallError as err:
            # autograd checks what a backward returns before it reaches q, k, v: a gradient it cannot
            # take (GQA: dK, dV left per query head) is raised here
            if err.stage == "backward" and _AUTOGRAD_REJECTS in str(err.exc):
                what = "shape" if "expected shape compatible" in str(err.exc) else "shape, device or layout"
                problems.append(case_record(case, problem=f"the backward returned a gradient of the wrong {what} "
                                                          f"({err.summary})"))
                ctx.progress((n + 1) / len(cases))
                continue
            raise
        inp = ctx.inputs(case)
        for name, want in (("dq", inp.q), ("dk", inp.k), ("dv", inp.v)):
            g = getattr(res, name)
            if g is None:
                problems.append(case_record(case, problem=f"no gradient for {name[1:]}"))
            elif g.shape != want.shape or g.dtype != want.dtype:
                problems.append(case_record(
                    case, problem=f"{name} has {tuple(g.shape)} {g.dtype}, expected {tuple(want.shape)} {want.dtype}"
                ))
        ctx.progress((n + 1) / len(cases))
    metrics = {"bad_gradients": len(problems), "cases": len(cases)}
    return ctx.judged(
        metrics,
        ok_message=f"dq, dk, dv have the right shapes and dtypes on {len(cases)} calls",
        worst_case=problems[0] if problems else {},
        extra_failures=[problems[0]["problem"]] if problems else [],
    )
