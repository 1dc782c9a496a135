"""junit.xml: the report for CI test viewers (GitLab, Jenkins, GitHub test-report actions).

One ``<testsuite>`` (inside a ``<testsuites>`` root, which every common viewer reads) with the run as
``<properties>`` and one ``<testcase classname=FAMILY name=CHECK time=SECONDS>`` per check:

- fail  -> ``<failure message=MESSAGE type="fail">`` whose text lists every metric against its threshold,
  the reproducer (seeds, command) and the worst case as JSON;
- error -> ``<error message=MESSAGE type="error">`` with the same text;
- skip  -> ``<skipped message=REASON>``;
- pass  -> an empty testcase;
- a finding (a failed or errored check of a verdict that does not gate the run: reproducibility or
  robustness, unless required) -> a testcase without failure whose ``<system-out>`` starts with
  ``FINDING (VERDICT, not gating)`` and carries the same text, so that a viewer stays green where
  the exit code is 0 and the finding is still one click away.

The run's properties ``verdict.NAME`` give each verdict's status and whether it gates, ``require`` the
verdicts required; a failure's text names its check's verdict.

A run that did not finish gets one more testcase, ``flamia-verify.run`` / ``run.complete``, with an
``<error type="incomplete">`` that gives the reason, so that a viewer never shows an interrupted run as
green; ``run_notes`` (incomplete run, gradients not checked) are also properties ``note.N``, and every
threshold override a property ``threshold_override.CHECK.KEY`` (``suite.KEY`` for a suite setting) whose
value reads ``VALUE (default D) from SOURCE``.

The tree is built with ``xml.etree`` (which escapes markup); characters that XML 1.0 cannot hold at all
(terminal colour codes, NUL) are written as visible ``\\x1b``-style escapes so the file always parses.
"""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from typing import Any

from flamia_verify.reports.metrics import format_value, higher_is_better, safe_json, threshold_verdict
from flamia_verify.reports.wording import case_seed, rerun_command, run_notes, shown_environment, shown_status
from flamia_verify.results import CheckResult, Report, incomplete_note

__all__ = ["render_junit"]

# Everything outside XML 1.0's Char production: https://www.w3.org/TR/xml/#charsets
_NOT_XML = re.compile("[^\t\n\r\u0020-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]")


def _x(value: Any) -> str:
    text = value if isinstance(value, str) else str(value)
    return _NOT_XML.sub(
        lambda m: f"\\x{ord(m.group(0)):02x}" if ord(m.group(0)) < 256 else f"\\u{ord(m.group(0)):04x}", text
    )


def _failure_text(report: Report, check: CheckResult) -> str:
    lines = [f"{check.name}: {check.status} ({check.verdict} verdict)"]
    if check.message:
        lines.append(f"message: {check.message}")
    metrics, thresholds = check.metrics or {}, check.thresholds or {}
    names = list(metrics) + [t for t in thresholds if t not in metrics]
    if names:
        lines.append("metrics:")
        for name in names:
            line = f"  {name} = {format_value(metrics.get(name))}"
            if name in thresholds:
                limit = "at least" if higher_is_better(name) else "at most"
                ok = threshold_verdict(name, metrics.get(name), thresholds[name])
                verdict = {True: "within", False: "OUTSIDE", None: "not comparable"}.get(ok, "not comparable")
                line += f"  (threshold: {limit} {format_value(thresholds[name])}: {verdict})"
            lines.append(line)
    seed = case_seed(report, check)
    command = rerun_command(report, check)
    lines.append(
        f"reproduce: run seed {report.seed}{' (--seed of the command below)' if command else ''}, "
        + (f"case seed {seed} (the worst case's own seed)" if seed is not None else "no case seed recorded")
    )
    if command:
        lines.append(f"  {command}")
    if check.worst_case:
        lines.append("worst case:")
        lines.append(safe_json(check.worst_case))
    return "\n".join(lines)


def render_junit(report: Report) -> str:
    """The report as JUnit XML text (see the module docstring)."""
    counts = dict.fromkeys(("pass", "fail", "error", "skip", "finding"), 0)
    for check in report.checks:
        counts[shown_status(check, report.require)] += 1
    total_time = sum(c.duration_s or 0.0 for c in report.checks)
    incomplete = not getattr(report, "complete", True)
    totals = {
        "tests": str(len(report.checks) + incomplete),
        "failures": str(counts["fail"]),
        "errors": str(counts["error"] + incomplete),
        "skipped": str(counts["skip"]),
        "time": f"{total_time:.3f}",
    }
    root = ET.Element("testsuites", {"name": "flamia-verify", **totals})
    suite_name = _x(f"flamia-verify {report.kernel} ({report.recipe}, {report.suite})")
    suite = ET.SubElement(root, "testsuite", {"name": suite_name, **totals})
    props = ET.SubElement(suite, "properties")
    run = [
        ("kernel", report.kernel),
        ("recipe", report.recipe),
        ("suite", report.suite),
        ("seed", report.seed),
        ("schema", report.schema),
    ]
    run += [
        (f"environment.{k}", v if isinstance(v, str) else safe_json(v, indent=None))
        for k, v in shown_environment(report)
    ]
    run += [("complete", "true" if not incomplete else "false")]
    run += [("require", ",".join(report.require))]
    run += [
        (f"verdict.{name}", f"{row['status']} ({'gates' if row['gates'] else 'not gating'})")
        for name, row in report.verdicts().items()
    ]
    run += [(f"note.{i}", note) for i, note in enumerate(run_notes(report), 1)]
    # every threshold override: threshold_override.CHECK.KEY = "VALUE (default D) from SOURCE"
    run += [
        (
            f"threshold_override.{entry.get('scope')}.{entry.get('key')}",
            f"{format_value(entry.get('value'))} (default {format_value(entry.get('default'))}) from "
            f"{entry.get('source') or 'an unknown source'}",
        )
        for entry in report.threshold_overrides or []
    ]
    for name, value in run:
        ET.SubElement(props, "property", {"name": _x(name), "value": _x(value)})
    if incomplete:
        case = ET.SubElement(
            suite, "testcase", {"classname": "flamia-verify.run", "name": "run.complete", "time": "0.000"}
        )
        reason = report.incomplete_reason or "the run did not finish"
        element = ET.SubElement(case, "error", {"message": _x(f"incomplete run: {reason}"), "type": "incomplete"})
        element.text = _x(f"The run did not finish: {reason}. {incomplete_note(report)}")

    for check in report.checks:
        case = ET.SubElement(
            suite,
            "testcase",
            {
                "classname": _x(check.family),
                "name": _x(check.name),
                "time": f"{check.duration_s or 0.0:.3f}",
            },
        )
        shown = shown_status(check, report.require)
        if shown == "finding":
            out = ET.SubElement(case, "system-out")
            out.text = _x(f"FINDING ({check.verdict}, not gating)\n" + _failure_text(report, check))
        elif check.status in ("fail", "error"):
            element = ET.SubElement(
                case,
                "failure" if check.status == "fail" else "error",
                {
                    "message": _x(check.message or f"check {check.status}"),
                    "type": check.status,
                },
            )
            element.text = _x(_failure_text(report, check))
        elif check.status == "skip":
            ET.SubElement(case, "skipped", {"message": _x(check.message or "skipped")})
    ET.indent(root)
    return '<?xml version="1.0" encoding="UTF-8"?>\n' + ET.tostring(root, encoding="unicode") + "\n"
