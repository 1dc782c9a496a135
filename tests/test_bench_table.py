"""The speed table's ratios and Markdown (the timing itself needs a GPU: benchmarks/RESULTS.md)."""

from __future__ import annotations

import math

from flamia_verify.kernels.triton.bench import COLUMNS, add_ratios, format_table


def _row(kernel, tflops=None, error=""):
    r = {"kernel": kernel, "seqlen": 8192, "batch": 4, "causal": True, "error": error}
    if tflops is not None:
        r.update(fwd_tflops=tflops * 1.2, bwd_tflops=tflops * 0.9, fwdbwd_tflops=tflops, fwd_ms=1.0, bwd_ms=2.0,
                 fwdbwd_ms=3.0, peak_extra_gib=0.5)
    return r


def test_ratios_against_the_fastest_sdpa_baseline_and_the_bf16_kernel():
    group = add_ratios([_row("sdpa-cudnn", 500.0), _row("sdpa-flash", 300.0), _row("bf16", 320.0),
                        _row("flamia-mxfp8", 160.0), _row("fp8", error="RuntimeError: no fit")])
    got = {r["kernel"]: (r["ratio"], r["ratio_bf16"]) for r in group}
    assert got["sdpa-cudnn"] == (1.0, 500.0 / 320.0)
    assert got["bf16"] == (320.0 / 500.0, 1.0)
    assert got["flamia-mxfp8"] == (160.0 / 500.0, 0.5)
    assert all(math.isnan(x) for x in got["fp8"])  # a failed row has no speed to compare


def test_without_a_bf16_kernel_or_baselines_the_ratios_are_nan():
    group = add_ratios([_row("flamia-mxfp8", 160.0)])
    assert math.isnan(group[0]["ratio"]) and math.isnan(group[0]["ratio_bf16"])
    group = add_ratios([_row("sdpa-cudnn", 500.0), _row("bf16", error="boom"), _row("fp8", 140.0)])
    assert group[2]["ratio"] == 140.0 / 500.0 and math.isnan(group[2]["ratio_bf16"])


def test_markdown_rows_have_as_many_cells_as_the_header():
    rows = add_ratios([_row("sdpa-cudnn", 500.0), _row("bf16", 320.0), _row("fp8", error="RuntimeError: x")])
    rows = [{key: r.get(key, "" if key == "error" else math.nan) for key in COLUMNS} for r in rows]
    lines = format_table(rows).splitlines()
    widths = {line.count("|") for line in lines}
    assert widths == {13}, lines  # 12 columns
    assert "| 0.64 | 1.00 |" in lines[3] and "| 1.00 | 1.56 |" in lines[2]
