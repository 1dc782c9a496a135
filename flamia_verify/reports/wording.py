"""Shared wording of every renderer: the verdict, the count line, the status markers, the reproducer.

Keeping these in one place makes the terminal, Markdown, HTML and JUnit reports say the same thing.
"""

from __future__ import annotations

import shlex
from typing import Any

from flamia_verify.reports.metrics import format_value
from flamia_verify.reports.text import printable
from flamia_verify.results import API_SOURCE, VERDICTS, CheckResult, Report, run_notes
from flamia_verify.settings import CLI_DTYPES, SUITES

__all__ = [
    "STATUS_MARK",
    "VERDICT_WORDS",
    "printable",
    "shown_status",
    "verdicts_line",
    "case_seed",
    "case_seeds_line",
    "counts_line",
    "override_line",
    "overrides_heading",
    "rerun_command",
    "run_line",
    "run_notes",
    "verdict",
]

#: Emoji-free markers of a check's status, for every renderer. ``finding``: a check of a verdict that does
#: not gate this run (reproducibility, robustness, unless required) failed or errored: reported, not gating.
STATUS_MARK = {"pass": "PASS", "fail": "FAIL", "error": "ERROR", "skip": "SKIP", "finding": "FINDING"}
#: what each verdict is about, in a few words, for the verdict lines of every renderer
VERDICT_WORDS = {
    "gating": "accuracy, information flow, convention",
    "reproducibility": "bitwise under repeated runs and other layouts",
    "robustness": "inputs no training run produces",
}


def shown_status(check: CheckResult, require: list[str] | tuple[str, ...] = ()) -> str:
    """The status a renderer shows: the check's own, except ``finding`` for a failed or errored check of a
    verdict that does not gate (neither ``gating`` nor in ``require``)."""
    gates = check.verdict == "gating" or check.verdict in require
    if check.status in ("fail", "error") and not gates:
        return "finding"
    return check.status


def verdicts_line(report: Report) -> str:
    """Each verdict's status, e.g. ``gating PASS · reproducibility FINDINGS (not gating): determinism.repeat ·
    robustness PASS`` ("" when every check is gating, as in a report written before verdicts existed)."""
    table = report.verdicts()
    if set(table) <= {"gating"}:
        return ""
    parts = []
    for name in VERDICTS:
        row = table.get(name)
        if row is None:
            continue
        bad = row["failed"] + row["errored"]
        if row["status"] == "pass":
            word = "PASS"
        elif row["status"] == "incomplete":
            word = "INCOMPLETE"
        else:
            word = "FAIL" if row["gates"] else "FINDINGS (not gating)"
        text = f"{name} {word}"
        if bad:
            text += ": " + ", ".join(bad)
        elif name != "gating" and not row["gates"]:
            text += " (not gating)"
        parts.append(text)
    return " · ".join(parts)


def verdict(report: Report) -> str:
    """``INCOMPLETE`` for a run that did not finish; else ``PASS`` when no check that gates failed or
    errored (skips do not fail a run; findings of a verdict not required do not either), else ``FAIL``."""
    if not getattr(report, "complete", True):
        return "INCOMPLETE"
    return "PASS" if report.passed else "FAIL"


def counts_line(report: Report) -> str:
    """E.g. ``12 checks: 8 passed, 1 failed, 1 error, 1 finding (not gating), 1 skipped`` (zero counts
    left out; a finding is a failed or errored check of a verdict that does not gate the run)."""
    counts = dict.fromkeys(STATUS_MARK, 0)
    for check in report.checks:
        counts[shown_status(check, report.require)] += 1
    total = len(report.checks)
    if total == 0:
        return "no checks ran"
    words = (
        ("pass", "passed"),
        ("fail", "failed"),
        ("error", "error" if counts["error"] == 1 else "errors"),
        ("finding", ("finding" if counts["finding"] == 1 else "findings") + " (not gating)"),
        ("skip", "skipped"),
    )
    parts = [f"{counts[status]} {word}" for status, word in words if counts[status]]
    return f"{total} check{'s' if total != 1 else ''}: " + ", ".join(parts)


def run_line(report: Report) -> str:
    """Where the run happened, which implementation of a built-in kernel ran and the state a kernel
    declares, e.g. "cuda (NVIDIA H200) · ran fused Triton (255 calls), PyTorch emulation (6 calls)" or
    "... · state: delayed scaling, amax history of 16 calls, margin 1, one state per instance (a factory:
    one instance per layer)" ("" when nothing is recorded)."""
    env = report.environment or {}
    parts = []
    device, name = env.get("device"), env.get("device_name")
    if device or name:
        parts.append(f"{device} ({name})" if device and name else str(device or name))
    paths = env.get("kernel_paths")
    if isinstance(paths, dict) and paths:
        parts.append("ran " + ", ".join(f"{name} ({n} call{'s' if n != 1 else ''})" for name, n in paths.items()))
    state = env.get("kernel_state")
    if isinstance(state, dict) and (state.get("declared") or state.get("factory")):
        parts.append(
            f"state: {state.get('description')}"
            + (" (a factory: one instance per layer)" if state.get("factory") else "")
        )
    return " · ".join(parts)


def case_seed(report: Report, check: CheckResult) -> Any:
    """The seed of the check's worst case, the one that rebuilds it: the seed of the case it records
    (``worst_case["case"]["seed"]``: ``Case.from_dict(worst_case["case"])`` and ``make_inputs`` rebuild
    its tensors), else its own ``worst_case["seed"]`` (a fuzz reproducer, whose case fields are at its
    top level), else None: a worst case that records no case has no case seed. Never the run's seed,
    which every case seed is derived from but which rebuilds no case by itself."""
    worst = check.worst_case or {}
    case = worst.get("case")
    if isinstance(case, dict) and "seed" in case:
        return case["seed"]
    return worst.get("seed")


def case_seeds_line(report: Report) -> str:
    """E.g. ``worst cases: causal.forward case seed 11, error.out case seed 1000 (run seed 0; each
    case in report.json)``: the case seed of every failed or errored check that records one ("" when
    none does)."""
    seeds = [
        f"{c.name} case seed {case_seed(report, c)}"
        for c in report.checks
        if c.status in ("fail", "error") and case_seed(report, c) is not None
    ]
    if not seeds:
        return ""
    return f"worst cases: {', '.join(seeds)} (run seed {report.seed}; each case in report.json)"


def override_line(entry: dict[str, Any]) -> str:
    """One threshold override as text, e.g. ``error.out normalized_error = inf (default 2) from
    pyproject.toml``."""
    return (
        f"{entry.get('scope')} {entry.get('key')} = {format_value(entry.get('value'))} "
        f"(default {format_value(entry.get('default'))}) from {entry.get('source') or 'an unknown source'}"
    )


def overrides_heading(report: Report) -> str:
    """The sentence above the list of overrides ("" when the run used every default)."""
    n = len(report.threshold_overrides or [])
    if not n:
        return ""
    return (
        f"{n} threshold override{'s' if n != 1 else ''}: the checks were judged against "
        f"{'these values' if n != 1 else 'this value'}, not the defaults"
    )


def _config_source(report: Report) -> str | None:
    """The config file the run's overrides came from (None: no override, or only from the Python API)."""
    for entry in report.threshold_overrides or []:
        source = entry.get("source")
        if isinstance(source, str) and source and source != API_SOURCE:
            return source
    return None


def rerun_command(report: Report, check: CheckResult) -> str | None:
    """The command that re-runs the check's family with the run's kernel, recipe, suite, seed and input
    dtype (and the config file its threshold overrides came from, whose suite settings shape the
    cases), or None when the report does not come from a `flamia-verify check` suite.

    Arguments are quoted for a POSIX shell. The check engine derives each case from the run seed
    (``--seed`` takes the run seed, never a case seed), so the same command draws the same cases again,
    the worst case among them; ``worst_case`` pins the single worst one and its case seed.
    """
    if report.suite not in SUITES:  # a report of another suite (a fuzz run) gets no rerun command
        return None
    args = [
        "flamia-verify",
        "check",
        "--kernel",
        report.kernel,
        "--recipe",
        report.recipe,
        "--suite",
        report.suite,
        "--seed",
        str(report.seed),
    ]
    dtype = (report.environment or {}).get("dtype")
    if dtype in CLI_DTYPES:  # a run of another dtype (fp32 from the Python API) has no --dtype for it
        args += ["--dtype", dtype]
    config = _config_source(report)
    if config is not None:
        args += ["--config", config]
    inputs = (report.environment or {}).get("inputs")
    if inputs:  # a run on a capture: the same calls, the same check
        args += ["--inputs", str(inputs), "--only", check.name]
    else:
        args += ["--only", check.family]
    return " ".join(shlex.quote(a) for a in args)


def shown_environment(report: Report) -> list[tuple[str, Any]]:
    """The environment entries a rendered report shows: those with a value (no CUDA version on a CPU
    machine, no backward_reason when the backward works; the kernel's state as one line); report.json
    keeps every entry."""
    out = []
    for k, v in (report.environment or {}).items():
        if k == "kernel_state" and isinstance(v, dict):
            v = f"{v.get('description')}{'; a factory (one instance per layer)' if v.get('factory') else ''}"
        if v is not None and v != "":
            out.append((k, v))
    return out


def call_table(check: CheckResult) -> tuple[list[str], list[list[str]]] | None:
    """A check on a capture: (column names, one row of printable cells per captured call) from its
    ``details["calls"]``, or None for any other check."""
    calls = (check.details or {}).get("calls")
    if not isinstance(calls, list) or not calls or not all(isinstance(r, dict) for r in calls):
        return None
    columns: list[str] = []
    for row in calls:
        columns += [k for k in row if k not in columns]

    def cell(value: Any) -> str:
        if isinstance(value, float):
            return f"{value:.4g}"
        return printable(value)

    return columns, [[cell(row.get(c, "")) for c in columns] for row in calls]
