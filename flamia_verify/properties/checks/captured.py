"""Checks on a capture: the value families on the tensors a real model produced.

``flamia-verify check --inputs CAPTURE_DIR`` (``run_checks(..., inputs=...)``) runs these checks and no
other: each captured call (:func:`flamia_verify.properties.cases.captured_cases`) is a case whose
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
suite: only a run with a capture selects them.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from flamia_verify.properties.cases import Case, captured_call
from flamia_verify.properties.compare import compare_beyond_noise
from flamia_verify.properties.helpers import (
    bound_report,
    case_record,
    doc_bounds,
    future_inputs,
    normalized_error,
    run_noise,
    verdict,
    violations,
)
from flamia_verify.properties.metrics import error_stats
from flamia_verify.properties.registry import register
from flamia_verify.properties.search import replace_others
from flamia_verify.properties.tolerances import ERROR_MODEL_FACTOR

__all__ = ["CAPTURED_CHECKS"]

#: positions t per document of causal.captured: the first query, the middle and the next-to-last
CAUSAL_POSITIONS = 3


def _calls(ctx) -> list[Case]:
    cases = list(getattr(ctx, "captured", ()) or ())
    return cases


def _row(case: Case) -> dict[str, Any]:
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


def _name(row: dict) -> str:
    return f"call {row['call']} (layer {row['layer']}, step {row['step']})"


def _no_capture(ctx):
    return ctx.skip("no capture given: these checks run with --inputs CAPTURE_DIR")


@register(
    "error.captured",
    "on every captured call: O (and dQ, dK, dV) against the float64 reference, relative RMSE over the "
    "recipe's rounding model on the recorded tensors <= 2",
    defaults=lambda recipe, dtype: {"normalized_error": ERROR_MODEL_FACTOR},
    adjustable=("normalized_error",),
    suites=(),
    cost=1.0,
)
def error_captured(ctx):
    calls = _calls(ctx)
    if not calls:
        return _no_capture(ctx)
    tensors = ("out", "dq", "dk", "dv") if ctx.has_backward else ("out",)
    rows, worst, worst_norm = [], None, -1.0
    for n, case in enumerate(calls):
        res, ref, base = ctx.run(case), ctx.reference(case), ctx.baseline(case)
        row = _row(case)
        for t in tensors:
            x, r, b = getattr(res, t), getattr(ref, t), getattr(base, t)
            if x is None:
                continue
            st, bst = error_stats(x, r), error_stats(b, r)
            norm = normalized_error(ctx, case, t, st["rel_rmse"])
            ratio = (
                st["rel_rmse"] / bst["rel_rmse"] if bst["rel_rmse"] > 0 else (1.0 if st["rel_rmse"] == 0 else math.inf)
            )
            row[f"{t}_rel_rmse"], row[f"{t}_normalized_error"], row[f"{t}_ratio_to_bf16"] = st["rel_rmse"], norm, ratio
            if not math.isfinite(norm) or norm > worst_norm:
                worst_norm = norm if math.isfinite(norm) else math.inf
                worst = case_record(
                    case,
                    **captured_call(case),
                    tensor=t,
                    summary=f"{_name(row)}: {t} normalized error {norm:.3g} (relative RMSE {st['rel_rmse']:.3g}, "
                    f"{ratio:.3g}x a BF16 run's)",
                )
        rows.append(row)
        ctx.progress((n + 1) / len(calls))
    metrics = {
        "normalized_error": max(r.get(f"{t}_normalized_error", 0.0) for r in rows for t in tensors),
        "rel_rmse": max(r.get(f"{t}_rel_rmse", 0.0) for r in rows for t in tensors),
        "ratio_to_bf16": max(r.get(f"{t}_ratio_to_bf16", 0.0) for r in rows for t in tensors),
        "calls": len(rows),
    }
    broken = violations(metrics, ctx.th)
    return verdict(
        ctx,
        metrics,
        ok_message=f"{len(rows)} captured calls within the error model (worst: {worst['summary'] if worst else '-'})",
        failures=[f"worst {worst['summary']}"] if broken and worst else [],
        worst_case=worst or {},
        details={"calls": rows},
    )


@register(
    "bound.captured",
    "on every captured call: every element of O (and dQ, dK, dV) within the recipe's rigorous a-priori "
    "bound; no violation allowed",
    defaults=lambda recipe, dtype: {"violations": 0},
    suites=(),
    cost=1.0,
)
def bound_captured(ctx):
    calls = _calls(ctx)
    if not calls:
        return _no_capture(ctx)
    tensors = ("out", "dq", "dk", "dv") if ctx.has_backward else ("out",)
    rows, first, total = [], None, 0
    for n, case in enumerate(calls):
        metrics, f, _, _ = bound_report(ctx, [case], tensors, inputs_label="captured calls")
        row = {**_row(case), "violations": metrics["violations"], "tightness": metrics.get("tightness", 0.0)}
        rows.append(row)
        total += metrics["violations"]
        if f is not None and first is None:
            first = dict(f, **captured_call(case), summary=f"{_name(row)}: {f.get('summary', '')}")
        ctx.progress((n + 1) / len(calls))
    return verdict(
        ctx,
        {"violations": total, "tightness": max(r["tightness"] for r in rows), "calls": len(rows)},
        ok_message=f"every element of {len(rows)} captured calls within the bound",
        first=first,
        details={"calls": rows},
    )


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


def _flow_check(ctx, calls: list[Case], perturbations, ok_message):
    """An information-flow check over ``calls``: ``perturbations(case, inp)`` yields, per perturbation,
    (where: the worst case's extra fields, e.g. document and t; the perturbed inputs; the rows of each
    output that must not change, as :func:`_perturbed_run` takes them; what was replaced, in words).
    Every changed element counts; the first names its call; ``ok_message(calls, runs)``."""
    rows, first, changed, runs = [], None, 0, 0
    for n, case in enumerate(calls):
        row = {**_row(case), "changed_elements": 0, "perturbations": 0}
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
                        summary=f"{_name(row)}, document {where['document']}: {name}{at} changed when "
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


@register(
    "causal.captured",
    "on every causal captured call: each document's out and dQ at or before t unchanged when its "
    "queries, keys, values and dO after t are replaced by huge values (bitwise, or beyond the kernel's "
    "run-to-run noise)",
    defaults=lambda recipe, dtype: {"changed_elements": 0},
    suites=(),
    cost=1.0,
)
def causal_captured(ctx):
    calls = [c for c in _calls(ctx) if c.causal]
    if not _calls(ctx):
        return _no_capture(ctx)
    if not calls:
        return ctx.skip("no captured call is causal")

    def perturbations(case: Case, inp):
        for b, lq in enumerate(case.lens_q):
            if lq < 2:
                continue
            q0 = doc_bounds(case, b)[0]
            for t in sorted({0, (lq - 2) // 2, lq - 2})[:CAUSAL_POSITIONS]:
                yield (
                    {"document": b, "t": t},
                    future_inputs(inp, b, t, "huge", seed=case.seed * 101 + b),
                    lambda name, q0=q0, t=t: slice(q0, q0 + t + 1) if name in ("out", "dq") else None,
                    "the document's future was",
                )

    return _flow_check(
        ctx,
        calls,
        perturbations,
        lambda n, runs: f"no position of {n} captured calls saw its future ({runs} perturbations)",
    )


@register(
    "isolation.captured",
    "on every captured call of 2+ documents: each document's out, dQ, dK, dV unchanged when every other "
    "document is replaced by huge values (bitwise, or beyond the kernel's run-to-run noise)",
    defaults=lambda recipe, dtype: {"changed_elements": 0},
    suites=(),
    cost=1.0,
)
def isolation_captured(ctx):
    all_calls = _calls(ctx)
    if not all_calls:
        return _no_capture(ctx)
    calls = [c for c in all_calls if sum(1 for a, k in zip(c.lens_q, c.lens_k) if a or k) >= 2]
    if not calls:
        return ctx.skip("no captured call packs two or more documents")

    def perturbations(case: Case, inp):
        for b, lq in enumerate(case.lens_q):
            if lq == 0:
                continue
            q0, q1, k0, k1 = doc_bounds(case, b)
            yield (
                {"document": b},
                replace_others(inp, b, "huge", seed=case.seed * 103 + b),
                lambda name, q0=q0, q1=q1, k0=k0, k1=k1: slice(q0, q1) if name in ("out", "dq") else slice(k0, k1),
                "the other documents were",
            )

    return _flow_check(
        ctx,
        calls,
        perturbations,
        lambda n, runs: f"every document of {n} captured calls unchanged by its neighbours ({runs} perturbations)",
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
