"""isolation across heads and across the layout of a batch: attention's invariances that value
perturbations of one neighbour do not state.

    isolation.heads   head independence (information flow, gating): new values in one query head's q
                      and dO leave every other query head's out and dQ, and every other kv head's dK
                      and dV, bitwise unchanged; new k, v in one kv head leave the query heads outside
                      its group and the other kv heads bitwise unchanged
    isolation.heads_bitwise
                      equivariance (structure, reproducibility): permuting the query heads inside each
                      GQA group permutes out and dQ; permuting the kv heads with their groups permutes
                      out, dQ, dK, dV, bitwise
    isolation.layout  the pack's layout judged for accuracy (gating): with the other documents in
                      another order, number or lengths (a neighbour longer than every tile raises
                      max_seqlen), or max_seqlen_q/k passed above the true maxima, every pack stays
                      within the recipe's a-priori bound, and a tensor whose bits changed stays within
                      the error checks' rule (the error model over the pack)
    isolation.layout_bitwise
                      batch invariance (reproducibility): a document's out, dQ, dK, dV do not depend on
                      anything else in the pack, bitwise. Every document present in two packs is
                      compared. A pad-to-max design or a tiling chosen from max_seqlen changes the
                      rounding, not the numbers the recipe promises: reported, gating only when
                      reproducibility is required

The packs of isolation.layout hold dozens of documents, empty documents at the start, in the middle
and at the end, documents whose key count differs from their query count, and one document longer
than every tile size of the built-in kernels (``layout_long`` keys). A kernel whose tiling, split
or scaling is chosen from max_seqlen, the number of documents or the total length fails the bitwise
half; one whose numbers break the recipe there fails the gating half.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from flamia_verify.properties.cases import Case, Inputs, cu_from_lens
from flamia_verify.properties.compare import compare_bitwise, compare_within
from flamia_verify.properties.harness import KernelCallError
from flamia_verify.properties.helpers import (
    LAYOUT_HEADS,
    Doc,
    bounds_of,
    case_record,
    layout_base_run,
    layout_docs,
    pack_docs,
    verdict,
)
from flamia_verify.properties.metrics import rel_rmse
from flamia_verify.properties.registry import register
from flamia_verify.properties.tolerances import ERROR_MODEL_FACTOR
from flamia_verify.recipes.noise_model import predicted_errors

__all__ = ["head_cases"]

_SLICE = {"out": "q", "dq": "q", "dk": "k", "dv": "k"}


# ----------------------------------------------------------------------------------------------
# heads
# ----------------------------------------------------------------------------------------------


def head_cases(ctx) -> list[Case]:
    """6:2 GQA (groups of 3) with an empty document, causal, Lq != Lk; 7:1 (one group of 7), not causal;
    4:2 at head_dim 80, where a 32-block laid over the flattened heads straddles two of them."""
    return [
        ctx.case((40, 0, 57), (45, 3, 57), heads=6, heads_k=2, causal=True, seed_offset=701),
        ctx.case((33, 20), heads=7, heads_k=1, causal=False, distribution="shifted", seed_offset=702),
        ctx.case((29, 24), (35, 24), heads=4, heads_k=2, headdim=80, causal=True, seed_offset=703),
    ]


#: the factor of the "huge" one-head perturbation: a value this far above the others pushes a
#: neighbour's elements that share a block scale with it below E4M3's normal range (2^-6 of 448)
HUGE_HEAD = 2.0**14


def _fresh(x: torch.Tensor, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(x.shape, generator=g) * 3.0).to(x.dtype).to(x.device)


def _with_head(inp: Inputs, names: tuple[str, ...], head: int, seed: int, factor: float = 1.0) -> Inputs:
    """The inputs with new values in head ``head`` of the tensors ``names`` (times ``factor``)."""
    new = {}
    for i, n in enumerate(names):
        x = getattr(inp, n).clone()
        x[:, head] = (_fresh(x[:, head], seed + i).double() * factor).to(x.dtype)
        new[n] = x
    return inp.replace(**new)


def _permuted(inp: Inputs, perm_q: list[int], perm_k: list[int]) -> Inputs:
    return inp.replace(q=inp.q[:, perm_q], do=inp.do[:, perm_q], k=inp.k[:, perm_k], v=inp.v[:, perm_k])


def _head_findings(ctx) -> dict:
    """The head cases, their one-head perturbations (information flow) and their head permutations
    (structure), run once for both halves of isolation.heads."""

    def compute() -> dict:
        changed, perm_bad, first, first_perm, runs = 0, 0, None, None, 0
        cases = head_cases(ctx)
        for n, case in enumerate(cases):
            inp = ctx.inputs(case)
            base = ctx.run(case)
            H, Hk = case.heads, case.heads_k
            group = H // Hk
            h0, g0 = 1, Hk - 1
            perturbations = [
                # (what changed, inputs, query heads that may change, kv heads that may change)
                (f"q, dO of query head {h0}", _with_head(inp, ("q", "do"), h0, case.seed + 7), {h0}, {h0 // group}),
                (
                    f"q of query head {h0} x 2^14",
                    _with_head(inp, ("q",), h0, case.seed + 13, factor=HUGE_HEAD),
                    {h0},
                    {h0 // group},
                ),
                (
                    f"k, v of kv head {g0}",
                    _with_head(inp, ("k", "v"), g0, case.seed + 11),
                    set(range(g0 * group, (g0 + 1) * group)),
                    {g0},
                ),
            ]
            for what, new_inp, may_q, may_k in perturbations:
                new = ctx.run(new_inp)
                runs += 1
                for t, x in new.tensors().items():
                    heads_here = may_q if _SLICE[t] == "q" else may_k
                    keep = [h for h in range(x.shape[1]) if h not in heads_here]
                    if not keep:
                        continue
                    m = compare_bitwise(
                        x[:, keep],
                        base.tensors()[t][:, keep],
                        what=f"{t} of the other heads ({what})",
                        against="the unperturbed run",
                    )
                    if not m.ok:
                        changed += m.mismatched
                        if first is None:
                            first = case_record(case, tensor=t, changed=what, mismatch=m.to_dict(), summary=m.summary())
            # permutations: query heads reversed inside each group; kv heads reversed with their groups
            inside = [g * group + (group - 1 - j) for g in range(Hk) for j in range(group)]
            whole_k = list(reversed(range(Hk)))
            whole_q = [g * group + j for g in whole_k for j in range(group)]
            for what, pq, pk, grads_k in (
                ("query heads reversed inside each group", inside, list(range(Hk)), False),
                ("kv heads reversed with their groups", whole_q, whole_k, True),
            ):
                if pq == list(range(H)) and pk == list(range(Hk)):
                    continue
                new = ctx.run(_permuted(inp, pq, pk))
                runs += 1
                for t, x in new.tensors().items():
                    if _SLICE[t] == "k" and not grads_k:
                        continue  # dK, dV sum the group's heads in another order: not bitwise
                    perm = pq if _SLICE[t] == "q" else pk
                    m = compare_bitwise(
                        x, base.tensors()[t][:, perm], what=f"{t} ({what})", against="the unpermuted run, permuted"
                    )
                    if not m.ok:
                        perm_bad += m.mismatched
                        if first_perm is None:
                            first_perm = case_record(
                                case, tensor=t, permutation=what, mismatch=m.to_dict(), summary=m.summary()
                            )
            ctx.progress((n + 1) / len(cases))
        return {"changed": changed, "perm_bad": perm_bad, "first": first, "first_perm": first_perm, "runs": runs}

    return ctx.memo(("head-findings",), compute)


@register(
    "isolation.heads",
    "new values in one head (random, and 2^14 times larger) leave every other head's out, dQ, dK, dV bitwise "
    "unchanged (GQA groups of 3 and 7; head_dim 80, where 32-blocks over the flattened heads straddle two)",
    defaults=lambda recipe, dtype: {"changed_elements": 0},
    cost=1.0,
)
def heads(ctx):
    f = _head_findings(ctx)
    return verdict(
        ctx,
        {"changed_elements": f["changed"], "runs": f["runs"]},
        ok_message=f"heads independent, bitwise ({f['runs']} perturbed or permuted runs)",
        first=f["first"],
    )


@register(
    "isolation.heads_bitwise",
    "permuting the query heads inside a group, or the kv heads with their groups, permutes out, dQ, dK, dV "
    "bitwise (head-order invariance: a structural change)",
    defaults=lambda recipe, dtype: {"permutation_mismatches": 0},
    cost=0.1,
    verdict="reproducibility",
)
def heads_bitwise(ctx):
    f = _head_findings(ctx)
    return verdict(
        ctx,
        {"permutation_mismatches": f["perm_bad"], "runs": f["runs"]},
        ok_message="permuted heads permute the results, bitwise",
        first=f["first_perm"],
    )


# ----------------------------------------------------------------------------------------------
# the layout of a batch
# ----------------------------------------------------------------------------------------------


def _variants(ctx, docs: list[Doc]) -> list[tuple[str, list[Doc], int]]:
    """(what changed, documents, max_seqlen pad) of the packs compared with the suite's pack."""
    longest = max(max(d.lq, d.lk) for d in docs)
    evens = [d for i, d in enumerate(docs) if i % 2 == 0 or d.lq == longest]
    short = sorted(d.lq for d in docs)[len(docs) // 2]  # keep the shorter half of the documents
    grown = [Doc(2 * longest + 7, 2 * longest + 7, ctx.seed * 1000 + 797)] + [d for d in docs if d.lq <= short]
    return [
        ("the documents in reverse order", list(reversed(docs)), 0),
        ("every other document removed", evens, 0),
        (f"a neighbour of {2 * longest + 7} tokens first, the longer half of the documents removed", grown, 0),
        ("max_seqlen_q/k passed 4096 above the true maxima", docs, 4096),
    ]


def _layout_findings(ctx) -> dict:
    """The suite's pack and its other layouts, run once for both halves of isolation.layout: each
    document's bitwise changes (reproducibility) and each layout's accuracy (gating): every pack within
    the recipe's a-priori bound, and a tensor whose bits changed within the error checks' rule
    (relative RMSE over the pack at most ERROR_MODEL_FACTOR times the rounding model's prediction)."""

    def compute() -> dict:
        heads, heads_k = LAYOUT_HEADS
        docs = layout_docs(ctx)
        found: dict[str, Any] = {
            "changed": 0,
            "first_bits": None,
            "violations": 0,
            "error_violations": 0,
            "first_accuracy": None,
        }
        found.update(packs=0, compared=0, judged=0, worst_normalized=0.0, refused=[])
        variants = _variants(ctx, docs)
        # every variant causal; the order and the number of documents not causal too
        jobs = [(True, v) for v in variants] + [(False, v) for v in variants[:2]]
        where_base = _positions(docs)
        judged_bases: set[bool] = set()
        for n, (causal, (what, other, pad)) in enumerate(jobs):
            base = layout_base_run(ctx, docs, causal)
            new_inp = pack_docs(ctx, other, heads=heads, heads_k=heads_k, causal=causal, pad=pad)
            try:
                new = ctx.run(new_inp)
            except KernelCallError as err:
                if not pad:
                    raise
                # max_seqlen far above the maxima sizes a pad-to-max design's buffers (it may run out of
                # memory): the same numbers not computed is a reproducibility finding, not a wrong number
                found["refused"].append(f"{what}: {err.summary}")
                continue
            found["packs"] += 1
            where_new = _positions(other)
            changed_tensors: set[str] = set()
            for d, (bq, bk) in where_base.items():
                if d not in where_new or (d.lq == 0 and d.lk == 0):
                    continue
                nq, nk = where_new[d]
                found["compared"] += 1
                for t, x in new.tensors().items():
                    a, b, length = (nq, bq, d.lq) if _SLICE[t] == "q" else (nk, bk, d.lk)
                    m = compare_bitwise(
                        x[a : a + length],
                        base.tensors()[t][b : b + length],
                        what=f"{t} of a document ({what})",
                        against="the suite's pack",
                    )
                    if not m.ok:
                        found["changed"] += m.mismatched
                        changed_tensors.add(t)
                        if found["first_bits"] is None:
                            found["first_bits"] = case_record(
                                new_inp.case,
                                tensor=t,
                                changed=what,
                                causal=causal,
                                document={
                                    "lens": [d.lq, d.lk],
                                    "seed": d.seed,
                                    "at_q": nq,
                                    "at_k": nk,
                                    "before_at_q": bq,
                                },
                                documents=[[x.lq, x.lk, x.seed] for x in other],
                                mismatch=m.to_dict(),
                                summary=f"{m.summary()} ({what})",
                            )
            # a layout that changed no bit of the documents it shares with the suite's pack has their
            # accuracy; it is judged when bits changed or it holds a document the suite's pack has not
            fresh = any(d not in where_base and (d.lq or d.lk) for d in other)
            judged = [(new_inp, new, what, other, changed_tensors)] if changed_tensors or fresh else []
            if causal not in judged_bases:  # the suite's pack itself, once per causal flag
                judged_bases.add(causal)
                base_inp = pack_docs(ctx, docs, heads=heads, heads_k=heads_k, causal=causal)
                judged.append((base_inp, base, "the suite's pack", docs, set()))
            for inp, res, label, packed, changed in judged:
                _judge_accuracy(ctx, inp, res, label, packed, changed, found)
            ctx.progress((n + 1) / len(jobs))
        found["tokens"] = sum(d.lq for d in docs)
        found["documents"] = len(docs)
        return found

    return ctx.memo(("layout-findings",), compute)


def _judge_accuracy(ctx, inp: Inputs, res, label: str, packed: list[Doc], changed: set[str], found: dict) -> None:
    """One pack's run against the float64 reference: the a-priori bound on every tensor, and the
    error model on the tensors whose bits differ from the suite's pack."""
    c = inp.case
    ref = ctx.reference(inp)
    tensors = tuple(res.tensors())
    grads = any(t != "out" for t in tensors)
    bounds = bounds_of(inp, ref, scale=c.scale, causal=c.causal, model=ctx.bound_model, grads=grads)
    found["judged"] += 1
    for t in tensors:
        cu = cu_from_lens(c.lens_q if _SLICE[t] == "q" else c.lens_k).tolist()
        m = compare_within(
            getattr(res, t),
            getattr(ref, t),
            getattr(bounds, t),
            what=f"|{t} - reference| ({label})",
            rule="within the a-priori bound",
            cu_seqlens=cu,
        )
        if not m.ok:
            found["violations"] += m.mismatched
            if found["first_accuracy"] is None:
                found["first_accuracy"] = case_record(
                    c,
                    tensor=t,
                    layout=label,
                    documents=[[x.lq, x.lk, x.seed] for x in packed],
                    mismatch=m.to_dict(),
                    summary=f"{m.summary()} ({label})",
                )
    if not changed:
        return
    pred = predicted_errors(inp, ref, ctx.bound_model, seed=c.seed)
    for t in sorted(changed):
        rel = rel_rmse(getattr(res, t), getattr(ref, t))
        norm = rel / pred[t] if pred[t] > 0 else (0.0 if rel == 0 else math.inf)
        found["worst_normalized"] = max(found["worst_normalized"], norm)
        if norm > ERROR_MODEL_FACTOR:
            found["error_violations"] += 1
            if found["first_accuracy"] is None:
                found["first_accuracy"] = case_record(
                    c,
                    tensor=t,
                    layout=label,
                    documents=[[x.lq, x.lk, x.seed] for x in packed],
                    normalized_error=norm,
                    summary=f"{t} with {label} has {norm:.3g} times the recipe's expected error over the pack "
                    f"(at most {ERROR_MODEL_FACTOR:g}); its bits differ from the suite's pack",
                )


@register(
    "isolation.layout",
    "a packed document's out, dQ, dK, dV stay within the recipe's bound (and, where their bits change, "
    "its error model) when the other documents change order, number or lengths and when max_seqlen is "
    "passed above the true maximum (dozens of documents, empty ones first, in the middle and last, one "
    "longer than every tile)",
    defaults=lambda recipe, dtype: {"violations": 0, "error_violations": 0},
    cost=2.0,
)
def layout(ctx):
    f = _layout_findings(ctx)
    return verdict(
        ctx,
        {
            "violations": f["violations"],
            "error_violations": f["error_violations"],
            "worst_normalized_error": f["worst_normalized"],
            "packs_judged": f["judged"],
            "tokens": f["tokens"],
        },
        ok_message=(
            f"{f['judged']} packs within the recipe's bound against the float64 reference: the suite's pack of "
            f"{f['documents']} documents and each of its {f['packs']} other layouts that changed a bit or added a "
            "document"
            + (
                f"; where bits changed, at most {f['worst_normalized']:.3g} times the expected error"
                if f["changed"]
                else ""
            )
        ),
        first=f["first_accuracy"],
    )


@register(
    "isolation.layout_bitwise",
    "a packed document's out, dQ, dK, dV are bitwise unchanged when the other documents change order, "
    "number or lengths, and when max_seqlen is passed above the true maximum (batch invariance)",
    defaults=lambda recipe, dtype: {"changed_elements": 0},
    cost=0.2,
    verdict="reproducibility",
)
def layout_bitwise(ctx):
    f = _layout_findings(ctx)
    failures = [f["first_bits"]["summary"]] if f["first_bits"] else []
    failures += [f"the kernel could not run the same pack with {why}" for why in f["refused"]]
    return verdict(
        ctx,
        {
            "changed_elements": f["changed"],
            "refused_layouts": len(f["refused"]),
            "packs": f["packs"],
            "documents_compared": f["compared"],
            "tokens": f["tokens"],
        },
        ok_message=(
            f"every document bitwise unchanged across {f['packs']} layouts of a {f['documents']}-document pack of "
            f"{f['tokens']} tokens ({f['compared']} document comparisons)"
        ),
        first=f["first_bits"],
        failures=failures,
    )


def _positions(docs: list[Doc]) -> dict[Doc, tuple[int, int]]:
    """Where each (non-repeated) document starts, in queries and keys."""
    out: dict[Doc, tuple[int, int]] = {}
    q = k = 0
    for d in docs:
        out.setdefault(d, (q, k))
        q += d.lq
        k += d.lk
    return out
