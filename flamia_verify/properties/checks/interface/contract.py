"""interface: the calling convention (shapes, dtypes, tuple outputs, untouched inputs, a backward)."""

from __future__ import annotations

import torch

from flamia_verify.properties.call_options import Stage
from flamia_verify.properties.checks.common.verdict import case_record, verdict
from flamia_verify.properties.harness import KernelCallError
from flamia_verify.properties.registry import register

__all__ = ["INPUTS_UNMODIFIED", "PROCESS_STATE", "judge_modifications", "judge_process_state"]

INPUTS_UNMODIFIED = "interface.inputs_unmodified"
PROCESS_STATE = "interface.process_state"

#: modifications listed one by one in worst_case (the count is in the metrics)
_LISTED = 20

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
            problems.append(
                case_record(case, problem=f"out has dtype {res.out.dtype}, expected {inp.q.dtype} (or wider)")
            )
        elif res.out.device != inp.q.device:
            problems.append(case_record(case, problem=f"out is on {res.out.device}, inputs on {inp.q.device}"))
        ctx.progress((n + 1) / len(cases))
    metrics = {"bad_outputs": len(problems), "cases": len(cases), "tuple_output": tuple_output}
    return verdict(
        ctx,
        metrics,
        ok_message=f"shape, dtype and device right on {len(cases)} calls" + (" (tuple output)" if tuple_output else ""),
        worst_case=problems[0] if problems else {},
        failures=[p["problem"] for p in problems[:1]],
    )


@register(
    INPUTS_UNMODIFIED,
    "q, k, v, cu_seqlens_q, cu_seqlens_k and the upstream gradient are bitwise unchanged after the "
    "forward and the backward of every kernel call of the run (an in-place write is a finding)",
    defaults=lambda recipe, dtype: {"modified_inputs": 0},
    cost=0.5,
)
def inputs_unmodified(ctx):
    # its own calls: causal and non-causal, dense, varlen with an empty document, GQA, Lq != Lk; every
    # other call of the run (probe, base cases, perturbations) is audited too, and the engine judges
    # this check again over all of them when the run ends
    cases = _cases(ctx)
    for n, case in enumerate(cases):
        ctx.run(ctx.inputs(case))  # explicit inputs: never cached; the harness passes fresh copies
        ctx.progress((n + 1) / len(cases))
    return judge_modifications(ctx)


@register(
    PROCESS_STATE,
    "torch's default dtype, grad mode, deterministic mode, matmul precision and cuDNN flags, thread count, "
    "current CUDA device and the global random generators' seeds are as every kernel call of the run found "
    "them (drawing random numbers is allowed, reseeding is not)",
    defaults=lambda recipe, dtype: {"changed_settings": 0},
    cost=0.2,
)
def process_state(ctx):
    # every call of the run is probed (flamia_verify.properties.process_state); these few make sure
    # there are some when the check runs alone, and the engine judges again over all when the run ends
    cases = _cases(ctx)
    for n, case in enumerate(cases):
        ctx.run(case)
        ctx.progress((n + 1) / len(cases))
    return judge_process_state(ctx)


def judge_process_state(ctx):
    """The verdict over every process setting the harness saw a call change so far."""
    changes = ctx.harness.state_changes
    names = sorted({r.change.what for r in changes})
    metrics = {
        "changed_settings": len(names),
        "changing_calls": len({r.call for r in changes}),
        "calls": ctx.harness.calls,
    }
    if not changes:
        return verdict(
            ctx,
            metrics,
            ok_message=f"the process state as each of the {ctx.harness.calls} kernel calls found it "
            "(default dtype, grad mode, precision flags, threads, device, random generators' seeds)",
        )
    case, stage, first = changes[0].case, changes[0].stage, changes[0].change
    summary = f"{first.what}: {first.before} before the call, {first.after} after it ({stage})"
    worst = case_record(case, stage=str(stage), summary=summary)
    worst["changes"] = [
        {"setting": r.change.what, "before": r.change.before, "after": r.change.after, "stage": str(r.stage)}
        for r in changes[:_LISTED]
    ]
    return verdict(
        ctx,
        metrics,
        ok_message="",
        worst_case=worst,
        failures=[
            f"a kernel call changed the process state ({', '.join(names)}); first on {case.describe()}: {summary}"
        ],
    )


def judge_modifications(ctx):
    """The verdict over every in-place write the harness recorded so far."""
    mods = ctx.harness.modifications
    names = sorted({m.tensor for m in mods})
    metrics = {
        "modified_inputs": len(names),
        "modifying_calls": len({m.call for m in mods}),
        "audited_calls": ctx.harness.audited,
    }
    if not mods:
        return verdict(
            ctx,
            metrics,
            ok_message=f"inputs bitwise unchanged after each of the {ctx.harness.audited} "
            "kernel calls (forward, and backward where it ran)",
        )
    first = mods[0]
    worst = case_record(
        first.case,
        tensor=first.tensor,
        stage=str(first.stage),
        mismatch=first.mismatch.to_dict(),
        summary=first.mismatch.summary(),
    )
    worst["modifications"] = [
        {"tensor": m.tensor, "stage": str(m.stage), "case": m.case.describe()} for m in mods[:_LISTED]
    ]
    where = "; ".join(sorted({f"{m.tensor} in the {m.stage}" for m in mods}))
    return verdict(
        ctx,
        metrics,
        ok_message="",
        worst_case=worst,
        failures=[
            f"the kernel wrote into {', '.join(names)} ({where}); first on {first.case.describe()}: "
            f"{first.mismatch.summary()}"
        ],
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
        b = ctx.backward
        if b.declared:
            return ctx.skip(
                "gradients not checked: the kernel is declared forward-only (--forward-only, "
                "forward_only = true); its backward was never called"
            )
        # undeclared: a backward that cannot run on the smallest case is a finding
        problem = f"no usable backward: {b.reason}" + (
            ""
            if b.cause in ("inplace", "bad_output")
            else "; a kernel without a backward must be declared forward-only (--forward-only, forward_only = true)"
        )
        worst = case_record(b.case, problem=problem, cause=b.cause) if b.case is not None else {"problem": problem}
        if b.traceback:  # what the backward raised, in full
            worst["traceback"] = b.traceback
        return verdict(ctx, {"bad_gradients": 1, "cases": 1}, ok_message="", worst_case=worst, failures=[problem])
    problems = []
    cases = _cases(ctx)
    for n, case in enumerate(cases):
        try:
            res = ctx.run(case)
        except KernelCallError as err:
            # autograd checks what a backward returns before it reaches q, k, v: a gradient it cannot
            # take (GQA: dK, dV left per query head) is raised here
            if err.stage is Stage.BACKWARD and _AUTOGRAD_REJECTS in str(err.exc):
                what = "shape" if "expected shape compatible" in str(err.exc) else "shape, device or layout"
                problems.append(
                    case_record(case, problem=f"the backward returned a gradient of the wrong {what} ({err.summary})")
                )
                ctx.progress((n + 1) / len(cases))
                continue
            raise
        inp = ctx.inputs(case)
        for name, want in (("dq", inp.q), ("dk", inp.k), ("dv", inp.v)):
            g = getattr(res, name)
            if g is None:
                problems.append(case_record(case, problem=f"no gradient for {name[1:]}"))
            elif g.shape != want.shape or g.dtype != want.dtype:
                problems.append(
                    case_record(
                        case,
                        problem=f"{name} has {tuple(g.shape)} {g.dtype}, expected {tuple(want.shape)} {want.dtype}",
                    )
                )
        ctx.progress((n + 1) / len(cases))
    metrics = {"bad_gradients": len(problems), "cases": len(cases)}
    return verdict(
        ctx,
        metrics,
        ok_message=f"dq, dk, dv have the right shapes and dtypes on {len(cases)} calls",
        worst_case=problems[0] if problems else {},
        failures=[problems[0]["problem"]] if problems else [],
    )
