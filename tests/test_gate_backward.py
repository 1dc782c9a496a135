"""A kernel without a working backward is a failure unless it is declared forward-only, and a
declared forward-only run says in every report that gradients were not checked."""

from __future__ import annotations

import json
from io import StringIO

import pytest
from rich.console import Console
from zoo import gate_bugs as G
from zoo import kernels as Z

import flamia_verify
from flamia_verify.cli import main
from flamia_verify.properties import list_checks, run_checks
from flamia_verify.reports import render_html, render_markdown, render_terminal
from flamia_verify.reports.junit import render_junit

GRADIENT_CHECKS = [s.name for s in list_checks("quick") if s.needs_backward]


@pytest.fixture(scope="module")
def undeclared():
    return run_checks(G.backward_raises, suite="quick")


def test_a_raising_backward_fails_the_run_unless_declared(undeclared):
    by = {c.name: c for c in undeclared.checks}
    assert by["interface.backward"].status == "fail"
    assert "misaligned address" in by["interface.backward"].message
    assert by["interface.backward"].worst_case["case"]["lens_q"] == [16]
    for name in GRADIENT_CHECKS:
        assert by[name].status in ("fail", "error"), (name, by[name].status, by[name].message)
        assert "misaligned address" in by[name].message and "--forward-only" in by[name].message
    assert not undeclared.passed
    assert undeclared.summary()["gradients_checked"] is False


def test_a_missing_grad_fn_fails_the_run_unless_declared():
    report = run_checks(Z.forward_only, only=["interface.backward", "error.dq"])
    assert report.check("interface.backward").status == "fail"
    assert "no grad_fn" in report.check("interface.backward").message
    assert report.check("error.dq").status == "error"
    assert not report.passed


def _all_renderings(report) -> dict[str, str]:
    buf = StringIO()
    render_terminal(report, Console(file=buf, width=100))
    return {
        "markdown": render_markdown(report),
        "html": render_html(report),
        "junit": render_junit(report),
        "terminal": buf.getvalue(),
        "json": json.dumps(report.to_dict()),
    }


def test_declared_forward_only_skips_gradients_and_every_report_says_so():
    report = flamia_verify.check(G.backward_raises, suite="quick", forward_only=True, device="cpu")
    by = {c.name: c for c in report.checks}
    for name in GRADIENT_CHECKS + ["interface.backward"]:
        assert by[name].status == "skip", (name, by[name].status, by[name].message)
        assert "declared forward-only" in by[name].message
    assert report.passed, [(c.name, c.message) for c in report.checks if c.status in ("fail", "error")]
    summary = report.summary()
    assert summary["gradients_checked"] is False and summary["forward_only"] is True
    assert report.environment["forward_only"] is True
    for kind, text in _all_renderings(report).items():
        assert "gradients were not checked" in " ".join(text.lower().split()), kind


def test_declared_forward_only_does_not_call_the_backward():
    calls = {"backward": 0}

    def counting(q, k, v, *args, **kwargs):
        out = G.backward_raises(q, k, v, *args, **kwargs)
        if out.requires_grad:
            calls["backward"] += 1
        return out

    run_checks(counting, recipe="mxfp8", only=["interface", "error.out"], forward_only=True)
    assert calls["backward"] == 0


def _cli(args, capsys):
    code = main([str(a) for a in args])
    cap = capsys.readouterr()
    return code, cap.out, cap.err


KERNEL = "tests/zoo/gate_bugs.py:backward_raises"


def test_cli_exit_1_without_declaration_and_0_with_it(capsys, tmp_path, monkeypatch):
    import pathlib

    monkeypatch.chdir(pathlib.Path(__file__).resolve().parent.parent)
    only = ["--only", "interface", "error.out", "error.dq"]
    code, out, _ = _cli(["check", "--kernel", KERNEL, *only, "--out", tmp_path / "a"], capsys)
    assert code == 1, out
    code, out, _ = _cli(["check", "--kernel", KERNEL, "--forward-only", *only, "--out", tmp_path / "b"], capsys)
    assert code == 0, out
    assert "gradients were not checked" in " ".join(out.lower().split())
    data = json.loads((tmp_path / "b" / "report.json").read_text())
    assert data["summary"]["gradients_checked"] is False and data["summary"]["forward_only"] is True
    assert "Gradients were not checked" in (tmp_path / "b" / "report.md").read_text()
    cfg = tmp_path / "fo.toml"
    cfg.write_text("forward_only = true\n")
    code, out, _ = _cli(["check", "--kernel", KERNEL, "--config", cfg, *only, "--out", tmp_path / "c"], capsys)
    assert code == 0, out
