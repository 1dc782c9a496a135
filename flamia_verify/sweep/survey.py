"""``flamia-verify survey``: one suite over many kernels, and one report that puts them side by side.

A survey is a sweep whose matrix is one case per kernel (same suite, dtype, seed and device), each
case also timing its kernel at one shape after its checks (on CUDA). It runs on the sweep's backends
(a local pool of one worker per GPU, or Ray), stores each kernel's result in OUT/cases/ and each
timing in OUT/speed/cases/ (the sweeps' stores: a rerun reuses what is unchanged, an interrupted
survey resumes) and writes

    OUT/survey.json   the rows (flamia_verify.reports.survey.survey_rows) and the run's settings
    OUT/survey.md     the table for a PR comment
    OUT/survey.html   the same table, sortable, with a plot of error against speed
    OUT/kernels/<name>/report.{json,md,html}, junit.xml   each kernel's full report

and nothing else: the sweeps' own pages (sweep.json, sweep.md, sweep.html and their case reports)
would repeat these.

The default kernels are every built-in design and every adapter; an adapter that cannot run on the
chosen device here (its library is not installed, it needs CUDA) gets a row that says why and is not
run. A kernel that crashes or hangs gets an ``error`` row with the reason; the survey goes on.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from flamia_verify.errors import ConfigError
from flamia_verify.results import SweepResult
from flamia_verify.settings import resolve_device
from flamia_verify.sweep.matrix import Sweep, SweepCase

__all__ = [
    "SURVEY_SCHEMA",
    "SurveyOutcome",
    "default_kernels",
    "availability",
    "run_survey",
    "survey_exit_code",
    "write_survey",
]

SURVEY_SCHEMA = "flamia-verify/survey/v1"


def default_kernels() -> list[str]:
    """Every built-in kernel (the designs, then the stateful ``fp8-delayed``), then every adapter, in
    registry order."""
    from flamia_verify.kernels import builtin_kernels
    from flamia_verify.kernels.adapters import ADAPTERS

    builtins = builtin_kernels()
    return [*builtins, *(name for name in ADAPTERS if name not in builtins)]


def availability(name: str, device: str) -> tuple[str | None, str]:
    """(None or the one-line reason ``name`` cannot run on ``device`` here, its recipe or "")."""
    from flamia_verify.kernels import builtin_kernels
    from flamia_verify.kernels.adapters import ADAPTERS
    from flamia_verify.kernels.designs import DESIGNS

    if name in DESIGNS:
        return None, DESIGNS[name].recipe.name
    builtins = builtin_kernels()
    if name in builtins:  # a built-in without a design (fp8-delayed): PyTorch, runs anywhere
        return None, builtins[name].recipe or ""
    adapter = ADAPTERS.get(name)
    if adapter is None:  # a user's spec: whether it loads is the run's business (an error row)
        return None, ""
    reason = adapter.unavailable()
    if reason is None and device == "cpu" and "CPU" not in adapter.runs_on:
        reason = f"runs on {adapter.runs_on} only"
    return reason, adapter.recipe


@dataclass
class SurveyOutcome:
    out: Path
    rows: list[dict[str, Any]]
    results: list[SweepResult]
    unavailable: list[tuple[str, str, str]] = field(default_factory=list)
    ran: int = 0
    reused: int = 0


def survey_exit_code(outcome: SurveyOutcome) -> int:
    """0 every surveyed kernel passed; 1 one failed (or did not finish); 3 none failed but one gave no
    verdict (it did not load, crashed or hung). Kernels not available here do not count."""
    statuses = {r.status for r in outcome.results}
    if statuses & {"fail", "incomplete"}:
        return 1
    if "error" in statuses:
        return 3
    return 0


def _slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("_") or "kernel"


def _write_kernel_reports(out: Path, results: Sequence[SweepResult]) -> dict[str, str]:
    """Each result's full report under OUT/kernels/<name>/; {result key: relative path of report.html}."""
    from flamia_verify.sweep.store import write_case_report

    paths: dict[str, str] = {}
    used: set[str] = set()
    for r in results:
        if r.report is None:
            continue
        slug = _slug(r.kernel)
        while slug in used:
            slug += "_"
        used.add(slug)
        paths[r.key] = write_case_report(out / "kernels" / slug, r.report).relative_to(out).as_posix()
    return paths


def run_survey(
    kernels: Sequence[str] | None,
    out: str | Path,
    *,
    suite: str = "quick",
    device: str = "auto",
    dtype: str = "bf16",
    seed: int = 0,
    only: Sequence[str] = (),
    speed: dict[str, Any] | None = None,
    backend: str = "local",
    workers: int | None = None,
    address: str | None = None,
    timeout_s: float | None = None,
    per_gpu: int = 1,
    recipe: str | None = None,
    on_start: Callable[[int, int, int], None] | None = None,
    on_result: Callable[[SweepResult, int, int], None] | None = None,
) -> SurveyOutcome:
    """Check every kernel of ``kernels`` (default :func:`default_kernels`) with one suite, then time it
    at ``speed`` (a :class:`flamia_verify.bench.SpeedShape`'s fields; None or a CPU device: no timing),
    and write the survey report into ``out``.

    Two phases on the same backend: the checks (``per_gpu`` workers share each GPU: a quick suite keeps
    a GPU busy a fraction of the time), then the timings, one worker per GPU so that a timed kernel
    has its GPU to itself. Both store their results (``out/cases``, ``out/speed/cases``): a rerun
    reuses what is unchanged. ``recipe`` is the recipe of the kernels that declare none (a user's
    ``file.py:function``; the built-ins and adapters carry their own)."""
    from flamia_verify.sweep import run_sweep

    names = list(kernels) if kernels else default_kernels()
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ConfigError(f"survey: a kernel is listed twice: {', '.join(twice)}")
    if any(not n for n in names):
        raise ConfigError("survey: an empty kernel name")
    from flamia_verify.kernels.loader import unknown_kernel_name

    for name in names:  # a typo is a usage error before anything runs, not an error row at the end
        problem = unknown_kernel_name(name)
        if problem:
            raise ConfigError(f"survey: {problem}")
    device = resolve_device(device)
    notes = []
    if device == "cpu" and speed is not None:
        speed = None
        notes.append("speed not measured: it is measured on a CUDA device only")
    cases, unavailable = [], []
    for name in names:
        reason, known_recipe = availability(name, device)
        if reason is not None:
            unavailable.append((name, known_recipe, reason))
            continue
        own = recipe if recipe and not known_recipe else None
        cases.append(
            SweepCase(kernel=name, recipe=own, suite=suite, only=tuple(only), dtype=dtype, seed=seed, device=device)
        )
    out = Path(out)
    # the survey's report is its own (survey.*, kernels/): the sweeps keep only their stores
    common: dict[str, Any] = {"backend": backend, "workers": workers, "address": address, "write_pages": False}
    outcome = run_sweep(
        Sweep(cases=tuple(cases), timeout_s=timeout_s, source="survey"),
        out,
        per_gpu=per_gpu,
        on_start=on_start,
        on_result=on_result,
        **common,
    )
    speeds: dict[str, dict[str, Any]] = {}
    if speed is not None and outcome.results:
        timed = tuple(
            SweepCase(kernel=r.kernel, device=device, speed=speed, speed_only=True)
            for r in outcome.results
            if r.report is not None
        )
        if on_start is not None:
            print(f"survey: timing {len(timed)} kernel(s), one at a time per GPU", file=sys.stderr, flush=True)
        timing = run_sweep(
            Sweep(cases=timed, timeout_s=timeout_s, source="survey speed"),
            out / "speed",
            on_start=on_start,
            on_result=on_result,
            **common,
        )
        speeds = {r.kernel: r.speed or {"error": r.error} for r in timing.results}
    results = [replace(r, speed=speeds[r.kernel]) if r.kernel in speeds else r for r in outcome.results]
    settings = {"suite": suite, "device": device, "dtype": dtype, "seed": seed, "only": list(only), "speed": speed}
    rows = write_survey(out, results, unavailable, settings, notes)
    return SurveyOutcome(out, rows, results, unavailable, ran=outcome.ran, reused=outcome.reused)


def write_survey(
    out: Path,
    results: Sequence[SweepResult],
    unavailable: Sequence[tuple[str, str, str]],
    settings: dict[str, Any],
    notes: Sequence[str] = (),
) -> list[dict[str, Any]]:
    """Write the survey report of ``results`` (sweep results, each with its ``speed`` when timed) into
    ``out``: survey.json, survey.md, survey.html and each kernel's full report; returns the rows."""
    from flamia_verify.reports.store import atomic_write_text
    from flamia_verify.reports.survey import render_survey_html, render_survey_markdown, survey_rows

    out.mkdir(parents=True, exist_ok=True)
    reports = _write_kernel_reports(out, results)
    rows = survey_rows(results, label=lambda case: str(case["kernel"]), reports=reports, unavailable=unavailable)
    title = f"flamia-verify survey: {settings.get('suite')} suite on {settings.get('device')}"
    notes = [_environment_note(results), *notes]
    document = {"schema": SURVEY_SCHEMA, "settings": settings, "environment": notes[0], "rows": rows}
    atomic_write_text(out / "survey.json", json.dumps(document, indent=1, allow_nan=False) + "\n")
    atomic_write_text(out / "survey.md", render_survey_markdown(rows, title, notes))
    atomic_write_text(out / "survey.html", render_survey_html(rows, title, notes))
    return rows


def _environment_note(results: Sequence[SweepResult]) -> str:
    """The device and the library versions the reports name (from the first report)."""
    for r in results:
        env = (r.report or {}).get("environment")
        if isinstance(env, dict):
            parts = [str(env.get("device_name") or env.get("device") or "")]
            parts += [f"{k} {env[k]}" for k in ("torch", "triton", "cuda", "python") if env.get(k)]
            return ", ".join(p for p in parts if p)
    return "no kernel ran"
