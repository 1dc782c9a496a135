"""isolation across heads and across the layout of a batch: attention's invariances that value
perturbations of one neighbour do not state.

    isolation.heads   head independence: new values in one query head's q and dO leave every other
                      query head's out and dQ, and every other kv head's dK and dV, bitwise unchanged;
                      new k, v in one kv head leave the query heads outside its group and the other kv
                      heads bitwise unchanged. Equivariance: permuting the query heads inside each
                      GQA group permutes out and dQ; permuting the kv heads with their groups permutes
                      out, dQ, dK, dV, bitwise
    isolation.layout  batch invariance: a document's out, dQ, dK, dV do not depend on anything else in
                      the pack: not the other documents' order, number or lengths (a neighbour longer
                      than every tile raises max_seqlen), nor max_seqlen_q/k passed above the true
                      maxima. Every document present in two packs is compared bitwise

The packs of isolation.layout hold dozens of documents, empty documents at the start, in the middle
and at the end, documents whose key count differs from their query count, and one document longer
than every tile size of the built-in kernels (``layout_long`` keys). A kernel whose tiling, split
or scaling is chosen from max_seqlen, the number of documents or the total length fails it.
"""

from __future__ import annotations

import torch

from flamia_verify.properties.cases import Case, Inputs
from flamia_verify.properties.compare import compare_bitwise
from flamia_verify.properties.helpers import (
    LAYOUT_HEADS,
    Doc,
    case_record,
    layout_base_run,
    layout_docs,
    pack_docs,
    verdict,
)
from flamia_verify.properties.registry import register

__all__ = ["head_cases"]

_SLICE = {"out": "q", "dq": "q", "dk": "k", "dv": "k"}


# ----------------------------------------------------------------------------------------------
# heads
# ----------------------------------------------------------------------------------------------


def head_cases(ctx) -> list[Case]:
    """6:2 GQA (groups of 3) with an empty document, causal, Lq != Lk; 7:1 (one group of 7), not causal."""
    return [
        ctx.case((40, 0, 57), (45, 3, 57), heads=6, heads_k=2, causal=True, seed_offset=701),
        ctx.case((33, 20), heads=7, heads_k=1, causal=False, distribution="shifted", seed_offset=702),
    ]


def _fresh(x: torch.Tensor, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(x.shape, generator=g) * 3.0).to(x.dtype).to(x.device)


def _with_head(inp: Inputs, names: tuple[str, ...], head: int, seed: int) -> Inputs:
    """The inputs with new values in head ``head`` of the tensors ``names``."""
    new = {}
    for i, n in enumerate(names):
        x = getattr(inp, n).clone()
        x[:, head] = _fresh(x[:, head], seed + i)
        new[n] = x
    return inp.replace(**new)


def _permuted(inp: Inputs, perm_q: list[int], perm_k: list[int]) -> Inputs:
    return inp.replace(q=inp.q[:, perm_q], do=inp.do[:, perm_q], k=inp.k[:, perm_k], v=inp.v[:, perm_k])


@register(
    "isolation.heads",
    "new values in one head leave every other head's out, dQ, dK, dV bitwise unchanged (GQA groups of 3 "
    "and 7); permuting the query heads inside a group, or the kv heads with their groups, permutes the "
    "results bitwise",
    defaults=lambda recipe, dtype: {"changed_elements": 0, "permutation_mismatches": 0},
    cost=1.0,
)
def heads(ctx):
    changed, perm_bad, first, runs = 0, 0, None, 0
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
                m = compare_bitwise(x[:, keep], base.tensors()[t][:, keep], what=f"{t} of the other heads ({what})")
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
                m = compare_bitwise(x, base.tensors()[t][:, perm], what=f"{t} ({what})")
                if not m.ok:
                    perm_bad += m.mismatched
                    if first is None:
                        first = case_record(case, tensor=t, permutation=what, mismatch=m.to_dict(), summary=m.summary())
        ctx.progress((n + 1) / len(cases))
    return verdict(
        ctx,
        {"changed_elements": changed, "permutation_mismatches": perm_bad, "runs": runs},
        ok_message=f"heads independent and permutation-equivariant, bitwise ({runs} perturbed or permuted runs)",
        first=first,
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


@register(
    "isolation.layout",
    "a packed document's out, dQ, dK, dV are bitwise unchanged when the other documents change order, "
    "number or lengths, and when max_seqlen is passed above the true maximum (dozens of documents, "
    "empty ones first, in the middle and last, one longer than every tile)",
    defaults=lambda recipe, dtype: {"changed_elements": 0},
    cost=2.0,
)
def layout(ctx):
    heads, heads_k = LAYOUT_HEADS
    docs = layout_docs(ctx)
    changed, first, packs, compared = 0, None, 0, 0
    variants = _variants(ctx, docs)
    # every variant causal; the order and the number of documents not causal too
    jobs = [(True, v) for v in variants] + [(False, v) for v in variants[:2]]
    where_base = _positions(docs)
    for n, (causal, (what, other, pad)) in enumerate(jobs):
        base = layout_base_run(ctx, docs, causal)
        new_inp = pack_docs(ctx, other, heads=heads, heads_k=heads_k, causal=causal, pad=pad)
        new = ctx.run(new_inp)
        packs += 1
        where_new = _positions(other)
        for d, (bq, bk) in where_base.items():
            if d not in where_new or (d.lq == 0 and d.lk == 0):
                continue
            nq, nk = where_new[d]
            compared += 1
            for t, x in new.tensors().items():
                a, b, length = (nq, bq, d.lq) if _SLICE[t] == "q" else (nk, bk, d.lk)
                m = compare_bitwise(
                    x[a : a + length], base.tensors()[t][b : b + length], what=f"{t} of a document ({what})"
                )
                if not m.ok:
                    changed += m.mismatched
                    if first is None:
                        first = case_record(
                            new_inp.case,
                            tensor=t,
                            changed=what,
                            causal=causal,
                            document={"lens": [d.lq, d.lk], "seed": d.seed, "at_q": nq, "at_k": nk, "before_at_q": bq},
                            documents=[[x.lq, x.lk, x.seed] for x in other],
                            mismatch=m.to_dict(),
                            summary=f"{m.summary()} ({what})",
                        )
        ctx.progress((n + 1) / len(jobs))
    tokens = sum(d.lq for d in docs)
    return verdict(
        ctx,
        {"changed_elements": changed, "packs": packs, "documents_compared": compared, "tokens": tokens},
        ok_message=(
            f"every document bitwise unchanged across {packs} layouts of a {len(docs)}-document pack of "
            f"{tokens} tokens ({compared} document comparisons)"
        ),
        first=first,
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
