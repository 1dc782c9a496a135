"""Many runs side by side: the survey report (kernels x check families) and the sweep report (cases x
check families) are one table, drawn from sweep results.

A result is a sweep result object (flamia_verify.sweep.worker): ``case``, ``status``, ``report`` (a
report.json object, or None when the run gave no verdict), ``error`` and, when the case asked for it,
``speed`` (a row of :func:`flamia_verify.bench.measure_speed`). :func:`survey_rows` turns results
into rows, one per run, each with

- the verdict of every check family that ran, over the checks that gate the run (the gating verdict,
  and the others when the run required them), with the first failing check and its one-line reason,
- the reproducibility and robustness verdicts beside them (``finding`` when one of their checks
  failed and the run did not require that verdict, ``fail`` when it did), with the first finding,
- the error of O and of the gradients (rel. RMSE against the float64 reference) beside the recipe's
  model of it and a BF16 run's on the same inputs (the ``error`` family's metrics),
- the speed (forward, backward, forward+backward TFLOP/s) and its ratio to the fastest BF16 SDPA
  backend of the same table,
- the path of the run's full report, when one was written.

Rows of kernels that could not run here (``unavailable``) carry their reason only. The Markdown suits
a PR comment; the HTML is one self-contained page with a sortable table and a plot of error against
speed; the JSON (:func:`survey_document`) is the rows themselves.
"""

from __future__ import annotations

import html
import io
import math
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from flamia_verify.reports.store import atomic_write_text
from flamia_verify.results import FAMILIES, OPTIONAL_VERDICTS, SweepResult

__all__ = [
    "family_cells",
    "verdict_cells",
    "error_summary",
    "survey_rows",
    "render_survey_markdown",
    "render_survey_html",
    "render_sweep_markdown",
    "render_sweep_html",
    "write_sweep_reports",
    "case_label",
    "BASELINE_KERNELS",
]

#: a family's verdict from its checks' statuses: the worst one wins
_RANK = {"error": 3, "fail": 4, "finding": 2, "pass": 1, "skip": 0}
#: the tensors of the error family, in the order the tables show them
_TENSORS = ("out", "dq", "dk", "dv")
#: the BF16 kernels whose fastest forward+backward is a survey's speed reference
BASELINE_KERNELS = ("sdpa-cudnn", "sdpa-flash", "flash-attn", "fa4")


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


def _gates(report: dict[str, Any], check: dict[str, Any]) -> bool:
    """Whether a report.json check counts toward its run's verdict (a report without verdicts: all do)."""
    verdict = check.get("verdict", "gating")
    return verdict == "gating" or verdict in (report.get("require") or [])


def family_cells(report: dict[str, Any] | None) -> dict[str, tuple[str, str]]:
    """Per family of ``report`` (report.json's object) that ran a check that gates: (verdict, reason), the
    reason naming the first failing or errored check. Checks of a verdict the run did not require are in
    :func:`verdict_cells`."""
    if not isinstance(report, dict):
        return {}
    cells: dict[str, tuple[str, str]] = {}
    for check in report.get("checks", []):
        family, status = check.get("family"), check.get("status")
        if family is None or status not in _RANK or not _gates(report, check):
            continue
        have = cells.get(family)
        reason = f"{check.get('name')}: {_one_line(check.get('message'))}" if status in ("fail", "error") else ""
        if have is None or _RANK[status] > _RANK[have[0]]:
            cells[family] = (status, reason)
    return cells


def verdict_cells(report: dict[str, Any] | None) -> dict[str, tuple[str, str]]:
    """Per non-gating verdict that ``report`` ran (reproducibility, robustness): (status, reason): ``pass``;
    ``finding`` when a check of it failed or errored and the run did not require it; ``fail`` when
    the run required it; the reason names the first such check."""
    if not isinstance(report, dict):
        return {}
    cells: dict[str, tuple[str, str]] = {}
    for check in report.get("checks", []):
        verdict, status = check.get("verdict", "gating"), check.get("status")
        if verdict not in OPTIONAL_VERDICTS or status not in _RANK:
            continue
        if status in ("fail", "error"):
            status = "fail" if _gates(report, check) else "finding"
        reason = f"{check.get('name')}: {_one_line(check.get('message'))}" if status in ("fail", "finding") else ""
        have = cells.get(verdict)
        if have is None or _RANK[status] > _RANK[have[0]]:
            cells[verdict] = (status, reason)
    return cells


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def error_summary(report: dict[str, Any] | None) -> dict[str, dict[str, float | None]]:
    """Per tensor (out, dq, dk, dv) the ``error`` family measured: ``rel_rmse`` (against float64),
    ``model`` (the recipe's predicted rel. RMSE), ``bf16`` (a BF16 run's on the same inputs)."""
    out: dict[str, dict[str, float | None]] = {}
    if not isinstance(report, dict):
        return out
    for check in report.get("checks", []):
        name = str(check.get("name", ""))
        tensor = name.partition(".")[2]
        if check.get("family") != "error" or tensor not in _TENSORS:
            continue
        metrics = check.get("metrics") or {}
        out[tensor] = {
            "rel_rmse": _number(metrics.get("rel_rmse")),
            "model": _number(metrics.get("predicted_rel_rmse")),
            "bf16": _number(metrics.get("bf16_rel_rmse")),
        }
    return out


def _speed_ratios(rows: list[dict[str, Any]]) -> None:
    """``speed.ratio``: forward+backward TFLOP/s over the fastest BF16 baseline among the rows of
    the same shape, ``speed.reference`` that baseline (None where either is missing)."""
    best: dict[str, tuple[float, str]] = {}  # shape -> (fwd+bwd TFLOP/s, kernel) of the fastest baseline
    for r in rows:
        s = r.get("speed") or {}
        x = _number(s.get("fwdbwd_tflops"))
        shape = s.get("shape", "")
        if r["kernel"] in BASELINE_KERNELS and x and not s.get("error") and x > best.get(shape, (0.0, ""))[0]:
            best[shape] = (x, r["kernel"])
    for r in rows:
        s = r.get("speed")
        if isinstance(s, dict):
            x, (ref, name) = _number(s.get("fwdbwd_tflops")), best.get(s.get("shape", ""), (0.0, None))
            s["ratio"] = x / ref if x and ref else None
            s["reference"] = name


def survey_rows(
    results: Sequence[SweepResult],
    *,
    label: Callable[[dict[str, Any]], str] | None = None,
    reports: dict[str, str] | None = None,
    unavailable: Sequence[tuple[str, str, str]] = (),
) -> list[dict[str, Any]]:
    """One plain-JSON row per result (in order), then one per ``unavailable`` kernel (name, recipe,
    reason). ``label(case)`` names a row (default: the case label); ``reports`` maps a result's key to
    the path of its full report."""
    label = label or case_label
    rows: list[dict[str, Any]] = []
    for r in results:
        report = r.report
        rows.append(
            {
                "label": label(r.case),
                "kernel": r.case.get("kernel"),
                "recipe": (report or {}).get("recipe") or r.recipe or r.case.get("recipe"),
                "status": r.status,
                "reason": _one_line(r.error, 400) if r.error else "",
                "families": {f: {"verdict": v, "reason": why} for f, (v, why) in family_cells(report).items()},
                "verdicts": {n: {"verdict": v, "reason": why} for n, (v, why) in verdict_cells(report).items()},
                "error": error_summary(report),
                "speed": dict(r.speed) if isinstance(r.speed, dict) else None,
                "report": (reports or {}).get(r.key),
                "elapsed_s": r.elapsed_s,
                "key": r.key,
                "forward_only": bool(((report or {}).get("summary") or {}).get("forward_only")),
            }
        )
    for name, recipe, why in unavailable:  # kernels this machine cannot run: a row that says why
        case = {"kernel": name, "recipe": recipe}
        rows.append(
            {
                "label": label(case),
                "kernel": name,
                "recipe": recipe,
                "status": "unavailable",
                "reason": _one_line(why, 400) if why else "",
                "families": {},
                "verdicts": {},
                "error": error_summary(None),
                "speed": None,
                "report": None,
                "elapsed_s": None,
                "key": None,
                "forward_only": False,
            }
        )
    _speed_ratios(rows)
    return rows


def _families(rows: Sequence[dict[str, Any]]) -> list[str]:
    """The gating families that ran, then the other verdicts that ran (their columns)."""
    seen = {f for r in rows for f in r["families"]}
    verdicts = {v for r in rows for v in r.get("verdicts", {})}
    return [f for f in FAMILIES if f in seen] + [v for v in OPTIONAL_VERDICTS if v in verdicts]


def _cell(row: dict[str, Any], column: str) -> dict[str, str] | None:
    """A row's cell of a family or verdict column."""
    cells: dict[str, dict[str, str]] = row.get("verdicts", {}) if column in OPTIONAL_VERDICTS else row["families"]
    return cells.get(column)


def _columns(rows: Sequence[dict[str, Any]], error_head: str, time_head: str) -> tuple[list[str], bool, list[str]]:
    """(the families that ran, whether any row was timed, the table's header)."""
    families = _families(rows)
    speed = any(r.get("speed") for r in rows)
    head = ["kernel" if any(r["label"] == r["kernel"] for r in rows) else "case", "recipe", "verdict", *families]
    head += [error_head, "worst gradient"]
    if speed:
        head += ["fwd TFLOP/s", "bwd TFLOP/s", "fwd+bwd TFLOP/s", "x BF16"]
    return families, speed, [*head, time_head, "report"]


def _fmt(x: float | None, spec: str) -> str:
    return "—" if x is None else format(x, spec)


def _worst_grad(errors: dict[str, dict[str, float | None]]) -> tuple[str, dict[str, float | None]] | None:
    """The gradient with the largest error relative to its BF16 run (or to its own size)."""
    grads = [(t, errors[t]) for t in ("dq", "dk", "dv") if t in errors and errors[t].get("rel_rmse") is not None]
    if not grads:
        return None
    return max(grads, key=lambda tv: (tv[1]["rel_rmse"] or 0.0) / (tv[1].get("bf16") or 1.0))


def _error_text(e: dict[str, float | None] | None, name: str = "") -> str:
    if not e or e.get("rel_rmse") is None:
        return "—"
    text = f"{name}{e['rel_rmse']:.2g}"
    extra = []
    if e.get("model") is not None:
        extra.append(f"model {e['model']:.2g}")
    if e.get("bf16") is not None:
        extra.append(f"BF16 {e['bf16']:.2g}")
    return text + (f" ({', '.join(extra)})" if extra else "")


def _speed_cells(s: dict[str, Any] | None) -> list[str]:
    if not s:
        return ["—"] * 4
    if s.get("error") and _number(s.get("fwd_tflops")) is None:
        return ["n/a"] * 4
    ratio = _number(s.get("ratio"))
    return [
        _fmt(_number(s.get("fwd_tflops")), ".0f"),
        _fmt(_number(s.get("bwd_tflops")), ".0f"),
        _fmt(_number(s.get("fwdbwd_tflops")), ".0f"),
        _fmt(ratio, ".2f"),
    ]


def _counts(rows: Sequence[dict[str, Any]]) -> str:
    counts: dict[str, int] = {}
    for r in rows:
        counts[r["status"]] = counts.get(r["status"], 0) + 1
    return ", ".join(f"{v} {k}" for k, v in sorted(counts.items()))


def _shapes(rows: Sequence[dict[str, Any]]) -> list[str]:
    return sorted({str((r.get("speed") or {}).get("shape")) for r in rows if (r.get("speed") or {}).get("shape")})


def _missing_line(rows: Sequence[dict[str, Any]], missing: Sequence[str]) -> str:
    return (
        f"INCOMPLETE: {len(missing)} of {len(rows) + len(missing)} case(s) missing (no merged directory has them; "
        "run their shards and merge again): " + "; ".join(missing)
    )


def render_survey_markdown(
    rows: Sequence[dict[str, Any]], title: str, notes: Sequence[str] = (), missing: Sequence[str] = ()
) -> str:
    """The table for a PR comment: verdicts per family, errors, speed, and why each failure failed;
    ``missing``: the cases of the matrix that no merged directory has (an incomplete merge)."""
    families, speed, head = _columns(rows, "O rel. RMSE (model, BF16)", "time")
    lines = [f"# {title}", ""]
    if missing:
        lines += [f"**{_missing_line(rows, missing)}**", ""]
    lines += [f"{len(rows)} row(s): {_counts(rows)}", ""]
    lines += [f"- {n}" for n in notes]
    for shape in _shapes(rows):
        lines.append(f"- speed: {shape}; x BF16: forward+backward over the fastest of {', '.join(BASELINE_KERNELS)}")
    if notes or speed:
        lines.append("")
    lines.append("| " + " | ".join(head) + " |")
    lines.append("|" + "---|" * len(head))
    reasons = []
    for r in rows:
        row = [str(r["label"]), str(r.get("recipe") or ""), f"**{r['status'].upper()}**"]
        for f in families:
            cell = _cell(r, f)
            row.append(cell["verdict"] if cell else "—")
            if cell and cell["reason"]:
                reasons.append(f"- {r['label']}: {cell['reason']}")
        row.append(_error_text(r["error"].get("out")))
        worst = _worst_grad(r["error"])
        row.append(_error_text(worst[1], f"{worst[0]} ") if worst else ("forward-only" if r["forward_only"] else "—"))
        if speed:
            row += _speed_cells(r.get("speed"))
            sp = r.get("speed") or {}
            if sp.get("error") and r["status"] != "unavailable":
                reasons.append(f"- {r['label']}: speed {_one_line(sp['error'], 200)}")
        row.append(f"{r['elapsed_s']:.0f} s" if isinstance(r.get("elapsed_s"), (int, float)) else "—")
        row.append(f"[report]({r['report']})" if r.get("report") else "—")
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in row) + " |")
        if r.get("reason"):
            what = "not available here" if r["status"] == "unavailable" else "no verdict"
            reasons.append(f"- {r['label']}: {what}: {r['reason']}")
    if reasons:
        lines += ["", "## Why", "", *[line.replace("|", "\\|") for line in reasons]]
    return "\n".join(lines) + "\n"


_CSS = """
body{font-family:system-ui,sans-serif;margin:1.5rem;color:#1d1d1f}
.scroll{overflow-x:auto}
table{border-collapse:collapse;width:100%}
th,td{border:1px solid #d0d0d7;padding:.25rem .3rem;font-size:.8rem;vertical-align:top;text-align:left}
th{background:#f3f3f6;vertical-align:bottom}th[data-col]{cursor:pointer;user-select:none}
th.rot span{writing-mode:vertical-rl;transform:rotate(180deg);white-space:nowrap}th.group{text-align:center}
.w,td.v,td.n{white-space:nowrap}
td.n{text-align:right;font-variant-numeric:tabular-nums}
.sub{display:block;white-space:nowrap;font-size:.7rem;color:#555}
td.pass{background:#e6f6ea}td.fail{background:#fde4e1}td.error{background:#fff1cc}td.skip{color:#777}
td.finding{background:#fff8c5}td.incomplete{background:#fff1cc}td.unavailable{color:#777;background:#f3f3f6}
tr.why td{border-top:0;background:#fafafb;font-size:.75rem;color:#444}
tr.why div{contain:inline-size;overflow-wrap:anywhere}
tr.why ul{margin:0;padding-left:1.2rem}
p.incomplete{background:#fff1cc;padding:.3rem .45rem}
.plot{max-width:46rem}.plot svg{width:100%;height:auto}
"""

# Each row is a <tbody> of its own (the row, and the line of its reasons under it): a click on a header
# sorts the tbodies by the cell of that header's column (its data-k when it has one).
_JS = """
document.querySelectorAll('th[data-col]').forEach(th=>th.addEventListener('click',()=>{
 const i=+th.dataset.col,t=th.closest('table'),groups=[...t.tBodies],asc=th.dataset.asc!=='1';
 const key=g=>{const c=g.rows[0].cells[i];return c.dataset.k||c.textContent;};
 groups.sort((a,b)=>{const x=key(a),y=key(b);const nx=parseFloat(x),ny=parseFloat(y);
  const c=(!isNaN(nx)&&!isNaN(ny))?nx-ny:x.localeCompare(y);return asc?c:-c;});
 th.dataset.asc=asc?'1':'0';groups.forEach(g=>t.appendChild(g));}));
"""

_VERDICT_COLOUR = {"pass": "#1a7f37", "fail": "#cf222e", "error": "#9a6700", "incomplete": "#9a6700"}


def error_speed_svg(rows: Sequence[dict[str, Any]]) -> str | None:
    """A scatter of each kernel's O error (rel. RMSE, log scale) against its forward+backward speed
    (its forward speed, marked, for a forward-only kernel), coloured by verdict; None when no row has
    both."""
    points = []
    for r in rows:
        e = (r["error"].get("out") or {}).get("rel_rmse")
        s = r.get("speed") or {}
        x, fwd_only = _number(s.get("fwdbwd_tflops")), False
        if x is None and _number(s.get("fwd_tflops")) is not None:
            x, fwd_only = _number(s.get("fwd_tflops")), True
        if e is not None and x is not None and e > 0:
            points.append((x, e, r["label"], r["status"], fwd_only))
    if not points:
        return None
    import matplotlib
    from matplotlib.figure import Figure

    with matplotlib.rc_context({"svg.fonttype": "none", "svg.hashsalt": "survey", "font.size": 9}):
        fig = Figure(figsize=(7.5, 4.2), layout="constrained")
        ax = fig.add_subplot()
        for x, e, name, status, fwd_only in points:
            colour = _VERDICT_COLOUR.get(status, "#555")
            ax.scatter([x], [e], color=colour, marker="^" if fwd_only else "o", s=36, zorder=3)
            ax.annotate(name + (" (fwd)" if fwd_only else ""), (x, e), textcoords="offset points", xytext=(5, 4))
        ax.set_yscale("log")
        ax.set_xlabel("forward+backward TFLOP/s (triangles: forward only)")
        ax.set_ylabel("O rel. RMSE vs float64")
        ax.set_title("error against speed (green pass, red fail)")
        ax.grid(True, which="both", alpha=0.3)
        buf = io.StringIO()
        fig.savefig(buf, format="svg")
    svg = buf.getvalue()
    return svg[svg.index("<svg") :]


def _words(text: str) -> str:
    """Escaped text that wraps only between its words and after a word's ``/`` or ``,`` (a kernel's
    path, an only-list), never inside a kernel name or a number."""
    words = []
    for word in str(text).split():
        pieces = re.split(r"(?<=[/,])", word)
        words.append("<wbr>".join(f"<span class='w'>{html.escape(p)}</span>" for p in pieces if p))
    return " ".join(words)


def _error_html(e: dict[str, float | None] | None, name: str = "") -> str:
    """The error (rel. RMSE) on one line, the recipe's model and the BF16 run's on a line each under it."""
    if not e or e.get("rel_rmse") is None:
        return "—"
    lines = [f"<span class='w'>{html.escape(name)}{e['rel_rmse']:.2g}</span>"]
    for what, key in (("model", "model"), ("BF16", "bf16")):
        if e.get(key) is not None:
            lines.append(f"<span class='sub'>{what} {e[key]:.2g}</span>")
    return "".join(lines)


def _reasons(row: dict[str, Any], families: Sequence[str]) -> list[str]:
    """Why the row has no verdict, why each of its columns failed (or found), and why it has no speed."""
    out = []
    if row.get("reason"):
        what = "not available here" if row["status"] == "unavailable" else "no verdict"
        out.append(f"<b>{what}</b>: {html.escape(row['reason'])}")
    for f in families:
        cell = _cell(row, f)
        if cell and cell["reason"]:
            out.append(f"<b>{html.escape(f)}</b>: {html.escape(cell['reason'])}")
    sp = row.get("speed") or {}
    if sp.get("error") and row["status"] != "unavailable":
        out.append(f"<b>speed</b>: {html.escape(_one_line(sp['error'], 200))}")
    return out


#: the speed columns, grouped under one header "TFLOP/s" in the HTML table
_TFLOPS = {"fwd TFLOP/s": "fwd", "bwd TFLOP/s": "bwd", "fwd+bwd TFLOP/s": "fwd+bwd"}


def _html_head(head: Sequence[str], families: Sequence[str]) -> str:
    """The table's header: a family's or verdict's name written upwards (those columns hold one short
    word each), the speed columns under one "TFLOP/s"; each column's header sorts by it."""
    esc = html.escape
    grouped = [i for i, h in enumerate(head) if h in _TFLOPS]
    span = " rowspan='2'" if grouped else ""
    top, sub = [], []
    for i, h in enumerate(head):
        if i in grouped:
            if i == grouped[0]:
                top.append(f"<th class='group' colspan='{len(grouped)}'>TFLOP/s</th>")
            sub.append(f"<th data-col='{i}'>{esc(_TFLOPS[h])}</th>")
        elif h in families:
            top.append(f"<th class='rot' data-col='{i}'{span}><span>{esc(h)}</span></th>")
        else:
            top.append(f"<th data-col='{i}'{span}>{esc(h)}</th>")
    rows = [top, sub] if grouped else [top]
    return "<thead>" + "".join(f"<tr>{''.join(r)}</tr>" for r in rows) + "</thead>"


def render_survey_html(
    rows: Sequence[dict[str, Any]], title: str, notes: Sequence[str] = (), missing: Sequence[str] = ()
) -> str:
    """One self-contained page: the table (a row per run, sortable by any column; each row's failure
    reasons on a line under it, the width of the table, so that the columns stay as narrow as their
    words), then the plot of error against speed."""
    esc = html.escape
    families, speed, head = _columns(rows, "O rel. RMSE", "time (s)")
    body = []
    for r in rows:
        status = r["status"]
        tds = [
            f"<td>{_words(r['label'])}</td>",
            f"<td class='v'>{esc(str(r.get('recipe') or ''))}</td>",
            f"<td class='v {esc(status)}'><b>{esc(status.upper())}</b></td>",
        ]
        for f in families:
            cell = _cell(r, f) or {"verdict": "", "reason": ""}
            tds.append(
                f"<td class='v {esc(cell['verdict'])}' title='{esc(cell['reason'])}'>{esc(cell['verdict'] or '—')}</td>"
            )
        out = r["error"].get("out") or {}
        tds.append(f"<td data-k='{out.get('rel_rmse') or 0}'>{_error_html(out)}</td>")
        worst = _worst_grad(r["error"])
        text = _error_html(worst[1], f"{worst[0]} ") if worst else ("forward-only" if r["forward_only"] else "—")
        tds.append(f"<td data-k='{(worst[1]['rel_rmse'] if worst else 0) or 0}'>{text}</td>")
        if speed:
            for c in _speed_cells(r.get("speed")):
                tds.append(f"<td class='n' data-k='{c if c not in ('—', 'n/a') else -1}'>{esc(c)}</td>")
        seconds = r.get("elapsed_s")
        tds.append(f"<td class='n' data-k='{seconds or 0}'>{'—' if seconds is None else f'{seconds:.0f}'}</td>")
        link = f"<a href='{esc(r['report'])}'>report</a>" if r.get("report") else "—"
        tds.append(f"<td class='v'>{link}</td>")
        reasons = _reasons(r, families)
        why = (
            f"<tr class='why'><td colspan='{len(head)}'><div><ul>{''.join(f'<li>{x}</li>' for x in reasons)}"
            "</ul></div></td></tr>"
            if reasons
            else ""
        )
        body.append(f"<tbody><tr>{''.join(tds)}</tr>{why}</tbody>")
    svg = error_speed_svg(rows)
    plot = f"<div class='plot'>{svg}</div>" if svg else ""
    note_items = "".join(f"<li>{esc(n)}</li>" for n in notes)
    note_items += "".join(
        f"<li>speed: {esc(s)}; x BF16: forward+backward over the fastest of {esc(', '.join(BASELINE_KERNELS))}</li>"
        for s in _shapes(rows)
    )
    return (
        "<!doctype html><html lang='en'><head><meta charset='utf-8'>"
        "<meta name='viewport' content='width=device-width, initial-scale=1'>"
        f"<title>{esc(title)}</title><style>{_CSS}</style></head><body>"
        f"<h1>{esc(title)}</h1>"
        + (f"<p class='incomplete'><b>{esc(_missing_line(rows, missing))}</b></p>" if missing else "")
        + f"<p>{len(rows)} row(s): {esc(_counts(rows))}; click a column to sort.</p>"
        f"<ul>{note_items}</ul>"
        f"<div class='scroll'><table class='survey'>{_html_head(head, families)}{''.join(body)}</table></div>{plot}"
        f"<script>{_JS}</script></body></html>\n"
    )


def render_sweep_markdown(
    results: Sequence[SweepResult], title: str = "flamia-verify sweep", reports: dict[str, str] | None = None
) -> str:
    return render_survey_markdown(survey_rows(results, reports=reports), title)


def render_sweep_html(
    results: Sequence[SweepResult], title: str = "flamia-verify sweep", reports: dict[str, str] | None = None
) -> str:
    return render_survey_html(survey_rows(results, reports=reports), title)


def write_sweep_reports(
    results: Sequence[SweepResult],
    out: Path,
    title: str = "flamia-verify sweep",
    missing: Sequence[str] = (),
    reports: dict[str, str] | None = None,
) -> None:
    """sweep.md and sweep.html in ``out``; ``reports`` maps a result's key to the path of its report,
    relative to ``out``."""
    rows = survey_rows(results, reports=reports)
    atomic_write_text(out / "sweep.md", render_survey_markdown(rows, title, missing=missing))
    atomic_write_text(out / "sweep.html", render_survey_html(rows, title, missing=missing))
