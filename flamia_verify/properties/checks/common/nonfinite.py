"""The poisoned runs of special.nonfinite and isolation.nonfinite: a NaN or Inf reaches exactly what
depends on it.

special.nonfinite (robustness: a NaN already in q is an input no healthy training step produces, so a
kernel that hides it is reported, gating only when robustness is required) asks the first question
below; isolation.nonfinite (gating: a value in one document or head reaching another is an information
flow) the second. Both read the same poisoned runs (:func:`nonfinite_findings`, made once per run).

One element of q, k, v or dO is made NaN (q, k, dO) or +-Inf (v) at a position that some query sees.
What depends on that element is read off the float64 reference: the elements of out, dQ, dK, dV
that change when the element takes two other finite values (a generic perturbation changes every
element that depends on it). The kernel must then

  * not hide it: every dependent element comes out NaN or Inf (a kernel that applies nan_to_num,
    clamps, or masks NaN turns a diverging training run into a silent one), and
  * not spread it to another document or another head: no element of the other documents or of the
    heads the poisoned element does not feed becomes NaN or Inf (a NaN that reaches them through a
    shared scale or a wrong index is a leak; whether their finite values move is isolation's
    question, asked bitwise by isolation.nan and isolation.heads). Inside its own document and
    head a NaN or Inf may reach elements that do not depend on it: every FlashAttention-style kernel
    multiplies the masked (zero) weights of a tile by the tile's values, and 0 x Inf is NaN; those
    elements are counted (``spread_in_document``), not failed. Whether a non-finite future key
    reaches past outputs is causal.nan's question.

Inf is placed in V and dO only: an infinite score has a finite limit (a one-hot row), so a kernel
may resolve it either way; an infinite value does not.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from flamia_verify.properties.cases import Case
from flamia_verify.properties.checks.common.verdict import case_record

__all__ = ["dependent", "nonfinite_cases", "nonfinite_findings", "poisons"]

_SIDE = {"out": "q", "dq": "q", "dk": "k", "dv": "k"}


def nonfinite_cases(ctx) -> list[Case]:
    """A causal pack with Lq != Lk and 4:2 GQA; a non-causal pack with 3:1 GQA."""
    return [
        ctx.case((40, 57), (45, 57), heads=4, heads_k=2, causal=True, seed_offset=901),
        ctx.case((21, 35), heads=3, heads_k=1, causal=False, distribution="shifted", seed_offset=902),
    ]


def poisons(case: Case) -> list[tuple[str, tuple[int, int, int], float]]:
    """(tensor, (token, head, channel), value): NaN in q, k and dO, +Inf and -Inf in v, in a row or a
    key that queries see (the last document's middle; a key below the first query's diagonal)."""
    q0 = case.total_q - case.lens_q[-1]
    k0 = case.total_k - case.lens_k[-1]
    mid_q = q0 + case.lens_q[-1] // 2
    mid_k = k0 + max(0, case.lens_k[-1] - case.lens_q[-1]) + 3  # seen by every query of the document past its 3rd
    first_k = (case.total_k - case.lens_k[-1]) - case.lens_k[-2] + 1 if len(case.lens_k) > 1 else 1
    last = case.headdim - 1
    return [
        ("q", (mid_q, case.heads - 1, 5), math.nan),
        ("k", (mid_k, 0, last), math.nan),
        ("v", (first_k, case.heads_k - 1, 9), math.inf),
        ("v", (mid_k + 1, 0, 0), -math.inf),
        ("do", (mid_q + 2, 0, 17), math.nan),
    ]


def _with(inp, tensor: str, where: tuple[int, int, int], value: float):
    x = getattr(inp, tensor).clone()
    x[where] = value
    return inp.replace(**{tensor: x})


def dependent(ctx, case: Case, tensor: str, where: tuple[int, int, int]) -> dict[str, torch.Tensor]:
    """The elements of out, dQ, dK, dV that depend on one input element, by the float64 reference:
    those that change when the element is set to two generic finite values."""
    inp = ctx.inputs(case)
    a = ctx.reference(_with(inp, tensor, where, 1.6875))
    b = ctx.reference(_with(inp, tensor, where, -2.3125))
    return {t: getattr(a, t) != getattr(b, t) for t in ("out", "dq", "dk", "dv")}


def nonfinite_findings(ctx) -> dict:
    """Every poisoned run, once for both halves: the dependent elements left finite (hidden) and the
    independent elements of other documents or heads made non-finite (spread)."""

    def compute() -> dict:
        found: dict[str, Any] = {
            "hidden": 0,
            "spread": 0,
            "in_doc": 0,
            "runs": 0,
            "first_hidden": None,
            "first_spread": None,
        }
        jobs = [(c, p) for c in nonfinite_cases(ctx) for p in poisons(c)]
        for n, (case, (tensor, where, value)) in enumerate(jobs):
            if tensor == "do" and not ctx.has_backward:
                continue
            clean = ctx.run(case)
            new = ctx.run(_with(ctx.inputs(case), tensor, where, value))
            found["runs"] += 1
            dep = dependent(ctx, case, tensor, where)
            for t, x in new.tensors().items():
                d = dep[t].to(x.device)
                bad_hidden = d & torch.isfinite(x)
                # reached: non-finite where the run without the poison was finite
                reached = ~torch.isfinite(x) & torch.isfinite(clean.tensors()[t])
                near = _own_document_and_head(case, tensor, where, t).to(x.device)
                bad_spread = ~d & reached & ~near
                found["in_doc"] += int((~d & reached & near).sum())
                for kind, bad, words in (
                    ("hidden", bad_hidden, "finite where it depends on"),
                    ("spread", bad_spread, "non-finite where it does not depend on"),
                ):
                    count = int(bad.sum())
                    found[kind] += count
                    if count and found[f"first_{kind}"] is None:
                        idx = torch.nonzero(bad)[0].tolist()
                        found[f"first_{kind}"] = case_record(
                            case,
                            tensor=t,
                            poisoned={"tensor": tensor, "index": list(where), "value": str(value)},
                            element=idx,
                            kernel_value=float(x[tuple(idx)]),
                            summary=(
                                f"{t}[{idx[0]}, {idx[1]}, {idx[2]}] is {words} {tensor}[{where[0]}, {where[1]}, "
                                f"{where[2]}] = {value} ({count} elements {kind} in this run)"
                            ),
                        )
            ctx.progress((n + 1) / len(jobs))
        return found

    return ctx.memo(("nonfinite-findings",), compute)


def _own_document_and_head(case: Case, tensor: str, where: tuple[int, int, int], out_name: str) -> torch.Tensor:
    """Elements of ``out_name`` in the poisoned element's document and in the heads it feeds: its query
    head (q, dO) or its kv head's group (k, v) for out and dQ; its kv head for dK and dV."""
    group = case.heads // case.heads_k
    side = "q" if tensor in ("q", "do") else "k"
    lens = case.lens_q if side == "q" else case.lens_k
    start, doc = 0, 0
    for doc, n in enumerate(lens):
        if start <= where[0] < start + n:
            break
        start += n
    kv = where[1] // group if side == "q" else where[1]
    if _SIDE[out_name] == "q":
        rows, total, heads = case.lens_q, case.total_q, case.heads
        hs = [where[1]] if side == "q" else list(range(kv * group, (kv + 1) * group))
    else:
        rows, total, heads = case.lens_k, case.total_k, case.heads_k
        hs = [kv]
    r0 = sum(rows[:doc])
    mask = torch.zeros(total, heads, 1, dtype=torch.bool)
    for h in hs:
        mask[r0 : r0 + rows[doc], h] = True
    return mask
