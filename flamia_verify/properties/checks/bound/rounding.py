"""bound.rounding: every MXFP8 operand rounds exactly as the recipe says.

The recipe's bound (bound.out, bound.grad) must hold for any block layout, so it charges every
element's underflow at the worst block scale of its line: it cannot tell a block scale one exponent
too large from the right one (only elements 2^-13 below their block maximum lose a bit), nor
rounding toward zero from rounding to nearest on inputs that lie on the grid. But an MX recipe fixes
the rounding completely (E4M3, 32-blocks along the contraction axis, E8M0 by RCEIL or FLOOR, RNE).
On the probe inputs of :mod:`flamia_verify.properties.mx_probes` it is known in closed form, every
other rounding is exact, and the weights are exactly uniform; a kernel that follows its recipe then
computes the attention of the *rounded* inputs, up to fp32 accumulation and the rounding of its
outputs. That residue is bounded rigorously by the bound model with every operand exact
(:func:`~flamia_verify.recipes.bounds.exact_operands_model`); no element may leave it.

Probed: each of the recipe's MXFP8 sites (Q, K in S; V in PV; dO, V in dP; dO in dV; dS, K in dQ;
dS^T, Q in dK) with grid probes, and its input operands with step probes. Scale-rule probes
(``scale``: V, dO, K, Q along the sequence; ``tiny``: V, BF16/fp32 inputs only) put block maxima on
both sides of every boundary of the recipe's E8M0 rule and of the plausible wrong ones (docs/checks.md);
the grid probes' maxima, powers of two, cannot tell most of those rules apart. Sites the recipe does not
round as MXFP8 (BF16; FP8 with a scale of any granularity; NVFP4's P^T, dS, dS^T) are not probed:
their rounding is not fixed by the recipe.
"""

from __future__ import annotations

from flamia_verify.properties.acc_probe import ACC_DIM, ACC_LEN, ACC_SCALE
from flamia_verify.properties.acc_probe import SITES as ACC_SITES
from flamia_verify.properties.bounds import bounds_of
from flamia_verify.properties.checks.common.error_model import bound_ratio
from flamia_verify.properties.checks.common.verdict import case_record, verdict
from flamia_verify.properties.compare import compare_within
from flamia_verify.properties.mx_probes import (
    PROBE_DIM,
    PROBE_LEN,
    PROBE_SCALE,
    PROBES,
    SITE_OPERANDS,
    Probe,
    probe_tensors,
    scale_probes,
)
from flamia_verify.properties.registry import register
from flamia_verify.recipes import Recipe
from flamia_verify.recipes.bounds import exact_operands_model

__all__ = ["probe_case", "mx_sites", "rounding_report"]


def mx_sites(recipe: Recipe, dtype) -> tuple[str, ...]:
    """The probe sites whose every operand the recipe rounds as MXFP8."""
    model = recipe.bound_model(dtype)
    return tuple(s for s, ops in SITE_OPERANDS.items() if all(model[op].mx_block for op in ops))


def probe_case(ctx, probe: Probe, seed_offset: int = 0):
    return ctx.case(
        (PROBE_LEN,),
        heads=1,
        headdim=PROBE_DIM,
        causal=False,
        softmax_scale=PROBE_SCALE,
        overrides=(("probe", probe.tag),),
        seed_offset=4000 + seed_offset,
    )


class _Tally:
    """What a run of probe cases found: elements outside their bound, the largest bound ratio
    (overall and per site), the cases run and the first violating case."""

    def __init__(self) -> None:
        self.violations = 0
        self.tight = 0.0
        self.per_site: dict[str, float] = {}
        self.cases = 0
        self.first: dict | None = None

    def add(self, ctx, case, got, want, bound, *, tensor: str, key: str, what: str, rule: str, label: str, **record):
        """Compare one observed tensor of ``case`` with ``want`` within ``bound``; ``key`` is the site
        of the per-site tightness, ``label`` names the tensor in the first violation's summary,
        ``record`` adds fields to that case record."""
        m = compare_within(got, want, bound, what=what, rule=rule, cu_seqlens=[0, case.total_q])
        t = float(bound_ratio(got, want, bound).max())
        self.tight = max(self.tight, t)
        name = f"tightness_{key}"
        self.per_site[name] = max(self.per_site.get(name, 0.0), t)
        if not m.ok:
            self.violations += m.mismatched
            if self.first is None:
                self.first = case_record(
                    case,
                    tensor=tensor,
                    **record,
                    recipe=ctx.recipe.name,
                    mismatch=m.to_dict(),
                    summary=f"{label}: {m.summary()}",
                )

    def metrics(self) -> dict:
        return {"violations": self.violations, "tightness": self.tight, "probe_cases": self.cases, **self.per_site}


def rounding_report(ctx, probes, seeds: int = 1):
    """Run ``probes`` (``seeds`` draws each); count elements of their observed tensors outside the
    exact-operand bound around the attention of the rounded inputs (the scale-rule probes rounded by
    the recipe's rule). ``probe_cases`` counts the grid and step probe cases, ``scale_cases`` the
    scale-rule ones."""
    model = exact_operands_model(ctx.bound_model)
    rule = ctx.recipe.scale_rule
    tally = _Tally()
    scale_cases = 0
    jobs = [(p, s) for s in range(seeds) for p in probes]
    for n, (probe, s) in enumerate(jobs):
        case = probe_case(ctx, probe, s)
        res = ctx.run(case)
        inp = ctx.inputs(case)
        _, rounded = probe_tensors(probe, case.seed, rule)
        scale_cases += probe.variant in ("scale", "tiny")
        rin = inp.replace(**{k: v.to(inp.q.device) for k, v in rounded.items()})
        ref = ctx.reference(rin)
        B = bounds_of(rin, ref, scale=case.scale, causal=False, model=model)
        tally.cases += 1
        for t in probe.observed:
            x = getattr(res, t)
            if x is None:
                continue
            tally.add(
                ctx,
                case,
                x,
                getattr(ref, t),
                getattr(B, t),
                tensor=t,
                key=probe.site,
                what=f"|{t} - attention of the rounded inputs|",
                rule="within fp32 accumulation and the output rounding",
                label=f"{t} of probe {probe.tag} ({probe.describe()})",
                probe=probe.tag,
                site=probe.describe(),
            )
        ctx.progress((n + 1) / len(jobs))
    metrics = tally.metrics()
    metrics["probe_cases"] -= scale_cases
    metrics["scale_cases"] = scale_cases
    return metrics, tally.first


@register(
    "bound.rounding",
    "each MXFP8 operand of the recipe rounds exactly as the recipe says (E4M3, 32-blocks, the E8M0 "
    "scale rule, round to nearest): on probe inputs where that rounding is known in closed form and "
    "every other one is exact, O and the gradients equal the attention of the rounded inputs to "
    "within fp32 accumulation and the output rounding; no violation allowed",
    defaults=lambda recipe, dtype: {"violations": 0},
    cost=0.5,
)
def bound_rounding(ctx):
    sites = mx_sites(ctx.recipe, ctx.dtype)
    if not sites:
        return ctx.skip(
            f"the {ctx.recipe.name} recipe rounds no GEMM operand as MXFP8 (E4M3 32-blocks with an "
            "E8M0 scale rule): no operand's rounding is fixed by the recipe"
        )
    candidates = [p for p in PROBES + scale_probes(ctx.dtype) if p.site in sites]
    probes = [p for p in candidates if ctx.has_backward or not p.needs_backward]
    left_out = sorted({p.site for p in candidates} - {p.site for p in probes})
    metrics, first = rounding_report(ctx, probes, seeds=ctx.settings.rounding_seeds)
    not_probed = [s for s in SITE_OPERANDS if s not in sites]
    notes = []
    if not_probed:
        notes.append(f"not MXFP8 in the recipe, not probed: {', '.join(not_probed)}")
    if left_out:
        notes.append(f"no backward, not probed: {', '.join(left_out)}")
    scaled = sorted({p.site for p in probes if p.variant in ("scale", "tiny")})
    msg = (
        f"every probed operand rounds as the {ctx.recipe.name} recipe says on {metrics['probe_cases']} probe cases "
        f"({', '.join(sorted({p.site for p in probes}))}) and {metrics['scale_cases']} scale-rule cases "
        f"(block maxima either side of every {ctx.recipe.scale_rule.name} boundary and of its wrong "
        f"twins: {', '.join(scaled)}); tightness {metrics['tightness']:.3g}"
    )
    if notes:
        msg += "; " + "; ".join(notes)
    return verdict(ctx, metrics, ok_message=msg, first=first)


@register(
    "bound.accumulation",
    "the GEMM sums are as wide as the recipe says: on inputs that every recipe's operands represent "
    "exactly and whose output only a narrow accumulator changes (uniform weights, a cancelling +-448 "
    "pair beside values below 2^-5 in each 32-long slice of V, and of dO for dV = P^T dO), O and dV "
    "equal the exact attention to within the recipe's accumulator and the output rounding; no "
    "violation allowed",
    defaults=lambda recipe, dtype: {"violations": 0},
    cost=0.1,
)
def bound_accumulation(ctx):
    model = exact_operands_model(ctx.bound_model)
    tally = _Tally()
    sites = [s for s in ACC_SITES if ctx.has_backward or ACC_SITES[s] == "out"]
    jobs = [(site, d) for d in range(ctx.settings.rounding_seeds) for site in sites]
    for n, (site, draw) in enumerate(jobs):
        observed = ACC_SITES[site]
        case = ctx.case(
            (ACC_LEN,),
            heads=1,
            headdim=ACC_DIM,
            causal=False,
            softmax_scale=ACC_SCALE,
            overrides=(("accprobe", site),),
            seed_offset=4500 + draw,
        )
        res = ctx.run(case)
        got = getattr(res, observed)
        if got is None:
            continue
        inp = ctx.inputs(case)
        ref = ctx.reference(inp)
        grads = observed != "out"
        B = bounds_of(inp, ref, scale=case.scale, causal=False, model=model, grads=grads)
        tally.cases += 1
        tally.add(
            ctx,
            case,
            got,
            getattr(ref, observed),
            getattr(B, observed),
            tensor=observed,
            key=site,
            what=f"|{observed} - exact attention|",
            rule=f"within the {ctx.recipe.name} recipe's accumulator and the output rounding",
            label=f"{observed} of the accumulation probe ({site})",
            site=site,
        )
        ctx.progress((n + 1) / len(jobs))
    metrics = tally.metrics()
    msg = (
        f"{' and '.join(ACC_SITES[s] for s in sites)} within the {ctx.recipe.name} recipe's accumulator on "
        f"{tally.cases} accumulation probe(s) (a +-448 pair beside values below 2^-5 in every 32-long "
        f"slice); tightness {tally.tight:.3g}"
    )
    if not ctx.has_backward:
        msg += "; no backward, dV not probed"
    first = tally.first
    return verdict(ctx, metrics, ok_message=msg, first=first)
