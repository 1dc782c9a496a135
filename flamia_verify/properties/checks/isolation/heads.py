"""isolation across heads: new values in one head reach no other, and permuted heads permute the results.

isolation.heads   head independence (information flow, gating): new values in one query head's q
                  and dO leave every other query head's out and dQ, and every other kv head's dK
                  and dV, bitwise unchanged; new k, v in one kv head leave the query heads outside
                  its group and the other kv heads bitwise unchanged
isolation.heads_bitwise
                  equivariance (structure, reproducibility): permuting the query heads inside each
                  GQA group permutes out and dQ; permuting the kv heads with their groups permutes
                  out, dQ, dK, dV, bitwise
"""

from __future__ import annotations

import torch

from flamia_verify.properties.cases import Case, Inputs
from flamia_verify.properties.checks.common.verdict import case_record, verdict
from flamia_verify.properties.compare import compare_bitwise
from flamia_verify.properties.registry import register

__all__ = ["head_cases"]

#: which side of the pack each output lies on (queries: out, dQ; keys: dK, dV)
SIDE = {"out": "q", "dq": "q", "dk": "k", "dv": "k"}


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
                    heads_here = may_q if SIDE[t] == "q" else may_k
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
                    if SIDE[t] == "k" and not grads_k:
                        continue  # dK, dV sum the group's heads in another order: not bitwise
                    perm = pq if SIDE[t] == "q" else pk
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
