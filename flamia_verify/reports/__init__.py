"""Reports of a flamia-verify run: report.json and its renderers, and the regression gate. The result
model itself (`Report`, `CheckResult`, re-exported here) lives in `flamia_verify.results`.

- `write_reports` / `load_report`: report.json, report.md, report.html, junit.xml (atomic writes; validation);
  `atomic_write_text` for a single rendered file (``flamia-verify report --html FILE``).
- `render_markdown`, `render_html`, `render_junit`, `render_terminal`: one renderer per audience.
- `compare_reports` / `render_comparison`: the regression gate of `flamia-verify compare`.

The key metric of a check and the "which direction is better" rule that all of them share are documented
in `flamia_verify.reports.metrics`; the plot conventions of ``CheckResult.details`` in
`flamia_verify.reports.plots`.
"""

from __future__ import annotations

from flamia_verify.reports.compare import (
    Change,
    Comparison,
    compare_reports,
    default_higher_is_worse,
    render_comparison,
)
from flamia_verify.reports.html_report import render_html
from flamia_verify.reports.junit import render_junit
from flamia_verify.reports.markdown import render_markdown
from flamia_verify.reports.metrics import KeyMetric, key_metric
from flamia_verify.reports.store import atomic_write_text, load_report, write_reports
from flamia_verify.reports.terminal import render_terminal
from flamia_verify.results import SCHEMA, CheckResult, Report

__all__ = [
    "SCHEMA",
    "Change",
    "CheckResult",
    "Comparison",
    "KeyMetric",
    "Report",
    "atomic_write_text",
    "compare_reports",
    "default_higher_is_worse",
    "key_metric",
    "load_report",
    "render_comparison",
    "render_html",
    "render_junit",
    "render_markdown",
    "render_terminal",
    "write_reports",
]
