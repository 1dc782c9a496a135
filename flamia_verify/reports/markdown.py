"""report.md: the report as a pull-request comment (GitHub-flavoured Markdown).

A verdict line, the run, every threshold override (check, key, value, default, source) when there is
one, one table row per check (status marker, key metric against its threshold; the key metric rule is in
`flamia_verify.reports.metrics`), then a collapsed ``<details>`` block per failed or errored check with
its message, its metrics and the reproducer: the run seed (what the re-run command takes), the worst
case's own case seed (what rebuilds it), the worst case as JSON and the command that re-runs the check's
family.

Text from kernels, checks and the command line is escaped for Markdown and HTML (GitHub renders inline
HTML), so a kernel named ``<script>`` or ``a|b`` cannot break the table or the page. JSON blocks write
``<``, ``>`` and ``&`` as ``\\u003c``-style escapes and stay valid JSON. Each JSON block is cut at
`MAX_JSON_CHARS` so a comment stays well under GitHub's 65,536-character limit.
"""

from __future__ import annotations

import html
import re
from typing import Any

from flamia_verify.reports.metrics import format_threshold, format_value, key_metric, safe_json, threshold_verdict
from flamia_verify.reports.wording import (
    STATUS_MARK,
    call_table,
    case_seed,
    counts_line,
    override_line,
    overrides_heading,
    printable,
    rerun_command,
    run_line,
    run_notes,
    shown_status,
    verdict,
    verdicts_line,
)
from flamia_verify.results import CheckResult, Report

__all__ = ["md_escape", "render_markdown"]

#: Longest JSON block per check; the full case is always in report.json.
MAX_JSON_CHARS = 4000

# Characters that can start Markdown syntax inside a line: emphasis, code, links, tables, strikethrough,
# headings. "(" and "!" are harmless once "[" is escaped.
_MD_SPECIAL = re.compile(r"([\\`*_\[\]#|~])")


def md_escape(value: Any) -> str:
    """One line of literal text for Markdown: HTML-escaped, Markdown punctuation backslash-escaped,
    line breaks folded to spaces, control characters made visible."""
    text = " ".join(printable(value).split())
    text = html.escape(text, quote=False)
    return _MD_SPECIAL.sub(r"\\\1", text)


def _html_line(value: Any) -> str:
    return html.escape(" ".join(printable(value).split()), quote=False)


def _marker(status: str) -> str:
    mark = STATUS_MARK.get(status, status.upper())
    return f"**{mark}**" if status in ("fail", "error") else mark


def _fence(text: str, lang: str = "") -> str:
    """A fenced code block longer than any backtick run inside `text`."""
    longest = max((len(m) for m in re.findall(r"`+", text)), default=0)
    fence = "`" * max(3, longest + 1)
    return f"{fence}{lang}\n{text}\n{fence}"


def _json(value: Any) -> str:
    text = safe_json(value)
    if len(text) > MAX_JSON_CHARS:
        return _fence(text[:MAX_JSON_CHARS], "json") + f"\n\n_Cut at {MAX_JSON_CHARS} characters; see report.json._"
    return _fence(text, "json")


def _seeds(report: Report, check: CheckResult) -> str:
    """The run seed (what the re-run command takes) and the worst case's own seed (what rebuilds it)."""
    seed = case_seed(report, check)
    run = f"run seed {report.seed}" + (" (--seed of the re-run below)" if rerun_command(report, check) else "")
    if seed is None:
        return f"{run}; the worst case records no case seed"
    return f"{run}, case seed {seed} (the worst case's own seed, in its JSON)"


def _overrides(report: Report) -> list[str]:
    """Every threshold override, as a quoted block under the run line ([] when there is none)."""
    heading = overrides_heading(report)
    if not heading:
        return []
    head, _, rest = heading.partition(":")
    lines = [f"> **{md_escape(head)}:** {md_escape(rest.strip())}", ">"]
    lines += [f"> - {md_escape(override_line(entry))}" for entry in report.threshold_overrides]
    return lines + [""]


def _failure_block(report: Report, check: CheckResult) -> str:
    # <summary> is raw HTML to GitHub: Markdown escapes would show literally there.
    shown = shown_status(check, report.require)
    summary = f"<b>{_html_line(check.name)}</b> {STATUS_MARK[shown]}"
    if shown == "finding":
        summary += f" ({_html_line(check.verdict)}, not gating)"
    if check.message:
        summary += f": {_html_line(check.message)}"
    lines = [f"<details>\n<summary>{summary}</summary>", ""]
    if check.message:
        lines += [f"**Message:** {md_escape(check.message)}", ""]
    metrics, thresholds = check.metrics or {}, check.thresholds or {}
    names = list(metrics) + [t for t in thresholds if t not in metrics]
    if names:
        lines += ["| Metric | Value | Threshold | |", "|---|---:|---:|---|"]
        for name in names:
            value, threshold = metrics.get(name), thresholds.get(name)
            limit = format_threshold(name, threshold) if name in thresholds else ""
            ok = threshold_verdict(name, value, threshold)
            mark = {True: "within", False: "**outside**", None: ""}.get(ok, "")
            cells = [md_escape(name), md_escape(format_value(value)), md_escape(limit) or "—", mark]
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    table = call_table(check)
    if table is not None:
        lines += ["Per captured call:", "", "| " + " | ".join(md_escape(c) for c in table[0]) + " |"]
        lines.append("|" + "---|" * len(table[0]))
        lines += ["| " + " | ".join(md_escape(v) for v in row) + " |" for row in table[1]]
        lines.append("")
    lines.append(f"**Reproduce:** {md_escape(_seeds(report, check))}.")
    lines.append("")
    if check.worst_case:
        lines += ["Worst case:", "", _json(check.worst_case), ""]
    else:
        lines += ["_No worst case was recorded._", ""]
    command = rerun_command(report, check)
    if command and not re.search(r"[<>&`]", command):
        lines += ["Re-run the family:", "", _fence(command, "sh"), ""]
    elif command:
        lines += ["_The kernel spec holds characters unsafe in Markdown; see report.json for the re-run._", ""]
    lines.append("</details>")
    return "\n".join(lines)


def render_markdown(report: Report) -> str:
    """The report as GitHub-flavoured Markdown for a pull-request comment (see the module docstring)."""
    word = verdict(report)
    out = [
        f"### flamia-verify: **{word}**: {md_escape(counts_line(report))}",
        "",
        f"Kernel {md_escape(report.kernel)} · recipe {md_escape(report.recipe)} · "
        f"suite {md_escape(report.suite)} · seed {md_escape(report.seed)}"
        + (f" · {md_escape(run_line(report))}" if run_line(report) else ""),
        "",
    ]
    for note in run_notes(report):
        head, _, rest = note.partition(":")
        out += [f"> **{md_escape(head)}:** {md_escape(rest.strip())}", ""]
    line = verdicts_line(report)
    if line:
        out += [f"**Verdicts:** {md_escape(line)}", ""]
    out += _overrides(report)
    if report.checks:
        out += ["| Check | Verdict | Status | Key metric | Value | Threshold |", "|---|---|---|---|---:|---:|"]
        for check in report.checks:
            key = key_metric(check)
            if key is None:
                cells = ["—", "—", "—"]
            else:
                cells = [
                    md_escape(key.label),
                    md_escape(format_value(key.value)),
                    md_escape(format_threshold(key.name, key.threshold)),
                ]
            out.append(
                f"| {md_escape(check.name)} | {md_escape(check.verdict)} | "
                f"{_marker(shown_status(check, report.require))} | " + " | ".join(cells) + " |"
            )
        out.append("")
    failed = [c for c in report.checks if shown_status(c, report.require) in ("fail", "error")]
    if failed:
        out += ["#### Failures", ""]
        for check in failed:
            out += [_failure_block(report, check), ""]
    findings = [c for c in report.checks if shown_status(c, report.require) == "finding"]
    if findings:  # reported beside the verdict: what a workload that needs it (--require) would gate on
        out += ["#### Findings (reproducibility and robustness, not gating)", ""]
        for check in findings:
            out += [_failure_block(report, check), ""]
    out.append("_Full report with plots: report.html; machine-readable: report.json._")
    return "\n".join(out) + "\n"
