"""The verdict matrix of many runs side by side: one row per run (a sweep case), one column per
check family, each cell the family's verdict with the first failing check and its one-line reason.
Markdown for a PR comment, one self-contained HTML page with a sortable table for people.

A row is a sweep result object (flamia_verify.sweep.worker): ``case``, ``status``, ``report`` (a
report.json object, or None when the run gave no verdict) and ``error``.
"""

from __future__ import annotations

import html
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from flamia_verify.reports.store import atomic_write_text
from flamia_verify.results import FAMILIES

__all__ = ["family_cells", "render_sweep_markdown", "render_sweep_html", "write_sweep_reports", "case_label"]

#: a family's verdict from its checks' statuses: the worst one wins
_RANK = {"error": 3, "fail": 4, "pass": 1, "skip": 0}


def case_label(case: dict[str, Any]) -> str:
    parts = [str(case.get("kernel"))]
    if case.get("recipe"):
        parts.append(f"recipe={case['recipe']}")
    parts += [str(case.get("suite")), str(case.get("dtype")), f"seed={case.get('seed')}"]
    if case.get("only"):
        parts.append("only=" + ",".join(case["only"]))
    if case.get("settings"):
        parts.append(",".join(f"{k}={v}" for k, v in sorted(case["settings"].items())))
    return " ".join(parts)


def _one_line(text: Any, limit: int = 160) -> str:
    line = " ".join(str(text or "").split())
    return line if len(line) <= limit else line[: limit - 1] + "…"


def family_cells(result: dict[str, Any]) -> dict[str, tuple[str, str]]:
    """Per family that ran: (verdict, reason), the reason naming the first failing or errored check."""
    report = result.get("report")
    if not isinstance(report, dict):
        return {}
    cells: dict[str, tuple[str, str]] = {}
    for check in report.get("checks", []):
        family, status = check.get("family"), check.get("status")
        if family is None or status not in _RANK:
            continue
        have = cells.get(family)
        reason = f"{check.get('name')}: {_one_line(check.get('message'))}" if status in ("fail", "error") else ""
        if have is None or _RANK[status] > _RANK[have[0]]:
            cells[family] = (status, reason)
    return cells


def _families(results: Sequence[dict[str, Any]]) -> list[str]:
    seen = {f for r in results for f in family_cells(r)}
    return [f for f in FAMILIES if f in seen]


def render_sweep_markdown(results: Sequence[dict[str, Any]], title: str = "flamia-verify sweep") -> str:
    families = _families(results)
    counts: dict[str, int] = {}
    for r in results:
        counts[r["status"]] = counts.get(r["status"], 0) + 1
    lines = [
        f"# {title}",
        "",
        f"{len(results)} case(s): " + ", ".join(f"{v} {k}" for k, v in sorted(counts.items())),
        "",
    ]
    lines.append("| " + " | ".join(["case", "verdict", *families, "time"]) + " |")
    lines.append("|" + "---|" * (len(families) + 3))
    reasons = []
    for r in results:
        cells = family_cells(r)
        row = [case_label(r["case"]).replace("|", "\\|"), f"**{r['status'].upper()}**"]
        for f in families:
            status, reason = cells.get(f, ("", ""))
            row.append(status or "—")
            if reason:
                reasons.append(f"- {case_label(r['case'])}: {reason}")
        row.append(f"{r.get('elapsed_s', 0):.1f} s")
        lines.append("| " + " | ".join(row) + " |")
        if r.get("error"):
            reasons.append(f"- {case_label(r['case'])}: no verdict: {_one_line(r['error'], 300)}")
    if reasons:
        lines += ["", "## Why", "", *[line.replace("|", "\\|") for line in reasons]]
    return "\n".join(lines) + "\n"


_CSS = """
body{font-family:system-ui,sans-serif;margin:1.5rem;color:#1d1d1f}
table{border-collapse:collapse;width:100%;table-layout:auto}
th,td{border:1px solid #d0d0d7;padding:.3rem .45rem;font-size:.85rem;vertical-align:top;overflow-wrap:anywhere}
th{background:#f3f3f6;cursor:pointer;user-select:none}
td.pass{background:#e6f6ea}td.fail{background:#fde4e1}td.error{background:#fff1cc}td.skip{color:#777}
td.incomplete{background:#fff1cc}
.why{font-size:.75rem;color:#555}
"""

_JS = """
document.querySelectorAll('th').forEach((th,i)=>th.addEventListener('click',()=>{
 const tb=th.closest('table').tBodies[0];const rows=[...tb.rows];const asc=th.dataset.asc!=='1';
 rows.sort((a,b)=>{const x=a.cells[i].dataset.k||a.cells[i].textContent,y=b.cells[i].dataset.k||b.cells[i].textContent;
  const nx=parseFloat(x),ny=parseFloat(y);const c=(!isNaN(nx)&&!isNaN(ny))?nx-ny:x.localeCompare(y);return asc?c:-c;});
 th.dataset.asc=asc?'1':'0';rows.forEach(r=>tb.appendChild(r));}));
"""


def render_sweep_html(results: Sequence[dict[str, Any]], title: str = "flamia-verify sweep") -> str:
    esc = html.escape
    families = _families(results)
    head = "".join(f"<th>{esc(h)}</th>" for h in ["case", "verdict", *families, "time (s)"])
    body = []
    for r in results:
        cells = family_cells(r)
        status = r["status"]
        why = f"<div class='why'>{esc(_one_line(r['error'], 300))}</div>" if r.get("error") else ""
        tds = [
            f"<td>{esc(case_label(r['case']))}{why}</td>",
            f"<td class='{esc(status)}'><b>{esc(status.upper())}</b></td>",
        ]
        for f in families:
            verdict, reason = cells.get(f, ("", ""))
            note = f"<div class='why'>{esc(reason)}</div>" if reason else ""
            tds.append(f"<td class='{esc(verdict)}' title='{esc(reason)}'>{esc(verdict or '—')}{note}</td>")
        seconds = float(r.get("elapsed_s") or 0)
        tds.append(f"<td data-k='{seconds:.3f}'>{seconds:.1f}</td>")
        body.append("<tr>" + "".join(tds) + "</tr>")
    return (
        "<!doctype html><html lang='en'><head><meta charset='utf-8'>"
        "<meta name='viewport' content='width=device-width, initial-scale=1'>"
        f"<title>{esc(title)}</title><style>{_CSS}</style></head><body>"
        f"<h1>{esc(title)}</h1><p>{len(results)} case(s); click a column to sort.</p>"
        f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"
        f"<script>{_JS}</script></body></html>\n"
    )


def write_sweep_reports(results: Sequence[dict[str, Any]], out: Path, title: str = "flamia-verify sweep") -> None:
    atomic_write_text(out / "sweep.md", render_sweep_markdown(results, title))
    atomic_write_text(out / "sweep.html", render_sweep_html(results, title))
