"""The command line: exit codes, reports on disk, configuration errors, bad input that loses nothing."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from cli_run import _write, run_cli

from flamia_verify.cli import main
from flamia_verify.commands.common import load_config
from flamia_verify.errors import ConfigError

REPO = Path(__file__).resolve().parent.parent

GOOD_KERNEL = """
from flamia_verify.kernels import builtin_kernels
_k = builtin_kernels()["bf16"]
def attn(q, k, v, cu_q, cu_k, mq, mk, *, softmax_scale, causal):
    return _k(q, k, v, cu_q, cu_k, mq, mk, softmax_scale=softmax_scale, causal=causal)
"""

LEAKY_KERNEL = """
from flamia_verify.kernels import builtin_kernels
_k = builtin_kernels()["fp8-tensor"]
def attn(q, k, v, cu_q, cu_k, mq, mk, *, softmax_scale, causal):
    return _k(q, k, v, cu_q, cu_k, mq, mk, softmax_scale=softmax_scale, causal=causal)
"""

CRASHING_KERNEL = """
def attn(q, k, v, cu_q, cu_k, mq, mk, *, softmax_scale, causal):
    raise RuntimeError("CUDA error: an illegal memory access was encountered")
"""


def test_no_command_is_usage_error(capsys):
    code, _, err = run_cli([], capsys)
    assert code == 2 and "usage" in err.lower()


def test_bad_option_is_exit_2_with_one_line(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["check", "--suite", "huge"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "huge" in err and len(err.strip().splitlines()) == 1


def test_unknown_kernel_is_exit_3(capsys, tmp_path):
    code, _, err = run_cli(["check", "--kernel", "no-such-kernel", "--out", tmp_path / "r"], capsys)
    assert code == 3
    assert "no-such-kernel" in err and len(err.strip().splitlines()) == 1


def test_import_error_in_user_kernel_is_exit_3(capsys, tmp_path):
    f = _write(tmp_path, "broken.py", "import not_a_module_anywhere\n")
    code, _, err = run_cli(["check", "--kernel", f"{f}:attn", "--recipe", "bf16", "--out", tmp_path / "r"], capsys)
    assert code == 3 and "not_a_module_anywhere" in err


def test_user_kernel_without_recipe_is_exit_2(capsys, tmp_path):
    f = _write(tmp_path, "good.py", GOOD_KERNEL)
    code, _, err = run_cli(["check", "--kernel", f"{f}:attn", "--out", tmp_path / "r", "--only", "interface"], capsys)
    assert code == 2 and "recipe" in err


def test_crashing_kernel_is_exit_3(capsys, tmp_path):
    f = _write(tmp_path, "crash.py", CRASHING_KERNEL)
    code, _, err = run_cli(["check", "--kernel", f"{f}:attn", "--recipe", "mxfp8", "--out", tmp_path / "r"], capsys)
    assert code == 3 and "illegal memory access" in err


def test_check_passes_and_writes_all_reports(capsys, tmp_path):
    f = _write(tmp_path, "good.py", GOOD_KERNEL)
    out = tmp_path / "rep"
    code, stdout, _ = run_cli(
        ["check", "--kernel", f"{f}:attn", "--recipe", "bf16", "--only", "causal", "isolation", "--out", out], capsys
    )
    assert code == 0, stdout
    for name in ("report.json", "report.md", "report.html", "junit.xml"):
        assert (out / name).is_file(), name
    data = json.loads((out / "report.json").read_text())
    assert data["schema"] == "flamia-verify/report/v1"
    assert data["recipe"] == "bf16" and data["checks"]
    assert {c["family"] for c in data["checks"]} <= {"causal", "isolation"}
    assert all(c["status"] in ("pass", "skip") for c in data["checks"])


def test_check_fails_a_leaky_kernel_with_exit_1(capsys, tmp_path):
    f = _write(tmp_path, "leaky.py", LEAKY_KERNEL)
    out = tmp_path / "rep"
    code, stdout, _ = run_cli(
        ["check", "--kernel", f"{f}:attn", "--recipe", "fp8", "--only", "causal", "--out", out], capsys
    )
    assert code == 1
    data = json.loads((out / "report.json").read_text())
    assert any(c["status"] == "fail" and c["family"] == "causal" for c in data["checks"])


def test_compare_gates_regressions(capsys, tmp_path):
    good = _write(tmp_path, "good.py", GOOD_KERNEL)
    leaky = _write(tmp_path, "leaky.py", LEAKY_KERNEL)
    base, new = tmp_path / "base", tmp_path / "new"
    assert (
        run_cli(["check", "--kernel", f"{good}:attn", "--recipe", "fp8", "--only", "causal", "--out", base], capsys)[0]
        == 0
    )
    assert (
        run_cli(["check", "--kernel", f"{leaky}:attn", "--recipe", "fp8", "--only", "causal", "--out", new], capsys)[0]
        == 1
    )
    code, out, _ = run_cli(["compare", base / "report.json", new / "report.json"], capsys)
    assert code == 1 and "causal" in out
    code, _, _ = run_cli(["compare", base / "report.json", base / "report.json"], capsys)
    assert code == 0


def test_report_rerenders_and_rejects_bad_files(capsys, tmp_path):
    good = _write(tmp_path, "good.py", GOOD_KERNEL)
    out = tmp_path / "rep"
    run_cli(["check", "--kernel", f"{good}:attn", "--recipe", "bf16", "--only", "interface", "--out", out], capsys)
    html, md = tmp_path / "again.html", tmp_path / "again.md"
    code, _, _ = run_cli(["report", out / "report.json", "--html", html, "--md", md], capsys)
    assert code == 0 and html.read_text().lstrip().lower().startswith("<!doctype html") and md.read_text()
    bad = _write(tmp_path, "bad.json", json.dumps({"schema": "something/else"}))
    code, _, err = run_cli(["report", bad], capsys)
    assert code == 2 and "schema" in err
    code, _, err = run_cli(["report", tmp_path / "missing.json"], capsys)
    assert code == 2


def test_list_shows_builtin_kernels(capsys):
    code, out, _ = run_cli(["list"], capsys)
    assert code == 0
    for name in ("bf16", "fp8", "fp8-tensor", "flamia-mxfp8", "flamia-nvfp4", "mxfp8-naive"):
        assert name in out


def test_list_says_what_each_builtin_runs_on_cuda():
    from flamia_verify.commands.list import cuda_path as _cuda_path
    from flamia_verify.kernels import builtin_kernels

    kernels = builtin_kernels()
    assert _cuda_path(kernels["flamia-mxfp8"]) == "fused Triton, head_dim 32-256"
    assert _cuda_path(kernels["fp8"]) == "fused Triton, head_dim 32-128"
    assert _cuda_path(kernels["mxfp8-naive"]).startswith("emulation (")
    assert _cuda_path(kernels["fp8-tensor"]).startswith("emulation (")


def test_bench_without_cuda_is_a_clear_usage_error(capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    code, _, err = run_cli(["bench"], capsys)
    assert code == 2 and "CUDA" in err


def test_bench_passes_its_options_loads_specs_first_and_writes_the_table(capsys, monkeypatch, tmp_path):
    """The command's plumbing with the GPU timing stubbed out: --seqlens/--causal/--rep-ms reach
    bench_table, progress is reported, --md/--json are written, a spec that does not load is exit 3
    before any timing."""
    import torch

    from flamia_verify import bench

    seen = {}

    def fake_table(kernels, device="cuda", *, seqlens, causal, rep_ms, progress):
        seen.update(kernels=[k.label for k in kernels], seqlens=seqlens, causal=causal, rep_ms=rep_ms)
        progress(0, 2, "x")
        progress(2, 2, "done")
        rows = bench.add_ratios(
            [
                {
                    "kernel": k,
                    "seqlen": seqlens[0],
                    "batch": 4,
                    "causal": causal[0],
                    "fwd_tflops": t,
                    "bwd_tflops": t,
                    "fwdbwd_tflops": t,
                    "fwd_ms": 1.0,
                    "bwd_ms": 1.0,
                    "fwdbwd_ms": 2.0,
                    "peak_extra_gib": 0.5,
                    "error": "",
                }
                for k, t in (("sdpa-cudnn", 500.0), ("bf16", 300.0), ("fp8", 150.0), ("fwd-only", math.nan))
            ]
        )
        return [{key: r.get(key) for key in bench.COLUMNS} for r in rows]

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "stub GPU")
    monkeypatch.setattr(bench, "bench_table", fake_table)
    md, js = tmp_path / "t.md", tmp_path / "t.json"
    code, out, err = run_cli(
        [
            "bench",
            "--kernel",
            "bf16",
            "fp8",
            "--seqlens",
            "8192",
            "--causal",
            "true",
            "--rep-ms",
            "20",
            "--md",
            md,
            "--json",
            js,
        ],
        capsys,
    )
    assert code == 0, err
    assert seen == {"kernels": ["bf16", "fp8"], "seqlens": (8192,), "causal": (True,), "rep_ms": 20}
    assert "fp8" in out and "0.5" in out  # ratio_bf16 of fp8: 150 / 300
    # off a terminal (captured stdout): one whole line per row, never a table that wraps mid-word
    assert any(
        line.split()[:9] == ["fp8", "8192", "4", "True", "150", "150", "150", "0.3", "0.5"] for line in out.splitlines()
    ), out
    assert "| fp8 | 8192 | True | 150 | 150 | 150 | 0.30 | 0.50 |" in md.read_text()

    def no_constants(name):
        raise AssertionError(f"bench --json wrote the non-JSON constant {name}")

    rows = json.loads(js.read_text(), parse_constant=no_constants)["rows"]  # strict JSON, as report.json
    assert rows[2]["ratio_bf16"] == 0.5 and rows[0]["ratio_bf16"] == 500.0 / 300.0
    assert rows[3]["fwdbwd_tflops"] == "nan" and rows[3]["ratio"] == "nan"
    assert "B*S = 32768 tokens" in md.read_text()  # from the rows: 4 documents of 8192
    code, _, err = run_cli(["bench", "--kernel", "no_such_module_xyz:attn"], capsys)
    assert code == 3 and "no_such_module_xyz" in err
    code, _, err = run_cli(["bench", "--seqlens", "0"], capsys)
    assert code == 2
    code, _, err = run_cli(["bench", "--md", tmp_path / "missing" / "t.md"], capsys)
    assert code == 2 and "does not exist" in err


# ---------------------------------------------------------------------------------------------
# configuration
# ---------------------------------------------------------------------------------------------


def test_config_from_pyproject_and_file(tmp_path):
    (tmp_path / "pyproject.toml").write_text(
        '[tool.flamia-verify]\nsuite = "standard"\nseed = 7\n[tool.flamia-verify.thresholds."error.out"]\nnormalized_error = 1.5\n'
    )
    cfg = load_config(search_dir=tmp_path)
    assert cfg.suite == "standard" and cfg.seed == 7 and cfg.thresholds["error.out"]["normalized_error"] == 1.5
    f = _write(tmp_path, "fv.toml", 'suite = "full"\nonly = ["causal"]\n')
    cfg = load_config(f)
    assert cfg.suite == "full" and cfg.only == ["causal"]
    assert load_config(search_dir=tmp_path / "nowhere").suite == "quick"


@pytest.mark.parametrize(
    "text, needle",
    [
        ('suit = "quick"\n', "suit"),
        ('suite = "huge"\n', "huge"),
        ('seed = "seven"\n', "seed"),
        ("case_timeout_s = -1\n", "case_timeout_s"),
        ('[thresholds]\n"error.out" = 3\n', "thresholds['error.out'] must be a mapping"),
        ('[thresholds."error.output"]\nrel_rmse_max = 0.1\n', "unknown check 'error.output'"),
        ('[thresholds."error.out"]\nnormalized_error = "big"\n', "normalized_error"),
        ("this is not toml", "TOML"),
    ],
)
def test_bad_config_names_the_problem(tmp_path, text, needle):
    f = _write(tmp_path, "bad.toml", text)
    with pytest.raises(ConfigError) as exc:
        load_config(f)
    assert needle in str(exc.value)


def test_bad_config_on_the_command_line_is_exit_2(capsys, tmp_path):
    f = _write(tmp_path, "bad.toml", 'suit = "quick"\n')
    code, _, err = run_cli(["check", "--config", f, "--out", tmp_path / "r"], capsys)
    assert code == 2 and "suit" in err


def test_unknown_threshold_name_is_exit_2(capsys, tmp_path):
    f = _write(tmp_path, "thr.toml", '[thresholds."error.out"]\nno_such_threshold = 1.0\n')
    code, _, err = run_cli(["check", "--config", f, "--only", "error", "--out", tmp_path / "r"], capsys)
    assert code == 2 and "no_such_threshold" in err


def test_console_script_is_installed():
    exe = Path(sys.executable).parent / "flamia-verify"
    if not exe.exists():
        pytest.skip("package not installed with its console script")
    res = subprocess.run([str(exe), "--version"], capture_output=True, text=True, env={**os.environ})
    assert res.returncode == 0 and "flamia-verify" in res.stdout


def test_fuzz_finds_a_leak_writes_a_reproducer_and_replays_it(capsys, tmp_path):
    leaky = _write(tmp_path, "leaky.py", LEAKY_KERNEL)
    out = tmp_path / "fz"
    code, stdout, _ = run_cli(
        ["fuzz", "--kernel", f"{leaky}:attn", "--recipe", "fp8", "--examples", "20", "--out", out], capsys
    )
    assert code == 1, stdout
    case = out / "fuzz-case.json"
    assert case.is_file() and "--replay" in stdout
    repro = json.loads(case.read_text())
    assert repro["property"] and repro["seed"] is not None
    code, _, _ = run_cli(
        ["fuzz", "--kernel", f"{leaky}:attn", "--recipe", "fp8", "--replay", case, "--out", tmp_path / "rp"], capsys
    )
    assert code == 1
    # the same case passes on the correct kernel
    good = _write(tmp_path, "good.py", GOOD_KERNEL)
    code, _, _ = run_cli(
        ["fuzz", "--kernel", f"{good}:attn", "--recipe", "fp8", "--replay", case, "--out", tmp_path / "ok"], capsys
    )
    assert code == 0


def test_fuzz_passes_a_correct_kernel(capsys, tmp_path):
    code, stdout, _ = run_cli(["fuzz", "--kernel", "flamia-mxfp8", "--examples", "5", "--out", tmp_path / "fz"], capsys)
    assert code == 0, stdout
    assert not (tmp_path / "fz" / "fuzz-case.json").exists()


def test_replay_of_a_bad_file_is_exit_2(capsys, tmp_path):
    bad = _write(tmp_path, "case.json", "[1, 2]")
    code, _, err = run_cli(["fuzz", "--kernel", "bf16", "--replay", bad, "--out", tmp_path / "r"], capsys)
    assert code == 2 and "JSON object" in err
    code, _, err = run_cli(
        ["fuzz", "--kernel", "bf16", "--replay", tmp_path / "none.json", "--out", tmp_path / "r"], capsys
    )
    assert code == 2 and "does not exist" in err


# ---------------------------------------------------------------------------------------------
# bad input reaches the user as one line and the documented exit code, never a traceback
# ---------------------------------------------------------------------------------------------


def _one_line(err: str) -> bool:
    return len(err.strip().splitlines()) == 1 and "Traceback" not in err


@pytest.mark.parametrize("only", [["no_such_family"], ["error.no_such_check"], ["causal", "bogus"]])
def test_only_with_an_unknown_name_is_exit_2_naming_it(capsys, tmp_path, only):
    code, _, err = run_cli(["check", "--kernel", "bf16", "--only", *only, "--out", tmp_path / "r"], capsys)
    assert code == 2 and only[-1] in err and _one_line(err)
    assert not (tmp_path / "r" / "report.json").exists()


@pytest.mark.parametrize(
    "command", [["check", "--kernel", "bf16", "--only", "interface"], ["fuzz", "--kernel", "bf16", "--examples", "2"]]
)
@pytest.mark.parametrize("where", ["file", "under_file", "empty"])
def test_bad_out_is_exit_2_before_any_check_runs(capsys, tmp_path, command, where):
    f = _write(tmp_path, "afile", "x")
    out = {"file": str(f), "under_file": str(f / "sub"), "empty": ""}[where]
    code, _, err = run_cli([*command, "--out", out], capsys)
    assert code == 2 and "--out" in err and _one_line(err), err
    assert f.read_text() == "x"


def test_report_to_an_unwritable_target_is_exit_2(capsys, tmp_path):
    out = tmp_path / "rep"
    assert run_cli(["check", "--kernel", "bf16", "--only", "interface", "--out", out], capsys)[0] == 0
    f = _write(tmp_path, "afile", "x")
    for option, target in (("--html", f / "x.html"), ("--md", tmp_path)):
        code, _, err = run_cli(["report", out / "report.json", option, target], capsys)
        assert code == 2 and str(target) in err and _one_line(err), err


def test_report_and_compare_on_a_directory_or_truncated_json_are_exit_2(capsys, tmp_path):
    out = tmp_path / "rep"
    assert run_cli(["check", "--kernel", "bf16", "--only", "interface", "--out", out], capsys)[0] == 0
    truncated = _write(tmp_path, "trunc.json", (out / "report.json").read_text()[:150])
    for args in (
        ["report", tmp_path],
        ["report", truncated],
        ["compare", truncated, out / "report.json"],
        ["compare", out / "report.json", tmp_path],
    ):
        code, _, err = run_cli(args, capsys)
        assert code == 2 and _one_line(err), (args, err)


def test_replay_of_a_directory_or_a_malformed_reproducer_is_exit_2(capsys, tmp_path):
    code, _, err = run_cli(["fuzz", "--kernel", "bf16", "--replay", tmp_path, "--out", tmp_path / "r"], capsys)
    assert code == 2 and "replay" in err and _one_line(err), err
    bad = _write(tmp_path, "case.json", json.dumps({"property": "causal", "lens_q": [16], "lens_k": [16], "seed": "x"}))
    code, _, err = run_cli(["fuzz", "--kernel", "bf16", "--replay", bad, "--out", tmp_path / "r"], capsys)
    assert code == 2 and "reproducer" in err and _one_line(err), err


KERNEL_EXITS_AT_IMPORT = "import sys\nsys.exit(0)\n"
KERNEL_CALLS_EXIT = """
import sys
def attn(q, k, v, cu_q, cu_k, mq, mk, *, softmax_scale, causal):
    sys.exit(0)
"""


@pytest.mark.parametrize(
    "make_spec, needle",
    [
        (lambda d: f"{_write(d, 'k.py', KERNEL_EXITS_AT_IMPORT)}:attn", "SystemExit"),
        (lambda d: f"{_write(d, 'k.py', KERNEL_CALLS_EXIT)}:attn", "SystemExit"),
        (lambda d: f"{_write(d, 'k.py', 'def attn(:')}:attn", "SyntaxError"),
        (lambda d: f"{_write(d, 'k.py', KERNEL_CALLS_EXIT)}:", "names no function"),
        (lambda d: ":attn", "names no module"),
        (lambda d: "json:not.callable", "not.callable"),
        (lambda d: f"{_write(d, 'k.py', 'attn = 3')}:attn", "not callable"),
    ],
)
def test_kernel_that_cannot_load_or_exits_is_exit_3(capsys, tmp_path, make_spec, needle):
    spec = make_spec(tmp_path)
    code, _, err = run_cli(
        ["check", "--kernel", spec, "--recipe", "bf16", "--only", "interface", "--out", tmp_path / "r"], capsys
    )
    assert code == 3 and needle in err and _one_line(err), err


def test_crash_before_any_check_leaves_no_reports_of_an_earlier_run(capsys, tmp_path):
    out = tmp_path / "rep"
    assert run_cli(["check", "--kernel", "bf16", "--only", "interface", "--out", out], capsys)[0] == 0
    assert (out / "report.json").is_file()
    crash = _write(tmp_path, "crash.py", CRASHING_KERNEL)
    code, _, err = run_cli(["check", "--kernel", f"{crash}:attn", "--recipe", "bf16", "--out", out], capsys)
    assert code == 3 and "no reports written" in err
    assert not any((out / name).exists() for name in ("report.json", "report.md", "report.html", "junit.xml"))


def test_check_twice_into_one_out_replaces_the_reports(capsys, tmp_path):
    out = tmp_path / "rep"
    assert run_cli(["check", "--kernel", "bf16", "--only", "interface", "--out", out], capsys)[0] == 0
    assert run_cli(["check", "--kernel", "bf16", "--only", "determinism", "--out", out], capsys)[0] == 0
    data = json.loads((out / "report.json").read_text())
    assert {c["family"] for c in data["checks"]} == {"determinism"}
    assert "interface" not in (out / "junit.xml").read_text()


def test_passing_fuzz_run_removes_an_earlier_reproducer(capsys, tmp_path):
    out = tmp_path / "fz"
    out.mkdir()
    _write(out, "fuzz-case.json", json.dumps({"property": "causal"}))
    code, stdout, _ = run_cli(["fuzz", "--kernel", "bf16", "--examples", "3", "--out", out], capsys)
    assert code == 0, stdout
    assert not (out / "fuzz-case.json").exists() and (out / "report.json").is_file()


def test_infinite_case_timeout_is_a_config_error(capsys, tmp_path):
    f = _write(tmp_path, "inf.toml", "case_timeout_s = inf\n")
    code, _, err = run_cli(
        ["check", "--kernel", "bf16", "--config", f, "--only", "interface", "--out", tmp_path / "r"], capsys
    )
    assert code == 2 and "case_timeout_s" in err and _one_line(err)
    import flamia_verify

    with pytest.raises(ConfigError, match="case_timeout_s"):
        flamia_verify.check("bf16", only=["interface"], case_timeout_s=float("inf"))


def test_compare_fails_when_checks_go_missing_unless_allowed(capsys, tmp_path):
    good = _write(tmp_path, "good.py", GOOD_KERNEL)
    base, narrow = tmp_path / "base", tmp_path / "narrow"
    assert (
        run_cli(
            ["check", "--kernel", f"{good}:attn", "--recipe", "bf16", "--only", "interface", "--out", base], capsys
        )[0]
        == 0
    )
    assert (
        run_cli(
            ["check", "--kernel", f"{good}:attn", "--recipe", "bf16", "--only", "interface.output", "--out", narrow],
            capsys,
        )[0]
        == 0
    )
    code, out, _ = run_cli(["compare", base / "report.json", narrow / "report.json"], capsys)
    assert code == 1 and "missing" in out
    code, _, _ = run_cli(["compare", base / "report.json", narrow / "report.json", "--allow-missing"], capsys)
    assert code == 0


@pytest.mark.parametrize("argv", [["list"], ["mutate", "--list"]])
def test_a_closed_stdout_ends_the_command_quietly_with_141(argv):
    """`flamia-verify list | head -1`: the reader goes away; the command stops without a traceback or
    a 'cannot access' line, with the shell's code for a writer whose pipe closed (128 + SIGPIPE)."""
    r, w = os.pipe()
    os.close(r)  # every write to stdout now fails with EPIPE
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "flamia_verify.cli", *argv], stdout=w, stderr=subprocess.PIPE, text=True, timeout=120
        )
    finally:
        os.close(w)
    assert proc.returncode == 141, proc.stderr
    assert proc.stderr == ""


def test_fuzz_prints_the_rerun_hint_and_report_paths_on_whole_lines(tmp_path, capsys):
    out = tmp_path / ("a-rather-long-directory-name-for-the-fuzz-reports-" * 2)
    code = main(["fuzz", "--kernel", "mxfp8-naive", "--examples", "5", "--out", str(out)])
    assert code == 1
    lines = capsys.readouterr().out.splitlines()
    case = out / "fuzz-case.json"
    assert f"rerun it with: flamia-verify fuzz --kernel mxfp8-naive --replay {case}" in lines
    assert f"  markdown {out / 'report.md'}" in lines and f"  json     {out / 'report.json'}" in lines


@pytest.mark.parametrize("where", ["flag", "config"])
def test_an_empty_kernel_name_is_a_usage_error_not_the_builtin(tmp_path, capsys, where):
    """`--kernel "$KERNEL"` with the variable unset must not check the built-in and pass."""
    if where == "flag":
        code = main(["check", "--kernel", "", "--out", str(tmp_path / "r")])
    else:
        cfg = tmp_path / "c.toml"
        cfg.write_text('[tool.flamia-verify]\nkernel = ""\n')
        code = main(["check", "--config", str(cfg), "--out", str(tmp_path / "r")])
    err = capsys.readouterr().err
    assert code == 2 and "empty" in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "r" / "report.json").exists()
    if where == "config":  # which file says so
        assert "c.toml" in err, err


def test_a_ci_run_without_a_kernel_says_it_checks_the_builtin(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("CI", "true")
    code = main(["check", "--only", "interface.output", "--out", str(tmp_path / "r")])
    err = capsys.readouterr().err
    assert code == 0 and "checking the built-in example flamia-mxfp8" in err, err
