"""report.md: a pull-request comment with a verdict, a table and a reproducer per failure."""

from __future__ import annotations

import json
import re

import pytest
from reports_examples import XSS, example_report, hostile_report, passing_report

from flamia_verify.reports import render_markdown
from flamia_verify.reports.markdown import MAX_JSON_CHARS, md_escape


@pytest.fixture(scope="module")
def md():
    return render_markdown(example_report())


def _table_rows(text):
    return [
        line
        for line in text.splitlines()
        if line.startswith("| ") and not line.startswith("| Check") and not line.startswith("| Metric")
    ]


def _unescaped_pipes(line):
    return len(re.findall(r"(?<!\\)\|", line))


def _json_blocks(text):
    return [json.loads(m) for m in re.findall(r"^`{3,}json\n(.*?)\n`{3,}$", text, flags=re.S | re.M)]


def test_verdict_line_comes_first(md):
    assert md.splitlines()[0] == "### flamia-verify: **FAIL**: 11 checks: 7 passed, 2 failed, 1 error, 1 skipped"
    ok = render_markdown(passing_report())
    assert ok.splitlines()[0] == "### flamia-verify: **PASS**: 4 checks: 3 passed, 1 skipped"
    assert "<details>" not in ok and "#### Failures" not in ok


def test_table_has_one_row_per_check_with_marker_and_key_metric(md):
    report = example_report()
    header = "| Check | Verdict | Status | Key metric | Value | Threshold |"
    start = md.splitlines().index(header)
    rows = md.splitlines()[start + 2 : start + 2 + len(report.checks)]
    assert [r.split(" | ")[0][2:].replace("\\_", "_") for r in rows] == [c.name for c in report.checks]
    assert "| error.backward | gating | **FAIL** | rel\\_err\\_vs\\_bf16\\_dK | 9.7 | ≤ 4 |" in rows
    assert "| causal.backward | gating | **ERROR** | max\\_leak | — | ≤ 0 |" in rows
    assert "| determinism.backward | gating | SKIP | — | — | — |" in rows
    assert "| bias.gradient\\_shrinkage | gating | PASS | cos\\_dQ | 0.9999 | ≥ 0.999 |" in rows


def test_markers_are_emoji_free(md):
    assert all(ord(ch) < 0x2000 or ch in "—·≤≥" for ch in md), "only text markers, no emoji"


def test_each_failure_gets_a_collapsed_reproducer(md):
    blocks = re.findall(r"<details>\n<summary>(.*?)</summary>(.*?)</details>", md, flags=re.S)
    assert [b[0].split("</b>")[0].removeprefix("<b>") for b in blocks] == [
        "error.backward",
        "causal.forward",
        "causal.backward",
    ]
    summary, body = blocks[0]
    assert summary == (
        "<b>error.backward</b> FAIL: dK error 9.7x BF16 (limit 4x): K quantized across the causal diagonal"
    )
    assert "**Message:** dK error 9.7x BF16 (limit 4x): K quantized across the causal diagonal" in body
    assert "| rel\\_err\\_vs\\_bf16\\_dK | 9.7 | ≤ 4 | **outside** |" in body
    assert (
        "**Reproduce:** run seed 1234 (--seed of the re-run below), case seed 1301 (the worst case's own seed, in its JSON)."
        in body
    )
    assert _json_blocks(body) == [example_report().check("error.backward").worst_case]
    assert "flamia-verify check --kernel mxfp8-naive --recipe mxfp8 --suite quick --seed 1234 --only error" in body


def test_details_blocks_have_blank_lines_for_github(md):
    # GitHub renders Markdown inside <details> only after a blank line following </summary>.
    assert md.count("</summary>\n\n") == md.count("<summary>") == 3


def test_hostile_strings_cannot_inject_markup_or_break_the_table():
    md = render_markdown(hostile_report())
    assert not re.search(r"<(script|img|a)\b", md, flags=re.I), "a raw tag survived"
    assert XSS not in md
    assert "&lt;script&gt;alert\\(1\\)&lt;/script&gt;" in md or "&lt;script&gt;alert(1)&lt;/script&gt;" in md
    for row in _table_rows(md):
        assert _unescaped_pipes(row) in (5, 7), f"a cell broke the table: {row}"
    assert "\x1b" not in md.split("```json")[0], "control characters are folded out of text lines"
    for case in _json_blocks(md):
        assert isinstance(case, dict)
    assert "Re-run the family" not in md, "the unsafe kernel spec is not put into a shell block"
    assert "see report.json for the re-run" in md


def test_long_worst_case_is_cut():
    report = example_report()
    report.check("causal.forward").worst_case["values"] = list(range(5000))
    md = render_markdown(report)
    assert f"_Cut at {MAX_JSON_CHARS} characters; see report.json._" in md
    assert len(md) < 20_000


def test_backticks_in_a_case_get_a_longer_fence():
    report = example_report()
    report.check("causal.forward").worst_case["note"] = "````"
    md = render_markdown(report)
    assert "`````json" in md


@pytest.mark.parametrize(
    "text, escaped",
    [
        ("a|b", "a\\|b"),
        ("*x*", "\\*x\\*"),
        ("<b>", "&lt;b&gt;"),
        ("line\nbreak", "line break"),
        ("[l](u)", "\\[l\\](u)"),
        ("rel_err", "rel\\_err"),
        ("plain text 1.5", "plain text 1.5"),
    ],
)
def test_md_escape(text, escaped):
    assert md_escape(text) == escaped


def test_run_notes_read_as_sentences():
    """A run note is ``> **Head:** text`` with a space after the bold head (it rendered ``**...:**text``)."""
    from flamia_verify.results import CheckResult, Report

    rep = Report(
        kernel="k", recipe="mxfp8", suite="quick", seed=0, checks=[CheckResult("interface.output", "interface", "pass")]
    )
    rep.complete, rep.incomplete_reason = False, "interrupted (SIGINT) after 1 of 32 checks"
    lines = [x for x in render_markdown(rep).splitlines() if "INCOMPLETE run" in x]
    assert lines == [
        "> **INCOMPLETE run:** interrupted (SIGINT) after 1 of 32 checks. Only the checks listed ran; "
        "this is no verdict on the kernel."
    ]
