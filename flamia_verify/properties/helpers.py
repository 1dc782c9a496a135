"""What several check modules share: tensors by name and worst-case records, the verdict of a
check, perturbations of document rows, the many-document pack, the cases on the MX-exact grid, the
rounding model's prediction, and the a-priori bound of a case with the report of its violations.

The check modules (:mod:`flamia_verify.properties.checks`) import this module and never each other;
it sits above the run context (every helper takes the running check's ``ctx``) and below the checks.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, replace

import torch

from flamia_verify.properties.cases import Case, Inputs, cu_from_lens, make_inputs
from flamia_verify.properties.compare import compare_within, run_to_run_noise
from flamia_verify.properties.harness import KernelCallError, KernelOutputs
from flamia_verify.recipes.bounds import BoundResult, RecipeBoundModel, attention_bounds
from flamia_verify.recipes.noise_model import predicted_errors
from flamia_verify.recipes.operands import Operand
from flamia_verify.results import CheckResult, higher_is_better, json_number, threshold_verdict

__all__ = [
    "TENSORS",
    "GRADS",
    "tensors_of",
    "case_record",
    "worst_element",
    "verdict",
    "violations",
    "ADVERSARIAL",
    "perturb_rows",
    "doc_bounds",
    "future_inputs",
    "Doc",
    "LAYOUT_HEADS",
    "GPU_LONG_FACTOR",
    "pack_docs",
    "layout_docs",
    "layout_base_run",
    "GRID_QK",
    "bias_cases",
    "predicted",
    "normalized_error",
    "bounds_of",
    "bounds_for",
    "exact_weight_model",
    "bound_ratio",
    "admission_summary",
    "bound_report",
]


# ----------------------------------------------------------------------------------------------
# tensors by name, worst-case records
# ----------------------------------------------------------------------------------------------


TENSORS = ("out", "dq", "dk", "dv")
GRADS = ("dq", "dk", "dv")


def tensors_of(res: KernelOutputs, names=TENSORS) -> dict[str, torch.Tensor]:
    d = res.tensors()
    return {n: d[n] for n in names if n in d}


def case_record(case: Case, **extra) -> dict:
    """What reproduces a case: the case itself (seed, packing, shapes, distribution) plus extras."""
    rec = {"case": case.to_dict(), "cu_seqlens_q": _cu(case.lens_q), "cu_seqlens_k": _cu(case.lens_k)}
    rec.update(extra)
    return rec


def _cu(lens) -> list[int]:
    out = [0]
    for x in lens:
        out.append(out[-1] + x)
    return out


def worst_element(
    x: torch.Tensor, ref: torch.Tensor, case: Case, tensor: str, *, baseline: torch.Tensor | None = None
) -> dict:
    """Location of the largest absolute error with the kernel's and the reference's values."""
    x64, r64 = x.detach().double().to(ref.device), ref.detach().double()
    if r64.numel() == 0:
        return {}
    err = (x64 - r64).abs()
    err = torch.nan_to_num(err, nan=float("inf"))
    flat = int(torch.argmax(err.reshape(-1)))
    shape = tuple(r64.shape)
    idx = []
    rem = flat
    for size in reversed(shape):
        idx.append(rem % size)
        rem //= size
    idx.reverse()
    cu = _cu(case.lens_q if tensor in ("out", "dq") else case.lens_k)
    doc = next((b for b in range(len(cu) - 1) if cu[b] <= idx[0] < cu[b + 1]), None)
    rec = {
        "tensor": tensor,
        "token": idx[0],
        "head": idx[1],
        "channel": idx[2],
        "document": doc,
        "position": idx[0] - cu[doc] if doc is not None else None,
        "kernel": json_number(x64.reshape(-1)[flat]),
        "reference": json_number(r64.reshape(-1)[flat]),
        "abs_error": json_number(err.reshape(-1)[flat]),
    }
    if baseline is not None:
        rec["bf16"] = json_number(baseline.detach().double().reshape(-1)[flat])
    return rec


# ----------------------------------------------------------------------------------------------
# the verdict of a check
# ----------------------------------------------------------------------------------------------


def verdict(
    ctx,
    metrics: dict,
    *,
    ok_message: str,
    first: dict | None = None,
    failures: list[str] | None = None,
    worst_case: dict | None = None,
    details: dict | None = None,
    thresholds: dict | None = None,
    judge_thresholds: bool = True,
) -> CheckResult:
    """The verdict of a check: ``fail`` with its reasons joined by "; ", else ``pass`` with ``ok_message``.

    The reasons are every threshold that a same-named metric breaks (``key = value breaks <= limit``),
    then the sentences of ``failures``; without ``failures``, the summary of ``first`` (the check's
    first finding, a :func:`case_record` with a ``summary``) when there is one. ``worst_case``
    defaults to ``first``. ``thresholds`` are those judged and reported (default: the check's);
    ``judge_thresholds=False`` for a check that judged them itself (its ``failures`` say why it
    fails): they are reported, not compared."""
    limits = ctx.th if thresholds is None else thresholds
    reasons = []
    if judge_thresholds:
        reasons = [
            f"{k} = {_fmt(metrics[k])} breaks {_direction(k)} {_fmt(limits[k])}" for k in violations(metrics, limits)
        ]
    if failures is None:
        failures = [first["summary"]] if first else []
    reasons += failures
    return ctx.result(
        "fail" if reasons else "pass",
        metrics,
        message="; ".join(reasons) if reasons else ok_message,
        worst_case=first if worst_case is None else worst_case,
        details=details,
        thresholds=thresholds,
    )


def violations(metrics: dict, thresholds: dict) -> list[str]:
    """Threshold keys whose same-named metric breaks them (the reports' direction rule)."""
    bad = []
    for key, limit in thresholds.items():
        if key in metrics and threshold_verdict(key, metrics[key], limit) is False:
            bad.append(key)
    return bad


def _direction(key: str) -> str:
    return ">=" if higher_is_better(key) else "<="


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


# ----------------------------------------------------------------------------------------------
# perturbations of document rows (causal checks, the fuzzer)
# ----------------------------------------------------------------------------------------------


#: adversarial replacement magnitudes (relative to N(0, 1) inputs): huge values move every block
#: maximum they touch; tiny ones remove a maximum the replaced positions held
ADVERSARIAL = {"huge": 1.0e4, "tiny": 1.0e-4}


def perturb_rows(x: torch.Tensor, rows: slice, kind: str, gen: torch.Generator) -> torch.Tensor:
    """A copy of x whose ``rows`` hold adversarial values (``huge``, ``tiny`` or ``nan``)."""
    y = x.clone()
    n = y[rows].shape
    if kind == "nan":
        y[rows] = float("nan")
    else:
        y[rows] = (torch.randn(n, generator=gen) * ADVERSARIAL[kind]).to(y.dtype).to(y.device)
    return y


def doc_bounds(case: Case, b: int):
    """(q0, q1, k0, k1): where document b's queries and keys lie in the pack."""
    q0 = sum(case.lens_q[:b])
    k0 = sum(case.lens_k[:b])
    return q0, q0 + case.lens_q[b], k0, k0 + case.lens_k[b]


def future_inputs(inp: Inputs, b: int, t: int, kind: str, seed: int, tensors=("q", "k", "v", "do")) -> Inputs:
    """Replace queries/dO after query t and keys/values after key t + offset (document b only)."""
    case = inp.case
    q0, q1, k0, k1 = doc_bounds(case, b)
    off = (k1 - k0) - (q1 - q0)
    g = torch.Generator().manual_seed(seed)
    new = {}
    for name in ("q", "k", "v", "do"):
        x = getattr(inp, name)
        if name in tensors:
            rows = slice(q0 + t + 1, q1) if name in ("q", "do") else slice(max(k0, k0 + t + off + 1), k1)
            x = perturb_rows(x, rows, kind, g)
        new[name] = x
    return inp.replace(**new)


# ----------------------------------------------------------------------------------------------
# the many-document pack (isolation.layout, determinism.repeat)
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Doc:
    """One document of a pack: its own query and key lengths and its own seed (its tensors do not
    depend on where it is packed)."""

    lq: int
    lk: int
    seed: int


def pack_docs(ctx, docs: list[Doc], *, heads: int, heads_k: int, causal: bool, pad: int = 0) -> Inputs:
    """The documents packed in order (their tensors made one by one from their seeds)."""
    parts = []
    for d in docs:
        c = Case(
            (d.lq,),
            (d.lk,),
            heads=heads,
            heads_k=heads_k,
            headdim=ctx.settings.headdim,
            causal=causal,
            seed=d.seed,
            dtype=ctx.dtype_str,
        )
        parts.append(ctx.memo(("layout-doc", c), lambda c=c: make_inputs(c, ctx.device)))
    lens_q = tuple(d.lq for d in docs)
    lens_k = tuple(d.lk for d in docs)
    call = (("max_seqlen_pad", pad),) if pad else ()
    case = Case(
        lens_q,
        lens_k,
        heads=heads,
        heads_k=heads_k,
        headdim=ctx.settings.headdim,
        causal=causal,
        seed=docs[0].seed if docs else 0,
        dtype=ctx.dtype_str,
        call=call,
    )
    dev = ctx.device

    def cat(name):
        return torch.cat([getattr(p, name) for p in parts])

    return Inputs(case, cat("q"), cat("k"), cat("v"), cat("do"), cu_from_lens(lens_q, dev), cu_from_lens(lens_k, dev))


def layout_docs(ctx) -> list[Doc]:
    """The suite's pack: ``layout_docs`` documents of 0 to ``layout_max_len`` queries (some with more keys than
    queries), empty ones first, in the middle and last, and one of ``layout_long`` queries and keys
    (:data:`GPU_LONG_FACTOR` times that on a GPU)."""
    n, long_len = ctx.settings.layout_docs, ctx.settings.layout_long * _device_factor(ctx)
    rng = random.Random(ctx.seed * 7919 + 801)
    docs = [Doc(0, 0, 0)]
    for i in range(n):
        top = ctx.settings.layout_max_len
        choices = [n for n in (1, 2, 17, 31, 32, 33, 63, 64, 65, 96) if n <= top] + [rng.randint(3, top)]
        lq = rng.choice(choices)
        lk = lq + (rng.choice((0, 0, 3, 40)) if i % 3 else 0)
        docs.append(Doc(lq, lk, ctx.seed * 1000 + 800 + i))
        if i == n // 2:
            docs += [Doc(0, 0, 0), Doc(0, 5, ctx.seed * 1000 + 799), Doc(long_len, long_len, ctx.seed * 1000 + 798)]
    docs.append(Doc(0, 0, 0))
    return docs


#: on a GPU the pack's long document is this many times ``layout_long`` (standard: 6800 tokens, a pack
#: of about 14K): the fused kernels' splits and atomics engage on rows that long
GPU_LONG_FACTOR = 4


def _device_factor(ctx) -> int:
    return GPU_LONG_FACTOR if str(ctx.device).startswith("cuda") else 1


#: (heads, heads_k) of the many-document pack
LAYOUT_HEADS = (4, 2)


def layout_base_run(ctx, docs: list[Doc], causal: bool):
    """The kernel's run on the suite's pack (shared by isolation.layout and determinism.repeat)."""
    heads, heads_k = LAYOUT_HEADS
    return ctx.memo(
        ("layout-base", causal, tuple(docs)),
        lambda: ctx.run(pack_docs(ctx, docs, heads=heads, heads_k=heads_k, causal=causal)),
    )


# ----------------------------------------------------------------------------------------------
# cases with q and k on the MX-exact E4M3 grid (bias, bound, special)
# ----------------------------------------------------------------------------------------------


#: q and k on the MX-exact grid: exact scores, so the bound is tight on P, V and dO
GRID_QK = (("grid_q", True), ("grid_k", True))


def bias_cases(ctx):
    """The cases of the bias family (see :mod:`flamia_verify.properties.checks.bias`), which bound.out
    and bound.grad judge too: q and k on the MX-exact grid, v and dO shifted, ``seeds`` seeds."""
    cases = []
    for s in range(max(1, ctx.settings.seeds)):
        o = 2000 + 100 * s
        cases += [
            ctx.case((64, 130, 62), heads=2, heads_k=1, distribution="shifted", overrides=GRID_QK, seed_offset=o),
            ctx.case((50, 1, 77), (64, 3, 40), distribution="shifted", overrides=GRID_QK, seed_offset=o + 1),
            ctx.case((128, 96), causal=False, distribution="shifted", overrides=GRID_QK, seed_offset=o + 2),
            ctx.case((96,), distribution="shifted", overrides=(("scale_q", 4.0),) + GRID_QK, seed_offset=o + 3),
            # one long document (long_len keys, 512 in the quick suite): a row's running maximum
            # still rises after many key tiles, where an online softmax must keep rescaling; q x 2
            # spreads the scores so that a rise of the (integer, log2) block maximum is common
            ctx.case(
                (ctx.settings.long_len,),
                distribution="shifted",
                overrides=(("scale_q", 2.0),) + GRID_QK,
                seed_offset=o + 4,
            ),
        ]
    return cases


# ----------------------------------------------------------------------------------------------
# the rounding model's prediction (error, bound.shapes, consistency.grad_forward_ratio)
# ----------------------------------------------------------------------------------------------


def predicted(ctx, case) -> dict[str, float]:
    """The rounding model's relative RMSE of every tensor on this case (cached)."""

    model = ctx.bound_model

    def compute():
        return predicted_errors(ctx.inputs(case), ctx.reference(case), model, seed=case.seed)

    return ctx.memo(("predicted", case), lambda: ctx.across_runs(("predicted", case), compute, model=model))


def normalized_error(ctx, case, tensor: str, rel: float) -> float:
    """``rel`` (a relative RMSE of ``tensor`` on ``case``) over the rounding model's prediction."""
    pred = predicted(ctx, case)[tensor]
    if pred <= 0:
        return 0.0 if rel == 0 else math.inf
    return rel / pred


# ----------------------------------------------------------------------------------------------
# the a-priori bound and its violations (bound, special, interface, bound.rounding, the fuzzer)
# ----------------------------------------------------------------------------------------------


def bounds_of(
    inp: Inputs, ref, *, scale: float, causal: bool, model: RecipeBoundModel, grads: bool = True
) -> BoundResult:
    """The elementwise bounds of O (and of the gradients, with ``grads``) on inputs ``inp`` whose
    float64 reference is ``ref`` (out, dq, dk, dv), under ``model``."""
    return attention_bounds(
        inp.q,
        inp.k,
        inp.v,
        inp.do if grads else None,
        inp.cu_q.tolist(),
        inp.cu_k.tolist(),
        scale=scale,
        causal=causal,
        model=model,
        ref_out=ref.out,
        ref_grads=(ref.dq, ref.dk, ref.dv) if grads else None,
    )


def bounds_for(ctx, case, *, grads: bool, exact_weights: bool = False, nominal: bool = False):
    """The bound of a case (cached), with gradients when asked and the kernel has a backward;
    ``exact_weights``: under :func:`exact_weight_model` (only for cases whose weights are exact, such as uniform rows);
    ``nominal``: under the recipe's nominal model, without its admissions (what they add is reported, never judged)."""

    model = ctx.bound_model
    if nominal:
        model = model.nominal()
    if exact_weights:
        model = exact_weight_model(model)

    def compute():
        return bounds_of(ctx.inputs(case), ctx.reference(case), scale=case.scale, causal=case.causal, model=model)

    # how the tensors are passed (``case.call``) does not change the bound
    key = ("bound", replace(case, call=()))
    return ctx.memo(key + (exact_weights, nominal), lambda: ctx.across_runs(key, compute, model=model))


def exact_weight_model(model):
    """The recipe's model with P's relative rounding removed (u_P = 0; its underflow terms kept).

    Sound on inputs whose weights are exact: rows whose scores are all equal (the uniform key and query cases
    of :mod:`flamia_verify.properties.checks.bound`) have weights 1/n however P's elements are rounded, because every
    element of the row is rounded alike and the normalizer sums the rounded elements (to within fp32
    rounding, inside the bound's REL32 slack), and however the scores are rounded, because equal
    scores stay equal. Without the u_P |dS| slack that the bound otherwise must leave, the dQ (dK)
    bound of the uniform key (query) case is the rounding of the dS (dS^T) operand itself plus the
    rounding of D and the output: a dS format one bit coarser than the recipe (E5M2, u = 2^-3, under an E4M3 claim,
    u = 2^-4) leaves it."""
    return model.with_operands({Operand.P: replace(model[Operand.P], u=0.0)})


def bound_ratio(x: torch.Tensor, ref: torch.Tensor, bound: torch.Tensor) -> torch.Tensor:
    """|x - ref| / bound elementwise, float64: 0 where the error is 0, inf where it is NaN."""
    err = (x.detach().double().to(ref.device) - ref).abs()
    ratio = torch.where(err == 0, torch.zeros_like(err), err / bound.clamp_min(1e-300))
    return torch.nan_to_num(ratio, nan=float("inf"))


#: the token axis of each tensor (one, several), as the admission summary names it
_TOKENS = {"out": ("query", "queries"), "dq": ("query", "queries"), "dk": ("key", "keys"), "dv": ("key", "keys")}


def admission_summary(admissions, counts: dict) -> str:
    """The elements that only ``admissions`` accept, in a user's words: ``counts`` maps a tensor name
    to (elements, tokens, largest |error| among them, that error over the tensor's RMS)."""
    what = " and ".join(a.what for a in admissions)
    parts = [
        f"{n} element{'s' * (n != 1)} of {t} on {tok} {_TOKENS.get(t, ('token', 'tokens'))[tok != 1]} "
        f"(|error| up to {mx:.2g}, {share:.2g} of {t}'s RMS)"
        for t, (n, tok, mx, share) in counts.items()
        if n
    ]
    if not parts:
        return f"admitted {what}: no element needed it"
    nominal = "/".join(a.nominal_name for a in admissions)
    return f"admitted {what}: " + ", ".join(parts) + f" outside the {nominal} bound, inside this one"


def _admitted(x: torch.Tensor, r: torch.Tensor, within: torch.Tensor, nominal_bound: torch.Tensor):
    """(elements, tokens, max |error|, max |error| / RMS of the reference) of the elements inside the
    bound (``within``) but outside ``nominal_bound``."""
    err = (x.detach().double().to(r.device) - r).abs()
    adm = within & (err > nominal_bound) & (err > 0)
    n = int(adm.sum())
    if not n:
        return 0, 0, 0.0, 0.0
    mx = float(err[adm].max())
    rms = float(r.double().pow(2).mean().sqrt()) if r.numel() else 0.0
    return n, int(adm.flatten(1).any(1).sum()), mx, mx / rms if rms > 0 else math.inf


def bound_report(ctx, cases, tensors, *, inputs_label: str = "base cases", exact_weights: bool = False):
    """Count violations of the bound over ``cases`` for ``tensors``; metrics, worst case, details.

    Under a recipe with admissions (and not ``exact_weights``, whose model changes P) the elements
    that only the admissions accept are counted: metrics ``admitted_elements``, ``admitted_max_abs``,
    ``admitted_rms_share``, and the ok message says where they are."""
    violated, tight, first = 0, 0.0, None
    per_tensor = {t: 0 for t in tensors}
    tight_t = {t: 0.0 for t in tensors}
    admissions = () if exact_weights else ctx.bound_model.admissions
    admitted = {t: (0, 0, 0.0, 0.0) for t in tensors}
    series = None
    for n, case in enumerate(cases):
        res = ctx.run(case)
        ref = ctx.reference(case)
        grads = any(t != "out" for t in tensors)
        B = bounds_for(ctx, case, grads=grads, exact_weights=exact_weights)
        B0 = bounds_for(ctx, case, grads=grads, nominal=True) if admissions else None
        for t in tensors:
            x = getattr(res, t)
            if x is None:
                continue
            r = getattr(ref, t)
            b = getattr(B, t)
            cu = cu_from_lens(case.lens_q if t in ("out", "dq") else case.lens_k).tolist()
            m = compare_within(x, r, b, what=f"|{t} - reference|", rule="within the a-priori bound", cu_seqlens=cu)
            ratio = bound_ratio(x, r, b)
            if B0 is not None:
                got = _admitted(x, r, ratio <= 1, getattr(B0, t))
                n0, tok0, mx0, share0 = admitted[t]
                admitted[t] = (n0 + got[0], tok0 + got[1], max(mx0, got[2]), max(share0, got[3]))
            mx = float(ratio.max()) if ratio.numel() else 0.0
            if mx > tight_t[t]:
                tight_t[t] = mx
            if mx >= tight:
                tight = mx
                if ratio.numel():
                    series = {
                        "title": f"{t}: max |error| / bound per token ({case.describe()})",
                        "x_label": "token (packed)",
                        "y_label": "|error| / bound",
                        "ys": {t: [float(v) for v in ratio.flatten(1).amax(1).clamp_max(1e6).cpu().tolist()]},
                        "log_y": True,
                        "thresholds": {"bound": 1.0},
                    }
            if not m.ok:
                violated += m.mismatched
                per_tensor[t] += m.mismatched
                if first is None:
                    first = case_record(
                        case, tensor=t, recipe=ctx.recipe.name, mismatch=m.to_dict(), summary=m.summary()
                    )
        ctx.progress((n + 1) / len(cases))
    metrics = {"violations": violated, "tightness": tight}
    for t in tensors:
        metrics[f"tightness_{t}"] = tight_t[t]
        metrics[f"violations_{t}"] = per_tensor[t]
    details = {"series": [series]} if series else {}
    msg = f"no element outside the {ctx.recipe.name} bound on {len(cases)} {inputs_label}; tightness {tight:.3g}"
    if admissions:
        metrics["admitted_elements"] = sum(a[0] for a in admitted.values())
        metrics["admitted_max_abs"] = max(a[2] for a in admitted.values())
        metrics["admitted_rms_share"] = max(a[3] for a in admitted.values())
        if metrics["admitted_elements"]:
            msg += "; " + admission_summary(admissions, admitted)
    return metrics, first, details, msg


# ----------------------------------------------------------------------------------------------
# the kernel's run-to-run noise, which the information-flow checks judge beyond
# ----------------------------------------------------------------------------------------------


def unrepeatable_tensors(ctx) -> frozenset[str]:
    """The tensors in which the kernel does not repeat itself bitwise, seen on the suite's pack (dozens
    of documents, one longer than every tile: where split-K and atomics engage) run twice; empty for a
    repeatable kernel, and when the kernel cannot run the pack (the checks that need it say why)."""

    def compute() -> frozenset[str]:
        docs = layout_docs(ctx)
        try:
            first = layout_base_run(ctx, docs, True)
            again = ctx.run(pack_docs(ctx, docs, heads=LAYOUT_HEADS[0], heads_k=LAYOUT_HEADS[1], causal=True))
        except KernelCallError:
            return frozenset()
        return frozenset(t for t, n in run_to_run_noise(first.tensors(), again.tensors()).items() if n is not None)

    return ctx.memo(("unrepeatable tensors",), compute)


def run_noise(ctx, key, base: KernelOutputs, rerun) -> dict[str, float | None]:
    """The kernel's run-to-run noise on the inputs of ``base`` (``rerun()``: a second run of them),
    per tensor: None (judge bitwise) where the kernel repeats itself bitwise; for a tensor that
    :func:`unrepeatable_tensors` names, at least 0 (two units in the last place may move) even where
    these two runs happened to agree. Computed once per ``key``."""
    noise = ctx.memo(("run-to-run noise", key), lambda: run_to_run_noise(base.tensors(), rerun().tensors()))
    unrepeatable = unrepeatable_tensors(ctx)
    return {t: (0.0 if n is None and t in unrepeatable else n) for t, n in noise.items()}
