"""state: does the kernel stay within its recipe when it is called the way training calls it?

Every other family judges a pure function: each call on its own inputs, compared with other calls.
A kernel that keeps state between calls (delayed scaling's amax history, scales frozen after a
calibration, a cache) is not one: what a call computes depends on the calls before it. Training
calls one kernel from every attention layer, layer after layer, with activations whose magnitudes
differ from layer to layer and drift over the steps, and a backward for every forward, in reverse
layer order. These checks make such a sequence of calls and judge every call, not only the first.

    state.training   3 layers x 12 steps through the kernel as a model uses it (one instance per
                     layer from a factory, ``new_instance()``; else the one function in every layer),
                     forward in layer order then backward in reverse, the inputs written into the
                     same buffers step after step (as a caching allocator hands activations the same
                     addresses). The layers' magnitudes differ by 2^4 to 2^8; every step moves one of
                     q (with k the other way, so the scores stay those of N(0, 1) inputs), v or dO by
                     one binade, up to 2^3, then all of them down: no tensor of the call, and none the
                     kernel derives (O, dS, dQ, dK, dV), grows by more than 2x from one call of a layer
                     to the next. Every call is judged by the recipe's rigorous bound (no element
                     outside) and its error model (normalized error <= 2, the error family's limit);
                     the worst call is named with its layer, step and drift, and the kernel's state at
                     that call (``state_describe()``: each scale, the history amax it came from) with
                     the scale that was stale.
    state.history    for a kernel that declares delayed scaling with an amax history of H calls: two
                     runs from one state, one of them with a spike (q, v, dO x 2^8) in its first call,
                     then the same calls. One window later (call H + 2) O must have the same bits in
                     both, and q, k, v, dO the same scales where the kernel describes them (these
                     roles record the calls' own inputs). The roles a kernel measures on its own
                     results (dS, the gradients) echo the spike for one window per step of the chain
                     that leads to them; after ECHO_WINDOWS windows every record of both runs comes
                     from calls with the same inputs and the same scales, so the last call must give
                     O, dQ, dK and dV with the same bits, and every described scale must agree. A
                     history that never forgets fails, described or not.

Stateless kernels run the same sequence and pass it (pure functions are within the bound at every
magnitude); the report says whether state was detected (the same inputs before and after other
calls giving other bits) and what the kernel declares (``state_policy``; docs/checks.md, "Stateful
kernels").
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from flamia_verify.convention import first_output
from flamia_verify.formats.constants import E4M3_MAX as _E4M3_MAX
from flamia_verify.kernels.state import (
    StateKind,
    can_snapshot,
    declared_state,
    describe_state,
    is_factory,
    layer_kernels,
    restore_state,
    snapshot_state,
)
from flamia_verify.properties.call_options import Stage
from flamia_verify.properties.cases import Case, Inputs
from flamia_verify.properties.checks.common.error_model import bound_ratio, bounds_for, normalized_error
from flamia_verify.properties.checks.common.verdict import case_record, verdict
from flamia_verify.properties.compare import compare_bitwise, compare_within
from flamia_verify.properties.metrics import rel_rmse
from flamia_verify.properties.registry import register
from flamia_verify.properties.tolerances import ERROR_MODEL_FACTOR

__all__ = ["DRIFT", "LAYER_OFFSETS", "SPIKE_LOG2", "training_schedule"]

_TENSORS = ("out", "dq", "dk", "dv")
_LABEL = {"out": "O", "dq": "dQ", "dk": "dK", "dv": "dV"}

#: per layer, log2 of (q, v, dO) relative to N(0, 1); k gets the opposite of q's (scores unchanged)
LAYER_OFFSETS: tuple[tuple[int, int, int], ...] = ((0, 0, 0), (4, 6, 4), (-6, -4, -4))
#: per step, the drift of every layer, log2 of (q, v, dO): one of them moves up by one binade per step,
#: v and dO dip by 2^3 for one step and come back (to the level of their earlier calls), on up to 2^3,
#: then all of them down one binade. No tensor of a call, and none the kernel derives (O, dS, dQ, dK,
#: dV), exceeds the largest amax of its layer's earlier calls by more than 2x: a delayed scale with one
#: binade of margin over the history's maximum never saturates here
DRIFT: tuple[tuple[int, int, int], ...] = (
    (0, 0, 0),
    (1, 0, 0),
    (1, 1, 0),
    (1, 1, 1),
    (1, -2, -2),
    (1, 1, 1),
    (2, 1, 1),
    (2, 2, 1),
    (2, 2, 2),
    (3, 2, 2),
    (3, 3, 2),
    (3, 3, 3),
    (2, 2, 2),
)
#: state.history's spike: q, v, dO x 2^8 (k x 2^-8), 2^4 for fp16 inputs (whose range is narrower)
SPIKE_LOG2 = {"fp16": 4}
_SPIKE_DEFAULT = 8
#: state.history runs at most this many calls per run (a longer declared history is skipped, saying so)
MAX_HISTORY_CALLS = 4096
#: the windows of H calls after which no record of either run can hold the spike, however it travels:
#: a role whose record depends on other roles' scales is clean one window after they are, and attention's
#: longest chain is four roles deep (q, k, v -> O -> dS, through D = rowsum(dO * O) -> dQ, dK)
ECHO_WINDOWS = 4


def _exponents(layer: int, step: int, dtype: str = "bf16") -> tuple[int, int, int, int]:
    """log2 of the scale of (q, k, v, dO) of ``layer`` at ``step``; half of each (toward zero) for fp16
    inputs, whose range (2^16) the gradients would leave otherwise (dK grows with q, v and dO at once)."""
    off, d = LAYER_OFFSETS[layer], DRIFT[step]
    e = [off[i] + d[i] for i in range(3)]
    if dtype == "fp16":
        e = [int(x / 2) for x in e]
    eq, ev, edo = e
    return eq, -eq, ev, edo


def training_schedule(dtype: str = "bf16") -> list[tuple[int, int, tuple[int, int, int, int]]]:
    """(step, layer, log2 scales of q, k, v, dO) of every forward, in calling order."""
    return [(t, layer, _exponents(layer, t, dtype)) for t in range(len(DRIFT)) for layer in range(len(LAYER_OFFSETS))]


def _scaled(case: Case, exps: tuple[int, int, int, int]) -> Case:
    names = ("scale_q", "scale_k", "scale_v", "scale_do")
    over = tuple((n, 2.0**e) for n, e in zip(names, exps, strict=True) if e)
    return Case(
        case.lens_q,
        case.lens_k,
        heads=case.heads,
        heads_k=case.heads_k,
        headdim=case.headdim,
        causal=case.causal,
        seed=case.seed,
        dtype=case.dtype,
        overrides=over,
    )


#: the pack of every call: two causal documents, GQA 2:1, the suite's head_dim
PACK_LENS = (24, 40)


def _pack(ctx, seed_offset: int, lens=PACK_LENS) -> Case:
    return ctx.case(lens, heads=2, heads_k=1, causal=True, seed_offset=seed_offset)


def _drift_words(layer: int, step: int, dtype: str = "bf16") -> str:
    """What moved since the layer's previous call, e.g. "v x2^1 since step 1"."""
    if step == 0:
        return "the first call of the layer"
    now, before = _exponents(layer, step, dtype), _exponents(layer, step - 1, dtype)
    moved = [
        f"{name} x2^{a - b}" if a != b else ""
        for name, a, b in zip(
            ("q (k the other way)", "v", "dO"), (now[0], now[2], now[3]), (before[0], before[2], before[3]), strict=True
        )
    ]
    moved = [m for m in moved if m]
    return (", ".join(moved) if moved else "nothing") + f" since step {step - 1}"


def _magnitudes(exps: tuple[int, int, int, int]) -> str:
    return ", ".join(f"{n} x2^{e}" for n, e in zip(("q", "k", "v", "dO"), exps, strict=True))


# ----------------------------------------------------------------------------------------------
# the kernel as a model uses it
# ----------------------------------------------------------------------------------------------


def _kernels(ctx, layers: int) -> tuple[list, str]:
    """The layers' kernels and how they were made: fresh instances of a factory, or the kernel itself in
    every layer (put back to the state every other check ran at, when it can be)."""
    fn = ctx.harness.fn
    if is_factory(fn):
        return layer_kernels(fn, layers), f"one instance per layer ({layers} from new_instance())"
    if ctx.harness.pin is not None:
        ctx.harness.pin.restore_fresh()  # as the run found it, before any call
    return layer_kernels(fn, layers), "one function called from every layer (not a factory)"


class _Buffers:
    """q, k, v of one layer: leaves that require grad, written in place call after call."""

    def __init__(self, inp: Inputs, grads: bool):
        self.q, self.k, self.v = (x.detach().clone().requires_grad_(grads) for x in (inp.q, inp.k, inp.v))

    def write(self, inp: Inputs) -> None:
        with torch.no_grad():
            for buf, x in ((self.q, inp.q), (self.k, inp.k), (self.v, inp.v)):
                buf.copy_(x)

    def grads(self) -> dict[str, torch.Tensor | None]:
        out = {}
        for name, buf in (("dq", self.q), ("dk", self.k), ("dv", self.v)):
            out[name] = None if buf.grad is None else buf.grad.detach().clone()
            buf.grad = None
        return out


@dataclass
class _Call:
    index: int
    step: int
    layer: int
    exps: tuple[int, int, int, int]
    case: Case
    before_forward: dict | None = None
    before_backward: dict | None = None
    after: dict | None = None
    outputs: dict = field(default_factory=dict)
    # the verdict of the call
    violations: int = 0
    tightness: float = 0.0
    norm: float = 0.0
    worst_tensor: str = "out"
    mismatch: Any = None
    norms: dict = field(default_factory=dict)


def _forward(ctx, fn, bufs: _Buffers, inp: Inputs, call: _Call):
    case = inp.case

    def go():
        out = first_output(
            fn(
                bufs.q,
                bufs.k,
                bufs.v,
                inp.cu_q,
                inp.cu_k,
                inp.max_q,
                inp.max_k,
                softmax_scale=case.scale,
                causal=case.causal,
            )
        )
        return out

    return ctx.harness.call_guarded(case, go, Stage.FORWARD, f"forward (step {call.step}, layer {call.layer})")


def _backward(ctx, out: torch.Tensor, inp: Inputs, call: _Call) -> None:
    def go():
        if out.grad_fn is None and not out.requires_grad:
            raise RuntimeError("the output has no grad_fn (a kernel without a backward must be declared forward-only)")
        out.backward(inp.do.to(out.dtype))

    ctx.harness.call_guarded(inp.case, go, Stage.BACKWARD, f"backward (step {call.step}, layer {call.layer})")


def _run_sequence(ctx) -> tuple[list[_Call], str]:
    """Every call of the training-like sequence, with its outputs and the kernel's state around it."""
    layers = len(LAYER_OFFSETS)
    kernels, how = _kernels(ctx, layers)
    grads = ctx.has_backward
    bufs: list[_Buffers | None] = [None] * layers
    calls: list[_Call] = []
    steps = len(DRIFT)
    for t in range(steps):
        pending = []
        for layer in range(layers):
            exps = _exponents(layer, t, ctx.dtype_str)
            case = _scaled(_pack(ctx, 7000 + 100 * t + layer), exps)
            inp = ctx.inputs(case)
            buf = bufs[layer]
            if buf is None:
                buf = bufs[layer] = _Buffers(inp, grads)
            else:
                buf.write(inp)
            call = _Call(len(calls), t, layer, exps, case)
            call.before_forward = describe_state(kernels[layer])
            out = _forward(ctx, kernels[layer], buf, inp, call)
            call.outputs["out"] = out.detach().clone()
            calls.append(call)
            pending.append((call, out, inp, buf))
        for call, out, inp, buf in reversed(pending):  # the backward in reverse layer order
            if grads:
                call.before_backward = describe_state(kernels[call.layer])
                _backward(ctx, out, inp, call)
                call.outputs.update(buf.grads())
            call.after = describe_state(kernels[call.layer])
        ctx.progress(0.7 * (t + 1) / steps)
    return calls, how


def _judge(ctx, call: _Call) -> None:
    case = call.case
    ref = ctx.reference(case)
    tensors = [t for t in _TENSORS if call.outputs.get(t) is not None]
    B = bounds_for(ctx, case, grads=any(t != "out" for t in tensors))
    worst = -1.0
    for t in tensors:
        x, r, b = call.outputs[t], getattr(ref, t), getattr(B, t)
        m = compare_within(x, r, b, what=f"|{t} - reference|", rule="within the a-priori bound")
        ratio = bound_ratio(x, r, b)
        tight = float(ratio.max()) if ratio.numel() else 0.0
        norm = normalized_error(ctx, case, t, rel_rmse(x, r))
        call.norms[t] = norm
        call.tightness = max(call.tightness, tight)
        if not m.ok:
            call.violations += m.mismatched
        if norm > call.norm or math.isnan(norm):
            call.norm = math.inf if math.isnan(norm) else norm
        score = max(norm / ERROR_MODEL_FACTOR if math.isfinite(norm) else math.inf, tight)
        if score > worst:
            worst, call.worst_tensor = score, t
            call.mismatch = None if m.ok else m


def _score(call: _Call) -> float:
    return max(call.norm / ERROR_MODEL_FACTOR, call.tightness)


# ----------------------------------------------------------------------------------------------
# the stale scale
# ----------------------------------------------------------------------------------------------

#: the roles the family knows the amax of (its own inputs), with the tensor they scale
_INPUT_ROLES = {"q": 0, "k": 1, "v": 2, "do": 3}
#: the roles whose scale a stale state breaks: the inputs, and what a backward records right after it
#: ran (dS as cuDNN's "dp", the E4M3 gradients); O's and P's scales are rules, not history
_JUDGED_ROLES = ("q", "k", "v", "do", "dp", "dq", "dk", "dv")


def _role_amax(call: _Call, role: str, inp: Inputs) -> float | None:
    """This call's amax of a role: the input's own for q, k, v, dO; else what the kernel recorded."""
    if role in _INPUT_ROLES:
        x = (inp.q, inp.k, inp.v, inp.do)[_INPUT_ROLES[role]]
        return float(x.detach().abs().max()) if x.numel() else 0.0
    rec = (call.after or {}).get(role)
    if isinstance(rec, dict) and isinstance(rec.get("last_amax"), (int, float)):
        return float(rec["last_amax"])
    return None


def _stale(ctx, call: _Call) -> list[dict]:
    """Per role with a scale in the kernel's description: the scale this call used, the amax it came
    from, this call's amax, and how far this call's amax landed from E4M3's range (``ratio`` = amax *
    scale / 448: above 1 saturates). Sorted worst first."""
    inp = ctx.inputs(call.case)
    rows = []
    for phase, state in (("forward", call.before_forward), ("backward", call.before_backward)):
        if not isinstance(state, dict):
            continue
        for role, rec in state.items():
            if not isinstance(rec, dict) or not isinstance(rec.get("scale"), (int, float)):
                continue
            if role not in _JUDGED_ROLES or (phase == "forward") != (role in ("q", "k", "v")):
                continue
            scale = float(rec["scale"])
            amax = _role_amax(call, role, inp)
            if amax is None or not math.isfinite(scale) or scale <= 0:
                continue
            rows.append(
                {
                    "role": role,
                    "scale": scale,
                    "scale_log2": math.log2(scale),
                    "history_amax": rec.get("window_amax"),
                    "amax": amax,
                    "ratio": amax * scale / _E4M3_MAX,
                    "records": rec.get("records"),
                }
            )
    # saturating roles first (the largest overshoot first), then the ones leaving most of E4M3 unused
    rows.sort(key=lambda r: (r["ratio"] <= 1, -abs(math.log2(r["ratio"])) if r["ratio"] > 0 else 0.0))
    return rows


def _stale_words(rows: list[dict]) -> str:
    if not rows:
        return ""
    r = rows[0]
    hist = r["history_amax"]
    came = f" (from a history amax of {hist:.3g})" if isinstance(hist, (int, float)) else ""
    mapped = r["amax"] * r["scale"]
    if r["ratio"] > 1:
        how = f"saturates by {r['ratio']:.3g}x"
    else:
        how = f"{math.log2(_E4M3_MAX / mapped):.1f} binades below 448" if mapped > 0 else "all zero"
    return (
        f"{r['role']}'s scale 2^{r['scale_log2']:.0f}{came} maps this call's amax {r['amax']:.3g} to "
        f"{mapped:.3g}: {how}"
    )


# ----------------------------------------------------------------------------------------------
# detection: the same inputs before and after other calls
# ----------------------------------------------------------------------------------------------


def _detect(ctx) -> tuple[bool | None, str]:
    """(state detected, how): a fresh instance (or the kernel at its pinned state) runs A, A, B, A with B
    the same pack 2^6 larger: A's third call differing from its first two is state. None when a
    kernel's repeated call already differs (its own run-to-run noise)."""
    fn = ctx.harness.fn
    inst = fn.new_instance() if is_factory(fn) else fn
    if not is_factory(fn) and ctx.harness.pin is not None:
        ctx.harness.pin.restore_fresh()
    a = _pack(ctx, 6900)
    b = _scaled(a, (3, -3, 6, 6))
    grads = ctx.has_backward
    runs = []
    for n, case in enumerate((a, a, b, a)):
        inp = ctx.inputs(case)
        bufs = _Buffers(inp, grads)
        call = _Call(n, 0, 0, (0, 0, 0, 0), case)
        out = _forward(ctx, inst, bufs, inp, call)
        res = {"out": out.detach().clone()}
        if grads:
            _backward(ctx, out, inp, call)
            res.update(bufs.grads())
        runs.append(res)

    def same(x: dict, y: dict) -> bool:
        return all(
            x[t] is None or y[t] is None or compare_bitwise(x[t], y[t]).ok for t in x if t in y and x[t] is not None
        )

    if not same(runs[0], runs[1]):
        return None, "a repeated call already differs (run-to-run noise): state not told apart"
    if not same(runs[0], runs[3]):
        return True, "the same inputs gave other bits after a call 2^6 larger: the kernel keeps state"
    return False, "the same inputs gave the same bits after a call 2^6 larger"


# ----------------------------------------------------------------------------------------------
# the checks
# ----------------------------------------------------------------------------------------------


def _declared(ctx) -> tuple[str, dict | None]:
    try:
        policy = declared_state(ctx.harness.fn)
    except ValueError as exc:
        return f"a malformed state_policy ({exc})", None
    if policy is None:
        return "no state_policy declared", None
    return policy.describe(), policy.to_dict()


@register(
    "state.training",
    "every call of a training-like sequence (3 layers of magnitudes 2^4-2^8 apart, 12 steps drifting by "
    "one binade per step, backward in reverse layer order, one instance per layer from a factory) within "
    "the recipe's bound and error model: delayed, frozen, shared or cached scales that go stale fail",
    defaults=lambda recipe, dtype: {"violations": 0, "normalized_error": ERROR_MODEL_FACTOR},
    adjustable=("normalized_error",),
    cost=3.0,
)
def training(ctx):
    declared, declared_dict = _declared(ctx)
    calls, how = _run_sequence(ctx)
    detected, detected_how = _detect(ctx)  # after the sequence: a shared state starts it clean
    for n, call in enumerate(calls):
        _judge(ctx, call)
        ctx.progress(0.7 + 0.3 * (n + 1) / len(calls))
    failing = [c for c in calls if c.violations or c.norm > ctx.th.get("normalized_error", ERROR_MODEL_FACTOR)]
    worst = max(calls, key=_score)
    report_call = failing[0] if failing else worst
    stale = _stale(ctx, report_call)
    metrics = {
        "violations": sum(c.violations for c in calls),
        "normalized_error": max(c.norm for c in calls),
        "tightness": max(c.tightness for c in calls),
        "failing_calls": len(failing),
        "calls": len(calls),
        "state_detected": -1 if detected is None else int(detected),
    }
    c = report_call
    where = (
        f"call {c.index + 1} of {len(calls)} (step {c.step}, layer {c.layer}: {_magnitudes(c.exps)}; "
        f"{_drift_words(c.layer, c.step, ctx.dtype_str)})"
    )
    tensor = c.worst_tensor
    what = f"{_LABEL[tensor]} normalized error {c.norms.get(tensor, c.norm):.3g}" + (
        f", {c.violations} elements outside the bound" if c.violations else ""
    )
    state_words = _stale_words(stale) or (
        "the kernel describes no state (state_describe)" if c.before_forward is None else ""
    )
    failures = []
    if failing:
        first = f"{len(failing)} of {len(calls)} calls break the recipe; the first, {where}: {what}"
        failures.append(first + (f"; {state_words}" if state_words else ""))
        if worst is not c:
            w_stale = _stale_words(_stale(ctx, worst))
            failures.append(
                f"the worst, call {worst.index + 1} (step {worst.step}, layer {worst.layer}; "
                f"{_drift_words(worst.layer, worst.step, ctx.dtype_str)}): {_LABEL[worst.worst_tensor]} normalized "
                f"error {worst.norms.get(worst.worst_tensor, worst.norm):.3g}"
                + (f", {worst.violations} elements outside the bound" if worst.violations else "")
                + (f"; {w_stale}" if w_stale else "")
            )
    worst_case = case_record(
        c.case,
        call=c.index + 1,
        step=c.step,
        layer=c.layer,
        log2_scales={"q": c.exps[0], "k": c.exps[1], "v": c.exps[2], "do": c.exps[3]},
        drift=_drift_words(c.layer, c.step, ctx.dtype_str),
        tensor=tensor,
        normalized_error=c.norms.get(tensor, c.norm),
        violations=c.violations,
        stale_scales=stale[:4],
        state_before_forward=c.before_forward,
        state_before_backward=c.before_backward,
        state_after=c.after,
        kernels=how,
        declared_state=declared_dict,
        mismatch=c.mismatch.to_dict() if c.mismatch is not None else None,
        worst_call={
            "call": worst.index + 1,
            "step": worst.step,
            "layer": worst.layer,
            "normalized_error": worst.norm,
            "tightness": worst.tightness,
            "violations": worst.violations,
        },
    )
    per_call = [
        {
            "call": x.index + 1,
            "step": x.step,
            "layer": x.layer,
            "log2_scales": list(x.exps),
            "normalized_error": x.norm,
            "tightness": x.tightness,
            "violations": x.violations,
        }
        for x in calls
    ]
    details = {
        "per_call": per_call,
        "declared_state": declared,
        "state_detected": detected_how,
        "kernels": how,
        "series": [
            {
                "title": "worst normalized error of each call (O, dQ, dK, dV) over the training-like sequence",
                "x_label": "call (3 layers per step)",
                "y_label": "normalized error",
                "ys": {"normalized error": [min(x.norm, 1e6) for x in calls]},
                "log_y": True,
                "thresholds": {"limit": ctx.th.get("normalized_error", ERROR_MODEL_FACTOR)},
            }
        ],
    }
    ok = (
        f"every one of {len(calls)} calls within the {ctx.recipe.name} bound and error model "
        f"(worst normalized error {metrics['normalized_error']:.2g}, tightness {metrics['tightness']:.2g}); "
        f"{how}; {declared}; {detected_how}"
    )
    return verdict(ctx, metrics, ok_message=ok, failures=failures, worst_case=worst_case, details=details)


def _history_run(ctx, fn, cases: list[Case], marks: tuple[int, ...], part: tuple[int, int]) -> dict[int, tuple]:
    """Every case through ``fn`` (forward, backward), one after the other; at each index of ``marks``,
    that call's outputs and the kernel's state before it. ``part`` (this run, runs) scales the progress."""
    grads = ctx.has_backward
    kept: dict[int, tuple] = {}
    for n, case in enumerate(cases):
        inp = ctx.inputs(case)
        bufs = _Buffers(inp, grads)
        before = describe_state(fn) if n in marks else None
        call = _Call(n, n, 0, (0, 0, 0, 0), case)
        out = _forward(ctx, fn, bufs, inp, call)
        res: dict[str, torch.Tensor | None] = {"out": out.detach().clone()}
        if grads:
            _backward(ctx, out, inp, call)
            res.update(bufs.grads())
        if n in marks:
            kept[n] = (res, before)
        ctx.progress((part[0] + (n + 1) / len(cases)) / part[1])
    return kept


def _differing(a: dict, b: dict, tensors=("out", "dq", "dk", "dv")) -> dict[str, int]:
    """Per tensor present in both, the number of elements whose bits differ (only those that differ)."""
    out = {}
    for t in tensors:
        if a.get(t) is None or b.get(t) is None:
            continue
        m = compare_bitwise(a[t], b[t], what=t)
        if not m.ok:
            out[t] = m.mismatched
    return out


@register(
    "state.history",
    "a kernel that declares an amax history of H calls forgets: after a spike (x2^8), one window later O "
    "has the bits, and q, k, v, dO the scales, of the same calls without the spike; four windows later "
    "O, dQ, dK, dV have the same bits and every scale agrees",
    defaults=lambda recipe, dtype: {"mismatched_elements": 0, "stale_input_scales": 0, "echo_elements": 0},
    cost=1.0,
)
def history(ctx):
    try:
        policy = declared_state(ctx.harness.fn)
    except ValueError as exc:
        return ctx.skip(f"the kernel's state_policy is malformed ({exc}); state.training judges its calls")
    if policy is None or policy.kind is not StateKind.DELAYED or policy.history_len is None:
        said = "no state_policy" if policy is None else policy.describe()
        return ctx.skip(f"the kernel declares no amax history ({said}); state.training judges its calls")
    h = policy.history_len
    total = ECHO_WINDOWS * h + 2
    if total > MAX_HISTORY_CALLS:
        return ctx.skip(
            f"the declared history of {h} calls needs {total} calls per run, more than this check runs "
            f"({MAX_HISTORY_CALLS})"
        )
    fn = ctx.harness.fn
    factory = is_factory(fn)
    if not factory and not can_snapshot(fn):
        return ctx.skip(
            "cannot start two runs from one state: the kernel is neither a factory (new_instance) nor "
            "restorable (state_snapshot, state_restore)"
        )
    spike = SPIKE_LOG2.get(ctx.dtype_str, _SPIKE_DEFAULT)
    cases = [_scaled(_pack(ctx, 8000 + n, lens=(16, 24)), (0, 0, 0, 0)) for n in range(total)]
    spiked = [_scaled(cases[0], (spike, -spike, spike, spike))] + cases[1:]
    # index h + 1: q, k, v and dO (the calls' own inputs) have left the spike's window, and O's scales come
    # from them alone; index total - 1: every role, however many steps of the chain lead to it
    one, last = h + 1, total - 1
    marks = (one, last)

    def start():
        if factory:
            return fn.new_instance()
        if ctx.harness.pin is not None:
            ctx.harness.pin.restore_fresh()
        else:
            restore_state(fn, start_state)
        return fn

    start_state = None if factory else snapshot_state(fn)
    plain = _history_run(ctx, start(), cases, marks, (0, 2))
    spiked_run = _history_run(ctx, start(), spiked, marks, (1, 2))
    echo = _differing(spiked_run[last][0], plain[last][0])
    noise: dict[str, int] = {}
    if echo:  # the same run again: a backward that does not repeat itself cannot be judged bit for bit
        again = _history_run(ctx, start(), cases, (last,), (1, 2))
        noise = _differing(again[last][0], plain[last][0])
    if not factory and ctx.harness.pin is None:
        restore_state(fn, start_state)

    m = compare_bitwise(spiked_run[one][0]["out"], plain[one][0]["out"], what="out")
    mismatched = 0 if m.ok else m.mismatched
    scales_one = _scale_differences(plain[one][1], spiked_run[one][1])
    stale_inputs = [r for r in scales_one if r[0] in _INPUT_ROLES]
    scales_last = _scale_differences(plain[last][1], spiked_run[last][1])
    judged_echo = {t: n for t, n in echo.items() if t not in noise}
    metrics = {
        "mismatched_elements": mismatched,
        "stale_input_scales": len(stale_inputs),
        "echo_elements": sum(judged_echo.values()),
        "stale_scales_after_echo": len(scales_last),
        "history_len": h,
        "calls_per_run": total,
        "spike_log2": spike,
    }
    worst_case = case_record(
        cases[last],
        spike_case=spiked[0].to_dict(),
        call=one + 1,
        last_call=last + 1,
        state_without_spike=plain[one][1],
        state_with_spike=spiked_run[one][1],
        state_without_spike_last=plain[last][1],
        state_with_spike_last=spiked_run[last][1],
        differing_scales=scales_one,
        differing_scales_last=scales_last,
        differing_elements_last=echo,
        not_repeatable=noise,
        mismatch=None if m.ok else m.to_dict(),
    )

    def scale_words(rows):
        return "; ".join(f"{r}'s scale 2^{a:.0f} instead of 2^{b:.0f}" for r, a, b in rows[:3])

    failures = []
    if mismatched or stale_inputs:
        what = f"O differs in {mismatched} elements" if mismatched else "O is the same"
        words = scale_words(stale_inputs or scales_one)
        failures.append(
            f"declared an amax history of {h} calls, yet call {one + 1}, {h + 1} calls after a 2^{spike} spike, "
            f"still sees it ({what}" + (f"; {words}" if words else "") + "): the history does not forget"
        )
    elif judged_echo or scales_last:
        parts = [f"{_LABEL[t]} differs in {n} elements" for t, n in judged_echo.items()]
        words = scale_words(scales_last)
        failures.append(
            f"declared an amax history of {h} calls, yet call {last + 1}, {ECHO_WINDOWS} windows after a "
            f"2^{spike} spike (every record of both runs made since, by the same calls), still sees it ("
            + "; ".join(parts + ([words] if words else []))
            + "): a history that does not forget"
        )
    notes = ""
    if noise:
        notes = (
            f"; the last call's {', '.join(_LABEL[t] for t in noise)} do not repeat bit for bit between two runs "
            "without the spike, so their bits were not judged"
        )
    return verdict(
        ctx,
        metrics,
        ok_message=f"call {one + 1} gives O's bits and the input scales of the same calls without a 2^{spike} "
        f"spike {h + 1} calls earlier, and call {last + 1} ({ECHO_WINDOWS} windows on) every tensor's bits"
        + (" and every scale" if plain[last][1] else "")
        + f": the declared history of {h} calls forgets it{notes}",
        failures=failures,
        worst_case=worst_case,
        judge_thresholds=False,
    )


def _scale_differences(a: dict | None, b: dict | None) -> list[tuple[str, float, float]]:
    """(role, log2 scale with the spike, log2 scale without) where the two states' scales differ."""
    out: list[tuple[str, float, float]] = []
    if not isinstance(a, dict) or not isinstance(b, dict):
        return out
    for role, rec in b.items():
        other = a.get(role)
        if not (isinstance(rec, dict) and isinstance(other, dict)):
            continue
        x, y = rec.get("scale"), other.get("scale")
        if isinstance(x, (int, float)) and isinstance(y, (int, float)) and x != y and x > 0 and y > 0:
            out.append((role, math.log2(x), math.log2(y)))
    return out
