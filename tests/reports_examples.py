"""Example reports for the report tests: what a run of the known-bad `mxfp8-naive` kernel looks like.

`example_report()` has several families, every status, a NaN metric, and details with series,
histograms and heatmaps drawn by the HTML report. `hostile_report()` puts markup and control characters
into every string a kernel, a check or the command line can reach.
"""

from __future__ import annotations

import math
import random

from flamia_verify.results import CheckResult, Report, SweepResult

#: Plots in `example_report()`: the HTML report must draw exactly this many <svg> elements (its all-zero
#: heatmap is stated in words, not drawn).
EXAMPLE_PLOT_COUNT = 5

XSS = "<script>alert(1)</script>"
IMG_XSS = "<img src=x onerror=\"document.title='pwned'\">"


def _position_error(n: int, seed: int, *, spike_at: int | None = None, scale: float = 1e-3) -> list[float]:
    rng = random.Random(seed)
    out = [scale * (1.0 + 0.3 * rng.random()) * (1.0 + i / n) for i in range(n)]
    if spike_at is not None:
        out[spike_at] = scale * 40.0
    return out


def _histogram(seed: int, center: float, n_bins: int = 30) -> tuple[list[float], list[int]]:
    rng = random.Random(seed)
    edges = [10.0 ** (-7 + 6 * i / n_bins) for i in range(n_bins + 1)]
    counts = [0] * n_bins
    for _ in range(4000):
        x = 10.0 ** rng.gauss(math.log10(center), 0.5)
        for b in range(n_bins):
            if edges[b] <= x < edges[b + 1]:
                counts[b] += 1
                break
    return edges, counts


def _leakage_map(n: int, leaks: list[tuple[int, int, float]]) -> list[list[float]]:
    z = [[0.0] * n for _ in range(n)]
    for q, k, v in leaks:
        z[q][k] = v
    return z


def example_report(*, kernel: str = "mxfp8-naive", seed: int = 1234) -> Report:
    """A realistic report: 11 checks over 9 families with 7 passes, 2 failures, 1 error and 1 skip."""
    n = 256
    edges_o, counts_kernel = _histogram(seed, 3e-3)
    _, counts_bf16 = _histogram(seed + 1, 8e-4)
    edges_g, counts_dq = _histogram(seed + 2, 2e-2)
    _, counts_dk = _histogram(seed + 3, 5e-2)
    _, counts_dv = _histogram(seed + 4, 1e-2)
    checks = [
        CheckResult(
            name="error.forward",
            family="error",
            status="pass",
            metrics={"rel_err_vs_bf16_O": 2.7, "rms_err_O": 2.1e-3, "rms_err_O_bf16": 7.8e-4, "sqnr_O_db": 31.4},
            thresholds={"rel_err_vs_bf16_O": 4.0, "sqnr_O_db": 25.0},
            worst_case={"seed": 1234, "cu_seqlens": [0, 128, 256], "head": 3, "position": 191, "tensor": "O"},
            message="O error 2.7x BF16 (limit 4x)",
            duration_s=1.82,
            details={
                "series": [
                    {
                        "title": "Forward error along the sequence",
                        "x_label": "token position",
                        "y_label": "RMS error of O",
                        "x": list(range(n)),
                        "ys": {
                            "mxfp8-naive": _position_error(n, 1, scale=2e-3),
                            "bf16": _position_error(n, 2, scale=8e-4),
                        },
                        "log_y": True,
                    }
                ],
                "histograms": [
                    {
                        "title": "|O - O_ref| per element",
                        "x_label": "absolute error",
                        "bin_edges": edges_o,
                        "counts": {"mxfp8-naive": counts_kernel, "bf16": counts_bf16},
                        "log_x": True,
                    }
                ],
                "cases": 24,
            },
        ),
        CheckResult(
            name="error.backward",
            family="error",
            status="fail",
            metrics={
                "rel_err_vs_bf16_dK": 9.7,
                "rel_err_vs_bf16_dQ": 3.1,
                "rel_err_vs_bf16_dV": 1.9,
                "max_abs_err_dV": float("nan"),
            },
            thresholds={"rel_err_vs_bf16_dQ": 4.0, "rel_err_vs_bf16_dK": 4.0, "rel_err_vs_bf16_dV": 4.0},
            worst_case={
                "seed": 1301,
                "cu_seqlens": [0, 37, 300],
                "nheads": 8,
                "nheads_k": 2,
                "headdim": 128,
                "causal": True,
                "tensor": "dK",
                "index": [211, 1, 77],
                "value": 0.0313,
                "reference": 0.0287,
            },
            message="dK error 9.7x BF16 (limit 4x): K quantized across the causal diagonal",
            duration_s=3.41,
            details={
                "series": [
                    {
                        "title": "Gradient error vs BF16 along the sequence",
                        "x_label": "key position",
                        "y_label": "error / BF16 error",
                        "ys": {
                            "dK": _position_error(n, 3, spike_at=200, scale=2.0),
                            "dV": _position_error(n, 4, scale=1.5),
                        },
                        "thresholds": {"limit": 4.0},
                        "log_y": True,
                    }
                ],
                "histograms": [
                    {
                        "title": "Gradient errors per tensor",
                        "x_label": "absolute error",
                        "bin_edges": edges_g,
                        "counts": {"dQ": counts_dq, "dK": counts_dk, "dV": counts_dv},
                        "log_x": True,
                        "log_y": True,
                    }
                ],
            },
        ),
        CheckResult(
            name="bound.forward",
            family="bound",
            status="pass",
            metrics={"bound_violations": 0, "max_err_over_bound": 0.41},
            thresholds={"bound_violations": 0},
            worst_case={"seed": 1234, "tensor": "O", "position": 17},
            duration_s=0.92,
        ),
        CheckResult(
            name="bias.gradient_shrinkage",
            family="bias",
            status="pass",
            metrics={"cos_dQ": 0.99991, "shrinkage_dQ": 0.0012, "mean_over_rms_O": 0.004},
            thresholds={"cos_dQ": 0.999, "shrinkage_dQ": 0.01},
            worst_case={"seed": 1240},
            duration_s=1.1,
        ),
        CheckResult(
            name="consistency.shift_invariance",
            family="consistency",
            status="pass",
            metrics={"sum_dK_rel": 3.2e-7},
            thresholds={"sum_dK_rel": 1e-5},
            worst_case={"seed": 1234},
            duration_s=0.4,
        ),
        CheckResult(
            name="causal.forward",
            family="causal",
            status="fail",
            metrics={"max_leak": 0.031, "leaking_positions": 3},
            thresholds={"max_leak": 0.0},
            worst_case={
                "seed": 1377,
                "cu_seqlens": [0, 64],
                "query": 40,
                "changed_keys": [41, 63],
                "head": 0,
                "before": 0.1250,
                "after": 0.1561,
                "poison": "adversarial",
                "block": 32,
            },
            message="outputs at 3 positions moved when only later keys changed (max 0.031)",
            duration_s=2.2,
            details={
                "heatmaps": [
                    {
                        "title": "Causal leakage: |dO| when keys after the query change",
                        "x_label": "changed key position",
                        "y_label": "query position",
                        "z_label": "max |change of O|",
                        "z": _leakage_map(64, [(40, 41, 0.031), (40, 63, 0.012), (33, 60, 0.004)]),
                        "x": list(range(64)),
                        "y": list(range(64)),
                    }
                ],
            },
        ),
        CheckResult(
            name="causal.backward",
            family="causal",
            status="error",
            metrics={},
            thresholds={"max_leak": 0.0},
            worst_case={"seed": 1378, "cu_seqlens": [0, 64]},
            message="KernelCrashError: backward raised RuntimeError: shape mismatch in dS block 3",
            duration_s=0.05,
        ),
        CheckResult(
            name="isolation.packing",
            family="isolation",
            status="pass",
            metrics={"max_cross_doc_change": 0.0, "max_offset_change": 0.0},
            thresholds={"max_cross_doc_change": 0.0, "max_offset_change": 0.0},
            worst_case={"seed": 1400, "cu_seqlens": [0, 5, 5, 6, 70]},
            duration_s=1.6,
            details={
                "heatmaps": [
                    {
                        "title": "Cross-document change (all zero)",
                        "x_label": "changed document",
                        "y_label": "observed document",
                        "z": [[0.0, 0.0, 0.0, 0.0] for _ in range(4)],
                        "x": ["doc0", "doc1", "doc2", "doc3"],
                        "y": ["doc0", "doc1", "doc2", "doc3"],
                    }
                ],
            },
        ),
        CheckResult(
            name="special.attention_sink",
            family="special",
            status="pass",
            metrics={"rel_err_vs_bf16_O": 1.4},
            thresholds={"rel_err_vs_bf16_O": 4.0},
            worst_case={"seed": 1450, "sink_logit": 30.0},
            duration_s=0.7,
        ),
        CheckResult(
            name="determinism.backward",
            family="determinism",
            status="skip",
            metrics={},
            thresholds={},
            worst_case={},
            message="kernel is forward-only: gradient checks skipped",
        ),
        CheckResult(
            name="interface.shapes",
            family="interface",
            status="pass",
            metrics={"inputs_unmodified": True, "out_dtype": "bfloat16"},
            thresholds={"inputs_unmodified": True},
            worst_case={},
            duration_s=0.02,
        ),
    ]
    return Report(
        kernel=kernel,
        recipe="mxfp8",
        suite="quick",
        seed=seed,
        environment={
            "python": "3.11.2",
            "torch": "2.13.0",
            "triton": None,
            "device": "cpu",
            "platform": "Linux-6.1-x86_64",
            "threads": 2,
        },
        checks=checks,
    )


def passing_report(*, seed: int = 1234) -> Report:
    """A small all-pass report (one skip), as the FLAMIA kernel gives."""
    checks = [
        CheckResult(
            "error.forward",
            "error",
            "pass",
            {"rel_err_vs_bf16_O": 1.3, "sqnr_O_db": 36.0},
            {"rel_err_vs_bf16_O": 4.0, "sqnr_O_db": 25.0},
            {"seed": seed},
            duration_s=1.0,
        ),
        CheckResult(
            "error.backward",
            "error",
            "pass",
            {"rel_err_vs_bf16_dK": 1.6},
            {"rel_err_vs_bf16_dK": 4.0},
            {"seed": seed + 1},
            duration_s=2.0,
        ),
        CheckResult("causal.forward", "causal", "pass", {"max_leak": 0.0}, {"max_leak": 0.0}, {"seed": seed + 2}),
        CheckResult("determinism.forward", "determinism", "skip", {}, {}, {}, message="one run only in quick"),
    ]
    return Report("flamia-mxfp8", "mxfp8", "quick", seed, {"torch": "2.13.0", "device": "cpu"}, checks)


def hostile_report() -> Report:
    """Markup, Markdown and control characters in every string that reaches a renderer."""
    report = example_report(kernel=XSS)
    report.recipe = "mxfp8|`code`"
    report.suite = "quick"
    report.environment[XSS] = IMG_XSS
    bad = report.check("error.backward")
    bad.message = f"{IMG_XSS} | **bold** [link](http://x) ```\x1b[31m red \x00"
    bad.worst_case[XSS] = IMG_XSS
    bad.metrics[XSS] = 1.0
    bad.details["series"][0]["title"] = XSS
    bad.details["series"][0]["ys"][IMG_XSS] = bad.details["series"][0]["ys"].pop("dV")
    bad.details[XSS] = IMG_XSS
    report.checks.append(CheckResult(name=f"special.{XSS}", family="special", status="skip", message=IMG_XSS))
    return report


#: The survey of docs/survey.md (H200, quick suite), as sweep results: (kernel, recipe, failing
#: checks {name: message}, O rel. RMSE, its model, fwd / bwd / fwd+bwd TFLOP/s or None).
_SURVEY = [
    ("bf16", "bf16", {}, 0.0019, 0.0029, (400.1, 313.9, 333.6)),
    ("fp8", "fp8", {}, 0.052, 0.12, (324.9, 120.2, 147.0)),
    ("fp8-mma", "fp8-mma", {}, 0.052, 0.12, (131.6, 72.2, 83.6)),
    (
        "fp8-tensor",
        "fp8",
        {
            "consistency.conservation_forward": "max_rel_dev = 0.108 breaks <= 0.007828",
            "causal.forward": "leaked_elements = 618924 breaks <= 0; out at/before t: Mismatched elements: "
            "128 / 128 (100%), max abs diff 0.1484, max rel diff 1; worst at token 0, head 0, channel 5",
            "isolation.neighbours": "changed_elements = 477826 breaks <= 0; out of the target document "
            "(neighbours huge): Mismatched elements: 5645 / 5760 (98%), max abs diff 0.2393, max rel diff 1",
            "special.nonfinite": "spread_elements = 119168 breaks <= 0; out[0, 0, 0] is non-finite where it does "
            "not depend on v[1, 1, 9] = inf (0 elements hidden, 19712 spread)",
        },
        0.072,
        0.12,
        (5.9, 1.2, 1.5),
    ),
    ("flamia-mxfp8", "mxfp8", {}, 0.052, 0.12, (291.9, 152.7, 177.0)),
    ("flamia-mxfp8-floor", "mxfp8-floor", {}, 0.076, 0.22, (292.0, 156.7, 180.6)),
    ("flamia-nvfp4", "nvfp4", {}, 0.052, 0.12, (293.6, 62.4, 80.5)),
    (
        "mxfp8-naive",
        "mxfp8",
        {
            "consistency.conservation_forward": "max_rel_dev = 0.05469 breaks <= 0.007828",
            "causal.forward": "leaked_elements = 74817 breaks <= 0; out at/before t: Mismatched elements: "
            "68 / 128 (53.1%), max abs diff 0.1172, max rel diff 1; worst at token 0, head 0, channel 3",
            "isolation.neighbours": "changed_elements = 224544 breaks <= 0; out of the target document "
            "(neighbours huge): Mismatched elements: 5225 / 5760 (90.7%), max abs diff 0.06641",
        },
        0.054,
        0.12,
        (3.1, 2.5, 2.7),
    ),
    ("sdpa-math", "bf16", {}, 0.0017, 0.0029, (9.8, 23.9, 16.9)),
    (
        "sdpa-flash",
        "bf16",
        {
            "special.nonfinite": "hidden_elements = 5760 breaks <= 0; dv[45, 0, 0] is finite where it depends on "
            "k[48, 0, 63] = nan (3584 elements hidden, 0 spread)",
        },
        0.0019,
        0.0029,
        (233.0, 132.8, 148.9),
    ),
    ("sdpa-efficient", "bf16", {}, 0.0019, 0.0029, (136.4, 18.4, 24.3)),
    (
        "sdpa-cudnn",
        "bf16",
        {
            "isolation.layout_bitwise": "changed_elements = 110 breaks <= 0; dq of a document (the documents in "
            "reverse order): Mismatched elements: 57 / 655360 (0.0087%), max abs diff 0.0002441",
            "determinism.repeat": "mismatched_elements = 5 breaks <= 0; dq, run vs first run: Mismatched "
            "elements: 5 / 131072 (0.00381%), max abs diff 0.001953, max rel diff 0.007634",
        },
        0.0019,
        0.0029,
        (432.5, 366.1, 378.1),
    ),
    ("flex", "bf16", {}, 0.0019, 0.0029, (45.3, 343.3, 99.0)),
    (
        "flex-packed",
        "bf16",
        {
            "isolation.nan": "changed_elements = 162560 breaks <= 0; nonfinite = 162560 breaks <= 0; out of the "
            "target document (NaN neighbours): Mismatched elements: 5760 / 5760 (100%)",
            "special.nonfinite": "spread_elements = 42365 breaks <= 0; dk[0, 1, 5] is non-finite where it does "
            "not depend on q[68, 3, 5] = nan (0 elements hidden, 45 spread)",
        },
        0.0019,
        0.0029,
        (46.0, 341.6, 119.8),
    ),
    (
        "sage",
        "bf16",
        {
            "interface.inputs_unmodified": "modified_inputs = 1 breaks <= 0; the kernel wrote into k (k in the "
            "forward); first on lens_q=[16] heads=2/2 d=64 causal gaussian seed=0 bf16",
            "error.out": "normalized_error = 368.1 breaks <= 2",
            "bound.out": "violations = 184031 breaks <= 0; |out - reference|: Mismatched elements: 1166 / 32768 "
            "(3.56%), max abs diff 0.03831, max rel diff 27.38; worst at token 197, head 3",
            "bias.gain": "gain_error_out = 0.02754 breaks <= 0.0009766",
            "consistency.conservation_forward": "max_rel_dev = 0.9744 breaks <= 0.007828",
            "causal.forward": "leaked_elements = 676109 breaks <= 0; out at/before t: Mismatched elements: "
            "639 / 768 (83.2%), max abs diff 1.727, max rel diff 134.7; worst at token 2, head 1",
            "isolation.neighbours": "changed_elements = 133291 breaks <= 0; out of the target document "
            "(neighbours huge): Mismatched elements: 5625 / 5760 (97.7%), max abs diff 2.558",
            "special.zero_blocks": "violations = 230 breaks <= 0; |out - reference|: Mismatched elements: 230 / "
            "12288 (1.87%), max abs diff 0.0397, max rel diff 9.928; worst at token 2, head 1",
            "special.nonfinite_inputs": "the kernel raised ValueError: q holds NaN",
        },
        0.9,
        0.0029,
        (333.0, None, None),
    ),
]

#: The checks of a survey row that are not gating (docs/checks.md, "Verdicts").
_SURVEY_VERDICTS = {
    "determinism.repeat": "reproducibility",
    "isolation.layout_bitwise": "reproducibility",
    "special.nonfinite_inputs": "robustness",
}

#: Kernels of the survey that could not run (name, recipe, reason).
SURVEY_UNAVAILABLE = [
    ("flash-attn", "bf16", "flash_attn is not installed (PyPI has no wheel: a source build against CUDA)"),
    ("te-fp8", "fp8", "not built: transformer_engine_torch has no wheel (a source build against CUDA)"),
]


def survey_results(*, speed: bool = True) -> list[SweepResult]:
    """Sweep results of a whole survey: 15 kernels with a report (every gating family, the
    reproducibility and robustness verdicts, long failure reasons), then one that hung (no report)."""
    from flamia_verify.results import FAMILIES

    shape = "4 x 8192 tokens, H = 16, D = 128, causal, bf16"
    results = []
    for name, recipe, failing, rel, model, tflops in _SURVEY:
        checks = []
        for family in FAMILIES:
            failed = [c for c in failing if c.startswith(family + ".")]
            first = f"{family}.out" if family in ("error", "bound") else f"{family}.probe"
            extra = {"determinism": "determinism.repeat", "special": "special.nonfinite_inputs"}.get(family)
            names = list(dict.fromkeys([first, *([extra] if extra else []), *failed]))
            for check in names:
                metrics = {"rel_rmse": rel, "predicted_rel_rmse": model, "bf16_rel_rmse": 0.0019}
                checks.append(
                    {
                        "name": check,
                        "family": family,
                        "status": "fail" if check in failing else "pass",
                        "verdict": _SURVEY_VERDICTS.get(check, "gating"),
                        "message": failing.get(check, ""),
                        "metrics": metrics if check == "error.out" else {},
                    }
                )
        checks.append(
            {"name": "error.dq", "family": "error", "status": "pass", "verdict": "gating", "metrics": metrics}
        )
        gating = [c for c in checks if c["verdict"] == "gating"]
        report = {
            "kernel": name,
            "recipe": recipe,
            "checks": checks,
            "summary": {"status": "fail" if any(c["status"] == "fail" for c in gating) else "pass"},
        }
        fwd, bwd, both = tflops
        result = {
            "key": f"{len(results):032x}",
            "case": {"kernel": name, "suite": "quick", "dtype": "bf16", "seed": 0, "only": []},
            "status": report["summary"]["status"],
            "report": report,
            "error": None,
            "elapsed_s": 40.0 + 7 * len(results),
        }
        if speed:
            result["speed"] = {"fwd_tflops": fwd, "bwd_tflops": bwd, "fwdbwd_tflops": both, "shape": shape}
        results.append(result)
    results.append(
        {
            "key": f"{len(results):032x}",
            "case": {"kernel": "/home/me/attention/kernels/hung_kernel.py:attn", "suite": "quick", "seed": 0},
            "status": "error",
            "report": None,
            "recipe": "bf16",
            "error": "timed out after 300 s (worker killed)",
            "elapsed_s": 300.0,
        }
    )
    return [SweepResult.from_dict(r) for r in results]
