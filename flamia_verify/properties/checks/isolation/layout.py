"""isolation across the layout of a batch: a packed document does not depend on how the rest of the
pack is laid out.

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

from flamia_verify.properties.bounds import bounds_of
from flamia_verify.properties.cases import Inputs, cu_from_lens
from flamia_verify.properties.checks.common.pack import LAYOUT_HEADS, Doc, layout_base_run, layout_docs, pack_docs
from flamia_verify.properties.checks.common.verdict import case_record, verdict
from flamia_verify.properties.checks.isolation.heads import SIDE
from flamia_verify.properties.compare import compare_bitwise, compare_within
from flamia_verify.properties.harness import KernelCallError
from flamia_verify.properties.metrics import rel_rmse
from flamia_verify.properties.registry import register
from flamia_verify.properties.tolerances import ERROR_MODEL_FACTOR
from flamia_verify.recipes.noise_model import predicted_errors

__all__: list[str] = []


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
                    a, b, length = (nq, bq, d.lq) if SIDE[t] == "q" else (nk, bk, d.lk)
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
        cu = cu_from_lens(c.lens_q if SIDE[t] == "q" else c.lens_k).tolist()
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
