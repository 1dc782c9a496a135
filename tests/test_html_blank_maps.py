"""report.html draws a heatmap only where a cell is non-zero; a map of zeros is one line of text."""

from __future__ import annotations

import re

import pytest
from reports_examples import example_report

import flamia_verify
from flamia_verify.reports import render_html
from flamia_verify.reports.plots import Plot, blank_heatmap
from flamia_verify.results import CheckResult, Report


def _section(page: str, name: str) -> str:
    sections = [part.split("</section>")[0] for part in page.split('<section class="check ')[1:]]
    found = [
        s for s in sections if re.search(rf'<h3>.*?<span class="mono">{re.escape(name)}</span>', s.split("</h3>")[0])
    ]
    assert len(found) == 1, name
    return '<section class="check ' + found[0]


def _map(z, title="out leakage map"):
    return {
        "title": title,
        "x_label": "position in document",
        "y_label": "perturbation position t",
        "z_label": "changed elements (protected positions)",
        "z": z,
    }


def test_blank_heatmap_is_only_a_map_of_exact_zeros():
    assert blank_heatmap(Plot("heatmaps", 0, _map([[0, 0, 0], [0, 0.0, 0]]))) == (2, 3)
    assert blank_heatmap(Plot("heatmaps", 0, _map([[0, 0, 0], [0, 1, 0]]))) is None
    assert blank_heatmap(Plot("heatmaps", 0, _map([[0, "nan"], [0, 0]]))) is None  # NaN is something to see
    assert blank_heatmap(Plot("heatmaps", 0, _map([[0, 0], [0]]))) is None  # malformed: drawing reports it
    assert blank_heatmap(Plot("series", 0, {"ys": {"a": [0, 0]}})) is None


def test_a_leaking_map_is_drawn_and_a_blank_one_is_a_line():
    check = CheckResult(
        name="causal.forward",
        family="causal",
        status="fail",
        metrics={"leaked_elements": 2},
        thresholds={"leaked_elements": 0},
        details={
            "heatmaps": [
                _map([[0] * 8 for _ in range(3)], "out leakage map, tiny perturbation"),
                _map([[0] * 8, [0, 0, 0, 2, 0, 0, 0, 0], [0] * 8], "out leakage map, huge perturbation"),
            ]
        },
    )
    page = render_html(Report(kernel="k", recipe="mxfp8", suite="quick", seed=0, checks=[check]))
    section = _section(page, "causal.forward")
    assert section.count("<svg") == 1
    assert "out leakage map, huge perturbation" in section.split('<ul class="blank-maps')[0]
    assert (
        "out leakage map, tiny perturbation</span>: changed elements (protected positions) is 0 in every cell, "
        "3 rows (perturbation position t) × 8 columns (position in document); not drawn"
    ) in section


def test_example_report_states_its_zero_map_in_words():
    section = _section(render_html(example_report()), "isolation.packing")
    assert "<svg" not in section
    assert "Cross-document change (all zero)</span>: value is 0 in every cell, 4 rows (observed document)" in section


@pytest.fixture(scope="module")
def causal_pages():
    # the passing kernel's test reads both causal maps, the leaking kernel's test causal.forward's
    only = {"flamia-mxfp8": ["causal.forward", "causal.dk_dv"], "mxfp8-naive": ["causal.forward"]}
    return {
        name: render_html(flamia_verify.check(name, suite="quick", only=checks, device="cpu"))
        for name, checks in only.items()
    }


def test_a_passing_kernel_draws_no_empty_leakage_map(causal_pages):
    page = causal_pages["flamia-mxfp8"]
    for name in ("causal.forward", "causal.dk_dv"):
        section = _section(page, name)
        assert 'class="check pass"' in section
        assert "<svg" not in section, name
        assert section.count("is 0 in every cell") >= 1, name


def test_a_leaking_kernel_draws_its_leakage_maps(causal_pages):
    page = causal_pages["mxfp8-naive"]
    section = _section(page, "causal.forward")
    assert 'class="check fail"' in section
    assert section.count("<svg") >= 1
