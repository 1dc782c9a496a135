"""Example reports for the report tests: what a run of the known-bad `mxfp8-naive` kernel looks like.

`example_report()` has several families, every status, a NaN metric, and details with series,
histograms and heatmaps drawn by the HTML report. `hostile_report()` puts markup and control characters
into every string a kernel, a check or the command line can reach.
"""

from __future__ import annotations

import math
import random

from flamia_verify.results import CheckResult, Report

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
