"""Where a sweep keeps its results: one JSON file per case under ``OUT/cases/<key>.json``, written
atomically (a temporary file renamed into place), so an interrupted sweep loses at most the cases
that were running, and a rerun reads every finished case back instead of running it again.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["CaseStore"]


class CaseStore:
    def __init__(self, out: str | Path) -> None:
        self.root = Path(out)
        self.cases = self.root / "cases"

    def path(self, key: str) -> Path:
        return self.cases / f"{key}.json"

    def get(self, key: str) -> dict[str, Any] | None:
        """The stored result of ``key``, or None (never stored, or unreadable: then it runs again)."""
        try:
            data = json.loads(self.path(key).read_text())
        except (OSError, ValueError):
            return None
        return data if isinstance(data, dict) and data.get("key") == key else None

    def put(self, result: dict[str, Any]) -> Path:
        """Store one result atomically (a full disk is an OSError naming the case's file)."""
        from flamia_verify.reports.store import atomic_write_text

        self.cases.mkdir(parents=True, exist_ok=True)
        return atomic_write_text(self.path(result["key"]), json.dumps(result, separators=(",", ":")))

    def all(self) -> list[dict[str, Any]]:
        """Every stored result (any sweep that wrote to this directory)."""
        out = []
        for path in sorted(self.cases.glob("*.json")):
            data = self.get(path.stem)
            if data is not None:
                out.append(data)
        return out
