"""``flamia-verify report``: render a report.json again."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from flamia_verify.commands.common import EXIT_PASS, console, plain
from flamia_verify.errors import UsageError

__all__ = ["add_parser", "run"]


def add_parser(sub: Any) -> None:
    r = sub.add_parser(
        "report",
        help="render a report.json again",
        description="Render a report.json again. Exit 0 once rendered, whatever the report's verdict "
        "(the run that wrote it gave that exit code); 2 when the file cannot be read or written.",
    )
    r.add_argument("report", help="the report.json to read (validated against the report schema)")
    r.add_argument("--html", help="write the HTML report to this file (instead of printing the summary)")
    r.add_argument("--md", help="write the Markdown report to this file (instead of printing the summary)")
    r.add_argument("--junit", help="write the JUnit XML report to this file (instead of printing the summary)")


def run(args: argparse.Namespace) -> int:
    """Render a report.json again: exit 0 once rendered. A re-render is not a verdict; the run that
    wrote the report gave that exit code (and ``compare`` gates one report against another)."""
    from flamia_verify.reports import load_report, render_html, render_junit, render_markdown, render_terminal
    from flamia_verify.reports.store import atomic_write_text

    report = load_report(args.report)
    if not args.html and not args.md and not args.junit:
        cons = console()
        render_terminal(report, cons, plain=plain(cons))
    for target, render in ((args.html, render_html), (args.md, render_markdown), (args.junit, render_junit)):
        if not target:
            continue
        if Path(target).is_dir():
            raise UsageError(f"{target!r} is a directory; give a file name")
        try:
            atomic_write_text(Path(target), render(report))
        except OSError as exc:
            raise UsageError(f"cannot write {target!r}: {exc.strerror or exc}") from None
    return EXIT_PASS
