"""bias: is the error systematic?

Inputs (docs/checks.md "bias"): q and k on the MX-exact E4M3 grid (so no recipe rounds them and the
score noise, whose softmax response is biased at second order, stays out), v and dO ~ N(0.5, 1)
(a common sign, so a one-sided error shows in the mean), plus one peaked case (q x 4: many small
probabilities, where mass lost to underflow shows) and one document of ``long_len`` keys (512 in the
quick suite: rows of many key tiles, where an online softmax keeps rescaling). Errors are pooled over the cases per tensor.

    bias.gain   gain = <x - r, r> / <r, r>: the fraction by which the kernel scales the tensor along
                the reference (negative: shrinkage). A round-to-nearest quantizer is unbiased to
                first order; truncation toward zero shrinks by ~0.7 u, a saturating scale rule and
                mass lost from the numerator shrink too.
                threshold |gain| <= u_T / 4, u_T the coarsest unit roundoff among the operands that
                reach the tensor (truncation gives ~0.7 u_T)
    bias.mean   mean(x - r) / rms(x - r): the share of the error that is a constant offset.
                fails when |m| > 1/2 (the offset carries more than a quarter of the error energy)
                and the offset is significant: |m| sqrt(rows) > 6 (rows = tokens x heads);
                ``significant_mean_share`` is the largest |m| among the significant tensors
"""

from __future__ import annotations

import math

import torch

from flamia_verify.properties.checks.common.cases import bias_cases
from flamia_verify.properties.checks.common.verdict import case_record, verdict
from flamia_verify.properties.registry import register
from flamia_verify.properties.tolerances import BIAS_Z
from flamia_verify.recipes import Recipe
from flamia_verify.recipes.operands import OPERANDS_REACHING

__all__ = ["GAIN_FRACTION", "MEAN_SHARE"]

#: the gain threshold as a fraction of u_T (truncation toward zero produces ~0.72 u_T)
GAIN_FRACTION = 0.25
#: a constant offset larger than half the RMS error carries more than a quarter of the error energy
MEAN_SHARE = 0.5


def _u_tensor(recipe: Recipe, dtype, tensor) -> float:
    model = recipe.bound_model(dtype)
    return max(model[op].u for op in OPERANDS_REACHING[tensor])


def _tensors(ctx):
    return ("out", "dq", "dk", "dv") if ctx.has_backward else ("out",)


def _pooled(ctx):
    def compute():
        cases = bias_cases(ctx)
        pooled: dict[str, tuple[list[torch.Tensor], list[torch.Tensor]]] = {
            t: ([], []) for t in ("out", "dq", "dk", "dv")
        }
        per_case: dict[str, list[tuple[float, float]]] = {
            t: [] for t in ("out", "dq", "dk", "dv")
        }  # (<e, r>, <r, r>) of every case
        for n, case in enumerate(cases):
            res, ref = ctx.run(case), ctx.reference(case)
            for t in _tensors(ctx):
                x = getattr(res, t)
                if x is None:
                    continue
                r = getattr(ref, t)
                e_c = (x.detach().double().to(r.device) - r).flatten()
                pooled[t][0].append(e_c)
                pooled[t][1].append(r.flatten())
                per_case[t].append((float((e_c * r.flatten()).sum()), float((r * r).sum())))
            ctx.progress((n + 1) / len(cases))
        stats = {}
        for t, (es, rs) in pooled.items():
            if not es:
                continue
            e, r = torch.cat(es), torch.cat(rs)
            rows = e.numel() / max(1, ctx.inputs(cases[0]).q.shape[-1])
            rr = float((r * r).sum())
            ee = float((e * e).sum())
            gain = float((e * r).sum()) / rr if rr > 0 else 0.0
            rms = math.sqrt(ee / e.numel()) if e.numel() else 0.0
            mean_share = float(e.mean()) / rms if rms > 0 else 0.0
            cos = float((e * r).sum()) / math.sqrt(ee * rr) if ee > 0 and rr > 0 else 0.0
            stats[t] = {
                "gain": gain,
                "mean_share": mean_share,
                "rows": rows,
                "mean_z": mean_share * math.sqrt(rows),
                "gain_z": cos * math.sqrt(rows),
                "gain_se_cases": _case_standard_error(per_case[t], gain),
            }
        return cases, stats

    return ctx.memo(("bias", ctx.has_backward), compute)


def _case_standard_error(parts, gain: float) -> float:
    """Standard error of the pooled gain from its spread over the cases it pools.

    The pooled gain is the energy-weighted mean of the per-case gains g_c = <e_c, r_c> / <r_c, r_c>
    with weights w_c = <r_c, r_c> / sum <r, r>; its standard error over cases is
    sqrt(n / (n - 1) * sum w_c^2 (g_c - gain)^2). It measures how much the gain moves from one input
    to another (seeds, packings), which the row-level z-score, computed as if every row were an
    independent draw, does not."""
    parts = [(er, rr) for er, rr in parts if rr > 0]
    n = len(parts)
    if n < 2:
        return 0.0
    total = sum(rr for _, rr in parts)
    var = sum((rr / total) ** 2 * (er / rr - gain) ** 2 for er, rr in parts)
    return math.sqrt(n / (n - 1) * var)


def _gain_defaults(recipe, dtype):
    return {f"gain_error_{t}": GAIN_FRACTION * _u_tensor(recipe, dtype, t) for t in ("out", "dq", "dk", "dv")}


@register(
    "bias.gain",
    "systematic gain of O, dQ, dK, dV along the reference (<x - r, r> / <r, r>): shrinkage from "
    "truncation, saturation or mass lost from the numerator",
    defaults=_gain_defaults,
    adjustable=tuple(f"gain_error_{t}" for t in ("out", "dq", "dk", "dv")),
    cost=1.5,
)
def gain(ctx):
    cases, stats = _pooled(ctx)
    metrics = {}
    for t, s in stats.items():
        metrics[f"gain_error_{t}"] = abs(s["gain"])
        metrics[f"gain_{t}"] = s["gain"]
        metrics[f"gain_z_{t}"] = s["gain_z"]
        metrics[f"gain_se_{t}"] = s["gain_se_cases"]
    th = {k: v for k, v in ctx.th.items() if k in metrics}
    worst = max(stats, key=lambda t: abs(stats[t]["gain"]) / max(ctx.th.get(f"gain_error_{t}", 1e-300), 1e-300))
    wc = case_record(cases[0], tensor=worst, gain=stats[worst]["gain"], pooled_cases=[c.to_dict() for c in cases])
    return verdict(
        ctx,
        metrics,
        ok_message="gains " + ", ".join(f"{t} {s['gain']:+.2e}" for t, s in stats.items()),
        worst_case=wc,
        thresholds=th,  # the tensors measured (no gradients on a forward-only kernel)
    )


@register(
    "bias.mean",
    "mean signed error relative to the RMS error of O, dQ, dK, dV (a constant offset), on inputs with a common sign",
    defaults=lambda recipe, dtype: {"significant_mean_share": MEAN_SHARE},
    adjustable=("significant_mean_share",),
    cost=0.2,
)
def mean(ctx):
    cases, stats = _pooled(ctx)
    worst = max(stats, key=lambda t: abs(stats[t]["mean_share"]))
    s = stats[worst]
    significant = abs(s["mean_z"]) > BIAS_Z
    # the gated number: the largest |mean share| among the tensors whose offset is significant
    gated = max((abs(st["mean_share"]) for st in stats.values() if abs(st["mean_z"]) > BIAS_Z), default=0.0)
    metrics = {"significant_mean_share": gated, "mean_share": abs(s["mean_share"]), "mean_z": s["mean_z"]}
    for t, st in stats.items():
        metrics[f"mean_share_{t}"] = st["mean_share"]
    extra = []
    over = abs(s["mean_share"]) > ctx.th["significant_mean_share"]
    wc = case_record(
        cases[0],
        tensor=worst,
        mean_share=s["mean_share"],
        mean_z=s["mean_z"],
        pooled_cases=[c.to_dict() for c in cases],
    )
    if over and significant:
        extra.append(
            f"{worst}: mean error is {s['mean_share']:+.3f} of the RMS error (z = {s['mean_z']:+.1f}): a systematic offset"
        )
    msg = f"largest mean/RMS {s['mean_share']:+.3f} ({worst}, z = {s['mean_z']:+.1f})"
    if over and not significant:
        msg += f"; not significant (|z| <= {BIAS_Z:g})"
    if gated > ctx.th["significant_mean_share"] and not extra:
        extra.append(f"a significant mean error of {gated:.3f} of the RMS error")
    # judged above: an offset fails only where it is significant too
    return verdict(ctx, metrics, ok_message=msg, worst_case=wc, failures=extra, judge_thresholds=False)
