"""report.json stays small: the causal checks' leakage maps (one row per perturbation, one count per
position) made it 3.3 MB for the standard suite and 13.7 MB for the full one, pretty-printed one number
per indented line. Lists of scalars are now one line each; the data read back is unchanged."""

from __future__ import annotations

import json

from flamia_verify.reports.store import SPACED_LIST_CHARS, load_report, report_json, write_reports
from flamia_verify.results import CheckResult, Report


def _causal_like_report(maps: int = 20, rows: int = 40, positions: int = 160) -> Report:
    heatmaps = [
        {
            "title": f"out leakage map {m}",
            "x_label": "position in document",
            "y_label": "perturbation position t",
            "z_label": "changed elements (protected positions)",
            "z": [[(r * c + m) % 3 == 0 and r % 7 == 0 and 1 or 0 for c in range(positions)] for r in range(rows)],
            "y": [f"t={r}" for r in range(rows)],
        }
        for m in range(maps)
    ]
    series = {"title": "error", "ys": {"kernel": [1e-3 * (1 + i % 5) for i in range(2000)]}, "log_y": True}
    check = CheckResult(
        name="causal.forward",
        family="causal",
        status="pass",
        metrics={"leaked_elements": 0, "perturbations": maps * rows},
        thresholds={"leaked_elements": 0},
        worst_case={"lens_q": [3, 0, 5], "heads": 2},
        message="ok",
        duration_s=1.0,
        details={"heatmaps": heatmaps, "series": [series]},
    )
    return Report(kernel="k", recipe="mxfp8", suite="standard", seed=0, checks=[check])


def test_large_arrays_are_written_compactly_and_read_back_unchanged(tmp_path):
    report = _causal_like_report()
    text = report_json(report)
    numbers = 20 * 40 * 160 + 2000
    # one number per indented line took about 15 bytes per number; one line per row takes 2 ("0,")
    assert len(text) < 3 * numbers, f"{len(text)} bytes for {numbers} numbers"
    assert text.count("\n") < 20 * 45 + 200
    assert json.loads(text) == json.loads(json.dumps(report.to_dict(), default=str))
    path = tmp_path / "report.json"
    path.write_text(text)
    assert load_report(path).to_dict() == report.to_dict()


def test_write_reports_writes_the_compact_text(tmp_path):
    report = _causal_like_report(maps=1, rows=3, positions=100)
    assert write_reports(report, tmp_path)["json"].read_text() == report_json(report)


def test_small_things_stay_readable():
    text = report_json(_causal_like_report(maps=1, rows=2, positions=4))
    assert '"lens_q": [3, 0, 5]' in text  # short lists keep their spaces
    assert '\n  "checks": [\n' in text and '\n      "name": "causal.forward",\n' in text  # objects stay indented
    long_row = next(line for line in text.splitlines() if line.strip().startswith("[1e-3") or "0.001," in line)
    assert ", " not in long_row.strip() and len(long_row.strip()) > SPACED_LIST_CHARS
