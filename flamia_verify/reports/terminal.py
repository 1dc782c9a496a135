"""The terminal summary printed at the end of `flamia-verify check`: a rich table and the verdict.

One row per check: name, status (coloured), key metric, its value and threshold (key metric rule in
`flamia_verify.reports.metrics`), and the message. Every string is placed as a `rich.text.Text`, never
parsed as console markup, so a kernel or message holding ``[bold]`` prints literally, and control
characters (terminal escape codes) are shown as ``\\x1b``-style text. The `Console` is
injectable: tests pass ``Console(file=StringIO(), width=...)``.
"""

from __future__ import annotations

from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text

from flamia_verify.reports.metrics import format_threshold, format_value, key_metric
from flamia_verify.reports.model import Report
from flamia_verify.reports.wording import STATUS_MARK, counts_line, printable, verdict

__all__ = ["STATUS_STYLE", "WIDE_CONSOLE", "render_terminal"]

#: Rich style of each status.
STATUS_STYLE = {"pass": "bold green", "fail": "bold red", "error": "bold magenta", "skip": "dim"}


#: Narrower consoles (CI logs default to 80 columns) list messages under the table instead of in a column.
WIDE_CONSOLE = 120


def render_terminal(report: Report, console: Console | None = None) -> None:
    """Print the summary table and the verdict of `report` to `console` (a new stdout console if None).

    On a console at least `WIDE_CONSOLE` columns wide the table has a Message column; on a narrower one the
    value and threshold share a column and the messages follow the table, one line per check.
    """
    console = console or Console()
    wide = console.width >= WIDE_CONSOLE
    title = Text.assemble(
        "flamia-verify  ", ("kernel ", "dim"), printable(report.kernel), ("  recipe ", "dim"),
        printable(report.recipe), ("  suite ", "dim"), printable(report.suite), ("  seed ", "dim"), str(report.seed),
    )
    table = Table(title=title, title_justify="left", expand=False, show_lines=False, header_style="bold",
                  box=box.HEAVY_HEAD if wide else box.SIMPLE_HEAD, pad_edge=wide)
    table.add_column("Check", no_wrap=True)
    table.add_column("Status", no_wrap=True)
    table.add_column("Key metric", overflow="fold")
    if wide:
        table.add_column("Value", justify="right", no_wrap=True)
        table.add_column("Threshold", justify="right", no_wrap=True)
        table.add_column("Message", overflow="fold", ratio=1)
    else:
        table.add_column("Value (threshold)", justify="right", no_wrap=True)
    for check in report.checks:
        key = key_metric(check)
        if key is None:
            label, value, threshold = Text("—", "dim"), Text("—", "dim"), Text("—", "dim")
        else:
            label = Text(printable(key.label))
            value_style = {True: "green", False: "red"}.get(key.within, "")
            value = Text(format_value(key.value), value_style)
            threshold = Text(format_threshold(key.name, key.threshold), "" if key.threshold is not None else "dim")
        name = Text(printable(check.name))
        status = Text(STATUS_MARK.get(check.status, check.status.upper()), STATUS_STYLE.get(check.status, ""))
        if wide:
            table.add_row(name, status, label, value, threshold, Text(printable(check.message or "")))
        else:
            both = value if key is None or key.threshold is None else Text.assemble(value, " (", threshold, ")")
            table.add_row(name, status, label, both)
    console.print(table)
    if not wide:
        for check in report.checks:
            if check.message:
                console.print(Text.assemble(
                    (printable(check.name), STATUS_STYLE.get(check.status, "")), ": ", printable(check.message)))
    word = verdict(report)
    console.print(Text.assemble((word, "bold green" if word == "PASS" else "bold red"), "  ", counts_line(report)))
    failed = [c.name for c in report.checks if c.status in ("fail", "error")]
    if failed:
        console.print(Text.assemble(("failed: ", "dim"), printable(", ".join(failed))))
