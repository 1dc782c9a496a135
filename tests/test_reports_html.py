"""report.html without a browser: content, self-containment, escaping, and the plot conventions."""

from __future__ import annotations

import copy
import json
import re
from html.parser import HTMLParser

import numpy as np
import pytest
from reports_examples import EXAMPLE_PLOT_COUNT, IMG_XSS, XSS, example_report, hostile_report, passing_report

from flamia_verify.reports import render_html
from flamia_verify.reports.plots import (
    MAX_HEATMAP_SIDE,
    MAX_LINE_POINTS,
    Plot,
    PlotSpecError,
    _decimate,
    _max_pool,
    plots_of,
    render_plot_svg,
)

# Elements that load or run something: none may appear in a report.
ACTIVE_TAGS = {
    "script",
    "iframe",
    "object",
    "embed",
    "link",
    "base",
    "form",
    "img",
    "video",
    "audio",
    "frame",
    "foreignobject",
    "animate",
    "set",
}


class _Page(HTMLParser):
    """Collects tags, attributes, ids and text of a page."""

    def __init__(self, text):
        super().__init__(convert_charrefs=True)
        self.tags: list[tuple[str, dict[str, str | None]]] = []
        self.text: list[str] = []
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))

    handle_startendtag = handle_starttag

    def handle_data(self, data):
        self.text.append(data)

    def count(self, tag, **attrs):
        return sum(1 for t, a in self.tags if t == tag and all(a.get(k) == v for k, v in attrs.items()))

    @property
    def plain(self):
        return "".join(self.text)


@pytest.fixture(scope="module")
def page_text():
    return render_html(example_report())


@pytest.fixture(scope="module")
def page(page_text):
    return _Page(page_text)


def _assert_inert(page):
    for tag, attrs in page.tags:
        assert tag not in ACTIVE_TAGS, f"<{tag}> in the report"
        for name, value in attrs.items():
            assert not name.startswith("on"), f"event handler {name}= on <{tag}>"
            if name in ("href", "src", "xlink:href") and value:
                inside = value.startswith(("#", "data:image/png;base64,"))
                assert inside, f"<{tag} {name}={value[:60]!r}> leaves the page"


def test_page_is_self_contained_and_inert(page_text, page):
    assert page_text.startswith("<!DOCTYPE html>")
    assert page.count("meta", **{"http-equiv": "Content-Security-Policy"}) == 1
    csp = next(a["content"] for t, a in page.tags if t == "meta" and a.get("http-equiv"))
    assert csp.startswith("default-src 'none'") and "script-src" not in csp
    _assert_inert(page)
    assert not re.search(r"(src|href)=[\"']?(https?:)?//", page_text), "no network reference"


def test_summary_and_verdict(page):
    text = page.plain
    assert "FAIL11 checks: 7 passed, 2 failed, 1 error, 1 skipped" in text
    for label, value in (
        ("Kernel", "mxfp8-naive"),
        ("Recipe", "mxfp8"),
        ("Suite", "quick"),
        ("Seed", "1234"),
        ("torch", "2.13.0"),
        ("device", "cpu"),
    ):
        assert f"{label}{value}" in text, label


def test_table_and_a_section_per_check(page):
    report = example_report()
    ids = [a.get("id") for t, a in page.tags if t == "section"]
    assert len(ids) == len(report.checks) == len(set(ids))
    links = [a["href"] for t, a in page.tags if t == "a" and a.get("href", "").startswith("#")]
    assert set(links) == {f"#{i}" for i in ids}
    # Failed and errored checks come first among the sections.
    assert ids[:3] == ["check-error.backward", "check-causal.forward", "check-causal.backward"]


def test_failure_section_has_metrics_message_and_reproducer(page_text):
    pattern = r'<section class="check fail" id="check-error.backward">(.*?)</section>'
    section = re.search(pattern, page_text, re.S).group(1)
    plain = _Page(section).plain
    assert "dK error 9.7x BF16 (limit 4x): K quantized across the causal diagonal" in plain
    assert "rel_err_vs_bf16_dK9.7≤ 4above" in plain
    assert "max_abs_err_dVnan" in plain
    assert "Run seed1234 (--seed of the re-run command)Case seed1301 (the worst case's own seed)" in plain
    assert "flamia-verify check --kernel mxfp8-naive --recipe mxfp8 --suite quick --seed 1234 --only error" in plain
    worst = json.loads(re.search(r"Worst case:(\{.*?\n\})", plain, re.S).group(1))
    assert worst == example_report().check("error.backward").worst_case


def test_every_plot_is_an_inline_svg(page):
    assert page.count("svg", **{"class": "plot"}) == EXAMPLE_PLOT_COUNT
    assert page.count("figure", **{"class": "plot"}) == EXAMPLE_PLOT_COUNT
    assert page.count("div", **{"class": "plot-error"}) == 0


def test_svg_ids_are_unique_across_plots(page):
    ids = [a["id"] for t, a in page.tags if a.get("id")]
    assert len(ids) == len(set(ids))


def test_hostile_strings_are_escaped_everywhere():
    text = render_html(hostile_report())
    page = _Page(text)
    _assert_inert(page)
    assert not re.search(r"<script|<img", text, re.I), "a raw tag survived"
    assert XSS in page.plain and IMG_XSS in page.plain, "the reader still sees the strings as text"
    assert "\x1b" not in text and "\x00" not in text
    assert "\\x1b[31m red \\x00" in page.plain
    assert page.count("svg", **{"class": "plot"}) == EXAMPLE_PLOT_COUNT


def test_title_escaped():
    text = render_html(hostile_report())
    title = re.search(r"<title>(.*?)</title>", text, re.S).group(1)
    assert title == "flamia-verify FAIL: &lt;script&gt;alert(1)&lt;/script&gt;"


def test_malformed_plot_is_reported_in_place_and_the_rest_renders():
    report = copy.deepcopy(example_report())
    report.check("error.forward").details["series"].append({"title": "bad", "ys": {"a": [1, 2], "b": [1]}})
    report.check("error.forward").details["heatmaps"] = "not a list"
    page = _Page(render_html(report))
    assert page.count("svg", **{"class": "plot"}) == EXAMPLE_PLOT_COUNT
    assert page.count("div", **{"class": "plot-error"}) == 2
    assert "Plot not drawn: details.series[1].ys['b']: has 1 values, expected 2 (the length of x)" in page.plain
    assert "Plot not drawn: details.heatmaps[0]: expected an object, got str" in page.plain


def test_report_without_checks_or_plots():
    report = passing_report()
    report.checks = []
    page = _Page(render_html(report))
    assert "No checks ran." in page.plain and page.count("svg") == 0


# ------------------------------------------------------------------------------------------------ plots


def _svg(kind, spec):
    return render_plot_svg(Plot(kind, 0, spec))


@pytest.mark.parametrize(
    "kind, spec, message",
    [
        ("series", {"x": [0, 1]}, "details.series[0].ys is missing"),
        ("series", {"ys": {"a": [1, "x"]}}, "details.series[0].ys['a'][1]: expected a number"),
        ("series", {"ys": {"a": [1, 2]}, "log_y": "yes"}, "details.series[0].log_y: expected true or false"),
        ("series", {"ys": {"a": [1, True]}}, "details.series[0].ys['a'][1]: expected a number, got a boolean"),
        ("series", {"ys": {"a": [1]}, "title": 3}, "details.series[0].title: expected a string, got int"),
        (
            "histograms",
            {"bin_edges": [0, 1, 1], "counts": {"a": [1, 2]}},
            "details.histograms[0].bin_edges: expected finite, strictly increasing edges",
        ),
        (
            "histograms",
            {"bin_edges": [0, 1, 2], "counts": {"a": [1]}},
            "details.histograms[0].counts['a']: has 1 values, expected 2",
        ),
        ("heatmaps", {"z": [[1, 2], [3]]}, "details.heatmaps[0].z: rows have different lengths"),
        ("heatmaps", {"z": [[1, 2]], "x": [0]}, "details.heatmaps[0].x: expected a list of 2 coordinates"),
        ("heatmaps", {}, "details.heatmaps[0].z is missing"),
    ],
)
def test_plot_spec_errors_name_the_field(kind, spec, message):
    with pytest.raises(PlotSpecError) as info:
        _svg(kind, spec)
    assert str(info.value).startswith(message), str(info.value)


def test_plots_of_finds_kinds_in_order():
    details = {"heatmaps": [{"z": [[0]]}], "series": [{"ys": {"a": [1]}}, {"ys": {"b": [2]}}], "other": 1}
    assert [(p.kind, p.index) for p in plots_of(details)] == [("series", 0), ("series", 1), ("heatmaps", 0)]
    assert plots_of(None) == [] and plots_of({}) == []


def test_decimation_keeps_a_single_spike():
    n = 100_000
    y = np.full(n, 1e-3)
    y[77_777] = 5.0
    x = np.arange(n, dtype=float)
    xd, yd = _decimate(x, y, MAX_LINE_POINTS)
    assert len(xd) <= MAX_LINE_POINTS and 5.0 in yd and 77_777.0 in xd
    assert np.all(np.diff(xd) > 0)


def test_max_pool_keeps_a_single_leaking_cell_and_its_sign():
    z = np.zeros((1000, 700))
    z[613, 401] = -0.25
    pooled = _max_pool(z, MAX_HEATMAP_SIDE)
    assert pooled.shape[0] <= MAX_HEATMAP_SIDE and pooled.shape[1] <= MAX_HEATMAP_SIDE
    assert pooled.min() == -0.25 and np.count_nonzero(pooled) == 1


def test_nonfinite_values_and_log_fallback_are_noted_in_the_title():
    svg = _svg("series", {"title": "t", "ys": {"a": [1.0, "nan", 2.0, "inf"]}, "log_y": True})
    assert "2 non-finite point(s)" in svg
    svg = _svg("series", {"ys": {"a": [0.0, 0.0]}, "log_y": True})
    assert "linear y: no positive values" in svg
    svg = _svg("heatmaps", {"z": [[0.0, "nan"], [1.0, 2.0]], "log_z": True})
    assert "1 non-finite cell(s) in magenta" in svg


def test_plot_text_is_literal():
    svg = _svg("series", {"title": "cost $x_1$ <b>", "ys": {"_hidden": [1, 2], "b": [2, 3]}})
    assert "&lt;b&gt;" in svg and "<b>" not in svg
    assert "$x_1$" in svg, "a dollar sign is not parsed as mathtext"
    assert "_hidden" in svg, "labels starting with an underscore stay in the legend"


def test_rendered_plots_are_cached_by_content():
    spec = {"title": "cache", "ys": {"a": list(range(50))}}
    first = _svg("series", spec)
    assert _svg("series", copy.deepcopy(spec)) is first
    assert _svg("series", {**spec, "title": "other"}) is not first
