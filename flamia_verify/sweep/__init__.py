"""Sweeps: a matrix of `check` runs spread over the GPUs of a machine (a local worker pool) or over a
Ray cluster, with results stored per case so that an interrupted sweep resumes and an unchanged case
is never run twice.

    flamia-verify sweep sweep.toml --out sweep-out                 # every GPU here (or every CPU core)
    flamia-verify sweep sweep.toml --shard 2/4 --out shard-2       # one deterministic quarter
    flamia-verify sweep merge shard-1 shard-2 shard-3 shard-4 --out all
    flamia-verify sweep sweep.toml --backend ray --address auto    # an existing Ray cluster

:func:`run_sweep` and :func:`merge_sweeps` are the Python API; :mod:`.matrix` reads the TOML file.
OUT holds ``cases/<key>.json`` (one result per case), ``sweep.json`` (the matrix and its results in
matrix order), ``sweep.md`` / ``sweep.html`` (the verdict matrix, cases x check families) and
``reports/<key>/`` (each case's full report: report.{json,md,html} and junit.xml, which the
matrix's rows link).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flamia_verify.errors import ConfigError
from flamia_verify.results import SweepResult
from flamia_verify.sweep.backends import BACKENDS, run_local, run_ray
from flamia_verify.sweep.matrix import Sweep, SweepCase, case_key, load_sweep, parse_shard, shard_of
from flamia_verify.sweep.store import CaseStore, write_case_report

__all__ = [
    "BACKENDS",
    "SCHEMA",
    "Sweep",
    "SweepCase",
    "SweepOutcome",
    "load_sweep",
    "run_sweep",
    "merge_sweeps",
    "parse_shard",
    "comparable",
    "exit_code",
]

SCHEMA = "flamia-verify/sweep/v1"
#: the folder of OUT that holds each case's report, in a folder named by the case's key
REPORTS = "reports"

#: fields of a result that say when, where and how fast it ran, not what it found
_VOLATILE_RESULT = ("elapsed_s", "host", "device", "speed")
_VOLATILE_ENV = (
    "total_seconds",
    "kernel_seconds",
    "torch_threads",
    "hostname",
    "started",
    "finished",
    "python",
    "platform",
)


@dataclass
class SweepOutcome:
    """What a sweep (or a merge) produced: every result of its cases in matrix order."""

    out: Path
    results: list[SweepResult]
    ran: int = 0  # cases run by this invocation
    reused: int = 0  # cases read back from the store
    missing: list[str] = field(default_factory=list)  # keys of the matrix with no result (merge only)
    workers: int = 0

    def counts(self) -> dict[str, int]:
        out = {"pass": 0, "fail": 0, "error": 0, "incomplete": 0}
        for r in self.results:
            out[r.status] = out.get(r.status, 0) + 1
        return out


def exit_code(outcome: SweepOutcome) -> int:
    """2 cases of the matrix are missing (a merge without every shard: no verdict on the matrix,
    whatever the present cases say); else 1 a case failed (or did not finish); 3 no case failed but
    one produced no verdict (its kernel did not load, its worker crashed or hung); 0 every case passed."""
    counts = outcome.counts()
    if outcome.missing:
        return 2
    if counts["fail"] or counts["incomplete"]:
        return 1
    if counts["error"]:
        return 3
    return 0


def comparable(result: SweepResult) -> dict[str, Any]:
    """``result``'s JSON object without what says when, where and how fast it ran (times, host): two runs
    of a case on the same code, one in a sweep and one in a single process, give equal objects."""
    out = {k: v for k, v in result.to_dict().items() if k not in _VOLATILE_RESULT}
    report = out.get("report")
    if isinstance(report, dict):
        report = dict(report)
        report["environment"] = {k: v for k, v in report.get("environment", {}).items() if k not in _VOLATILE_ENV}
        report["checks"] = [{k: v for k, v in c.items() if k != "duration_s"} for c in report.get("checks", [])]
        out["report"] = report
    return out


def _write_outputs(
    out: Path,
    source: str,
    labels: dict[str, str],
    results: list[SweepResult],
    shard: str | None,
    missing: Sequence[str] = (),
    origins: dict[str, Path] | None = None,
) -> None:
    """sweep.json (the matrix's keys in order, each case's label, the results; a merge that lacks cases
    says ``complete: false`` and lists them), each case's report under reports/<key>/ (written by
    its worker, copied from the sweep directory ``origins[key]`` of a merge, or rendered here), and
    sweep.md and sweep.html, whose rows link those reports."""
    from flamia_verify.reports.store import atomic_write_text
    from flamia_verify.reports.survey import write_sweep_reports

    out.mkdir(parents=True, exist_ok=True)
    document = {
        "schema": SCHEMA,
        "source": source,
        "shard": shard,
        "matrix": list(labels),
        "labels": labels,
        "complete": not missing,
        "missing": [{"key": k, "label": labels.get(k, k)} for k in missing],
        "results": [r.to_dict() for r in results],
    }
    atomic_write_text(out / "sweep.json", json.dumps(document, separators=(",", ":")) + "\n")
    reports = {}
    for r in results:
        if r.report is not None:
            origin = origins[r.key] / REPORTS / r.key if origins and r.key in origins else None
            page = write_case_report(out / REPORTS / r.key, r.report, origin)
            reports[r.key] = page.relative_to(out).as_posix()
    write_sweep_reports(
        results,
        out,
        title=f"flamia-verify sweep: {source}" + (f" (shard {shard})" if shard else ""),
        missing=[labels.get(k, k) for k in missing],
        reports=reports,
    )


def run_sweep(
    sweep: Sweep | str | Path,
    out: str | Path,
    *,
    backend: str = "local",
    workers: int | None = None,
    shard: str | tuple[int, int] | None = None,
    address: str | None = None,
    timeout_s: float | None = None,
    on_result: Callable[[SweepResult, int, int], None] | None = None,
    on_start: Callable[[int, int, int], None] | None = None,
    per_gpu: int = 1,
    write_pages: bool = True,
) -> SweepOutcome:
    """Run the cases of ``sweep`` (a :class:`Sweep` or a TOML path) that ``out`` has no result for.

    ``shard`` (``"i/n"`` or ``(i, n)``) keeps the i-th of n deterministic slices. ``on_start(total,
    reused, to_run)`` is called once, ``on_result(result, done, to_run)`` after each case that ran. A
    case whose stored result is an ``error`` without a report (a crash, a timeout, a lost node) runs
    again; every other stored result is reused. ``per_gpu`` (local backend) runs that many workers on
    each GPU. ``write_pages`` False keeps the results in the store only (``OUT/cases``) and writes
    neither sweep.json, sweep.md, sweep.html nor the case reports: for a caller that writes its own
    report of them, as the survey does."""
    if not isinstance(sweep, Sweep):
        sweep = load_sweep(sweep)
    if backend not in BACKENDS:
        raise ConfigError(f"unknown sweep backend {backend!r}; choose one of: {', '.join(BACKENDS)}")
    if per_gpu != 1 and backend != "local":
        raise ConfigError("--workers-per-gpu is for the local backend (Ray gives each task one GPU)")
    if workers is not None and workers < 1:
        raise ConfigError(f"--workers must be at least 1, got {workers}")
    if isinstance(shard, str):
        shard = parse_shard(shard)
    out = Path(out)
    store = CaseStore(out)
    keyed = [(case_key(c), c) for c in sweep.cases]
    labels = {k: c.label() for k, c in keyed}
    if shard is not None:
        keyed = [(k, c) for k, c in keyed if shard_of(k, shard[1]) == shard[0]]
    todo, reused = [], 0
    for key, case in keyed:
        stored = store.get(key)
        if stored is not None and not (stored.status == "error" and stored.report is None):
            reused += 1
        else:
            todo.append((key, case))
    if on_start is not None:
        on_start(len(keyed), reused, len(todo))
    done = 0

    def record(result: SweepResult) -> None:
        nonlocal done
        store.put(result)
        done += 1
        if on_result is not None:
            on_result(result, done, len(todo))

    timeout = timeout_s if timeout_s is not None else sweep.timeout_s
    device = sweep.cases[0].device if sweep.cases else "auto"
    used = 0
    if todo:
        if backend == "ray":
            used = run_ray(todo, record, device=device, workers=workers, timeout_s=timeout, address=address)
        else:
            reports = out / REPORTS if write_pages else None  # each worker writes the reports of its cases
            used = run_local(
                todo, record, device=device, workers=workers, timeout_s=timeout, per_gpu=per_gpu, report_dir=reports
            )
    results = [r for r in (store.get(k) for k, _ in keyed) if r is not None]
    label = f"{shard[0]}/{shard[1]}" if shard else None
    if write_pages:
        _write_outputs(out, sweep.source, labels, results, label)
    return SweepOutcome(out=out, results=results, ran=len(todo), reused=reused, workers=used)


def merge_sweeps(dirs: Sequence[str | Path], out: str | Path) -> SweepOutcome:
    """Join the results of sweeps (typically the shards of one matrix) into ``out``: the results in
    the matrix's order, and ``missing`` listing the matrix's cases that no shard has."""
    if not dirs:
        raise ConfigError("sweep merge needs at least one sweep output directory")
    by_key: dict[str, SweepResult] = {}
    origins: dict[str, Path] = {}  # the directory each kept result came from (its report is there)
    matrix: list[str] = []
    labels: dict[str, str] = {}
    sources = []
    for d in dirs:
        path = Path(d) / "sweep.json"
        try:
            document = json.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"{path} does not exist: is {d} the --out of a sweep?") from None
        except (OSError, ValueError) as exc:
            raise ConfigError(f"cannot read {path}: {exc}") from None
        if not isinstance(document, dict) or document.get("schema") != SCHEMA:
            raise ConfigError(f"{path} is not a sweep result (schema {SCHEMA})")
        if matrix and document["matrix"] != matrix:
            raise ConfigError(f"{path} comes from another matrix than {dirs[0]}: merge shards of one sweep")
        matrix = document["matrix"]
        labels.update(document.get("labels") or {})  # sweeps written before labels were kept name keys
        sources.append(document.get("source", ""))
        for data in document["results"]:
            try:
                result = SweepResult.from_dict(data)
            except (ValueError, TypeError) as exc:
                raise ConfigError(f"{path} holds a malformed result: {exc}") from None
            have = by_key.get(result.key)
            if have is None or (have.status == "error" and have.report is None):
                by_key[result.key] = result
                origins[result.key] = Path(d)
    results = [by_key[k] for k in matrix if k in by_key]
    missing = [k for k in matrix if k not in by_key]
    out = Path(out)
    source = sources[0] if len(set(sources)) == 1 else ", ".join(sorted(set(sources)))
    _write_outputs(out, source, {k: labels.get(k, k) for k in matrix}, results, None, missing, origins)
    return SweepOutcome(out=out, results=results, missing=missing)
