"""consistency.homogeneity: attention is positively homogeneous in V and in the upstream gradient.

For c > 0, O(c V) = c O(V) and the gradients of c V are (c dQ, c dK, dV); the gradients of c dO are
c times those of dO and the output does not move. For a power of two c every floating-point step of
a kernel scales exactly (a product or a quotient with 2^k is exact away from the ends of the range),
and so does every scale that a recipe derives from the data it scales: an E8M0 block scale of an MX
operand (the block's amax moves by 2^k, so does its scale, and the E4M3 elements are the same), an
NVFP4 block scale (the UE4M3 ratio of the block's amax to the row's fp32 amax does not move) and the
fp32 per-tensor scale amax/448 of current scaling (fl(c amax / 448) = c fl(amax / 448)). A correct
kernel therefore gives *bitwise* c times its unscaled results. What breaks it is a constant
somewhere: an epsilon added to an amax, a clamped scale exponent, small values flushed to zero, a
threshold in absolute units. Such a kernel is right at the magnitudes of N(0, 1) inputs and wrong
at those of training: dO is as small as loss / tokens (2^-20 and below), V's heads differ by orders
of magnitude.

Attention runs head by head, so the same holds per head: V of one kv head x c moves that head's
results (O and dQ of its query heads, its dK) by c and leaves every other head's bitwise where they
were. A scale shared by the heads (one amax over all of them, where the recipe's blocks are per
head) breaks that, and only that: at the magnitudes of one training step it is off by a factor
E4M3's range absorbs.

Cases: the base cases of the first seed and the dimension cases (head_dims that are not multiples of
16, rows whose maximum lies late, heads 100x apart; not the long document). Each is run four or five
more times: V x 2^-8 and x 2^6, dO x 2^-40 and x 2^8, and (two kv heads or more) V of the last kv
head alone x 2^6, each factor pulled in toward 1 as far as it must be to keep the scaled tensor, and
the results that move with it, 2^8 below the input dtype's largest value (dO: 2^8 times the longest
document's query count, the most rows one dV element sums) and their RMS 2^6 above the dtype's
smallest normal; a factor that cannot move at all (dO already near fp16's floor) is left out. On bf16
inputs the nominal factors stand; on fp16 they come to about 2^-4 to 2^5.

Judged bitwise (``mismatched_elements``, no finding allowed) where the recipe fixes every scale as a
function of the data it scales and the input dtype's range holds the scaled values: recipes bf16
(no scales), mxfp8, mxfp8-floor and nvfp4, on bf16 or fp32 inputs. The comparison is relative: the
scaled run's result divided by c against the unscaled run's, so a kernel that returns zero
gradients for a tiny dO fails however small they are. Where the expected result lies below the
output dtype's smallest normal (its subnormals), one subnormal step of the output is allowed (the
rounding of c x to a subnormal and of x to a normal are two roundings).

Judged by the recipe's rigorous bound and its error model instead, where bits are not promised:
every scaled run within the bound of its own inputs (``violations`` = 0) and its relative RMSE
within twice the recipe's rounding model on those inputs (``normalized_error`` <= 2, the error
family's rule). Both are relative to the scaled run's own size, and the second is what makes it
strict: a gradient's rigorous bound can exceed the gradient itself (the bound of dQ at dO x 2^-40
holds an all-zero dQ), a relative RMSE of 1 cannot meet the model. Where:

* fp16 inputs: fp16's normal range ends at 2^-14, so c O, c dQ, ... (and D = rowsum(dO O), which a
  backward forms from the output as the caller holds it, in fp16) fall into its subnormals for a
  share of the elements and round there to another grid; the BF16 recipe's dS, rounded to the input
  dtype without a scale, does the same. Measured: `bf16` and `flamia-mxfp8` on fp16 inputs differ
  from c x (unscaled) in tens to hundreds of elements per run above fp16's smallest normal (through
  D and dS), in none on bf16 inputs.
* the fp8 and fp8-mma recipes: "power-of-two or fp32 scales of any granularity" admits a per-tensor
  scale taken from an amax history (TransformerEngine's delayed scaling, the ``cudnn-fp8`` adapter)
  rather than from the call's own data; such a scale does not follow c, and the kernel is correct by
  its recipe. (The built-in ``fp8``, ``fp8-tensor`` and ``fp8-mma`` are bitwise homogeneous: their
  scales are current.) The bitwise differences are reported (``bitwise_differences``), not judged.

    consistency.homogeneity   V x 2^-8 and 2^6: out, dQ, dK x c and dV unchanged; dO x 2^-40 and 2^8:
                              dQ, dK, dV x c and out unchanged; V of one kv head x 2^6: that head's
                              out, dQ, dK x c, every other head unchanged
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from flamia_verify.properties.cases import Case, dimension_cases
from flamia_verify.properties.checks.common.error_model import bound_report, normalized_error
from flamia_verify.properties.checks.common.noise import run_noise
from flamia_verify.properties.checks.common.verdict import case_record, verdict
from flamia_verify.properties.compare import compare_within, noise_tolerance
from flamia_verify.properties.metrics import error_stats
from flamia_verify.properties.registry import register
from flamia_verify.properties.tolerances import ERROR_MODEL_FACTOR

__all__ = ["EXACT_RECIPES", "FACTORS", "HEAD_FACTOR", "Scaling", "homogeneity_cases", "scaled_cases"]

#: the power-of-two factors each input is scaled by (before the range limits of the dtype pull them in)
FACTORS = {"v": (2.0**-8, 2.0**6), "do": (2.0**-40, 2.0**8)}
#: the factor one kv head's V is scaled by, alone (the other heads must not move by a bit)
HEAD_FACTOR = 2.0**6
#: the recipes whose every scale follows the data it scales (or that have none): bitwise homogeneous
EXACT_RECIPES = ("bf16", "mxfp8", "mxfp8-floor", "nvfp4")
#: the input dtypes whose range holds the scaled values and results (fp32's exponent range)
EXACT_DTYPES = (torch.bfloat16, torch.float32)
#: the scaled tensor's largest |value| stays this many binades below the dtype's largest value, its
#: RMS this many above the dtype's smallest normal
TOP_MARGIN_LOG2 = 8
FLOOR_MARGIN_LOG2 = 6

#: how each result moves when the input is scaled by c: its power of c (dV does not depend on V's
#: scale, out not on dO's)
_POWER = {"v": {"out": 1, "dq": 1, "dk": 1, "dv": 0}, "do": {"out": 0, "dq": 1, "dk": 1, "dv": 1}}
_LABEL = {"v": "V", "do": "dO"}
#: the token axis each result lies along (its document lengths)
_QUERY_SIDE = ("out", "dq")


@dataclass(frozen=True)
class Scaling:
    """One scaled run of a case: ``what`` was scaled (``v``, ``do``), by ``factor``, in every head
    (``head`` None) or in kv head ``head`` of V only; ``case`` the scaled case."""

    what: str
    factor: float
    head: int | None
    case: Case

    @property
    def label(self) -> str:
        where = "" if self.head is None else f" of kv head {self.head}"
        return f"{_LABEL[self.what]}{where} x {_pow2(self.factor)}"

    def factors(self, tensor: str, base: Case) -> torch.Tensor:
        """The factor each head of ``tensor`` moves by, shaped (1, heads, 1)."""
        power = _POWER[self.what][tensor]
        heads = base.heads if tensor in _QUERY_SIDE else base.heads_k
        f = torch.ones(heads, dtype=torch.float64)
        if self.head is None:
            f[:] = self.factor**power
        else:  # V of kv head g: its query heads' out and dQ, its own dK
            group = base.heads // base.heads_k
            moved = range(self.head * group, (self.head + 1) * group) if tensor in _QUERY_SIDE else [self.head]
            f[list(moved)] = self.factor**power
        return f.view(1, heads, 1)


def homogeneity_cases(ctx) -> list[Case]:
    """The base cases of the first seed and the dimension cases without the long document."""
    base = ctx.base_cases()[: len(ctx.settings.base)]
    wide = dimension_cases(ctx.settings.name, seed=ctx.seed, dtype=ctx.dtype_str, device=ctx.device, long=False)
    return base + wide


def _factor(parts: list[tuple[torch.Tensor, int]], nominal: float, dtype: torch.dtype) -> float | None:
    """``nominal`` pulled toward 1 (by powers of two) until c x keeps the margins of ``dtype``'s range for
    every tensor x of ``parts`` (the scaled input and the results that move with it); None when no power
    of two other than 1 does. With each tensor the most elements one result sums of it: the headroom
    above the largest value is divided by it."""
    fi = torch.finfo(dtype)
    top: float = math.inf
    floor: float = -math.inf
    for x, rows in parts:
        xf = torch.nan_to_num(x.detach().double(), nan=0.0, posinf=0.0, neginf=0.0)
        amax = float(xf.abs().max()) if xf.numel() else 0.0
        rms = float(xf.pow(2).mean().sqrt()) if xf.numel() else 0.0
        if not amax > 0:
            continue
        top = min(top, math.floor(math.log2(fi.max) - TOP_MARGIN_LOG2 - math.log2(amax) - math.log2(max(rows, 1))))
        floor = max(floor, math.ceil(math.log2(fi.smallest_normal) + FLOOR_MARGIN_LOG2 - math.log2(rms)))
    if top == math.inf:
        return None
    wanted = int(round(math.log2(nominal)))
    e = int(min(wanted, top) if wanted > 0 else max(wanted, floor))
    if (e > 0) != (nominal > 1) or e == 0:
        return None
    return 2.0**e


def scaled_cases(ctx, case: Case) -> list[Scaling]:
    """Every scaling of ``case`` that fits the dtype's range: V and dO in every head by each of
    :data:`FACTORS`, and, with two kv heads or more, V of the last kv head alone by :data:`HEAD_FACTOR`.
    The range is the input dtype's, for the scaled input and for the unscaled run's results that
    move with it (a result far below the smallest normal of the dtype that holds it, or the operands
    behind it, would round on another grid)."""
    inp = ctx.inputs(case)
    dtype = inp.q.dtype
    base = ctx.run(case)
    out = []
    for name, nominals in FACTORS.items():
        if name == "do" and not ctx.has_backward:  # dO moves gradients only
            continue
        rows = max(case.lens_q, default=1) if name == "do" else 1
        moving = [(getattr(base, t), 1) for t, p in _POWER[name].items() if p and getattr(base, t) is not None]
        for nominal in nominals:
            c = _factor([(getattr(inp, name), rows)] + moving, nominal, dtype)
            if c is not None:
                out.append(Scaling(name, c, None, case.with_(overrides=case.overrides + ((f"scale_{name}", c),))))
    if case.heads_k > 1:
        g = case.heads_k - 1
        c = _factor([(inp.v[:, g], 1)], HEAD_FACTOR, dtype)
        if c is not None:
            out.append(Scaling("v", c, g, case.with_(overrides=case.overrides + (("headscale_v", (g, c)),))))
    return out


def _exactly_scaled(ctx, case: Case, s: Scaling) -> bool:
    """Whether the scaled case's tensor is exactly the case's times the factor (no element rounded or
    saturated)."""
    a, b = getattr(ctx.inputs(s.case), s.what).double(), getattr(ctx.inputs(case), s.what).double()
    if s.head is None:
        b = b * s.factor
    else:
        b = b.clone()
        b[:, s.head] *= s.factor
    return bool(torch.equal(a, b)) and bool(torch.isfinite(a).all())


def _model_error(ctx, cases: list[Case], tensors) -> tuple[float, tuple[Case, str] | None]:
    """The largest relative RMSE of a scaled run's result over the recipe's rounding model on the same
    (scaled) inputs (the error family's ``normalized_error``), and where."""
    worst, at = 0.0, None
    for case in cases:
        res, ref = ctx.run(case), ctx.reference(case)
        for t in tensors:
            x = getattr(res, t)
            if x is None:
                continue
            norm = normalized_error(ctx, case, t, error_stats(x, getattr(ref, t))["rel_rmse"])
            if at is None or not norm <= worst:
                worst, at = norm, (case, t)
    return worst, at


def _exponents(used: dict[str, set[int]]) -> str:
    """``V x 2^-8, 2^6; dO x 2^-12 to 2^8``: the factors of each kind of scaling."""
    parts = []
    for kind, es in used.items():
        e = sorted(es)
        parts.append(f"{kind} x " + (", ".join(f"2^{x}" for x in e) if len(e) <= 2 else f"2^{e[0]} to 2^{e[-1]}"))
    return "; ".join(parts)


def _pow2(c: float) -> str:
    """A power of two as text: 2^-8, 1."""
    return "1" if c == 1 else f"2^{int(math.log2(c))}"


def _relative_tolerance(y1: torch.Tensor, f: torch.Tensor) -> torch.Tensor:
    """The allowed |y_c / f - y_1| per element: 0 where y_1 and f y_1 are normal numbers of the output
    dtype, one subnormal step of the scaled output (over f) where either is below its smallest normal."""
    fi = torch.finfo(y1.dtype)
    y = y1.detach().double()
    f = f.to(y.device)
    sub = (y.abs() < fi.smallest_normal) | ((y * f).abs() < fi.smallest_normal)
    step = fi.smallest_normal * fi.eps  # the spacing of the subnormals
    return torch.where(sub, (step / f).expand_as(y), torch.zeros_like(y))


def _noise_allowance(y1: torch.Tensor, noise: float | None) -> torch.Tensor | float:
    """What the kernel's run-to-run noise adds to the tolerance of ``y1``'s elements (0 if repeatable)."""
    tol = noise_tolerance(y1, noise)
    return 0.0 if tol is None else tol


def _compare(ctx, case: Case, runs: list[Scaling]):
    """Per scaled run and result: the scaled result over its factors against the unscaled result
    (a :class:`~flamia_verify.properties.compare.Mismatch`), as (scaling, tensor, mismatch)."""
    base = ctx.run(case)
    # a kernel that does not repeat itself bitwise (atomics) is held to c x its result within its own
    # run-to-run noise, in the base's units (None for a repeatable kernel: bitwise)
    noise = run_noise(ctx, ("case", case), base, lambda: ctx.run(case, cache=False))
    for s in runs:
        res = ctx.run(s.case)
        for t in _POWER[s.what]:
            y1, yc = getattr(base, t), getattr(res, t)
            if y1 is None or yc is None:
                continue
            f = s.factors(t, case).to(y1.device)
            lens = case.lens_q if t in _QUERY_SIDE else case.lens_k
            cu = [0]
            for n in lens:
                cu.append(cu[-1] + n)
            m = compare_within(
                yc.detach().double() / f,
                y1.detach().double(),
                _relative_tolerance(y1, f) + _noise_allowance(y1, noise.get(t)),
                what=f"{t} with {s.label}, over its factor",
                against="the unscaled run",
                rule=f"{t} of the unscaled inputs, bitwise",
                cu_seqlens=cu,
            )
            yield s, t, m


def _bitwise(ctx, case: Case, runs: list[Scaling]) -> tuple[int, int, dict | None]:
    """(mismatched, compared, first finding) of the scaled runs of ``case`` against its run."""
    mismatched, compared, first = 0, 0, None
    for s, t, m in _compare(ctx, case, runs):
        compared += m.total
        if not m.ok:
            mismatched += m.mismatched
            if first is None:
                first = case_record(
                    s.case,
                    tensor=t,
                    scaled=s.what,
                    factor=s.factor,
                    head=s.head,
                    unscaled_case=case.to_dict(),
                    mismatch=m.to_dict(),
                    summary=f"{s.label}: {m.summary()}",
                )
    return mismatched, compared, first


@register(
    "consistency.homogeneity",
    "V x 2^-8 and 2^6 gives c O, c dQ, c dK and the same dV; dO x 2^-40 and 2^8 gives c dQ, c dK, c dV and "
    "the same O; V of one kv head x 2^6 moves that head's results alone: bitwise, scaled result over c against "
    "the unscaled one (recipes whose scales follow the data: bf16, mxfp8, nvfp4; bf16 inputs), else every "
    "scaled run within the recipe's bound and error model (fp16 inputs, the fp8 recipes' delayed scales)",
    defaults=lambda recipe, dtype: {"mismatched_elements": 0, "violations": 0, "normalized_error": ERROR_MODEL_FACTOR},
    adjustable=("normalized_error",),
    cost=1.0,
)
def homogeneity(ctx):
    exact_recipe = ctx.recipe.name in EXACT_RECIPES
    exact_dtype = ctx.dtype in EXACT_DTYPES
    exact = exact_recipe and exact_dtype
    tensors = ("out", "dq", "dk", "dv") if ctx.has_backward else ("out",)
    cases = homogeneity_cases(ctx)
    mismatched, compared, differing, first = 0, 0, 0, None
    by_bound: list[Case] = []
    used: dict[str, set[int]] = {}  # the exponents of every kind of scaling run
    for n, case in enumerate(cases):
        runs = scaled_cases(ctx, case)
        for sc in runs:
            kind = _LABEL[sc.what] + ("" if sc.head is None else " of one kv head")
            used.setdefault(kind, set()).add(int(math.log2(sc.factor)))
        if exact:
            bitwise = [s for s in runs if _exactly_scaled(ctx, case, s)]
            by_bound += [s.case for s in runs if s not in bitwise]
            m, total, f = _bitwise(ctx, case, bitwise)
            mismatched += m
            compared += total
            first = first or f
        else:
            by_bound += [s.case for s in runs]
            differing += sum(m.mismatched for _, _, m in _compare(ctx, case, runs))
        ctx.progress((n + 1) / (len(cases) + 1))
    runs_n = sum(len(scaled_cases(ctx, c)) for c in cases)
    metrics: dict = {"scaled_runs": runs_n, "cases": len(cases)}
    failures = []
    if exact:
        metrics.update(mismatched_elements=mismatched, compared_elements=compared)
        if first:
            failures.append(first["summary"])
        how = f"bitwise c times the unscaled results ({compared} elements)"
    else:
        metrics["bitwise_differences"] = differing
        why = (
            f"the {ctx.recipe.name} recipe admits scales that do not follow the data (delayed scaling)"
            if not exact_recipe
            else f"{ctx.dtype_str} inputs: the scaled results reach its subnormals"
        )
        how = f"within the {ctx.recipe.name} bound ({why}; {differing} elements not bitwise c times)"
    if by_bound:
        bm, bfirst, _, _ = bound_report(ctx, by_bound, tensors, inputs_label="scaled cases")
        metrics.update(violations=bm["violations"], tightness=bm["tightness"], bound_runs=len(by_bound))
        if bfirst:
            failures.append(bfirst["summary"])
            first = first or bfirst
        # relative too: the bound of a gradient can exceed the gradient (an all-zero dQ of a tiny dO
        # lies inside it); the error model, a relative RMSE, cannot be met by zeros
        worst, worst_at = _model_error(ctx, by_bound, tensors)
        metrics["normalized_error"] = worst
        if worst_at is not None and worst > ctx.th.get("normalized_error", math.inf):
            case, t = worst_at
            summary = f"{t} on {case.describe()}: error {worst:.3g} times the recipe's model"
            failures.append(summary)
            first = first or case_record(case, tensor=t, normalized_error=worst, summary=summary)
    ctx.progress(1.0)
    # the thresholds of the way this run was judged (bits, the bound or both), so that the reports show those
    judged = {k: v for k, v in ctx.th.items() if k in metrics}
    return verdict(
        ctx,
        metrics,
        ok_message=f"{runs_n} runs ({_exponents(used)}) on {len(cases)} cases: {how}",
        worst_case=first or case_record(cases[0]),
        failures=failures,
        thresholds=judged,
    )
