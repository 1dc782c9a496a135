"""The rich terminal summary, rendered into a StringIO."""

from __future__ import annotations

import io

from reports_examples import example_report, hostile_report, passing_report
from rich.console import Console

from flamia_verify.reports import render_terminal


def _render(report, *, color=False, width=200):
    buffer = io.StringIO()
    console = Console(file=buffer, width=width, force_terminal=color, color_system="truecolor" if color else None)
    render_terminal(report, console)
    return buffer.getvalue()


def _row(text, name):
    return next(line for line in text.splitlines() if f" {name} " in line)


def test_table_has_every_check_with_status_key_metric_and_message():
    text = _render(example_report())
    for check in example_report().checks:
        assert f" {check.name} " in text, check.name
    assert " ".join(_row(text, "error.backward").split()) == (
        "│ error.backward │ FAIL │ rel_err_vs_bf16_dK │ 9.7 │ ≤ 4 │ dK error 9.7x BF16 (limit 4x): K quantized "
        "across the causal diagonal │"
    )
    row = " ".join(_row(text, "causal.backward").split())
    assert row.startswith("│ causal.backward │ ERROR │ max_leak │ — │ ≤ 0 │")
    row = " ".join(_row(text, "determinism.backward").split())
    assert row.startswith("│ determinism.backward │ SKIP │ — │ — │ — │")
    assert "kernel mxfp8-naive  recipe mxfp8  suite quick  seed 1234" in text


def test_verdict_lines():
    text = _render(example_report())
    assert "FAIL  11 checks: 7 passed, 2 failed, 1 error, 1 skipped" in text
    # a failed property and a check that could not be evaluated are told apart
    assert "failed: error.backward, causal.forward" in text and "errored: causal.backward" in text
    assert "failed: error.backward, causal.forward, causal.backward" not in text
    ok = _render(passing_report())
    assert "PASS  4 checks: 3 passed, 1 skipped" in ok and "failed:" not in ok


def test_status_is_coloured_on_a_colour_terminal():
    text = _render(example_report(), color=True)
    # SGR codes: 1;31 bold red, 1;32 bold green, 1;35 bold magenta, 2 dim.
    for code, mark in (("1;31", "FAIL"), ("1;32", "PASS"), ("1;35", "ERROR"), ("2", "SKIP")):
        assert f"\x1b[{code}m{mark}" in text, mark


def test_markup_and_control_codes_print_literally():
    report = hostile_report()
    report.check("error.forward").message = "[bold red]not markup[/] \x1b[2K"
    text = _render(report, width=400)
    assert "[bold red]not markup[/] \\x1b[2K" in text
    assert "\x1b" not in text, "no escape code reaches the terminal"
    assert "<script>alert(1)</script>" in text  # a terminal shows text, nothing to escape


def test_narrow_console_lists_messages_under_the_table():
    text = _render(example_report(), width=80)
    lines = text.splitlines()
    assert all(len(line) <= 80 for line in lines)
    header = next(line for line in lines if "Check" in line and "Status" in line)
    assert "Message" not in header and "Value (threshold)" in header
    assert " ".join(_row(text, "error.backward").split()) == "error.backward FAIL rel_err_vs_bf16_dK 9.7 (≤ 4)"
    assert any(line.startswith("error.backward: dK error 9.7x BF16 (limit 4x)") for line in lines)
    assert any(line.startswith("determinism.backward: kernel is forward-only") for line in lines)
    assert "FAIL  11 checks: 7 passed, 2 failed, 1 error, 1 skipped" in text
