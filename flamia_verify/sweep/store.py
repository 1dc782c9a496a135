"""Where a sweep keeps its results: one JSON file per case under ``OUT/cases/<key>.json``, written
atomically (a temporary file renamed into place), so an interrupted sweep loses at most the cases
that were running, and a rerun reads every finished case back instead of running it again.

:func:`write_case_report` writes one case's full report (report.json, report.md, report.html,
junit.xml, as ``check --out`` does) into a folder, for the sweep's and the survey's pages to link.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from flamia_verify.results import SweepResult

__all__ = ["CaseStore", "write_case_report"]


class CaseStore:
    def __init__(self, out: str | Path) -> None:
        self.root = Path(out)
        self.cases = self.root / "cases"

    def path(self, key: str) -> Path:
        return self.cases / f"{key}.json"

    def get(self, key: str) -> SweepResult | None:
        """The stored result of ``key``, or None (never stored, unreadable or malformed: then it runs again)."""
        try:
            result = SweepResult.from_dict(json.loads(self.path(key).read_text()))
        except (OSError, ValueError, TypeError):
            return None
        return result if result.key == key else None

    def put(self, result: SweepResult) -> Path:
        """Store one result atomically (a full disk is an OSError naming the case's file)."""
        from flamia_verify.reports.store import atomic_write_text

        self.cases.mkdir(parents=True, exist_ok=True)
        return atomic_write_text(self.path(result.key), json.dumps(result.to_dict(), separators=(",", ":")))

    def all(self) -> list[SweepResult]:
        """Every stored result (any sweep that wrote to this directory)."""
        out = []
        for path in sorted(self.cases.glob("*.json")):
            data = self.get(path.stem)
            if data is not None:
                out.append(data)
        return out


def _holds(folder: Path, report: dict[str, Any]) -> bool:
    """Whether ``folder`` holds every file of exactly this report."""
    from flamia_verify.reports.store import REPORT_FILES

    try:
        same = json.loads((folder / REPORT_FILES["json"]).read_text()) == report
    except (OSError, ValueError):
        return False
    return same and all((folder / name).is_file() for name in REPORT_FILES.values())


def write_case_report(folder: Path, report: dict[str, Any], source: Path | None = None) -> Path:
    """Write ``report`` (a report.json object) as report.json, report.md, report.html and junit.xml into
    ``folder``, unless the folder already holds exactly this report (a rerun reads its cases back);
    copied from ``source`` when that folder holds it (a merge: the shard's worker wrote it), else
    rendered. Returns the path of its report.html."""
    from flamia_verify.reports.store import REPORT_FILES, atomic_write_text, load_report, write_reports

    if _holds(folder, report):
        return folder / REPORT_FILES["html"]
    folder.mkdir(parents=True, exist_ok=True)
    if source is not None and _holds(source, report):
        for name in REPORT_FILES.values():
            atomic_write_text(folder / name, (source / name).read_text(encoding="utf-8"))
        return folder / REPORT_FILES["html"]
    atomic_write_text(folder / REPORT_FILES["json"], json.dumps(report))
    write_reports(load_report(folder / REPORT_FILES["json"]), folder)
    return folder / REPORT_FILES["html"]
