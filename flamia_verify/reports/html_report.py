"""report.html: one self-contained page a person reads to decide whether a kernel may train.

The page needs nothing but itself: the CSS is inline, plots are inline SVG drawn by matplotlib (see
`flamia_verify.reports.plots` for the ``details`` conventions that ask for them), there is no JavaScript,
and a Content-Security-Policy (``default-src 'none'``) forbids the browser from fetching or running
anything, so the file can be archived as a CI artifact and opened anywhere.

Layout, top to bottom: the verdict; every threshold override (check, key, value, default, source);
links to the failed checks; a table of all checks with their key metric (rule in
`flamia_verify.reports.metrics`); the run (kernel, recipe, suite, seed, environment); then one section
per check (failed and errored ones first) with its message, every metric against its threshold, the
worst case, the reproducer of a failure (the run seed the re-run command takes, the worst case's own
case seed, the case as JSON, the command) and its plots.

Every string that comes from a kernel, a check or the command line is escaped with ``html.escape``.
"""

from __future__ import annotations

import html
import re
from typing import Any

from flamia_verify._version import __version__
from flamia_verify.reports.metrics import (
    format_seconds,
    format_threshold,
    format_value,
    higher_is_better,
    key_metric,
    safe_json,
    threshold_verdict,
)
from flamia_verify.reports.plots import (
    PLOT_KINDS,
    Plot,
    PlotSpecError,
    blank_heatmap,
    plots_of,
    prefix_svg_ids,
    render_plot_svg,
)
from flamia_verify.reports.wording import (
    STATUS_MARK,
    VERDICT_WORDS,
    call_table,
    case_seed,
    counts_line,
    override_line,
    overrides_heading,
    printable,
    rerun_command,
    run_notes,
    shown_environment,
    shown_status,
    verdict,
)
from flamia_verify.results import CheckResult, Report

__all__ = ["render_html"]

#: Longest JSON block (worst case, other details) shown inline; longer ones are cut with a note.
MAX_JSON_CHARS = 20_000

_CSP = "default-src 'none'; style-src 'unsafe-inline'; img-src data:"

_CSS = """
:root { --pass: #1a7f37; --fail: #cf222e; --error: #9a3412; --skip: #6e7781; --line: #d0d7de;
        --muted: #57606a; --bg-soft: #f6f8fa; }
* { box-sizing: border-box; }
body { margin: 0; font: 14px/1.5 system-ui, -apple-system, "Segoe UI", Roboto, "DejaVu Sans", sans-serif;
       color: #1f2328; background: #fff; }
main { max-width: 1240px; margin: 0 auto; padding: 24px 28px 48px; }
h1 { font-size: 22px; margin: 0 0 4px; } h2 { font-size: 18px; margin: 32px 0 8px; }
h3 { font-size: 15px; margin: 18px 0 6px; }
code, pre, .mono { font-family: ui-monospace, "DejaVu Sans Mono", Menlo, Consolas, monospace; font-size: 12.5px; }
pre { background: var(--bg-soft); border: 1px solid var(--line); border-radius: 6px; padding: 10px 12px;
      overflow: auto; max-height: 420px; white-space: pre-wrap; word-break: break-word; }
a { color: #0969da; text-decoration: none; } a:hover { text-decoration: underline; }
.verdict { display: flex; align-items: center; gap: 18px; padding: 16px 20px; border-radius: 8px;
           border: 1px solid var(--line); border-left-width: 8px; margin: 8px 0 20px; }
.verdict.pass { border-left-color: var(--pass); } .verdict.fail { border-left-color: var(--fail); }
.verdict .word { font-size: 28px; font-weight: 700; letter-spacing: .04em; }
.verdict.pass .word { color: var(--pass); } .verdict.fail .word { color: var(--fail); }
.verdict.incomplete { border-left-color: var(--fail); } .verdict.incomplete .word { color: var(--fail); }
.muted { color: var(--muted); }
table { border-collapse: collapse; width: 100%; margin: 6px 0 12px; }
th, td { text-align: left; padding: 5px 8px; border-bottom: 1px solid var(--line); vertical-align: top; }
th { background: var(--bg-soft); font-weight: 600; white-space: nowrap; }
td.num { font-variant-numeric: tabular-nums; white-space: nowrap; }
td { overflow-wrap: break-word; }
table.checks th { white-space: normal; }
table.checks td.msg { overflow-wrap: anywhere; }
tbody tr:hover { background: #fafbfc; }
dl.run { display: grid; grid-template-columns: max-content 1fr; gap: 2px 16px; margin: 0 0 8px;
  align-content: start; }
dl.run dt { font-weight: 600; } dl.run dd { margin: 0; word-break: break-all; }
.columns { display: grid; grid-template-columns: repeat(auto-fit, minmax(320px, 1fr)); gap: 0 32px;
  align-items: start; }
.columns h3 { margin-top: 0; }
.badge { display: inline-block; min-width: 54px; text-align: center; padding: 0 8px; border-radius: 10px;
         font-size: 12px; font-weight: 700; color: #fff; letter-spacing: .03em; }
.badge.pass { background: var(--pass); } .badge.fail { background: var(--fail); }
.badge.error { background: var(--error); } .badge.skip { background: var(--skip); }
.badge.finding { background: #9a6700; }
ul.verdicts { list-style: none; padding: 0; margin: -8px 0 16px; } ul.verdicts li { margin: 2px 0; }
.over { color: var(--fail); font-weight: 600; } .within { color: var(--pass); }
section.check { border: 1px solid var(--line); border-radius: 8px; padding: 4px 18px 12px; margin: 14px 0; }
section.check.fail, section.check.error { border-left: 6px solid var(--fail); }
section.check.error { border-left-color: var(--error); }
section.check > h3 { display: flex; gap: 10px; align-items: center; font-size: 16px; }
.message { margin: 6px 0 10px; }
.plots { display: grid; grid-template-columns: repeat(auto-fill, minmax(440px, 1fr)); gap: 14px; }
figure.plot { margin: 0; border: 1px solid var(--line); border-radius: 6px; padding: 6px; background: #fff; }
figure.plot svg { display: block; width: 100%; height: auto; }
figure.plot figcaption { font-size: 12px; color: var(--muted); padding: 2px 4px 0; }
.plot-error { color: var(--fail); border: 1px dashed var(--fail); border-radius: 6px; padding: 8px; }
.blank-maps { font-size: 13px; margin: 6px 0; padding-left: 18px; }
details > summary { cursor: pointer; color: var(--muted); }
footer { margin-top: 36px; color: var(--muted); font-size: 12px; }
@media print { pre { max-height: none; } section.check { break-inside: avoid; } }
"""


def _e(value: Any) -> str:
    """Escape any value for HTML text or a quoted attribute."""
    return html.escape(printable(value), quote=True)


def _anchors(report: Report) -> dict[str, str]:
    """A unique, URL-safe ``id`` per check."""
    used: set[str] = set()
    out: dict[str, str] = {}
    for check in report.checks:
        base = "check-" + (re.sub(r"[^A-Za-z0-9_.-]+", "-", check.name).strip("-") or "x")
        anchor, n = base, 2
        while anchor in used:
            anchor, n = f"{base}-{n}", n + 1
        used.add(anchor)
        out[check.name] = anchor
    return out


def _breakable(value: Any) -> str:
    """Escaped text that may wrap after each ``.`` and ``_`` (check and metric names in a narrow table)."""
    return re.sub(r"([._])", r"\1<wbr>", _e(value))


def _badge(status: str) -> str:
    return f'<span class="badge {_e(status)}">{_e(STATUS_MARK.get(status, status.upper()))}</span>'


def _json_block(value: Any) -> str:
    text = safe_json(value)
    note = ""
    if len(text) > MAX_JSON_CHARS:
        text = text[:MAX_JSON_CHARS]
        note = f'<p class="muted">Cut at {MAX_JSON_CHARS} characters; report.json holds all of it.</p>'
    return f"<pre>{_e(text)}</pre>{note}"


def _within_cell(metric: str, value: Any, threshold: Any) -> str:
    ok = threshold_verdict(metric, value, threshold)
    if ok is None:
        return '<td class="muted">—</td>'
    if ok:
        return '<td class="within">within</td>'
    word = "below" if higher_is_better(metric) else "above"
    return f'<td class="over">{word}</td>'


def _metrics_table(check: CheckResult) -> str:
    metrics, thresholds = check.metrics or {}, check.thresholds or {}
    names = list(metrics) + [t for t in thresholds if t not in metrics]
    if not names:
        return '<p class="muted">No metrics recorded.</p>'
    rows = []
    for name in names:
        value, threshold = metrics.get(name), thresholds.get(name)
        threshold_text = format_threshold(name, threshold) if name in thresholds else "—"
        rows.append(
            f'<tr><td class="mono">{_e(name)}</td><td class="num">{_e(format_value(value))}</td>'
            f'<td class="num">{_e(threshold_text)}</td>{_within_cell(name, value, threshold)}</tr>'
        )
    return (
        "<table><thead><tr><th>Metric</th><th>Value</th><th>Threshold</th><th>Against threshold</th></tr>"
        f"</thead><tbody>{''.join(rows)}</tbody></table>"
    )


def _blank_line(plot: Plot, shape: tuple[int, int]) -> str:
    """One line in place of a heatmap that is 0 everywhere: what it maps and over how many rows."""
    spec = plot.spec
    what = spec.get("z_label") if isinstance(spec.get("z_label"), str) and spec.get("z_label") else "value"
    rows = f"{shape[0]} row{'s' if shape[0] != 1 else ''}"
    if isinstance(spec.get("y_label"), str) and spec.get("y_label"):
        rows += f" ({spec['y_label']})"
    cols = f"{shape[1]} column{'s' if shape[1] != 1 else ''}"
    if isinstance(spec.get("x_label"), str) and spec.get("x_label"):
        cols += f" ({spec['x_label']})"
    return (
        f'<li><span class="mono">{_e(plot.title or plot.where)}</span>: {_e(what)} is 0 in every cell, '
        f"{_e(rows)} × {_e(cols)}; not drawn</li>"
    )


def _plots(check: CheckResult, anchor: str) -> str:
    figures = []
    blank = []
    for number, plot in enumerate(plots_of(check.details)):
        caption = f"{plot.title or plot.kind} · {plot.where}"
        shape = blank_heatmap(plot)
        if shape is not None:  # a map of zeros (nothing leaked) says it in words
            blank.append(_blank_line(plot, shape))
            continue
        try:
            svg = render_plot_svg(plot)
        except PlotSpecError as exc:
            figures.append(f'<div class="plot-error">Plot not drawn: {_e(exc)}</div>')
            continue
        except Exception as exc:  # a plotting bug must not lose the rest of the report
            figures.append(f'<div class="plot-error">Plot not drawn ({_e(type(exc).__name__)}): {_e(exc)}</div>')
            continue
        svg = prefix_svg_ids(svg, f"{anchor}-plot{number}-")
        svg = svg.replace('role="img"', f'role="img" aria-label="{_e(plot.title or plot.kind)}"', 1)
        figures.append(f'<figure class="plot">{svg}<figcaption>{_e(caption)}</figcaption></figure>')
    html = f'<div class="plots">{"".join(figures)}</div>' if figures else ""
    if blank:
        html += f'<ul class="blank-maps muted">{"".join(blank)}</ul>'
    return html


def _case_seed(report: Report, check: CheckResult) -> str:
    """The worst case's own seed, the one that rebuilds it (never the run's seed)."""
    seed = case_seed(report, check)
    if seed is None:
        return '<span class="muted">not recorded (the worst case holds no case)</span>'
    return f'<span class="mono">{_e(seed)}</span> <span class="muted">(the worst case\'s own seed)</span>'


def _overrides(report: Report) -> str:
    """Every threshold override (check, key, value, default, source) under the verdict ("" for none)."""
    heading = overrides_heading(report)
    if not heading:
        return ""
    items = "".join(f'<li class="mono">{_e(override_line(entry))}</li>' for entry in report.threshold_overrides)
    return f'<div class="note" id="threshold-overrides"><p><strong>{_e(heading)}</strong></p><ul>{items}</ul></div>'


def _verdicts(report: Report) -> str:
    """One line per verdict under the headline: its status, whether it gates this run, what failed."""
    table = report.verdicts()
    if set(table) <= {"gating"}:
        return ""
    items = []
    for name, row in table.items():
        bad = row["failed"] + row["errored"]
        status = "pass" if not bad else "fail" if row["gates"] else "finding"
        gates = "gates this run" if row["gates"] else "reported, not gating (--require " + name + " to gate)"
        names = ": " + ", ".join(bad) if bad else ""
        items.append(
            f"<li>{_badge(status)} <strong>{_e(name)}</strong> "
            f'<span class="muted">({_e(VERDICT_WORDS[name])}; {_e(gates)})</span>{_e(names)}</li>'
        )
    return f'<ul class="verdicts" id="verdicts">{"".join(items)}</ul>'


def _check_section(report: Report, check: CheckResult, anchor: str) -> str:
    shown = shown_status(check, report.require)
    parts = [
        f'<section class="check {_e(shown)}" id="{_e(anchor)}">',
        f'<h3>{_badge(shown)}<span class="mono">{_e(check.name)}</span>'
        f'<span class="muted">{_e(check.verdict)} · {_e(format_seconds(check.duration_s))}</span></h3>',
    ]
    if check.message:
        parts.append(f'<p class="message">{_e(check.message)}</p>')
    parts.append(_metrics_table(check))
    table = call_table(check)
    if table is not None:
        head = "".join(f"<th>{_e(c)}</th>" for c in table[0])
        body = "".join("<tr>" + "".join(f'<td class="mono">{_e(v)}</td>' for v in row) + "</tr>" for row in table[1])
        parts.append(f"<h4>Per captured call</h4><table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>")
    if check.status in ("fail", "error"):
        command = rerun_command(report, check)
        seed_note = ' <span class="muted">(--seed of the re-run command)</span>' if command else ""
        parts.append("<h4>Reproduce</h4>")
        parts.append(
            f'<dl class="run"><dt>Run seed</dt><dd><span class="mono">{_e(report.seed)}</span>{seed_note}</dd>'
            f"<dt>Case seed</dt><dd>{_case_seed(report, check)}</dd></dl>"
        )
        if command:
            parts.append(f"<pre>{_e(command)}</pre>")
        if check.worst_case:
            parts.append("<p>Worst case:</p>" + _json_block(check.worst_case))
        else:
            parts.append('<p class="muted">No worst case was recorded.</p>')
    elif check.worst_case:
        parts.append("<details><summary>Worst case</summary>" + _json_block(check.worst_case) + "</details>")
    parts.append(_plots(check, anchor))
    other = {k: v for k, v in (check.details or {}).items() if k not in PLOT_KINDS}
    if other:
        parts.append("<details><summary>Other details</summary>" + _json_block(other) + "</details>")
    parts.append("</section>")
    return "\n".join(p for p in parts if p)


def _run_summary(report: Report) -> str:
    items = [
        ("Kernel", report.kernel),
        ("Recipe", report.recipe),
        ("Suite", report.suite),
        ("Seed", report.seed),
        ("Schema", report.schema),
    ]
    run = "".join(f'<dt>{_e(k)}</dt><dd class="mono">{_e(v)}</dd>' for k, v in items)
    env = (
        "".join(
            f'<dt class="mono">{_e(k)}</dt><dd class="mono">'
            f"{_e(v if isinstance(v, str) else safe_json(v, indent=None))}</dd>"
            for k, v in shown_environment(report)
        )
        or '<dt class="muted">none recorded</dt><dd></dd>'
    )
    return (
        '<h2>Run</h2><div class="columns">'
        f'<dl class="run">{run}</dl>'
        f'<div><h3>Environment</h3><dl class="run">{env}</dl></div></div>'
    )


def _checks_table(report: Report, anchors: dict[str, str]) -> str:
    rows = []
    for check in report.checks:
        key = key_metric(check)
        if key is None:
            label = value = threshold = "—"
            value_class = "num"
        else:
            label, value = key.label, format_value(key.value)
            threshold = format_threshold(key.name, key.threshold)
            value_class = {True: "num within", False: "num over", None: "num"}.get(key.within, "num")
        rows.append(
            f'<tr><td class="mono"><a href="#{_e(anchors[check.name])}">{_breakable(check.name)}</a></td>'
            f'<td>{_badge(shown_status(check, report.require))}</td><td class="muted">{_e(check.verdict)}</td>'
            f'<td class="mono">{_breakable(label)}</td><td class="{value_class}">{_e(value)}</td>'
            f'<td class="num">{_e(threshold)}</td><td class="num">{_e(format_seconds(check.duration_s))}</td>'
            f'<td class="msg">{_e(check.message)}</td></tr>'
        )
    if not rows:
        return '<h2>Checks</h2><p class="muted">No checks ran.</p>'
    return (
        '<h2>Checks</h2><table class="checks"><thead><tr><th>Check</th><th>Status</th><th>Verdict</th><th>Key metric</th>'
        f"<th>Value</th><th>Threshold</th><th>Time</th><th>Message</th></tr></thead><tbody>{''.join(rows)}</tbody></table>"
    )


def render_html(report: Report) -> str:
    """The whole report as one self-contained HTML page (see the module docstring)."""
    anchors = _anchors(report)
    word = verdict(report)
    failed = [c for c in report.checks if shown_status(c, report.require) in ("fail", "error")]
    findings = [c for c in report.checks if shown_status(c, report.require) == "finding"]
    failed_links = ""
    for title, chosen in (("Failed checks", failed), ("Findings (reported, not gating)", findings)):
        if not chosen:
            continue
        items = "".join(
            f'<li>{_badge(shown_status(c, report.require))} <a class="mono" href="#{_e(anchors[c.name])}">'
            f"{_e(c.name)}</a>{' — ' + _e(c.message) if c.message else ''}</li>"
            for c in chosen
        )
        failed_links += f"<h2>{_e(title)}</h2><ul>{items}</ul>"
    # Failed and errored checks first: they are what the reader came for, then the findings. The table
    # keeps run order.
    ordered = failed + findings + [c for c in report.checks if c.status not in ("fail", "error")]
    sections = "\n".join(_check_section(report, c, anchors[c.name]) for c in ordered)
    run_line = " · ".join(
        f'{label} <span class="mono">{_e(value)}</span>'
        for label, value in (
            ("Kernel", report.kernel),
            ("recipe", report.recipe),
            ("suite", report.suite),
            ("seed", report.seed),
        )
    )
    counts = _e(counts_line(report))
    return f"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta http-equiv="Content-Security-Policy" content="{_CSP}">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>flamia-verify {word}: {_e(report.kernel)}</title>
<style>{_CSS}</style>
</head>
<body>
<main>
<h1>flamia-verify report</h1>
<div class="muted">{run_line}</div>
<div class="verdict {word.lower()}" id="verdict"><span class="word">{word}</span><span>{counts}</span></div>
{_verdicts(report)}
{"".join(f'<p class="note"><strong>{_e(note)}</strong></p>' for note in run_notes(report))}
{_overrides(report)}
{failed_links}
{_checks_table(report, anchors)}
{_run_summary(report)}
<h2>Check details</h2>
{sections}
<footer>Written by flamia-verify {_e(__version__)} · schema {_e(report.schema)} ·
self-contained: no scripts, no network.</footer>
</main>
</body>
</html>
"""
