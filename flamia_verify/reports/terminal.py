"""The terminal summary printed at the end of `flamia-verify check`: a rich table and the verdict.

One row per check: name, status (coloured), key metric, its value and threshold (key metric rule in
`flamia_verify.reports.metrics`), and the message. Under the verdict: the failed and errored checks, the
case seed of each one's worst case (the seed that rebuilds it; the run seed re-runs them all), the run's
notes and every threshold override (check, key, value, default, source). Every string is placed as a `rich.text.Text`, never
parsed as console markup, so a kernel or message holding ``[bold]`` prints literally, and control
characters (terminal escape codes) are shown as ``\\x1b``-style text. The `Console` is
injectable: tests pass ``Console(file=StringIO(), width=...)``.

Off an interactive terminal (a CI log, ``| tee``, a file) tables wrap their cells mid-word at the
console's assumed 80 columns. There the command line asks for plain output instead (`is_plain`):
`render_terminal(..., plain=True)` writes one full line per check, `check_line` is the line printed as
each check finishes, and `print_table` writes a table as aligned lines that are never wrapped or cut.
A check can run for minutes (bound.shapes and isolation.layout take about 50 s each on a 2-core CPU
in the standard suite); `Heartbeat` prints a ``still running`` line when no line has appeared for
`HEARTBEAT_S` seconds, so that a log never looks hung.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text

from flamia_verify.reports.metrics import format_threshold, format_value, key_metric
from flamia_verify.reports.wording import (
    STATUS_MARK,
    case_seeds_line,
    counts_line,
    override_line,
    overrides_heading,
    printable,
    run_notes,
    shown_status,
    verdict,
    verdicts_line,
)
from flamia_verify.results import CheckResult, Report

__all__ = [
    "HEARTBEAT_S",
    "STATUS_STYLE",
    "WIDE_CONSOLE",
    "Heartbeat",
    "check_line",
    "is_plain",
    "print_table",
    "render_terminal",
]

#: Rich style of each status.
STATUS_STYLE = {
    "pass": "bold green",
    "fail": "bold red",
    "error": "bold magenta",
    "skip": "dim",
    "finding": "bold yellow",
}


#: Narrower consoles (CI logs default to 80 columns) list messages under the table instead of in a column.
WIDE_CONSOLE = 120


#: Width a check's name is padded to in plain lines (the longest built-in name is 33 characters); a
#: longer name is written whole and pushes the rest of its line to the right.
NAME_WIDTH = 34


def is_plain(console: Console) -> bool:
    """Whether `console` should get plain lines: it is not an interactive terminal (nor a notebook)."""
    return not console.is_terminal and not console.is_jupyter


def _key_text(check: CheckResult) -> Text:
    """``label value (threshold)`` of the check's key metric, ``—`` when it has none."""
    key = key_metric(check)
    if key is None:
        return Text("—", "dim")
    value = Text(format_value(key.value), {True: "green", False: "red", None: ""}.get(key.within, ""))
    if key.threshold is None:
        return Text.assemble(printable(key.label), " ", value)
    return Text.assemble(printable(key.label), " ", value, " (", format_threshold(key.name, key.threshold), ")")


def _status_text(status: str) -> Text:  # a status as shown_status gives it
    return Text(f"{STATUS_MARK.get(status, status.upper()):<5}", STATUS_STYLE.get(status, ""))


def check_line(
    check: CheckResult,
    index: int | None = None,
    total: int | None = None,
    elapsed: float | None = None,
    require: list[str] | tuple[str, ...] = (),
) -> Text:
    """One line for a finished check, e.g.
    ``[ 4/31] PASS  error.out  normalized_error 0.645 (≤ 2)  0.28 s  (run 4.1 s)``: its position among the
    selected checks, status, name, key metric, its own duration (work shared with earlier checks is not
    counted again) and, given `elapsed`, the seconds since the run started."""
    parts: list[str | Text] = []
    if index is not None:
        width = len(str(total)) if total else 1
        parts.append(f"[{index:>{width}}/{total}] " if total else f"[{index}] ")
    parts += [
        _status_text(shown_status(check, require)),
        " ",
        f"{printable(check.name):<{NAME_WIDTH}}",
        " ",
        _key_text(check),
        f"  {check.duration_s:.2f} s",
    ]
    if elapsed is not None:
        parts.append(f"  (run {elapsed:.1f} s)")
    return Text.assemble(*parts)


#: Longest silence of a plain log while a check runs: past it, `Heartbeat` prints a line.
HEARTBEAT_S = 30.0


class Heartbeat:
    """``still running`` lines for a plain log (see `is_plain`) while a long check runs.

    Feed it the run's progress events (``update``: anything with ``check``, ``index``, ``total`` and
    ``fraction``, such as `flamia_verify.properties.ProgressEvent`); a new check index counts as a
    printed line (its predecessor's line was printed as it finished). Inside ``with heartbeat:`` a
    daemon thread calls `poll` every second or so; `poll` prints, when `interval` seconds have passed
    since the last line, e.g.::

        [12/41] ...   bound.shapes                       still running: 30 s in this check, 45% done  (run 96.1 s)
    """

    def __init__(
        self, console: Console, *, interval: float | None = None, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.console = console
        self.interval = HEARTBEAT_S if interval is None else float(interval)
        self.clock = clock
        self._started = clock()
        self._last_line = self._started
        self._check_started = self._started
        self._event: Any = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def update(self, event: Any) -> None:
        """Note where the run stands; a new check resets the silence (its predecessor's line printed)."""
        with self._lock:
            now = self.clock()
            if self._event is None or getattr(event, "index", 0) != getattr(self._event, "index", 0):
                self._last_line = self._check_started = now
            self._event = event

    def printed(self) -> None:
        """A line was just printed."""
        with self._lock:
            self._last_line = self.clock()

    def poll(self) -> bool:
        """Print a ``still running`` line if the log has been silent for `interval` seconds."""
        with self._lock:
            now = self.clock()
            event = self._event
            if event is None or now - self._last_line < self.interval:
                return False
            self._last_line = now
            index, total = getattr(event, "index", 0) + 1, getattr(event, "total", None)
            width = len(str(total)) if total else 1
            fraction = getattr(event, "fraction", None)
            done = f", {100 * fraction:.0f}% done" if fraction else ""
            line = (f"[{index:>{width}}/{total}] ...   " if total else "... ") + (
                f"{printable(getattr(event, 'check', '') or ''):<{NAME_WIDTH}} still running: "
                f"{now - self._check_started:.0f} s in this check{done}  (run {now - self._started:.1f} s)"
            )
        _print_line(self.console, line)
        return True

    def _run(self) -> None:
        tick = min(1.0, self.interval / 4)
        while not self._stop.wait(tick):
            self.poll()

    def __enter__(self) -> Heartbeat:
        with self._lock:
            self._started = self._last_line = self._check_started = self.clock()
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="flamia-verify-heartbeat", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None


def _print_line(console: Console, text: Text | str) -> None:
    """Print one line that is never wrapped, cropped or read as markup."""
    console.print(text if isinstance(text, Text) else Text(text), soft_wrap=True, overflow="ignore", crop=False)


def print_table(
    console: Console, title: str, columns: list[str], rows: list[list[str]], *, plain: bool | None = None
) -> None:
    """A table: rich on a terminal; plain, aligned, full-width lines otherwise (`plain` overrides)."""
    plain = is_plain(console) if plain is None else plain
    cells = [[printable(c) for c in row] for row in rows]
    if not plain:
        from rich.table import Table

        table = Table(title=title)
        for column in columns:
            table.add_column(column)
        for row in cells:
            table.add_row(*(Text(c) for c in row))
        console.print(table)
        return
    widths = [max([len(column)] + [len(row[i]) for row in cells]) for i, column in enumerate(columns)]

    def line(values: list[str]) -> str:
        padded = [v.ljust(w) for v, w in zip(values[:-1], widths[:-1])] + [values[-1]]
        return "  ".join(padded).rstrip()

    _print_line(console, printable(title))
    _print_line(console, line(columns))
    for row in cells:
        _print_line(console, line(row))
    _print_line(console, "")


def _render_plain(report: Report, console: Console) -> None:
    _print_line(
        console,
        f"flamia-verify  kernel {printable(report.kernel)}  recipe {printable(report.recipe)}  "
        f"suite {printable(report.suite)}  seed {report.seed}",
    )
    for check in report.checks:
        line = Text.assemble(
            _status_text(shown_status(check, report.require)),
            " ",
            f"{printable(check.name):<{NAME_WIDTH}}",
            " ",
            _key_text(check),
        )
        if check.message:
            line.append("  " + printable(check.message))
        _print_line(console, line)
    _print_verdict(report, console)


def _print_verdict(report: Report, console: Console, plain: bool = True) -> None:
    word = verdict(report)
    _print_line(
        console, Text.assemble((word, "bold green" if word == "PASS" else "bold red"), "  ", counts_line(report))
    )
    for status, label in (("fail", "failed: "), ("error", "errored: "), ("finding", "findings (not gating): ")):
        names = [c.name for c in report.checks if shown_status(c, report.require) == status]
        if names:
            _print_line(console, Text.assemble((label, "dim"), printable(", ".join(names))))
    line = verdicts_line(report)
    if line:  # each verdict's status: what gates, and what is reported beside it
        _print_line(console, Text.assemble(("verdicts: ", "dim"), printable(line)))

    # the long lines below wrap at the console's width on a terminal; a log keeps each on one line
    def long_line(text: Text) -> None:
        if plain:
            _print_line(console, text)
        else:
            console.print(text)

    seeds = case_seeds_line(report)
    if seeds:  # the worst cases' own seeds: what rebuilds each (the run seed re-runs them all)
        long_line(Text(printable(seeds), "dim"))
    for note in run_notes(report):
        _print_line(console, Text(printable(note), "bold yellow"))
    heading = overrides_heading(report)
    if heading:  # a loosened (or tightened) gate is part of the verdict: never only a cell of the table
        long_line(Text(printable(heading), "bold yellow"))
        for entry in report.threshold_overrides:
            long_line(Text("  " + printable(override_line(entry)), "yellow"))


def render_terminal(report: Report, console: Console | None = None, *, plain: bool = False) -> None:
    """Print the summary table and the verdict of `report` to `console` (a new stdout console if None).

    On a console at least `WIDE_CONSOLE` columns wide the table has a Message column; on a narrower one the
    value and threshold share a column and the messages follow the table, one line per check. With `plain`
    (for logs: see `is_plain`) one unwrapped line per check, ``STATUS name key-metric message``, instead.
    """
    console = console or Console()
    if plain:
        _render_plain(report, console)
        return
    wide = console.width >= WIDE_CONSOLE
    title = Text.assemble(
        "flamia-verify  ",
        ("kernel ", "dim"),
        printable(report.kernel),
        ("  recipe ", "dim"),
        printable(report.recipe),
        ("  suite ", "dim"),
        printable(report.suite),
        ("  seed ", "dim"),
        str(report.seed),
    )
    table = Table(
        title=title,
        title_justify="left",
        expand=False,
        show_lines=False,
        header_style="bold",
        box=box.HEAVY_HEAD if wide else box.SIMPLE_HEAD,
        pad_edge=wide,
    )
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
            value_style = {True: "green", False: "red", None: ""}.get(key.within, "")
            value = Text(format_value(key.value), value_style)
            threshold = Text(format_threshold(key.name, key.threshold), "" if key.threshold is not None else "dim")
        name = Text(printable(check.name))
        shown = shown_status(check, report.require)
        status = Text(STATUS_MARK.get(shown, shown.upper()), STATUS_STYLE.get(shown, ""))
        if wide:
            table.add_row(name, status, label, value, threshold, Text(printable(check.message or "")))
        else:
            both = value if key is None or key.threshold is None else Text.assemble(value, " (", threshold, ")")
            table.add_row(name, status, label, both)
    console.print(table)
    if not wide:
        for check in report.checks:
            if check.message:
                console.print(
                    Text.assemble(
                        (printable(check.name), STATUS_STYLE.get(shown_status(check, report.require), "")),
                        ": ",
                        printable(check.message),
                    )
                )
    _print_verdict(report, console, plain=False)
