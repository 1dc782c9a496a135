"""What the checks of a run on a capture share: the captured calls, the columns of their per-call tables,
and the information-flow check over them (causal.captured, isolation.captured).

``flamia-verify check --inputs CAPTURE_DIR`` (``run_checks(..., inputs=...)``) runs :data:`CAPTURED_CHECKS`
and no other: each captured call (:func:`flamia_verify.properties.cases.captured_cases`) is a case whose
tensors are the recorded ones, and each check judges every call by the rule its family judges the
suite's cases by:

    error.captured      O (and, with a backward, dQ, dK, dV) against the float64 reference: the
                        normalized error (relative RMSE over the recipe's rounding model on these
                        very inputs) <= 2, as error.*; the ratio to a BF16 run is reported beside it
    bound.captured      every element within the recipe's rigorous a-priori bound, as bound.*
    causal.captured     (causal calls) every document's out and dQ at or before t bitwise unchanged
                        (beyond the kernel's run-to-run noise) when its queries, keys, values and dO
                        after t are replaced by huge values, at three positions t per document
    isolation.captured  (calls of 2+ documents) every document's out, dQ, dK, dV unchanged when all
                        the other documents are replaced by huge values

and, judging the calls as the suites' base cases (a run on a capture makes the captured calls its base
cases), the forward/backward consistency checks that hold on any inputs:
consistency.conservation_backward (sum_j dV_j = sum_i dO_i within the dV GEMM's rounding budget) and
consistency.grad_forward_ratio (the gradients' normalized error over the forward's <= 4).

Each check's details hold one row per call (call index, layer, step, shape, its numbers) and its
metrics the worst over the calls; the worst call is the worst case. The checks are registered in no
suite: only a run with a capture selects them. Each lives in its family's package (``error/captured.py``,
``bound/captured.py``, ``causal/captured.py``, ``isolation/captured.py``); this module holds what they
share.
"""

from __future__ import annotations

from typing import Any

import torch

from flamia_verify.properties.cases import Case, captured_call
from flamia_verify.properties.checks.common.noise import run_noise
from flamia_verify.properties.checks.common.verdict import case_record, verdict
from flamia_verify.properties.compare import compare_beyond_noise

__all__ = [
    "CAPTURED_CHECKS",
    "call_name",
    "call_row",
    "captured_calls",
    "flow_check",
    "no_capture",
]


def captured_calls(ctx) -> list[Case]:
    """The run's captured calls (none in a run without a capture)."""
    cases = list(getattr(ctx, "captured", ()) or ())
    return cases


def call_row(case: Case) -> dict[str, Any]:
    """Where a call came from and its shape: the fixed columns of every check's per-call table."""
    return {
        **captured_call(case),
        "documents": len(case.lens_q),
        "tokens_q": case.total_q,
        "tokens_k": case.total_k,
        "heads": f"{case.heads}/{case.heads_k}",
        "headdim": case.headdim,
        "causal": case.causal,
    }


def call_name(row: dict) -> str:
    """A call as a finding names it: its index, layer and step."""
    return f"call {row['call']} (layer {row['layer']}, step {row['step']})"


def no_capture(ctx):
    """The skip of a captured check in a run without a capture."""
    return ctx.skip("no capture given: these checks run with --inputs CAPTURE_DIR")


def _perturbed_run(ctx, case: Case, inp, compare_rows):
    """Run ``inp`` (a perturbed copy of ``case``'s tensors) and compare the rows ``compare_rows(name)``
    (a slice or None) of every output with the unperturbed run's, beyond the kernel's run-to-run noise;
    [(tensor, Mismatch)]."""
    base = ctx.run(case)
    noise = run_noise(ctx, ("captured", case), base, lambda: ctx.run(ctx.inputs(case)))
    new = ctx.run(inp)
    out = []
    for name in ("out", "dq", "dk", "dv"):
        a, b = getattr(new, name), getattr(base, name)
        rows = compare_rows(name)
        if a is None or b is None or rows is None:
            continue
        region = torch.zeros(a.shape[0], 1, 1, dtype=torch.bool, device=a.device)
        region[rows] = True
        out.append((name, compare_beyond_noise(a, b, noise.get(name), what=name, region=region)))
    return out


def flow_check(ctx, calls: list[Case], perturbations, ok_message):
    """An information-flow check over ``calls``: ``perturbations(case, inp)`` yields, per perturbation,
    (where: the worst case's extra fields, e.g. document and t; the perturbed inputs; the rows of each
    output that must not change, as :func:`_perturbed_run` takes them; what was replaced, in words).
    Every changed element counts; the first names its call; ``ok_message(calls, runs)``."""
    rows, first, changed, runs = [], None, 0, 0
    for n, case in enumerate(calls):
        row = {**call_row(case), "changed_elements": 0, "perturbations": 0}
        for where, new, compare_rows, replaced in perturbations(case, ctx.inputs(case)):
            found = _perturbed_run(ctx, case, new, compare_rows)
            row["perturbations"] += 1
            runs += 1
            for name, m in found:
                if m.ok:
                    continue
                row["changed_elements"] += m.mismatched
                changed += m.mismatched
                if first is None:
                    at = f" at/before t={where['t']}" if "t" in where else ""
                    first = case_record(
                        case,
                        **captured_call(case),
                        **where,
                        tensor=name,
                        mismatch=m.to_dict(),
                        summary=f"{call_name(row)}, document {where['document']}: {name}{at} changed when "
                        f"{replaced} replaced: {m.summary()}",
                    )
        rows.append(row)
        ctx.progress((n + 1) / len(calls))
    return verdict(
        ctx,
        {"changed_elements": changed, "perturbations": runs, "calls": len(rows)},
        ok_message=ok_message(len(rows), runs),
        first=first,
        details={"calls": rows},
    )


#: the checks a run with a capture runs, in order: those made for it, and the consistency checks that
#: judge the base cases (which a run on a capture makes the captured calls: CheckContext.base_cases)
CAPTURED_CHECKS = (
    "error.captured",
    "bound.captured",
    "consistency.conservation_backward",
    "consistency.grad_forward_ratio",
    "causal.captured",
    "isolation.captured",
)
