"""isolation.fuzz: a bounded, reproducible fuzz pass inside the standard and full suites.

The fixed packings of the other checks are where a kernel's authors looked; the fuzz pass draws
packings nobody picked. It runs the same search as ``flamia-verify fuzz`` (see
:mod:`flamia_verify.properties.search`) for a fixed number of hypothesis examples seeded by the run's
seed, so a rerun with the same seed draws the same examples:

    suite      examples   shrinking budget (kernel evaluations after the first failure)
    standard   FUZZ_EXAMPLES["standard"]   SHRINK_LIMIT["standard"]
    full       FUZZ_EXAMPLES["full"]       SHRINK_LIMIT["full"]

Each example is a packing of odd document lengths (empty, 1-token, around 32/64/128, rarely one
longer than 256 tokens), Lq != Lk, GQA, head_dim 32/64/128, a value distribution and a softmax scale,
plus a target document, a position t and a perturbation. It must not raise, must stay finite and
inside the recipe's bound, and the target document must be causal (out, dQ before t; dK, dV after
t + offset) and isolated from the others, bitwise. The first failure is shrunk (within the budget);
``worst_case`` is the reproducer that ``flamia-verify fuzz --replay`` reruns, with ``property``
naming what failed (``causal``, ``isolation``, ``bound``, ``finite``, ``crash``): an example outside
the bound is also tested for a causal or cross-document leak, and named after the leak when it has one
(see :mod:`flamia_verify.properties.search`). The metrics count the examples asked for
(``examples_requested``), drawn (``examples_drawn``, of which ``examples_shrinking`` after the first
failure) and run on the kernel (``distinct_examples``).

Why one check in the isolation family: what the pass varies is the packing (where documents start,
how long they are, their key counts), the isolation family's subject; the search stops at its first
failure whatever the property, so one verdict is what it can honestly give. Its failures are named
by property in the message and worst case.
"""

from __future__ import annotations

from flamia_verify.properties.checks.common.verdict import verdict
from flamia_verify.properties.registry import register
from flamia_verify.properties.search import PROPERTIES, fuzz_sizes, search

__all__ = ["FUZZ_EXAMPLES", "SHRINK_LIMIT"]

#: hypothesis examples per suite (about 0.15 s each for the emulated flamia-mxfp8 on one CPU core)
FUZZ_EXAMPLES = {"standard": 16, "full": 48}

#: kernel evaluations spent shrinking the first failure (past it, the smallest failing example so far)
SHRINK_LIMIT = {"standard": 40, "full": 120}


@register(
    "isolation.fuzz",
    "random packings (hypothesis, seeded by the run's seed; odd lengths, Lq != Lk, GQA, head_dim up to "
    "128, rarely a document of up to 1024 tokens): no crash, finite, within the bound, causal (out, dQ, "
    "dK, dV) and isolated, bitwise; the first failure shrunk to a replayable case",
    suites=("standard", "full"),
    defaults=lambda recipe, dtype: {"failing_examples": 0},
    cost=4.0,
)
def fuzz_pass(ctx):
    max_tokens, long_tokens = fuzz_sizes(ctx.device)

    suite = ctx.settings.name
    examples = FUZZ_EXAMPLES.get(suite, FUZZ_EXAMPLES["standard"])
    shrink = SHRINK_LIMIT.get(suite, SHRINK_LIMIT["standard"])
    res = search(
        ctx,
        examples=examples,
        seed=ctx.seed,
        max_tokens=max_tokens,
        long_tokens=long_tokens,
        shrink_limit=shrink,
        on_example=lambda n: ctx.progress(n / examples),
    )
    failing = sum(res.counts.values())
    metrics = {
        "failing_examples": failing,
        "examples_requested": res.requested,
        "examples_drawn": res.examples,
        "examples_shrinking": res.shrinking,
        "distinct_examples": res.distinct,
        **{f"failing_{p}": n for p, n in res.counts.items() if n},
        **res.coverage(max_tokens),
    }
    search_info = {
        "seed": ctx.seed,
        "examples": examples,
        "shrink_limit": shrink,
        "max_tokens": max_tokens,
        "long_tokens": long_tokens,
        "shrink_stopped": res.shrink_stopped,
    }
    if res.finding is None:
        return verdict(
            ctx,
            metrics,
            ok_message=f"no failure in random packings: {res.counts_text()} "
            f"({metrics['long_document_examples']} with a long document, "
            f"{metrics['headdim_128_examples']} at head_dim 128)",
            details={"search": search_info},
        )
    f = res.finding
    rep: dict = res.reproducer  # type: ignore[assignment]  # a finding has its reproducer
    worst = dict(rep)
    worst.update(
        check=PROPERTIES[f.prop],
        detail=f.detail,
        search=search_info,
        replay=(
            "save this worst_case as case.json, then: flamia-verify fuzz --kernel KERNEL --replay case.json "
            f"(the same search: flamia-verify fuzz --kernel KERNEL --seed {ctx.seed} --examples {examples})"
        ),
    )
    summary = (
        f"{f.prop} failed on the minimal case lens_q={list(rep['lens_q'])} lens_k={list(rep['lens_k'])} "
        f"heads={rep['heads']}/{rep['heads_k']} d={rep['headdim']} document {rep['document']} t={rep['t']} "
        f"({rep['perturbation']}): {f.message}; {res.counts_text()}"
    )
    return verdict(ctx, metrics, ok_message="", worst_case=worst, details={"search": search_info}, failures=[summary])
