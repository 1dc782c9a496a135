"""What a new user meets first: a kernel's own traceback, Ctrl-C at startup, re-rendering a report,
replaying someone else's case, a module spec run from its own directory, a usage error's --out,
the help's lists of built-ins, ``dir(flamia_verify)``, and a mismatch against a zero reference."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from cli_run import _write, run_cli

from flamia_verify.cli import build_parser
from flamia_verify.reports import write_reports
from flamia_verify.results import CheckResult, Report

REPO = Path(__file__).resolve().parent.parent

# works on the engine's smallest case (16 tokens), raises from a helper on every larger one
PICKY_KERNEL = """
from flamia_verify.kernels import builtin_kernels
_k = builtin_kernels()["bf16"]

def _tile_check_deep_inside(n):
    if n > 16:
        raise ValueError(f"picky kernel: {n} tokens is more than one tile\\nsecond line of the message")

def attn(q, k, v, cu_q, cu_k, mq, mk, *, softmax_scale, causal):
    _tile_check_deep_inside(q.shape[0])
    return _k(q, k, v, cu_q, cu_k, mq, mk, softmax_scale=softmax_scale, causal=causal)
"""

CRASHING_KERNEL = """
def _launch_the_grid(q):
    raise RuntimeError("CUDA error: an illegal memory access was encountered")

def attn(q, k, v, cu_q, cu_k, mq, mk, *, softmax_scale, causal):
    return _launch_the_grid(q)
"""


# ---------------------------------------------------------------------------------------------
# 1. the kernel's own traceback: in report.json always, on stderr with --traceback
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("flag", [[], ["--traceback"]])
def test_an_errored_check_keeps_the_kernels_traceback_and_traceback_prints_it(capsys, tmp_path, flag):
    spec = f"{_write(tmp_path, 'picky.py', PICKY_KERNEL)}:attn"
    out = tmp_path / "r"
    code, _, err = run_cli(
        ["check", "--kernel", spec, "--recipe", "bf16", "--only", "interface.output", "--out", out, *flag], capsys
    )
    assert code == 1, err
    (check,) = json.loads((out / "report.json").read_text())["checks"]
    assert check["status"] == "error"
    worst = check["worst_case"]
    assert worst["exception"].startswith("ValueError: picky kernel")  # the one-line summary stays
    trace = worst["traceback"]
    assert trace.startswith("Traceback (most recent call last):")
    assert "_tile_check_deep_inside" in trace and "second line of the message" in trace
    if flag:
        assert "_tile_check_deep_inside" in err and "interface.output" in err and "second line" in err
    else:
        assert "Traceback" not in err


def test_traceback_names_every_check_that_met_one_place_and_interface_arguments_keeps_its_own(capsys, tmp_path):
    """interface.arguments' failed calls kept no traceback, and one place raising messages that differ
    (the token count in the text) printed one block per check, each naming one check."""
    spec = f"{_write(tmp_path, 'picky.py', PICKY_KERNEL)}:attn"
    out = tmp_path / "r"
    only = ["interface.output", "interface.arguments"]
    code, _, err = run_cli(
        ["check", "--kernel", spec, "--recipe", "bf16", "--only", *only, "--out", out, "--traceback"], capsys
    )
    assert code == 1, err
    checks = {c["name"]: c for c in json.loads((out / "report.json").read_text())["checks"]}
    assert "_tile_check_deep_inside" in checks["interface.arguments"]["worst_case"]["traceback"]
    blocks = [line for line in err.splitlines() if line.startswith("flamia-verify: the kernel's exception in")]
    assert len(blocks) == 1, err
    assert "interface.output" in blocks[0] and "interface.arguments" in blocks[0], blocks


@pytest.mark.parametrize("flag", [[], ["--traceback"]])
def test_a_kernel_that_crashes_on_the_smallest_case_prints_its_traceback_on_request(capsys, tmp_path, flag):
    spec = f"{_write(tmp_path, 'crash.py', CRASHING_KERNEL)}:attn"
    code, _, err = run_cli(["check", "--kernel", spec, "--recipe", "bf16", "--out", tmp_path / "r", *flag], capsys)
    assert code == 3 and "illegal memory access" in err
    if flag:
        assert "Traceback (most recent call last):" in err and "_launch_the_grid" in err
        assert err.strip().splitlines()[-1].startswith("flamia-verify: "), err  # the one line still ends it
    else:
        assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err


def test_fuzz_keeps_the_traceback_of_a_crash_and_prints_it_with_traceback(capsys, tmp_path):
    spec = f"{_write(tmp_path, 'picky.py', PICKY_KERNEL)}:attn"
    out = tmp_path / "fz"
    code, _, err = run_cli(
        ["fuzz", "--kernel", spec, "--recipe", "bf16", "--examples", "10", "--out", out, "--traceback"], capsys
    )
    assert code == 1, err
    data = json.loads((out / "report.json").read_text())
    crash = next(c for c in data["checks"] if c["name"] == "interface.fuzz")
    assert crash["status"] == "fail" and "_tile_check_deep_inside" in crash["worst_case"]["traceback"]
    assert "_tile_check_deep_inside" in err and "Traceback (most recent call last):" in err
    assert "traceback" not in json.loads((out / "fuzz-case.json").read_text())  # the reproducer stays a case
    code, _, err = run_cli(
        ["fuzz", "--kernel", spec, "--replay", out / "fuzz-case.json", "--out", tmp_path / "rp", "--traceback"],
        capsys,
    )
    assert code == 1 and "_tile_check_deep_inside" in err
    (replayed,) = json.loads((tmp_path / "rp" / "report.json").read_text())["checks"]
    assert "_tile_check_deep_inside" in replayed["worst_case"]["traceback"]


# ---------------------------------------------------------------------------------------------
# 2. Ctrl-C while torch imports: one line, exit 1 (an interrupted run, as documented)
# ---------------------------------------------------------------------------------------------


def test_ctrl_c_while_torch_imports_is_one_line_and_exit_1(tmp_path):
    fake = tmp_path / "site" / "torch"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise KeyboardInterrupt\n")  # Ctrl-C in the middle of `import torch`
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path / "site"), str(REPO)]))
    # what pip's console script runs
    script = "import sys\nfrom flamia_verify.cli import main\nsys.exit(main())\n"
    proc = subprocess.run(
        [sys.executable, "-c", script, "check"], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120
    )
    assert proc.returncode == 1, (proc.returncode, proc.stderr)
    assert proc.stderr == "flamia-verify: interrupted\n", proc.stderr


# ---------------------------------------------------------------------------------------------
# 3. `report` re-renders: exit 0 whatever the verdict; --junit
# ---------------------------------------------------------------------------------------------


def _failed_report(tmp_path: Path) -> Path:
    rep = Report(
        kernel="k",
        recipe="mxfp8",
        suite="quick",
        seed=0,
        checks=[
            CheckResult("interface.output", "interface", "pass"),
            CheckResult("causal.forward", "causal", "fail", message="out changed at token 3"),
        ],
    )
    assert not rep.passed
    write_reports(rep, tmp_path / "run")
    return tmp_path / "run" / "report.json"


def test_report_rerenders_a_failed_report_with_exit_0_and_writes_junit(capsys, tmp_path):
    report = _failed_report(tmp_path)
    code, out, err = run_cli(["report", report], capsys)
    assert code == 0 and "causal.forward" in out, err
    junit = tmp_path / "again.xml"
    code, _, err = run_cli(["report", report, "--junit", junit], capsys)
    assert code == 0, err
    text = junit.read_text()
    assert text.startswith("<?xml") and "causal.forward" in text and 'failures="1"' in text
    code, _, err = run_cli(["report", report, "--junit", tmp_path], capsys)
    assert code == 2 and str(tmp_path) in err


# ---------------------------------------------------------------------------------------------
# 4. --replay of a case recorded for another kernel or recipe: one warning line naming both
# ---------------------------------------------------------------------------------------------

CASE = {
    "lens_q": [16, 5],
    "lens_k": [16, 5],
    "heads": 2,
    "heads_k": 2,
    "headdim": 64,
    "causal": True,
    "dtype": "bf16",
    "seed": 3,
    "property": "isolation",
    "document": 0,
    "t": 0,
    "perturbation": "huge",
    "recipe": "mxfp8",
    "kernel": "flamia-mxfp8",
}


@pytest.mark.parametrize(
    "extra, needles",
    [
        ([], None),
        (["--kernel", "bf16"], ("flamia-mxfp8", "bf16")),
        (["--kernel", "flamia-mxfp8", "--recipe", "mxfp8-floor"], ("mxfp8", "mxfp8-floor")),
    ],
)
def test_replaying_a_case_of_another_kernel_or_recipe_warns_naming_both(capsys, tmp_path, extra, needles):
    case = _write(tmp_path, "case.json", json.dumps(CASE))
    args = extra or ["--kernel", "flamia-mxfp8"]
    code, _, err = run_cli(["fuzz", *args, "--replay", case, "--out", tmp_path / "r"], capsys)
    assert code == 0, err
    if needles is None:
        assert err == ""
    else:
        (line,) = err.strip().splitlines()
        assert "warning" in line and all(n in line for n in needles), line


# ---------------------------------------------------------------------------------------------
# 5. module:function for a module.py in the current directory: say how to name it
# ---------------------------------------------------------------------------------------------


def test_a_module_spec_of_a_file_here_that_does_not_import_suggests_the_file_spec(capsys, tmp_path, monkeypatch):
    _write(tmp_path, "my_first_attention_kernel.py", PICKY_KERNEL)
    monkeypatch.chdir(tmp_path)
    here = {"", ".", str(tmp_path), os.getcwd()}
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in here])  # as under the console script
    code, _, err = run_cli(["check", "--kernel", "my_first_attention_kernel:attn", "--recipe", "bf16"], capsys)
    assert code == 3 and len(err.strip().splitlines()) == 1, err
    assert "my_first_attention_kernel.py:attn" in err and "sys.path" in err
    # a module missing everywhere gets no such hint
    code, _, err = run_cli(["check", "--kernel", "no_such_module_anywhere:attn", "--recipe", "bf16"], capsys)
    assert code == 3 and ".py:attn" not in err


# ---------------------------------------------------------------------------------------------
# 6. a usage error leaves no --out directory behind
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "command",
    [
        lambda d: ["check", "--kernel", "bf16", "--only", "no_such_family"],
        lambda d: ["check", "--kernel", f"{_write(d, 'k.py', PICKY_KERNEL)}:attn"],  # no recipe: exit 2
        lambda d: ["fuzz", "--kernel", f"{_write(d, 'k.py', PICKY_KERNEL)}:attn"],
        lambda d: ["fuzz", "--kernel", "bf16", "--examples", "0"],
    ],
)
def test_a_usage_error_leaves_no_out_directory_behind(capsys, tmp_path, command):
    out = tmp_path / "reports" / "run-1"
    code, _, err = run_cli([*command(tmp_path), "--out", out], capsys)
    assert code == 2, err
    assert not (tmp_path / "reports").exists(), list(tmp_path.rglob("*"))


def test_an_existing_out_directory_is_left_in_place_after_a_usage_error(capsys, tmp_path):
    out = tmp_path / "mine"
    out.mkdir()
    code, _, _ = run_cli(["check", "--kernel", "bf16", "--only", "no_such_family", "--out", out], capsys)
    assert code == 2 and out.is_dir()


# ---------------------------------------------------------------------------------------------
# 7. the help lists the built-in kernels and recipes from the registry
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("command", ["check", "fuzz"])
def test_help_lists_every_builtin_kernel_and_recipe(command):
    from flamia_verify.kernels import RECIPES, builtin_kernels

    sub = next(a for a in build_parser()._actions if a.dest == "command").choices[command]
    helps = {a.dest: a.help for a in sub._actions}
    for option, names in (("kernel", builtin_kernels()), ("recipe", RECIPES)):
        listed = helps[option].partition("(")[2].partition(")")[0].split(", ")
        assert listed == list(names), (option, helps[option])
    assert "fp8-mma" in helps["kernel"] and "fp8-mma" in helps["recipe"]


# ---------------------------------------------------------------------------------------------
# 8. dir(flamia_verify) shows the public API, without importing torch
# ---------------------------------------------------------------------------------------------


def test_dir_of_the_package_lists_its_public_api_without_importing_torch():
    script = (
        "import sys, flamia_verify\n"
        "names = dir(flamia_verify)\n"
        "assert 'torch' not in sys.modules, 'dir() imported torch'\n"
        "missing = [n for n in flamia_verify.__all__ if n not in names]\n"
        "assert not missing, missing\n"
        "assert {'check', 'fuzz', 'load_kernel', 'Report'} <= set(flamia_verify.__all__)\n"
        "extra = [n for n in names if not n.startswith('_') and n not in flamia_verify.__all__]\n"
        "assert not extra, extra  # no module machinery (annotations, importlib) among the public names\n"
        "assert all(getattr(flamia_verify, n) is not None for n in flamia_verify.__all__)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=str(REPO)),
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr


# ---------------------------------------------------------------------------------------------
# 9. a mismatch where the reference is 0 reports its absolute difference, not 1e+308
# ---------------------------------------------------------------------------------------------


def test_a_mismatch_against_a_zero_reference_says_so_instead_of_a_huge_relative_difference():
    import torch

    from flamia_verify.properties.compare import compare_bitwise, compare_within

    zero = torch.zeros(4, 2, 8)
    actual = zero.clone()
    actual[1, 0, 3] = 0.3125
    for m in (compare_bitwise(actual, zero, what="out"), compare_within(actual, zero, 0.01, what="out")):
        text = m.summary()
        assert "e+30" not in text and "is 0 at every mismatch" in text and "0.3125" in text, text
        d = m.to_dict()
        assert d["max_rel_diff"] is None and d["max_abs_diff_zero_reference"] == 0.3125
        assert json.dumps(d)  # still plain JSON
    # a mismatch with a non-zero reference keeps its relative difference, and the zero one is named too
    expected = zero.clone()
    expected[2, 1, 0] = 2.0
    actual[2, 1, 0] = 3.0
    m = compare_bitwise(actual, expected, what="out")
    assert m.max_rel_diff == 0.5 and "max rel diff 0.5" in m.summary() and "the base run is 0" in m.summary()
    assert "3.0 here vs 2.0 in the base run" in m.summary()


# ---------------------------------------------------------------------------------------------
# a kernel that returns one token too few: told its output shape, not "declare forward-only"
# ---------------------------------------------------------------------------------------------


def _one_token_short(
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, softmax_scale=None, causal=False
):
    from zoo.correct import sdpa_bf16

    out = sdpa_bf16(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale=softmax_scale, causal=causal
    )
    return out[:-1]


_one_token_short.recipe = "bf16"


def test_a_kernel_one_token_short_is_told_its_output_shape_everywhere():
    from flamia_verify.properties import run_checks

    report = run_checks(
        _one_token_short, suite="quick", only=["interface.output", "interface.backward", "interface.arguments"]
    )
    for name in ("interface.output", "interface.backward", "interface.arguments"):
        check = report.check(name)
        assert check.status == "fail", f"{name}: {check.status}: {check.message}"
        assert "shape" in check.message and "forward-only" not in check.message, check.message


def test_a_run_of_one_check_says_one_check(tmp_path, capsys):
    from cli_run import run_cli

    code, out, _ = run_cli(["check", "--kernel", "bf16", "--only", "interface.output", "--out", tmp_path], capsys)
    assert code == 0 and ": 1 check\n" in out and "1 checks" not in out, out


def test_rendered_reports_leave_out_environment_entries_without_a_value():
    """No ``cuda null`` on a CPU machine, no empty ``backward_reason`` in report.html and junit.xml;
    report.json keeps every entry."""
    from reports_examples import passing_report

    from flamia_verify.reports import render_html, render_junit

    report = passing_report()
    report.environment.update(cuda=None, backward_reason="", torch="2.13.0")
    html, junit = render_html(report), render_junit(report)
    assert "2.13.0" in html and "environment.torch" in junit
    for text in (html, junit):
        assert ">cuda<" not in text and "environment.cuda" not in text
        assert "backward_reason" not in text
    assert report.to_dict()["environment"]["cuda"] is None
