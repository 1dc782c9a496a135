"""isolation: a packed document's results depend on nothing but the document.

    isolation.neighbours  the target document between neighbours; the neighbours replaced by huge,
                          tiny or other random values -> target out, dQ, dK, dV bitwise unchanged
    isolation.nan         every neighbour's q, k, v, dO set to NaN -> target bitwise unchanged and
                          finite (a varlen kernel never loads another document's rows)
    isolation.offset      the document alone vs. packed at other offsets among other neighbours: the
                          difference relative to its RMS within the error family's tolerance (gating)
    isolation.offset_bitwise
                          the same runs, bitwise equal (reproducibility: a kernel whose tiles start at
                          absolute positions rounds a document differently at another offset)

          pack:  [ before | target (L) | after ]      cu_seqlens = [0, before, before + L, before + L + after]

The targets: one causal document with 2:1 GQA, one non-causal document, and one causal document
with more keys than queries (Lk = 1.5 L + 3) and 4:2 GQA, packed among neighbours whose key counts
differ from their query counts too (7 more keys before, 5 more after; a (1, 0) layout packs a
document of 0 queries and 5 keys after it). There cu_seqlens_q != cu_seqlens_k at every boundary, so
a kernel that lays out its K/V blocks (or any key-side state) at cu_seqlens_q, or swaps the two
anywhere, mixes neighbour keys into the target's blocks.
"""

from __future__ import annotations

import torch

from flamia_verify.properties.cases import Case, Inputs, cu_from_lens
from flamia_verify.properties.checks.common.noise import run_noise
from flamia_verify.properties.checks.common.verdict import case_record, verdict
from flamia_verify.properties.compare import compare_beyond_noise, compare_bitwise
from flamia_verify.properties.registry import register
from flamia_verify.properties.tolerances import ERROR_MODEL_FACTOR, predicted_rel_rmse

__all__ = ["pack_document"]

NEIGHBOUR_SCALE = {"random": 300.0, "huge": 1.0e4, "tiny": 1.0e-4}


def pack_document(
    target: Inputs,
    before: int,
    after: int,
    kind: str,
    seed: int,
    *,
    before_k: int | None = None,
    after_k: int | None = None,
) -> Inputs:
    """The target document (a one-document Inputs) with ``before`` and ``after`` neighbour tokens
    whose values are N(0, 1) times NEIGHBOUR_SCALE[kind] (or NaN for ``kind="nan"``). The neighbours
    hold ``before``/``after`` queries and ``before_k``/``after_k`` keys (default: as many as queries).
    The pack's case is the target's packed among them (its seed the target's): packs of one layout with
    other neighbour values share it, as a perturbation of one case does (a stateful kernel runs them at
    one state: harness.StatePin)."""
    c = target.case
    g = torch.Generator().manual_seed(seed)
    before_k = before if before_k is None else before_k
    after_k = after if after_k is None else after_k
    parts = {}
    for name in ("q", "k", "v", "do"):
        x = getattr(target, name)
        nb, na = (before, after) if name in ("q", "do") else (before_k, after_k)
        shape_b, shape_a = (nb,) + tuple(x.shape[1:]), (na,) + tuple(x.shape[1:])
        if kind == "nan":
            pre = torch.full(shape_b, float("nan"))
            post = torch.full(shape_a, float("nan"))
        else:
            pre = torch.randn(shape_b, generator=g) * NEIGHBOUR_SCALE[kind]
            post = torch.randn(shape_a, generator=g) * NEIGHBOUR_SCALE[kind]
        parts[name] = torch.cat([pre.to(x.dtype).to(x.device), x, post.to(x.dtype).to(x.device)])
    lens = (before, c.lens_q[0], after)
    lens_k = (before_k, c.lens_k[0], after_k)
    case = Case(
        lens,
        lens_k,
        heads=c.heads,
        heads_k=c.heads_k,
        headdim=c.headdim,
        causal=c.causal,
        distribution=c.distribution,
        seed=c.seed,
        dtype=c.dtype,
    )
    dev = target.q.device
    return Inputs(
        case, parts["q"], parts["k"], parts["v"], parts["do"], cu_from_lens(lens, dev), cu_from_lens(lens_k, dev)
    )


#: extra neighbour keys (before, after) around a target whose key count differs from its query count
K_EXTRA = (7, 5)


def _k_layout(target_case: Case, before: int, after: int) -> tuple[int, int]:
    """Neighbour key counts for a layout: as many as queries for an equal-length target, more otherwise."""
    if target_case.lens_q == target_case.lens_k:
        return before, after
    return before + K_EXTRA[0], after + K_EXTRA[1]


def _pack(target_case: Case, tgt: Inputs, before: int, after: int, kind: str, seed: int) -> Inputs:
    bk, ak = _k_layout(target_case, before, after)
    return pack_document(tgt, before, after, kind, seed, before_k=bk, after_k=ak)


def _targets(ctx):
    L = ctx.settings.isolation_len
    return [
        ctx.case((L,), heads=2, heads_k=1, causal=True, seed_offset=21),
        ctx.case((L,), heads=2, heads_k=2, causal=False, seed_offset=22),
        ctx.case((L,), (L + L // 2 + 3,), heads=4, heads_k=2, causal=True, seed_offset=23),
    ]


def _target_slice(target_case: Case, name: str, before: int, before_k: int) -> slice:
    if name in ("out", "dq"):
        return slice(before, before + target_case.lens_q[0])
    return slice(before_k, before_k + target_case.lens_k[0])


def _compare_target(
    ctx, target_case, alone_or_base, packed, before: int, what: str, *, alone: bool = False, noise=None
):
    """Bitwise comparison of the target slice of every tensor; returns list of (name, Mismatch).
    ``noise``: the run-to-run noise of the base (:func:`~flamia_verify.properties.checks.common.noise.run_noise`),
    for an information-flow comparison that a kernel without bitwise repeatability can pass."""
    out = []
    before_k = _k_layout(target_case, before, 0)[0]
    for name in ("out", "dq", "dk", "dv"):
        a = getattr(alone_or_base, name)
        p = getattr(packed, name)
        if a is None or p is None:
            continue
        sl = _target_slice(target_case, name, before, before_k)
        a_t = a if alone else a[sl]
        label = f"{name} of the target document ({what})"
        against = "the document alone" if alone else "the pack with random neighbours"
        if noise is None:
            out.append((name, compare_bitwise(p[sl], a_t, what=label, against=against)))
        else:
            out.append((name, compare_beyond_noise(p[sl], a_t, noise.get(name), what=label, against=against)))
    return out


def _base_noise(ctx, target_case, before: int, after: int, base_inp, base) -> dict[str, float | None]:
    """The run-to-run noise of the base pack of (target, before, after) (None for a repeatable kernel)."""
    return run_noise(ctx, ("iso-base", target_case, before, after), base, lambda: ctx.run(base_inp))


@register(
    "isolation.neighbours",
    "a packed document's out, dQ, dK, dV are bitwise unchanged when its neighbours are replaced by "
    "huge, tiny or other random values",
    defaults=lambda recipe, dtype: {"changed_elements": 0},
    cost=2.0,
)
def neighbours(ctx):
    layouts = ctx.settings.isolation_layouts
    jobs = [(t, lay, kind) for t in _targets(ctx) for lay in layouts for kind in ("huge", "tiny")]
    changed, first, runs = 0, None, 0
    for n, (target_case, (before, after), kind) in enumerate(jobs):
        if before + after == 0:
            continue
        tgt = ctx.inputs(target_case)
        base_inp = _pack(target_case, tgt, before, after, "random", seed=target_case.seed * 31 + before)
        new_inp = _pack(target_case, tgt, before, after, kind, seed=target_case.seed * 37 + after)
        base = ctx.memo(("iso-base", target_case, before, after), lambda: ctx.run(base_inp))  # noqa: B023 (ctx.memo calls it at once)
        noise = _base_noise(ctx, target_case, before, after, base_inp, base)
        new = ctx.run(new_inp)
        runs += 1
        for name, m in _compare_target(ctx, target_case, base, new, before, f"neighbours {kind}", noise=noise):
            if not m.ok:
                changed += m.mismatched
                if first is None:
                    first = case_record(
                        target_case,
                        tensor=name,
                        layout=[before, after],
                        layout_k=list(_k_layout(target_case, before, after)),
                        neighbours=kind,
                        neighbour_seed=target_case.seed * 37 + after,
                        mismatch=m.to_dict(),
                        summary=m.summary(),
                    )
        ctx.progress((n + 1) / len(jobs))
    return verdict(
        ctx,
        {"changed_elements": changed, "perturbations": runs},
        ok_message=f"target document bitwise unchanged under {runs} neighbour changes",
        first=first,
    )


@register(
    "isolation.nan",
    "NaN in every other document's q, k, v, dO leaves a document's out, dQ, dK, dV bitwise unchanged and finite",
    defaults=lambda recipe, dtype: {"changed_elements": 0, "nonfinite": 0},
    cost=1.0,
)
def nan(ctx):
    changed, nonfinite, first, runs = 0, 0, None, 0
    jobs = [(t, lay) for t in _targets(ctx) for lay in ctx.settings.isolation_layouts[:2]]
    for n, (target_case, (before, after)) in enumerate(jobs):
        tgt = ctx.inputs(target_case)
        base_inp = _pack(target_case, tgt, before, after, "random", seed=target_case.seed * 31 + before)
        base = ctx.memo(("iso-base", target_case, before, after), lambda: ctx.run(base_inp))  # noqa: B023 (ctx.memo calls it at once)
        noise = _base_noise(ctx, target_case, before, after, base_inp, base)
        new = ctx.run(_pack(target_case, tgt, before, after, "nan", seed=0))
        runs += 1
        before_k = _k_layout(target_case, before, after)[0]
        for name, m in _compare_target(ctx, target_case, base, new, before, "NaN neighbours", noise=noise):
            x = getattr(new, name)[_target_slice(target_case, name, before, before_k)]
            nonfinite += int((~torch.isfinite(x)).sum())
            if not m.ok:
                changed += m.mismatched
                if first is None:
                    first = case_record(
                        target_case,
                        tensor=name,
                        layout=[before, after],
                        layout_k=list(_k_layout(target_case, before, after)),
                        neighbours="nan",
                        mismatch=m.to_dict(),
                        summary=m.summary(),
                    )
        ctx.progress((n + 1) / len(jobs))
    return verdict(
        ctx,
        {"changed_elements": changed, "nonfinite": nonfinite, "perturbations": runs},
        ok_message=f"target document bitwise unchanged and finite next to NaN documents ({runs} packs)",
        first=first,
    )


def _offset_findings(ctx) -> dict:
    """Each target alone and packed at the suite's offsets, run once for both halves of
    isolation.offset: the bitwise mismatches and the largest difference relative to the RMS."""

    def compute() -> dict:
        mismatches, first, worst_rel, worst_rel_record, runs, bitwise_runs = 0, None, 0.0, None, 0, 0
        jobs = [(t, lay) for t in _targets(ctx) for lay in ctx.settings.isolation_layouts]
        for n, (target_case, (before, after)) in enumerate(jobs):
            alone = ctx.run(target_case)
            tgt = ctx.inputs(target_case)
            packed = ctx.memo(
                ("iso-base", target_case, before, after),
                lambda: ctx.run(_pack(target_case, tgt, before, after, "random", seed=target_case.seed * 31 + before)),  # noqa: B023 (ctx.memo calls it at once)
            )
            runs += 1
            before_k = _k_layout(target_case, before, after)[0]
            all_equal = True
            for name, m in _compare_target(ctx, target_case, alone, packed, before, f"offset {before}", alone=True):
                a = getattr(alone, name).double()
                p = getattr(packed, name)[_target_slice(target_case, name, before, before_k)].double()
                rms = float(a.pow(2).mean().sqrt())
                rel = float((p - a).pow(2).mean().sqrt()) / rms if rms > 0 else 0.0
                rel = rel if rel == rel else float("inf")
                record = dict(
                    tensor=name,
                    layout=[before, after],
                    layout_k=list(_k_layout(target_case, before, after)),
                    rel_diff=rel,
                    mismatch=m.to_dict(),
                    summary=f"{m.summary()} (relative to its RMS: {rel:.3g})",
                )
                if rel > worst_rel:
                    worst_rel, worst_rel_record = rel, case_record(target_case, **record)
                if not m.ok:
                    all_equal = False
                    mismatches += m.mismatched
                    if first is None:
                        first = case_record(target_case, **record)
            bitwise_runs += all_equal
            ctx.progress((n + 1) / len(jobs))
        return {
            "mismatches": mismatches,
            "first": first,
            "worst_rel": worst_rel,
            "worst_rel_record": worst_rel_record,
            "runs": runs,
            "bitwise_runs": bitwise_runs,
        }

    return ctx.memo(("offset-findings",), compute)


def _offset_defaults(recipe, dtype):
    return {"rel_diff": ERROR_MODEL_FACTOR * predicted_rel_rmse(recipe, dtype, "out")}


@register(
    "isolation.offset",
    "a document's out, dQ, dK, dV packed at other offsets among other neighbours differ from the document "
    "alone by at most the error checks' tolerance, relative to its RMS",
    defaults=_offset_defaults,
    adjustable=("rel_diff",),
    cost=2.0,
)
def offset(ctx):
    f = _offset_findings(ctx)
    metrics = {"rel_diff": f["worst_rel"], "bitwise_equal_packs": f["bitwise_runs"], "packs": f["runs"]}
    ok_message = (
        f"document bitwise identical alone and at {f['runs']} offsets"
        if not f["mismatches"]
        else f"document alone and at {f['runs']} offsets within the error tolerance (largest difference "
        f"{f['worst_rel']:.3g} of the RMS; bits differ at {f['runs'] - f['bitwise_runs']}: isolation.offset_bitwise)"
    )
    return verdict(ctx, metrics, ok_message=ok_message, worst_case=f["worst_rel_record"] or {})


@register(
    "isolation.offset_bitwise",
    "a document gives bitwise the same out, dQ, dK, dV alone and packed at other offsets among other neighbours",
    defaults=lambda recipe, dtype: {"bitwise_mismatches": 0},
    adjustable=("bitwise_mismatches",),
    cost=0.1,
    verdict="reproducibility",
)
def offset_bitwise(ctx):
    f = _offset_findings(ctx)
    metrics = {"bitwise_mismatches": f["mismatches"], "bitwise_equal_packs": f["bitwise_runs"], "packs": f["runs"]}
    ok_message = f"document bitwise identical alone and at {f['runs']} offsets"
    if f["mismatches"]:  # accepted by a raised bitwise_mismatches limit: say so instead of "identical"
        ok_message = (
            f"{f['mismatches']} elements differ between the document alone and packed ({f['runs'] - f['bitwise_runs']} "
            f"of {f['runs']} packs; accepted up to {ctx.th.get('bitwise_mismatches', 0):g})"
        )
    return verdict(ctx, metrics, ok_message=ok_message, worst_case=f["first"] or {}, failures=[])
