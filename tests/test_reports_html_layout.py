"""report.html for a person: times read "1.2 s", not "1.234"; a log-scale plot says where its zeros went
(they used to vanish: matplotlib masks the points a log axis cannot place)."""

from __future__ import annotations

import re

import pytest
from reports_examples import example_report

from flamia_verify.reports import render_html
from flamia_verify.reports.metrics import format_seconds
from flamia_verify.reports.plots import MAX_FLOOR_MARKERS, Plot, render_plot_svg


@pytest.mark.parametrize(
    "value, text",
    [
        (0.0, "0 s"),
        (0.0004, "< 0.01 s"),
        (0.0523, "0.05 s"),
        (1.234, "1.2 s"),
        (12.67, "12.7 s"),
        (59.96, "1 min 00 s"),
        (125.3, "2 min 05 s"),
        (None, "—"),
        ("inf", "inf"),
    ],
)
def test_format_seconds(value, text):
    assert format_seconds(value) == text


def test_times_in_the_page_are_formatted():
    report = example_report()
    report.checks[0].duration_s = 1.2345678
    page = render_html(report)
    table = re.search(r'<table class="checks">(.*?)</table>', page, re.S).group(1)
    times = re.findall(r'<td class="num">([^<]*\bs)</td><td class="msg">', table)
    assert times[0] == "1.2 s" and len(times) == len(report.checks), times
    assert "1.234" not in page and "<th>Time</th>" in table
    section = re.search(r'id="check-[^"]*">\s*<h3>(.*?)</h3>', page, re.S).group(1)
    assert re.search(r"\d s</span>$", section), section


def _svg(kind, spec):
    return render_plot_svg(Plot(kind, 0, spec))


def test_zero_points_of_a_log_plot_are_drawn_at_the_floor_and_counted():
    spec = {"title": "err", "ys": {"kernel": [0.1, 0.0, 0.2, 0.0], "bf16": [0.01, 0.02, 0.0, 0.01]}, "log_y": True}
    svg = _svg("series", spec)
    assert "3 point(s) ≤ 0 drawn at the axis floor" in svg
    assert "≤ 0, at the axis floor" in svg  # the legend names the markers
    without = _svg("series", {**spec, "ys": {"kernel": [0.1, 0.3, 0.2, 0.4]}})
    assert "axis floor" not in without
    many = _svg("series", {"ys": {"a": [0.0, 1.0] * 2000}, "log_y": True})
    assert "2000 point(s) ≤ 0 drawn at the axis floor" in many
    assert MAX_FLOOR_MARKERS < 2000


def test_points_a_log_axis_cannot_draw_are_counted():
    svg = _svg("series", {"x": [0, 1, 2, 3], "ys": {"a": [1.0, 2.0, 3.0, 4.0]}, "log_x": True})
    assert "1 point(s) at x ≤ 0 not drawn on the log x axis" in svg
    svg = _svg("histograms", {"bin_edges": [1, 2, 3, 4], "counts": {"a": [5, 0, 7]}, "log_y": True})
    assert "1 bin(s) of count 0 not drawn on the log y axis" in svg
