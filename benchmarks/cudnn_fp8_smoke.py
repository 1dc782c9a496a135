"""GPU smoke test of the cudnn-fp8 kernel: every cuDNN call it makes, one line per result.

    python benchmarks/cudnn_fp8_smoke.py            # about a minute on an H200, no network
    python benchmarks/cudnn_fp8_smoke.py --bench    # also fwd+bwd time against cuDNN BF16 at 8K and 16K
    python benchmarks/cudnn_fp8_smoke.py --dry-run  # the script itself on the CPU: the PyTorch model of
                                                    # cuDNN instead of cuDNN, short documents (1-2 minutes)

What it runs (a pack of documents of 128, 256 and 384 tokens, H=4 query heads over Hk=2, head_dim 128,
bf16 inputs ~ N(0, 1)):

1. the fused quantization kernels on the GPU against their PyTorch twins, bit for bit;
2. per scaling mode (current; delayed, calibrated then frozen; delayed, learning) and causal or not:
   the kernel's O, dQ, dK, dV against float64 attention (relative RMSE), the same call on the PyTorch
   model of cuDNN (:class:`EmulatedEngine`, the same scales) to tell glue bugs from cuDNN's numerics,
   and cuDNN's amax outputs against the float64 amaxes (amax_s tells the P scale's headroom);
3. edge cases: Lq != Lk without the causal mask, an empty document, a document without keys, causal
   Lq != Lk and head_dims 64 and 80 (adapted on Hopper), two identical calls (bitwise);
4. the causal property: the past, alone vs with the future changed (delayed: bitwise equal expected).

Every failure prints one line starting with ``FAIL``; the last line counts them. Exit 0 when none
failed, 1 otherwise, 2 when cudnn-fp8 cannot run here (the line says why).
"""

from __future__ import annotations

import argparse
import math
import time
import traceback
from collections.abc import Callable, Sequence

import torch

from flamia_verify.kernels.cudnn_fp8 import kernel as cudnn_fp8
from flamia_verify.kernels.cudnn_fp8.engine import EmulatedEngine
from flamia_verify.reference import attention_backward, attention_forward

LENS = (128, 256, 384)
DEVICE = "cuda"
DRY_RUN = False  # --dry-run: CPU, the PyTorch model of cuDNN (EmulatedEngine, Hopper's limits), short documents
TOL = {"O": 0.08, "dQ": 0.15, "dK": 0.15, "dV": 0.15}  # fp8 recipe: a few percent (docs/kernels.md table)
MODES = (
    ("current", {"mode": "current"}),
    ("delayed-frozen", {"mode": "delayed", "freeze_after_calibration": True}),
    ("delayed-learning", {"mode": "delayed"}),
)


def make_kernel(*args, **kw):
    if DRY_RUN and "engine" not in kw:
        kw["engine"] = EmulatedEngine(arch=9)
    return cudnn_fp8.make_kernel(*args, **kw)


def _arch() -> int:
    return 9 if DRY_RUN else torch.cuda.get_device_capability()[0]


class Smoke:
    def __init__(self, out: Callable[[str], None]) -> None:
        self.out = out
        self.failures: list[str] = []
        self.checks = 0

    def check(self, ok: bool, what: str, detail: str = "") -> None:
        self.checks += 1
        line = f"{'PASS' if ok else 'FAIL'} {what}{': ' + detail if detail else ''}"
        self.out(line)
        if not ok:
            self.failures.append(line)

    def crashed(self, what: str, exc: BaseException) -> None:
        self.checks += 1
        first = (str(exc).strip().splitlines() or [""])[0]
        line = f"FAIL {what}: {type(exc).__name__}: {first}"
        self.out(line)
        self.out("     " + "".join(traceback.format_exception(exc)[-3:]).replace("\n", "\n     ").rstrip())
        self.failures.append(line)


def _pack(lens_q: Sequence[int], lens_k: Sequence[int], heads=4, heads_k=2, dim=128, seed=0):
    g = torch.Generator().manual_seed(seed)
    cu_q = torch.tensor([0, *torch.tensor(lens_q).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    cu_k = torch.tensor([0, *torch.tensor(lens_k).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    mk = lambda t, h: torch.randn(t, h, dim, generator=g).to(torch.bfloat16).to(DEVICE)  # noqa: E731
    tq, tk = int(cu_q[-1]), int(cu_k[-1])
    return mk(tq, heads), mk(tk, heads_k), mk(tk, heads_k), mk(tq, heads), cu_q, cu_k


def _call(fn, q, k, v, do, cu_q, cu_k, causal, grads=True):
    q, k, v = (t.detach().clone().requires_grad_(grads) for t in (q, k, v))
    out = fn(q, k, v, cu_q, cu_k, int((cu_q[1:] - cu_q[:-1]).max()), int((cu_k[1:] - cu_k[:-1]).max()), causal=causal)
    if not grads:
        return (out,)
    return (out, *torch.autograd.grad(out, (q, k, v), do))


def _reference(q, k, v, do, cu_q, cu_k, causal):
    scale = q.shape[-1] ** -0.5
    o, lse = attention_forward(q, k, v, cu_q, cu_k, softmax_scale=scale, causal=causal)
    return (o, *attention_backward(do, q, k, v, o, lse, cu_q, cu_k, softmax_scale=scale, causal=causal))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float(torch.linalg.vector_norm(a - b) / torch.linalg.vector_norm(b).clamp(min=1e-300))


def _amax_ds(q, k, v, do, cu_q, cu_k, causal) -> float:
    """max |P (dP - D)| softmax_scale over the visible pairs, in float64: the tensor cuDNN quantizes
    with scale_dP, whose amax its amax_dP output reports."""
    best, scale = 0.0, q.shape[-1] ** -0.5
    group = q.shape[1] // k.shape[1]
    for b in range(len(cu_q) - 1):
        qs, qe, ks, ke = int(cu_q[b]), int(cu_q[b + 1]), int(cu_k[b]), int(cu_k[b + 1])
        if qe == qs or ke == ks:
            continue
        qq, dd = q[qs:qe].double(), do[qs:qe].double()
        kk, vv = (t[ks:ke].double().repeat_interleave(group, dim=1) for t in (k, v))
        s = torch.einsum("ihd,jhd->hij", qq, kk) * scale
        if causal:
            i = torch.arange(qe - qs, device=s.device)[:, None]
            j = torch.arange(ke - ks, device=s.device)[None, :]
            s = s.masked_fill(j > i + (ke - ks) - (qe - qs), -math.inf)
        p = s.softmax(-1).nan_to_num()
        dp = torch.einsum("ihd,jhd->hij", dd, vv)
        o = torch.einsum("hij,jhd->ihd", p, vv)
        d_row = (dd * o).sum(-1).transpose(0, 1)[:, :, None]
        best = max(best, float((p * (dp - d_row)).abs().max()) * scale)
    return best


def quantization_twins(s: Smoke) -> None:
    from flamia_verify.kernels.cudnn_fp8.layout import make_layout
    from flamia_verify.kernels.cudnn_fp8.quantize import (
        amax_many,
        amax_reference,
        dequantize_e4m3,
        dequantize_e4m3_reference,
        quantize_e4m3,
        quantize_e4m3_reference,
    )

    q, k, v, do, cu, _ = _pack(LENS, LENS)
    x = q * torch.exp2(torch.randint(-10, 10, q.shape[:2] + (1,), device=DEVICE)).to(q.dtype)
    x.view(-1)[:6] = torch.tensor([math.nan, math.inf, -math.inf, -0.0, 1e4, 2.0**-130], device=DEVICE).to(x.dtype)
    for padded in (False, True):
        layout = make_layout(padded, x.shape[0], len(LENS), max(LENS))
        scale = torch.tensor([4.0], device=DEVICE)
        try:
            codes, amax = quantize_e4m3(x, scale, layout, cu)
            want, want_amax = quantize_e4m3_reference(x, scale, layout, cu)
            diff = int((codes.view(torch.uint8) != want.view(torch.uint8)).sum())
            s.check(diff == 0, f"quantize {layout.kind} vs twin", f"{diff} codes differ")
            same_amax = amax is not None and (bool(torch.isnan(amax).all()) and bool(torch.isnan(want_amax)))
            s.check(same_amax, f"quantize {layout.kind} amax keeps NaN", f"{amax} vs {want_amax}")
            back = dequantize_e4m3(codes, 1 / scale, layout, cu, torch.bfloat16)
            twin = dequantize_e4m3_reference(codes, 1 / scale, layout, cu, torch.bfloat16)
            nan = torch.isnan(back.float())
            ok = torch.equal(nan, torch.isnan(twin.float())) and torch.equal(
                back.view(torch.int16)[~nan], twin.view(torch.int16)[~nan]
            )
            s.check(ok, f"dequantize {layout.kind} vs twin")
        except Exception as exc:
            s.crashed(f"quantization {layout.kind}", exc)
    try:
        got = amax_many([q, k, v])
        want = torch.stack([amax_reference(t) for t in (q, k, v)])
        s.check(torch.equal(got, want), "amax of q, k, v in one launch", f"{got.tolist()} vs {want.tolist()}")
    except Exception as exc:
        s.crashed("amax_many", exc)


def modes_against_float64(s: Smoke) -> None:
    q, k, v, do, cu, _ = _pack(LENS, LENS)
    for causal in (False, True):
        ref = _reference(q, k, v, do, cu, cu, causal)
        amax_ds = _amax_ds(q, k, v, do, cu, cu, causal)
        for label, kw in MODES:
            case = f"{label} causal={causal}"
            try:
                fn = make_kernel(**kw)
                got = _call(fn, q, k, v, do, cu, cu, causal)
                again = _call(fn, q, k, v, do, cu, cu, causal)  # a calibrated kernel's scales from the history
            except Exception as exc:
                s.crashed(case, exc)
                continue
            errs = {n: _rel(g, r) for n, g, r in zip(("O", "dQ", "dK", "dV"), got, ref, strict=True)}
            text = ", ".join(f"{n} {e:.3e}" for n, e in errs.items())
            s.check(all(e < TOL[n] for n, e in errs.items()), f"{case} vs float64 (rel. RMSE)", text)
            errs2 = {n: _rel(g, r) for n, g, r in zip(("O", "dQ", "dK", "dV"), again, ref, strict=True)}
            s.check(all(e < TOL[n] for n, e in errs2.items()), f"{case} second call vs float64", str(errs2))
            s.out(f"     paths {dict(fn.paths)}")  # type: ignore[attr-defined]
            hist = fn.scaling.history()  # type: ignore[attr-defined]
            if hist is not None and not kw.get("freeze_after_calibration"):  # frozen: o and s never recorded
                from flamia_verify.kernels.cudnn_fp8.scaling import ROLES

                row = dict(zip(ROLES, hist.amax(dim=0).tolist(), strict=True))
                f64 = {"o": float(ref[0].abs().max()), "dq": float(ref[1].abs().max()), "dk": float(ref[2].abs().max())}
                f64.update({"dv": float(ref[3].abs().max()), "dp": amax_ds})
                s.out(
                    "     cuDNN amax (history max) vs float64: "
                    + ", ".join(f"{r} {row[r]:.4g}/{f64[r]:.4g}" for r in ("o", "dp", "dq", "dk", "dv"))
                    + f"; amax_s {row['s']:.4g} (P scale 2^7 saturates above {448 / 128 * 16:.1f})"
                )
                ok = all(abs(row[r] - f64[r]) <= 0.25 * f64[r] for r in ("o", "dp", "dq", "dk", "dv"))
                s.check(ok, f"{case} cuDNN amax outputs within 25% of float64 (pre-quantization amaxes)")
            # the same call on the PyTorch model of cuDNN: glue bugs show here, cuDNN numerics do not
            try:
                arch = _arch()
                model = make_kernel(**kw, engine=EmulatedEngine(arch=arch))
                emu = _call(model, q, k, v, do, cu, cu, causal)
                diffs = {n: _rel(g, e) for n, g, e in zip(("O", "dQ", "dK", "dV"), got, emu, strict=True)}
                s.check(
                    all(d < TOL[n] for n, d in diffs.items()),
                    f"{case} cuDNN vs its PyTorch model (same scales)",
                    ", ".join(f"{n} {d:.3e}" for n, d in diffs.items()),
                )
            except Exception as exc:
                s.crashed(f"{case} PyTorch model", exc)


def edge_cases(s: Smoke) -> None:
    fn = make_kernel("current")
    cases = [
        ("Lq != Lk, not causal", (100, 50, 64), (60, 200, 64), False),
        ("an empty document", (128, 0, 64), (128, 0, 64), True),
        ("a document without keys (out 0)", (32, 16), (32, 0), False),
    ]
    for label, lq, lk, causal in cases:
        q, k, v, do, cu_q, cu_k = _pack(lq, lk, seed=3)
        try:
            got = _call(fn, q, k, v, do, cu_q, cu_k, causal)
            ref = _reference(q, k, v, do, cu_q, cu_k, causal)
            errs = {n: _rel(g, r) for n, g, r in zip(("O", "dQ", "dK", "dV"), got, ref, strict=True) if r.norm() > 0}
            finite = all(bool(torch.isfinite(g).all()) for g in got)
            ok = finite and all(e < TOL[n] for n, e in errs.items())
            s.check(ok, f"edge: {label}", f"finite {finite}, " + ", ".join(f"{n} {e:.3e}" for n, e in errs.items()))
        except Exception as exc:
            s.crashed(f"edge: {label}", exc)
    # Hopper runs these through adaptations (equal-length documents, zero-padded head_dim): the same
    # attention as the convention's, so the same tolerances
    adapted = [
        ("causal Lq != Lk (bottom-right)", (64, 32, 40, 0), (64, 96, 8, 30), True, 128),
        ("head_dim 64", LENS, LENS, True, 64),
        ("head_dim 80, causal Lq != Lk", (7, 50), (90, 20), True, 80),
    ]
    for label, lq, lk, causal, dim in adapted:
        q, k, v, do, cu_q, cu_k = _pack(lq, lk, dim=dim, seed=4)
        try:
            got = _call(fn, q, k, v, do, cu_q, cu_k, causal)
            ref = _reference(q, k, v, do, cu_q, cu_k, causal)
            errs = {n: _rel(g, r) for n, g, r in zip(("O", "dQ", "dK", "dV"), got, ref, strict=True) if r.norm() > 0}
            ok = all(e < TOL[n] for n, e in errs.items())
            s.check(ok, f"edge: {label}", ", ".join(f"{n} {e:.3e}" for n, e in errs.items()))
        except Exception as exc:
            s.crashed(f"edge: {label}", exc)
    q, k, v, do, cu, _ = _pack(LENS, LENS, seed=6)
    try:
        fz = make_kernel("delayed", freeze_after_calibration=True)
        a, b = _call(fz, q, k, v, do, cu, cu, True), _call(fz, q, k, v, do, cu, cu, True)
        s.check(all(torch.equal(x, y) for x, y in zip(a, b, strict=True)), "determinism: two identical calls, bitwise")
    except Exception as exc:
        s.crashed("determinism", exc)
    try:  # a NaN in q: its own output row turns NaN, no other (calibrated on clean data first)
        bad = q.clone()
        bad[LENS[0] + 10, 1, 5] = math.nan
        (out,) = _call(fz, bad, k, v, do, cu, cu, True, grads=False)
        rows = torch.isnan(out.float()).any(dim=2)
        ok = bool(rows[LENS[0] + 10, 1]) and int(rows.sum()) == 1
        s.check(ok, "NaN in one query: exactly its output row is NaN", f"{int(rows.sum())} NaN rows")
    except Exception as exc:
        s.crashed("NaN propagation", exc)


def causal_property(s: Smoke) -> None:
    q, k, v, do, cu, _ = _pack(LENS, LENS, seed=7)
    t0 = LENS[0] + LENS[1] // 3
    after = slice(t0 + 1, LENS[0] + LENS[1])
    changed = []
    for t in (q, k, v, do):
        c = t.clone()
        c[after] = c[after] * 50
        changed.append(c)
    for label, kw in MODES[:2]:
        try:
            fn = make_kernel(**kw)
            a = _call(fn, q, k, v, do, cu, cu, True)
            b = _call(fn, *changed, cu, cu, True)
            same = torch.equal(a[0][: t0 + 1], b[0][: t0 + 1]) and torch.equal(a[1][: t0 + 1], b[1][: t0 + 1])
            if label == "current":
                s.out(f"INFO causal property, current scaling: past unchanged by the future: {same} (expected False)")
            else:
                s.check(same, f"causal property, {label}: O and dQ up to t bitwise unchanged by the future")
        except Exception as exc:
            s.crashed(f"causal property {label}", exc)


def _cuda_split(f: Callable[[], None], reps: int = 5) -> dict[str, float]:
    """CUDA time per call of ``f`` by where it goes (torch.profiler): cuDNN's attention kernels, the
    Triton quantization passes, everything else (ms)."""
    from torch.profiler import ProfilerActivity, profile

    f()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            f()
        torch.cuda.synchronize()
    split = {"cuDNN": 0.0, "quantization (Triton)": 0.0, "other": 0.0}
    for e in prof.key_averages():
        us = getattr(e, "device_time_total", None)
        if us is None:
            us = getattr(e, "cuda_time_total", 0.0)
        if not us or e.key.startswith(("ProfilerStep", "cuda")):
            continue
        name = e.key.lower()
        where = "quantization (Triton)" if "quantize" in name or "amax" in name else "other"
        if any(t in name for t in ("cudnn", "sm90", "fmha", "xmma", "sdpa", "flash")):
            where = "cuDNN"
        split[where] += us / 1e3 / reps
    return split


def bench(s: Smoke) -> None:
    """fwd+bwd time at B * S = 32K tokens, H = 16, D = 128 against cuDNN BF16, with cuDNN's
    deterministic FP8 backward (what the checks use) and without it, and where the FP8 call's CUDA time
    goes."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def timed(f, reps=20):
        f()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(reps):
            f()
        torch.cuda.synchronize()
        return (time.perf_counter() - t) / reps

    for seq in (8192, 16384):
        for causal in (False, True):
            batch = 32768 // seq
            q, k, v, do, cu, _ = _pack([seq] * batch, [seq] * batch, heads=16, heads_k=16, seed=8)
            qb, kb, vb, dob = (t.reshape(batch, seq, 16, 128).transpose(1, 2) for t in (q, k, v, do))

            def bf16(qb=qb, kb=kb, vb=vb, dob=dob, causal=causal):
                x, y, z = (t.detach().requires_grad_() for t in (qb, kb, vb))
                with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                    o = torch.nn.functional.scaled_dot_product_attention(x, y, z, is_causal=causal)
                torch.autograd.grad(o, (x, y, z), dob)

            try:
                t16 = timed(bf16)
                line = f"BENCH S={seq} causal={causal}: cuDNN BF16 {t16 * 1e3:.2f} ms"
                for deterministic in (True, False):
                    fn = make_kernel("delayed", freeze_after_calibration=True, deterministic=deterministic)

                    def fp8(fn=fn, q=q, k=k, v=v, do=do, cu=cu, causal=causal):
                        _call(fn, q, k, v, do, cu, cu, causal)

                    t8 = timed(fp8)
                    label = "deterministic" if deterministic else "non-deterministic"
                    line += f"; cudnn-fp8 {label} bwd {t8 * 1e3:.2f} ms = {t16 / t8:.2f}x"
                    split = _cuda_split(fp8)
                    line += " (" + ", ".join(f"{k} {v:.2f}" for k, v in split.items()) + " ms)"
                s.out(line)
            except Exception as exc:
                s.crashed(f"bench S={seq}", exc)


def main(argv: Sequence[str] | None = None, out: Callable[[str], None] = print) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--bench",
        action="store_true",
        help="also time fwd+bwd against cuDNN BF16 at 8K and 16K, deterministic backward or not, with a CUDA "
        "time split",
    )
    ap.add_argument("--only-bench", action="store_true", help="the bench alone (no smoke sections)")
    ap.add_argument("--dry-run", action="store_true", help="on the CPU with the PyTorch model of cuDNN")
    args = ap.parse_args(argv)
    global DEVICE, DRY_RUN, LENS
    if args.dry_run:
        import os

        os.environ.setdefault("TRITON_INTERPRET", "1")  # before Triton is imported (lazily, by the kernels)
        DEVICE, DRY_RUN, LENS = "cpu", True, (24, 40, 56)
        out("cudnn-fp8 smoke: dry run on the CPU with the PyTorch model of cuDNN (not cuDNN)")
    else:
        reason = cudnn_fp8.unavailable()
        if reason is not None:
            out(f"cudnn-fp8 smoke: not run: {reason}")
            return 2
        import cudnn

        out(
            f"cudnn-fp8 smoke: torch {torch.__version__}, cudnn frontend {getattr(cudnn, '__version__', '?')}, "
            f"cuDNN {cudnn.backend_version()}, {torch.cuda.get_device_name()} "
            f"sm_{''.join(map(str, torch.cuda.get_device_capability()))}"
        )
    s = Smoke(out)
    sections = () if args.only_bench else (quantization_twins, modes_against_float64, edge_cases, causal_property)
    for section in sections:
        out(f"--- {section.__name__}")
        section(s)
    if (args.bench or args.only_bench) and not DRY_RUN:
        out("--- bench")
        bench(s)
    out(f"cudnn-fp8 smoke: {s.checks} checks, {len(s.failures)} failed")
    for line in s.failures:
        out(line)
    return 1 if s.failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
