"""The regression gate behind `flamia-verify compare BASE.json NEW.json`.

A check present in both reports regresses when

- its status got worse: it passed or was skipped in BASE and now fails or errors; or
- one of its thresholded metrics got worse in a way a reviewer cares about (the metric rule below);

and the check gates the NEW run (its verdict is gating, or one the new run required: a reproducibility
or robustness check that got worse in a run that does not require it is a status note, not a
regression, as it does not fail the run either).

Which metrics are compared, and which way is worse, is decided by ``higher_is_worse(check, metric)``,
called with the NEW report's `CheckResult` and a metric name present in both reports. It returns True
(higher is worse), False (lower is worse) or None (not compared). The default,
`default_higher_is_worse`, compares only the metrics named in the check's thresholds (the ones the check
gates on; other metrics are informational) and uses the direction rule of
`flamia_verify.reports.metrics`: names ending in ``_min`` or starting with ``sqnr``/``cos`` are
higher-is-better, all others lower-is-better. Pass your own callable to compare more metrics or to flip
a direction.

Every comparison is made on a *badness* that grows as the metric gets worse and is 0 for a perfect
value, so that ratios and shares mean the same thing on every scale:

- higher-is-worse: ``|value|`` (errors, ratios to BF16, counts, leaks);
- lower-is-worse, name starting with ``cos``: ``1 - value`` (distance of a cosine similarity from 1);
- lower-is-worse, name starting with ``sqnr`` or ending in ``_db``: ``10 ** (-value / 10)``, the noise
  power of a ratio in decibels (factor 1.5 is a drop of 1.76 dB);
- other lower-is-worse: ``1 / value`` (0 or below counts as infinitely bad).

NaN counts as infinitely bad. The metric rule, with b0, b1 the badness in BASE and NEW and bL the
badness of the NEW report's threshold (the metric's *headroom*: the distance from a perfect value to
the limit):

1. worse by the factor: ``b1 > factor * b0`` (so a metric that was exactly 0 can regress on any
   non-zero value); and
2. a meaningful share of the headroom: ``b1 - b0 >= HEADROOM_SHARE * bL`` (one half). Most defaults
   allow about twice what a correct kernel is expected to reach (the error thresholds are twice the
   rounding model's prediction, the gain threshold sits between rounding to nearest and truncation),
   so half the headroom is the allowance of the derivation itself; a change smaller than that is a
   move inside the band where correct kernels live, however large its ratio (1e-4 -> 1e-3 against a
   limit of 1.6e-2 is 10x, and 6% of the headroom). A threshold of 0 (leaks, violations) has no
   headroom: any increase passes this part; an infinite threshold (switched off) never does; and
3. beyond the statistic's own noise, where the report carries it: bias.gain reports a z-score
   ``gain_z_T`` beside ``gain_error_T``, so the gain's standard error under unbiased rounding is
   ``|gain| / |z|``, and ``gain_se_T``, its standard error over the cases it pools (the gain of a
   kernel moves from one input to another: per-tensor scaling's dK gain measured -0.0004 on seed 0
   and -0.0146 on seed 1, with case-level standard errors 0.0044 and 0.0033); the larger one counts,
   and the change must exceed ``NOISE_Z`` (6, the bias checks' significance level) standard errors
   of the difference ``sqrt(se0^2 + se1^2)``.

A metric past its threshold in both reports has no headroom left: the check fails in both and the check
command itself exits 1 on it; its changes either way are listed as notes and do not gate. A metric
without a numeric threshold (compared through a custom ``higher_is_worse``) has no headroom and is
judged by the factor alone. An improvement is the mirror image (``b0 > factor * b1`` and
``b0 - b1 >= HEADROOM_SHARE * bL``); improvements never gate.

Status changes that neither fail nor fix a check (pass -> skip, fail -> error, ...) are listed as notes.
Checks only in one report are listed as new or removed, and two of them gate, because a gate must not
pass by losing coverage: a check that passed (or skipped) in the baseline and is missing from the new
report regresses to ``missing`` (``allow_missing=True``, ``--allow-missing`` on the command line, turns
that off for a deliberately narrower run), and a check new in the new report that fails or errors
regresses from ``absent``. The comparison
also notes when kernel, recipe, suite or seed differ, because the metrics then come from other cases,
and every threshold override that only one of the runs had (its verdicts were judged against other
limits).
``Comparison.exit_code`` is 1 when there is any regression, else 0.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from flamia_verify.reports.metrics import as_number, format_value, higher_is_better
from flamia_verify.reports.wording import STATUS_MARK, override_line, printable
from flamia_verify.results import CheckResult, Report
from flamia_verify.settings import compare_factor

__all__ = [
    "DEFAULT_FACTOR",
    "HEADROOM_SHARE",
    "NOISE_Z",
    "Change",
    "Comparison",
    "compare_reports",
    "default_higher_is_worse",
    "metric_badness",
    "render_comparison",
]

#: Default tolerance of `compare_reports`: run-to-run noise of sampled error metrics stays well inside 1.5x.
DEFAULT_FACTOR = 1.5

#: A metric change gates only when it spends at least this share of the headroom between a perfect value
#: and the threshold (module docstring: most defaults allow twice what correct kernels are expected to
#: reach, so a change inside half the headroom stays inside the band the derivation grants them).
HEADROOM_SHARE = 0.5

#: Standard errors a change must exceed where the report carries the statistic's noise (bias.gain's
#: z-scores): the bias checks' significance level (flamia_verify.properties.thresholds.BIAS_Z).
NOISE_Z = 6.0

HigherIsWorse = Callable[[CheckResult, str], "bool | None"]

_GOOD = ("pass", "skip")
_BAD = ("fail", "error")


def default_higher_is_worse(check: CheckResult, metric: str) -> bool | None:
    """Compare only thresholded metrics; ``_min``/``sqnr*``/``cos*`` are higher-is-better, the rest lower."""
    if metric not in (check.thresholds or {}):
        return None
    return not higher_is_better(metric)


def metric_badness(metric: str, value: Any, higher_is_worse: bool) -> float | None:
    """How bad `value` is on a scale where bigger is worse (see the module docstring); None if not a number."""
    v = as_number(value)
    if v is None:
        return None
    if math.isnan(v):
        return math.inf
    if higher_is_worse:
        return abs(v)
    name = metric.lower()
    if name.startswith("cos"):
        return max(0.0, 1.0 - v)
    if name.startswith("sqnr") or name.endswith("_db"):
        return math.inf if v == -math.inf else 10.0 ** (-v / 10.0)
    return 1.0 / v if v > 0 else math.inf


def standard_error(check: CheckResult, metric: str) -> float | None:
    """The standard error of `metric` under its null hypothesis when the check reports it, else None.

    bias.gain reports ``gain_z_T`` (the gain's z-score under unbiased rounding) beside ``gain_error_T``
    (the gain's magnitude), so the row-level standard error is ``gain_error_T / |gain_z_T|``; and
    ``gain_se_T``, the standard error from the gain's spread over the cases it pools (how much it
    moves from one input to another). The larger of the two is the noise of the estimate.
    """
    if not metric.startswith("gain_error_"):
        return None
    tensor = metric[len("gain_error_") :]
    metrics = check.metrics or {}
    z, g = as_number(metrics.get("gain_z_" + tensor)), as_number(metrics.get(metric))
    found = []
    if z is not None and g is not None and math.isfinite(z) and math.isfinite(g) and z != 0 and g != 0:
        found.append(abs(g) / abs(z))
    se_cases = as_number(metrics.get("gain_se_" + tensor))
    if se_cases is not None and math.isfinite(se_cases) and se_cases > 0:
        found.append(se_cases)
    return max(found) if found else None


def _ratio(worse: float, better: float) -> float:
    """How many times `worse` exceeds `better` (both badness values, >= 0)."""
    if worse == better:
        return 1.0
    if better == 0.0 or math.isinf(worse):
        return math.inf
    return worse / better


@dataclass(frozen=True)
class Change:
    """One difference between two reports: a status change or a metric change of one check."""

    check: str
    kind: str  # "status" or "metric"
    base: Any
    new: Any
    metric: str | None = None
    times: float | None = None  # metric changes: how many times worse or better, by badness
    higher_is_worse: bool | None = None
    worse: bool = False  # True when it got worse (a regression, or a note on a metric past its limit)
    limit: Any = None  # metric changes: the NEW report's threshold of the metric, if any
    headroom: float | None = None  # |b1 - b0| / bL: the share of the threshold's headroom spent or won

    def change_text(self) -> str:
        """E.g. ``4.6x worse (lower is better)``; empty for a status change."""
        if self.kind == "status":
            return ""
        direction = "lower is better" if self.higher_is_worse else "higher is better"
        word = "worse" if self.worse else "better"
        if self.times is None or math.isinf(self.times):
            # The better side had zero badness (e.g. a leak of exactly 0) or the worse side is NaN/inf.
            text = f"{word}, no finite ratio ({direction})"
        else:
            text = f"{self.times:.3g}x {word} ({direction})"
        if self.headroom is not None and math.isfinite(self.headroom):
            text += f", {100 * self.headroom:.0f}% of the headroom to {format_value(self.limit)}"
        return text

    def describe(self) -> str:
        """One readable line, e.g. ``error.backward: rel_err_dK 2.1 -> 9.7, 4.6x worse (lower is better)``."""
        if self.kind == "status":
            return f"{self.check}: {STATUS_MARK.get(self.base, self.base)} -> {STATUS_MARK.get(self.new, self.new)}"
        return (
            f"{self.check}: {self.metric} {format_value(self.base)} -> {format_value(self.new)}, {self.change_text()}"
        )


@dataclass
class Comparison:
    """What changed from `base` to `new`; `exit_code` is the gate (1 on any regression)."""

    base: Report = field(repr=False)
    new: Report = field(repr=False)
    factor: float
    regressions: list[Change] = field(default_factory=list)
    improvements: list[Change] = field(default_factory=list)
    status_notes: list[Change] = field(default_factory=list)  # status changes that neither fail nor fix
    past_limit: list[Change] = field(default_factory=list)  # metric changes past the limit in both reports
    new_checks: list[str] = field(default_factory=list)
    removed_checks: list[str] = field(default_factory=list)
    context_notes: list[str] = field(default_factory=list)  # kernel/recipe/suite/seed differences
    #: differences that change no case (the same kernel file spelled another way)
    spelling_notes: list[str] = field(default_factory=list)

    @property
    def regressed(self) -> bool:
        return bool(self.regressions)

    @property
    def exit_code(self) -> int:
        return 1 if self.regressions else 0


def _same_kernel_file(a: str, b: str) -> bool:
    """Whether two kernel specs name the same function of the same .py file, spelled differently
    (``./k.py:attn``, ``k.py:attn``, ``dir/../k.py:attn``; an absolute path and a relative one of the
    same file name): the runs then checked the same kernel on the same cases."""
    (pa, _, fa), (pb, _, fb) = a.rpartition(":"), b.rpartition(":")
    if not (pa.endswith(".py") and pb.endswith(".py")) or fa != fb:
        return False
    na, nb = os.path.normpath(pa), os.path.normpath(pb)
    if na == nb:
        return True
    return os.path.basename(na) == os.path.basename(nb) and (
        os.path.isabs(na) != os.path.isabs(nb) or na.endswith(nb) or nb.endswith(na)
    )


def compare_reports(
    base: Report,
    new: Report,
    *,
    factor: float = DEFAULT_FACTOR,
    higher_is_worse: HigherIsWorse | None = None,
    allow_missing: bool = False,
) -> Comparison:
    """Compare `new` against the baseline `base` (rules in the module docstring)."""
    factor = compare_factor(factor)
    direction = higher_is_worse or default_higher_is_worse
    cmp = Comparison(base=base, new=new, factor=float(factor))

    for label, a, b in (
        ("kernel", base.kernel, new.kernel),
        ("recipe", base.recipe, new.recipe),
        ("suite", base.suite, new.suite),
        ("seed", base.seed, new.seed),
        # a run on a capture (check --inputs): the captured calls are the cases
        ("capture", (base.environment or {}).get("capture_sha256"), (new.environment or {}).get("capture_sha256")),
    ):
        if a != b and label == "kernel" and _same_kernel_file(str(a), str(b)):
            cmp.spelling_notes.append(f"kernel spelled {a!r} in base, {b!r} in new: the same file and function")
        elif a != b:
            cmp.context_notes.append(f"{label} differs: {a!r} in base, {b!r} in new")

    # a gate loosened (or tightened) in one run only: its verdicts were judged against other limits
    def setting(entry: dict[str, Any]) -> tuple[str, str, str]:  # what was set, wherever it was read from
        return str(entry.get("scope")), str(entry.get("key")), format_value(entry.get("value"))

    for which, ours, theirs in (("new", new, base), ("base", base, new)):
        others = {setting(e) for e in theirs.threshold_overrides or []}
        for entry in ours.threshold_overrides or []:
            if setting(entry) not in others:
                cmp.context_notes.append(f"threshold override only in {which}: {override_line(entry)}")

    # a run that did not finish is never a green gate, whatever it did finish (and --allow-missing
    # does not excuse it: its missing checks were not deselected, they never ran)
    if not new.complete:
        cmp.regressions.append(Change("run.complete", "status", "complete", "incomplete", worse=True))
    if not base.complete:
        cmp.context_notes.append(f"the baseline run is incomplete: {base.incomplete_reason or 'it did not finish'}")

    base_checks = {c.name: c for c in base.checks}
    new_checks = {c.name: c for c in new.checks}
    cmp.new_checks = [n for n in new_checks if n not in base_checks]
    cmp.removed_checks = [n for n in base_checks if n not in new_checks]
    if not allow_missing:
        for name in cmp.removed_checks:
            if base_checks[name].status in _GOOD:
                cmp.regressions.append(Change(name, "status", base_checks[name].status, "missing", worse=True))
    for name in cmp.new_checks:
        if new_checks[name].status in _BAD:
            change = Change(name, "status", "absent", new_checks[name].status, worse=new.gates(new_checks[name]))
            (cmp.regressions if change.worse else cmp.status_notes).append(change)

    for name, after in new_checks.items():
        before = base_checks.get(name)
        if before is None:
            continue
        # a check of a verdict the new run does not gate on (reproducibility, robustness unless required):
        # its changes are reported as notes, never as regressions
        gates = new.gates(after)
        if before.status != after.status:
            regressed = gates and before.status in _GOOD and after.status in _BAD
            change = Change(name, "status", before.status, after.status, worse=regressed)
            if regressed:
                cmp.regressions.append(change)
            elif before.status in _BAD and after.status == "pass":
                cmp.improvements.append(change)
            else:
                cmp.status_notes.append(change)
        for metric in after.metrics or {}:
            if metric not in (before.metrics or {}):
                continue
            worse_if_higher = direction(after, metric)
            if worse_if_higher is None:
                continue
            moved = _metric_change(name, metric, before, after, bool(worse_if_higher), cmp.factor)
            if moved is None:
                continue
            if all(
                _past_limit(metric, v, moved.limit, bool(worse_if_higher))
                for v in (before.metrics[metric], after.metrics[metric])
            ):
                cmp.past_limit.append(moved)
            elif moved.worse and gates:
                cmp.regressions.append(moved)
            elif moved.worse:
                continue  # a metric of a check that does not gate this run
            else:
                cmp.improvements.append(moved)
    return cmp


def _past_limit(metric: str, value: Any, limit: Any, worse_if_higher: bool) -> bool:
    """Whether `value` already breaks `limit` (a numeric threshold) in the metric's direction."""
    v, t = metric_badness(metric, value, worse_if_higher), metric_badness(metric, limit, worse_if_higher)
    return v is not None and t is not None and v > t


def _metric_change(
    name: str, metric: str, before: CheckResult, after: CheckResult, worse_if_higher: bool, factor: float
) -> Change | None:
    """The change of one metric when it passes the metric rule (module docstring) either way, else None."""
    b0 = metric_badness(metric, before.metrics[metric], worse_if_higher)
    b1 = metric_badness(metric, after.metrics[metric], worse_if_higher)
    if b0 is None or b1 is None or b0 == b1:
        return None
    worse = b1 > b0
    hi, lo = (b1, b0) if worse else (b0, b1)
    times = _ratio(hi, lo)
    if not times > factor:
        return None
    limit = (after.thresholds or {}).get(metric)
    bl = metric_badness(metric, limit, worse_if_higher) if limit is not None else None
    headroom = None
    if bl is not None:
        if math.isinf(bl):  # a threshold switched off: no change can matter
            return None
        spent = hi - lo
        if bl > 0:
            headroom = spent / bl if math.isfinite(spent) else math.inf
            if headroom < HEADROOM_SHARE:
                return None
        se0, se1 = standard_error(before, metric), standard_error(after, metric)
        known = [se for se in (se0, se1) if se is not None]
        if known and math.isfinite(spent):
            # the difference of two estimates, each with its standard error (one known: used for both)
            se = math.sqrt((se0 if se0 is not None else known[0]) ** 2 + (se1 if se1 is not None else known[0]) ** 2)
            if spent <= NOISE_Z * se:
                return None
    else:
        limit = None
    return Change(
        name,
        "metric",
        before.metrics[metric],
        after.metrics[metric],
        metric,
        times,
        worse_if_higher,
        worse=worse,
        limit=limit,
        headroom=headroom,
    )


def _run_label(report: Report) -> Text:
    return Text.assemble(
        printable(report.kernel), (printable(f" ({report.recipe}, {report.suite}, seed {report.seed})"), "dim")
    )


def _changes_table(title: str, changes: list[Change], style: str) -> Table:
    table = Table(title=Text(title, style), title_justify="left", header_style="bold")
    table.add_column("Check", no_wrap=True)
    table.add_column("What", overflow="fold")
    table.add_column("Base", justify="right", no_wrap=True)
    table.add_column("New", justify="right", no_wrap=True)
    table.add_column("Change", overflow="fold")
    for c in changes:
        if c.kind == "status":
            table.add_row(
                Text(printable(c.check)),
                Text("status"),
                Text(STATUS_MARK.get(c.base, str(c.base))),
                Text(STATUS_MARK.get(c.new, str(c.new)), style),
                Text(""),
            )
        else:
            table.add_row(
                Text(printable(c.check)),
                Text(printable(c.metric or "")),
                Text(format_value(c.base)),
                Text(format_value(c.new), style),
                Text(c.change_text()),
            )
    return table


def _rule(cmp: Comparison) -> str:
    return f"metric factor {cmp.factor:g}, headroom share {HEADROOM_SHARE:g}"


def render_comparison(cmp: Comparison, console: Console | None = None, *, plain: bool | None = None) -> None:
    """Print the comparison: context, regressions, improvements, other changes, and the gate's verdict.

    ``plain`` (default: the console is not an interactive terminal, e.g. a CI log): regressions and
    improvements as one unwrapped line each (``regression: <check>: <metric> a -> b, ...``) instead
    of a table whose narrow columns would break names mid-word."""
    from flamia_verify.reports.terminal import is_plain

    console = console or Console()
    if plain is None:
        plain = is_plain(console)

    def say(text: Text | str) -> None:  # off a terminal: one unwrapped line, whatever the console's width
        console.print(text, soft_wrap=plain)

    say(Text.assemble(("base ", "dim"), _run_label(cmp.base), ("  ->  new ", "dim"), _run_label(cmp.new)))
    for note in cmp.context_notes:
        say(Text.assemble(("note: ", "yellow"), printable(note), ("; metrics come from different cases", "dim")))
    for note in cmp.spelling_notes:
        say(Text.assemble(("note: ", "dim"), printable(note)))
    for title, changes, style, word in (
        (f"Regressions ({len(cmp.regressions)})", cmp.regressions, "bold red", "regression"),
        (f"Improvements ({len(cmp.improvements)})", cmp.improvements, "green", "improvement"),
    ):
        if not changes:
            continue
        if plain:
            for change in changes:
                say(Text.assemble((f"{word}: ", style), printable(change.describe())))
        else:
            console.print(_changes_table(title, changes, style))  # a terminal: the table
    for change in cmp.status_notes:
        say(Text.assemble(("status change (does not gate): ", "yellow"), printable(change.describe())))
    for change in cmp.past_limit:
        say(Text.assemble(("past its limit in both reports (does not gate): ", "yellow"), printable(change.describe())))
    if cmp.new_checks:
        statuses = {c.name: c.status for c in cmp.new.checks}
        items = ", ".join(f"{n} ({STATUS_MARK.get(statuses[n], statuses[n])})" for n in cmp.new_checks)
        say(Text.assemble(("new checks: ", "cyan"), printable(items)))
    if cmp.removed_checks:
        say(Text.assemble(("removed checks: ", "yellow"), printable(", ".join(cmp.removed_checks))))
    if cmp.regressions:
        n = len(cmp.regressions)
        say(Text.assemble(("REGRESSED", "bold red"), f"  {n} regression{'s' if n != 1 else ''} ({_rule(cmp)})"))
    else:
        say(
            Text.assemble(
                ("OK", "bold green"),
                f"  no regressions ({_rule(cmp)}, "
                f"{len(cmp.improvements)} improvement{'s' if len(cmp.improvements) != 1 else ''})",
            )
        )
