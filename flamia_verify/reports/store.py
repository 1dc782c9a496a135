"""Reading and writing report files: report.json, report.md, report.html and junit.xml.

`write_reports` renders all four files in memory first, then replaces each one atomically (a temporary
file in the same directory, flushed and fsynced, then ``os.replace``). A run that crashes mid-write, or a
renderer that raises, leaves the previous complete files in place and no temporary file behind, so the
command line can call it after every finished check.

`load_report` validates report.json against schema ``flamia-verify/report/v1`` before building the model:
every problem names the file and the field (``checks[2].status``) and raises `ReportSchemaError`.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
from pathlib import Path
from typing import Any

from flamia_verify.errors import ReportSchemaError
from flamia_verify.reports.html_report import render_html
from flamia_verify.reports.junit import render_junit
from flamia_verify.reports.markdown import render_markdown
from flamia_verify.results import FAMILIES, SCHEMA, STATUSES, VERDICTS, Report

__all__ = ["REPORT_FILES", "atomic_write_text", "load_report", "report_json", "validate_report_data", "write_reports"]

#: The files `write_reports` writes, by the key it returns them under.
REPORT_FILES = {
    "json": "report.json",
    "markdown": "report.md",
    "html": "report.html",
    "junit": "junit.xml",
}


#: A list of scalars whose one-line form (with ", ") is longer than this is written without spaces.
SPACED_LIST_CHARS = 72


def report_json(report: Report) -> str:
    """report.json's text: strict JSON (NaN and infinities as strings), keys in the model's order.

    Objects, and lists that hold objects or lists, are indented by two spaces, one item per line; a list
    of scalars (a shape, a per-position series, one row of a heatmap) is one line, without spaces when
    it is longer than `SPACED_LIST_CHARS`. The causal checks' leakage maps (``details.heatmaps``: one
    row per perturbation, one count per position) hold about 10^5 numbers in the standard suite; one
    number per indented line made report.json 3.3 MB there (13.7 MB in the full suite), one line per
    row 0.5 MB, and the data read back is the same."""
    return _layout(report.to_dict(), 0) + "\n"


def _scalar_json(value: Any, separators: tuple[str, str] | None = None) -> str:
    return json.dumps(value, ensure_ascii=False, allow_nan=False, default=str, separators=separators)


def _layout(value: Any, depth: int) -> str:
    if isinstance(value, dict):
        if not value:
            return "{}"
        pad, inner = "  " * depth, "  " * (depth + 1)
        items = [
            f"{inner}{_scalar_json(k if isinstance(k, str) else _scalar_json(k))}: {_layout(v, depth + 1)}"
            for k, v in value.items()
        ]
        return "{\n" + ",\n".join(items) + "\n" + pad + "}"
    if isinstance(value, (list, tuple)):
        if not value:
            return "[]"
        if not any(isinstance(v, (dict, list, tuple)) for v in value):
            spaced = _scalar_json(value)
            return spaced if len(spaced) <= SPACED_LIST_CHARS else _scalar_json(value, (",", ":"))
        pad, inner = "  " * depth, "  " * (depth + 1)
        return "[\n" + ",\n".join(inner + _layout(v, depth + 1) for v in value) + "\n" + pad + "]"
    return _scalar_json(value)


def atomic_write_text(path: str | os.PathLike[str], text: str) -> Path:
    """Replace `path` with `text` (UTF-8) atomically: readers see the old file or the new one, never a part.

    The temporary file lives beside `path` (``.<name>.<random>.tmp``) so that ``os.replace`` stays on one
    file system; it is removed if anything fails. The new file gets the usual permissions (0666 less umask).
    An OSError (a full disk: ENOSPC) is raised again naming `path`, the file the caller asked for.
    """
    path = Path(path)
    # Lone surrogates (undecodable file names in a message) become \udcxx: inside a JSON string that is
    # the escape that reads back as the same character; elsewhere it is visible text.
    data = text.encode("utf-8", errors="backslashreplace")
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    except OSError as exc:
        raise OSError(exc.errno, exc.strerror or str(exc), str(path)) from exc
    try:
        with os.fdopen(fd, "wb") as handle:
            fd = -1  # owned by `handle` now
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException as exc:
        if fd >= 0:
            os.close(fd)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        if isinstance(exc, OSError) and exc.filename != str(path):
            raise OSError(exc.errno, exc.strerror or str(exc), str(path)) from exc
        raise
    return path


def write_reports(report: Report, out_dir: str | os.PathLike[str]) -> dict[str, Path]:
    """Write report.json, report.md, report.html and junit.xml into `out_dir` (created if missing).

    Returns the written paths by kind: ``{"json", "markdown", "html", "junit"}``. Every renderer runs before
    any file is touched, and report.json is replaced first, so an interrupted call never leaves a mix of
    formats older than report.json. Safe to call repeatedly during a run.
    """
    out = Path(out_dir)
    texts = {
        "json": report_json(report),
        "markdown": render_markdown(report),
        "html": render_html(report),
        "junit": render_junit(report),
    }
    out.mkdir(parents=True, exist_ok=True)
    return {kind: atomic_write_text(out / REPORT_FILES[kind], text) for kind, text in texts.items()}


def load_report(path: str | os.PathLike[str]) -> Report:
    """Read and validate report.json; any problem raises `ReportSchemaError` naming the file and the field."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise ReportSchemaError(f"{path}: cannot read report: {exc.strerror or exc}") from exc
    try:
        data = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise ReportSchemaError(f"{path}: not UTF-8 text (byte {exc.start})") from exc
    except json.JSONDecodeError as exc:
        raise ReportSchemaError(f"{path}: not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}") from exc
    problems = validate_report_data(data)
    if problems:
        more = f" (and {len(problems) - 1} more problem(s))" if len(problems) > 1 else ""
        error = ReportSchemaError(f"{path}: {problems[0]}{more}")
        error.problems = problems  # type: ignore[attr-defined]
        raise error
    try:
        return Report.from_dict(data)
    except ReportSchemaError as exc:  # validation above should make this unreachable
        raise ReportSchemaError(f"{path}: {exc}") from exc


# ----------------------------------------------------------------------------------------------- validation

_TOP_LEVEL: tuple[tuple[str, type | tuple[type, ...], str], ...] = (
    ("kernel", str, "a string"),
    ("recipe", str, "a string"),
    ("suite", str, "a string"),
    ("seed", int, "an integer"),
    ("environment", dict, "an object"),
    ("checks", list, "a list"),
    ("summary", dict, "an object"),
)
_CHECK_REQUIRED: tuple[tuple[str, type | tuple[type, ...], str], ...] = (
    ("name", str, "a string"),
    ("family", str, "a string"),
    ("status", str, "a string"),
    ("metrics", dict, "an object"),
    ("thresholds", dict, "an object"),
    ("worst_case", dict, "an object"),
)
_CHECK_OPTIONAL: tuple[tuple[str, type | tuple[type, ...], str], ...] = (
    ("message", str, "a string"),
    ("duration_s", (int, float), "a number"),
    ("details", dict, "an object"),
    ("verdict", str, "a string"),
)


def _kind(value: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null"}.get(
        type(value), "a number" if isinstance(value, (int, float)) else type(value).__name__
    )


def _has_type(value: Any, types: type | tuple[type, ...]) -> bool:
    # JSON booleans are Python ints; they are never a seed or a duration.
    return isinstance(value, types) and not isinstance(value, bool)


def _scalar_problem(value: Any) -> str | None:
    # Non-finite floats are accepted too: they are written back as "nan"/"inf" strings.
    if value is None or isinstance(value, (bool, int, float, str)):
        return None
    return f"expected a number, string, boolean or null, got {_kind(value)}"


def validate_report_data(data: Any) -> list[str]:
    """Every way `data` (parsed report.json) breaks schema v1, as ``field 'path': problem`` lines.

    An empty list means the data is a valid report. An unknown schema string stops the check early: the
    other fields of a different schema mean other things.
    """
    if not isinstance(data, dict):
        return [f"expected a JSON object at the top level, got {_kind(data)}"]
    if "schema" not in data:
        return [f"field 'schema' is missing (expected {SCHEMA!r})"]
    if data["schema"] != SCHEMA:
        return [f"field 'schema': unsupported report schema {data['schema']!r}; this version reads {SCHEMA!r}"]

    problems: list[str] = []
    for key, types, kind in _TOP_LEVEL:
        if key not in data:
            problems.append(f"field {key!r} is missing")
        elif not _has_type(data[key], types):
            problems.append(f"field {key!r}: expected {kind}, got {_kind(data[key])}")

    overrides = data.get("threshold_overrides", [])  # added within v1: absent in older reports
    if not isinstance(overrides, list):
        problems.append(f"field 'threshold_overrides': expected a list, got {_kind(overrides)}")
    else:
        for index, entry in enumerate(overrides):
            where = f"threshold_overrides[{index}]"
            if not isinstance(entry, dict):
                problems.append(f"field {where!r}: expected an object, got {_kind(entry)}")
                continue
            for key in ("scope", "key"):
                if not isinstance(entry.get(key), str):
                    problems.append(f"field '{where}.{key}': expected a string, got {_kind(entry.get(key))}")
            for key in ("value", "default", "source"):
                problem = _scalar_problem(entry.get(key))
                if problem:
                    problems.append(f"field '{where}.{key}': {problem}")

    summary = data.get("summary")
    if isinstance(summary, dict):
        if "complete" in summary and not isinstance(summary["complete"], bool):
            problems.append(f"field 'summary.complete': expected a boolean, got {_kind(summary['complete'])}")
        reason = summary.get("incomplete_reason")
        if reason is not None and not isinstance(reason, str):
            problems.append(f"field 'summary.incomplete_reason': expected a string, got {_kind(reason)}")

    checks = data.get("checks")
    if not isinstance(checks, list):
        return problems
    seen: dict[str, int] = {}
    for index, check in enumerate(checks):
        where = f"checks[{index}]"
        if not isinstance(check, dict):
            problems.append(f"field {where!r}: expected an object, got {_kind(check)}")
            continue
        name = check.get("name")
        label = f" (check {name!r})" if isinstance(name, str) else ""
        for key, types, kind in _CHECK_REQUIRED:
            if key not in check:
                problems.append(f"field '{where}.{key}'{label} is missing")
            elif not _has_type(check[key], types):
                problems.append(f"field '{where}.{key}'{label}: expected {kind}, got {_kind(check[key])}")
        for key, types, kind in _CHECK_OPTIONAL:
            if key in check and not _has_type(check[key], types):
                problems.append(f"field '{where}.{key}'{label}: expected {kind}, got {_kind(check[key])}")

        status, family = check.get("status"), check.get("family")
        if isinstance(status, str) and status not in STATUSES:
            problems.append(f"field '{where}.status'{label}: expected one of {', '.join(STATUSES)}, got {status!r}")
        verdict = check.get("verdict")
        if isinstance(verdict, str) and verdict not in VERDICTS:
            problems.append(f"field '{where}.verdict'{label}: expected one of {', '.join(VERDICTS)}, got {verdict!r}")
        if isinstance(family, str) and family not in FAMILIES:
            problems.append(
                f"field '{where}.family'{label}: unknown family {family!r}; expected one of {', '.join(FAMILIES)}"
            )
        if isinstance(name, str) and isinstance(family, str) and not name.startswith(family + "."):
            problems.append(f"field '{where}.name'{label}: a check name must start with its family {family + '.'!r}")
        if isinstance(name, str):
            if name in seen:
                problems.append(f"field '{where}.name'{label}: duplicate of checks[{seen[name]}]")
            seen.setdefault(name, index)
        for key in ("metrics", "thresholds"):
            values = check.get(key)
            if isinstance(values, dict):
                for metric, value in values.items():
                    problem = _scalar_problem(value)
                    if problem:
                        problems.append(f"field '{where}.{key}.{metric}'{label}: {problem}")
    return problems
