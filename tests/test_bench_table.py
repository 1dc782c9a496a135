"""The speed table's ratios and Markdown (the timing itself needs a GPU: benchmarks/RESULTS.md)."""

from __future__ import annotations

import math
import sys

from flamia_verify.bench import COLUMNS, add_ratios, format_table


def _row(kernel, tflops=None, error=""):
    r = {"kernel": kernel, "seqlen": 8192, "batch": 4, "causal": True, "error": error}
    if tflops is not None:
        r.update(
            fwd_tflops=tflops * 1.2,
            bwd_tflops=tflops * 0.9,
            fwdbwd_tflops=tflops,
            fwd_ms=1.0,
            bwd_ms=2.0,
            fwdbwd_ms=3.0,
            peak_extra_gib=0.5,
        )
    return r


def test_ratios_against_the_fastest_sdpa_baseline_and_the_bf16_kernel():
    group = add_ratios(
        [
            _row("sdpa-cudnn", 500.0),
            _row("sdpa-flash", 300.0),
            _row("bf16", 320.0),
            _row("flamia-mxfp8", 160.0),
            _row("fp8", error="RuntimeError: no fit"),
        ]
    )
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


def test_kernel_runner_takes_any_spec_check_takes(tmp_path):
    """bench times built-in fused kernels directly and any other spec (a file, a module, a built-in
    without fused kernels) through the loader, called in the varlen convention."""
    import pytest
    import torch

    from flamia_verify.bench import kernel_runner
    from flamia_verify.errors import KernelLoadError

    (tmp_path / "user_attn.py").write_text(
        "import torch\n"
        "def bench_recorder(q, k, v, cu_q, cu_k, max_q, max_k, *, softmax_scale=None, causal=False):\n"
        "    bench_recorder.calls.append((int(max_q), float(softmax_scale), bool(causal)))\n"
        "    return v * 1.0, None\n"
        "bench_recorder.calls = []\n"
    )
    q = k = v = torch.randn(64, 2, 16, dtype=torch.bfloat16)
    cu = torch.tensor([0, 32, 64], dtype=torch.int32)
    fwd = kernel_runner(f"{tmp_path / 'user_attn.py'}:bench_recorder", True, cu, 32)
    out = fwd(q, k, v)  # an (out, lse) kernel: the output is taken
    assert out.shape == v.shape
    users = [m for n, m in sys.modules.items() if n.startswith("flamia_verify_user_") and hasattr(m, "bench_recorder")]
    assert [u.bench_recorder.calls for u in users] == [[(32, 16**-0.5, True)]]
    # a built-in without fused kernels runs through the registry (its emulation on CPU tensors)
    out = kernel_runner("fp8-tensor", False, cu, 32)(q, k, v)
    assert out.shape == q.shape and bool(torch.isfinite(out).all())
    with pytest.raises(KernelLoadError):
        kernel_runner("no_such_module_xyz:attn", True, cu, 32)


def test_the_stored_speed_table_plots(tmp_path):
    """plot_table draws the stored H200 table (benchmarks/plot_bench.py's figure in benchmarks/RESULTS.md)."""
    import json
    from pathlib import Path

    from flamia_verify.bench import plot_table

    stored = Path(__file__).resolve().parents[1] / "benchmarks" / "data" / "bench_8d58c47.json"
    table = json.loads(stored.read_text())
    assert {r["kernel"] for r in table["rows"]} >= {"sdpa-cudnn", "bf16", "fp8", "flamia-mxfp8", "flamia-nvfp4"}
    out = tmp_path / "speed.png"
    plot_table(table, out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000
    # a table of one mask (bench --causal false) and a kernel faster than the baselines
    one = [dict(r) for r in table["rows"] if not r["causal"]]
    one[-1].update(ratio=1.7)
    plot_table({"header": "no mask only", "rows": one}, tmp_path / "one.png")
    assert (tmp_path / "one.png").stat().st_size > 10_000


def test_the_table_loop_counts_measurements_and_keeps_forward_only_kernels(monkeypatch):
    """The real loop of bench_table with the timing stubbed (it needs a GPU): progress counts
    measurements (not tokens), the labels say which implementation runs, ratios are filled, and a
    forward-only kernel keeps its forward time with the rest empty."""
    import torch

    from flamia_verify import bench

    def fwd_only(q, k, v, cu_q, cu_k, max_q, max_k, *, softmax_scale=None, causal=False):
        return v.detach() * 1.0

    def fake_measure(forward, q, k, v, do, rep_ms):
        return {"fwd_ms": 1.0, "bwd_ms": 2.0, "fwdbwd_ms": 3.0, "peak_extra_gib": 0.1}

    calls = []
    kernels = [bench.resolve_kernel(s) for s in ("bf16", "fp8-tensor")]
    assert [k.label for k in kernels] == ["bf16", "fp8-tensor (emulation)"]
    rows = bench._bench_rows(
        kernels,
        "cpu",
        seqlens=(64, 128),
        tokens=256,
        heads=2,
        head_dim=16,
        causal=(True, False),
        baselines=("sdpa-cudnn",),
        rep_ms=1,
        progress=lambda d, t, label: calls.append((d, t)),
        measure=fake_measure,
    )
    assert len(rows) == 2 * 2 * 3 and [c[1] for c in calls] == [12] * 13
    assert [c[0] for c in calls] == list(range(13))
    assert {r["batch"] * r["seqlen"] for r in rows} == {256}
    assert all(r["ratio"] == 1.0 and r["ratio_bf16"] == 1.0 for r in rows)  # the stub times all alike

    # forward-only: _measure times the forward and leaves the backward empty (timing stubbed)
    monkeypatch.setattr(bench, "_time", lambda fn, rep_ms: (fn(), 1.5)[1])
    q = k = v = do = torch.randn(64, 2, 16, dtype=torch.bfloat16)
    cu = torch.tensor([0, 64], dtype=torch.int32)
    res = bench._measure(bench.kernel_runner(fwd_only, True, cu, 64), q, k, v, do, 1)
    assert res["fwd_ms"] == 1.5 and all(math.isnan(res[key]) for key in ("bwd_ms", "fwdbwd_ms", "peak_extra_gib"))
    row = {
        "kernel": "fwd_only",
        "seqlen": 64,
        "batch": 1,
        "causal": True,
        "error": "",
        **res,
        "fwd_tflops": 1.0,
        "bwd_tflops": math.nan,
        "fwdbwd_tflops": math.nan,
    }
    bench.add_ratios([row])
    assert "| fwd_only | 64 | True | 1 |  |  |  |  | 1.50 |  |  |  |" in bench.format_table([row])


def test_the_fa4_preset_gives_unavailable_kernels_one_row_and_keeps_the_rest():
    """benchmarks/bench_attention.py --preset fa4: the kernels that load are timed; one that does not
    (here flash-attn-4 and cuDNN's frontend are missing; on Hopper fa4-fp8) is a row with the reason."""
    import importlib.util
    from pathlib import Path

    import pytest

    from flamia_verify.kernels import fa4

    if fa4._found("flash_attn.cute"):
        pytest.skip("flash-attn-4 is installed here")
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_attention.py"
    spec = importlib.util.spec_from_file_location("bench_attention", path)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    names, seqlens = bench.PRESETS["fa4"]
    assert seqlens == [8192, 16384] and {"fa4", "bf16", "cudnn-fp8", "fa4-fp8"} <= set(names)
    kernels, missing = bench.resolve_available(["bf16", "fa4", "fa4-fp8"])
    assert [k.label for k in kernels] == ["bf16"]
    assert [r["kernel"] for r in missing] == ["fa4", "fa4-fp8"] and list(missing[0]) == list(COLUMNS)
    assert all(r["error"].startswith("not available: adapter") and "flash-attn-4" in r["error"] for r in missing)
    table = format_table(missing)
    assert "| fa4 | - | - | error: not available: adapter 'fa4' is not available: flash-attn-4" in table
