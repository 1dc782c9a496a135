"""report.html in a real headless Chromium: it renders, its plots are drawn, and nothing errs or escapes.

Needs Debian's ``chromium`` at /usr/bin/chromium (FLAMIA_VERIFY_CHROMIUM overrides the path). Without it
these tests skip with the reason, except under CI (``CI`` set to anything but 0/false), where a missing
browser fails the run: .ci/run installs it.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

import pytest
import reports_chromium
from reports_chromium import Chromium
from reports_examples import EXAMPLE_PLOT_COUNT, XSS, example_report, hostile_report

from flamia_verify.reports import write_reports


def _in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def require_chromium() -> str:
    """The browser's path; fails under CI and skips elsewhere when it is not installed."""
    path = reports_chromium.CHROMIUM
    if os.path.isfile(path) and os.access(path, os.X_OK):
        return path
    reason = (
        f"headless Chromium not found at {path}: install Debian's chromium (apt-get install -y chromium) "
        "or point FLAMIA_VERIFY_CHROMIUM at one"
    )
    if _in_ci():
        pytest.fail(reason + " (CI is set, so the browser test may not be skipped)", pytrace=False)
    pytest.skip(reason)


@pytest.fixture(scope="module")
def browser():
    with Chromium(require_chromium()) as running:
        yield running


@pytest.fixture(scope="module")
def example_page(browser, tmp_path_factory):
    paths = write_reports(example_report(), tmp_path_factory.mktemp("example"))
    session, record = browser.open(paths["html"].as_uri())
    return session, record, paths["html"]


def _assert_clean(record, page_url):
    assert record.errors == [], "the page reported errors:\n" + "\n".join(record.errors)
    outside = [u for u in record.requests if u != page_url and not u.startswith("data:image/png;base64,")]
    assert outside == [], f"the page asked for resources beyond itself: {outside}"


def test_example_report_renders_without_errors(browser, example_page):
    session, record, path = example_page
    _assert_clean(record, path.as_uri())
    assert browser.evaluate(session, "document.title") == "flamia-verify FAIL: mxfp8-naive"
    assert browser.evaluate(session, "document.querySelector('#verdict .word').innerText") == "FAIL"
    sections = browser.evaluate(session, "document.querySelectorAll('section.check').length")
    assert sections == len(example_report().checks)
    assert browser.evaluate(session, "document.querySelectorAll('script').length") == 0


def test_every_plot_is_drawn_with_a_real_size(browser, example_page):
    session, _, _ = example_page
    sizes = browser.evaluate(
        session,
        "Array.from(document.querySelectorAll('figure.plot svg.plot'))"
        ".map(s => { const r = s.getBoundingClientRect(); return [r.width, r.height]; })",
    )
    assert len(sizes) == EXAMPLE_PLOT_COUNT
    for width, height in sizes:
        assert width > 300 and height > 150, f"a plot rendered at {width} x {height} px"
    # Lines, histogram steps and heatmap images are actually in the drawn SVGs.
    assert browser.evaluate(session, "document.querySelectorAll('svg.plot path').length") > 50
    heatmaps = browser.evaluate(
        session, "Array.from(document.querySelectorAll('svg.plot image')).map(i => i.getBBox().width)"
    )
    assert sum(w > 100 for w in heatmaps) == 1, (
        f"one heatmap (the all-zero one is a line of text), got widths {heatmaps}"
    )
    # Clip paths resolve: their ids were prefixed per figure, and the references followed.
    dangling = browser.evaluate(
        session,
        "Array.from(document.querySelectorAll('[clip-path]')).map(e => e.getAttribute('clip-path'))"
        ".filter(v => !document.getElementById(v.slice(5, -1))).length",
    )
    assert dangling == 0


def test_hostile_report_is_inert(browser, tmp_path):
    paths = write_reports(hostile_report(), tmp_path)
    session, record = browser.open(paths["html"].as_uri())
    try:
        _assert_clean(record, paths["html"].as_uri())
        assert browser.evaluate(session, "document.title") == f"flamia-verify FAIL: {XSS}"
        assert browser.evaluate(session, "document.querySelectorAll('script, img, [onerror]').length") == 0
        assert XSS in browser.evaluate(session, "document.body.innerText")
        assert browser.evaluate(session, "document.querySelectorAll('svg.plot').length") == EXAMPLE_PLOT_COUNT
    finally:
        browser.close_page(session)


def test_the_harness_sees_errors(browser, tmp_path):
    """A page with each kind of problem: the checks above would catch it."""
    bad = tmp_path / "bad.html"
    bad.write_text(
        "<!DOCTYPE html><title>bad</title><p>x</p>"
        "<script>console.error('console says no'); undefined_function();</script>"
        '<img src="http://192.0.2.1/outside.png">'
    )
    session, record = browser.open(bad.as_uri())
    browser.close_page(session)
    errors = "\n".join(record.errors)
    assert "console.error: console says no" in errors
    assert "undefined_function is not defined" in errors
    assert any(u.startswith("http://192.0.2.1/") for u in record.requests)


def test_screenshot_is_a_png(browser, example_page, tmp_path):
    session, _, _ = example_page
    png = browser.screenshot(session, tmp_path / "shot.png", height=1200)
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", data[16:24])
    assert (width, height) == (1280, 1200)


def test_missing_browser_fails_in_ci_and_skips_elsewhere(monkeypatch):
    monkeypatch.setattr(reports_chromium, "CHROMIUM", "/nonexistent/chromium")
    monkeypatch.setenv("CI", "1")
    with pytest.raises(pytest.fail.Exception, match="CI is set"):
        require_chromium()
    monkeypatch.delenv("CI")
    with pytest.raises(pytest.skip.Exception, match="headless Chromium not found at /nonexistent/chromium"):
        require_chromium()


def test_the_checks_table_fits_an_800_pixel_window(browser, tmp_path):
    """At 800 px the checks table used to be 857 px wide (977 px for a standard-suite report): the page
    scrolled sideways. Long check and metric names break after their dots and underscores now."""
    paths = write_reports(example_report(), tmp_path)
    session, record = browser.open(paths["html"].as_uri(), width=800)
    try:
        _assert_clean(record, paths["html"].as_uri())
        page = browser.evaluate(session, "[document.documentElement.scrollWidth, document.documentElement.clientWidth]")
        assert page[0] <= page[1], f"the page is {page[0]} px wide in an {page[1]} px window"
        table = browser.evaluate(
            session, "(t => [t.scrollWidth, t.parentElement.clientWidth])(document.querySelector('table.checks'))"
        )
        assert table[0] <= table[1], f"the checks table is {table[0]} px wide in {table[1]} px"
        # names still read whole: a break opportunity is not a character
        names = browser.evaluate(
            session, "Array.from(document.querySelectorAll('table.checks td:first-child')).map(td => td.innerText)"
        )
        assert [n.replace("\n", "") for n in names] == [c.name for c in example_report().checks]
    finally:
        browser.close_page(session)


def test_the_run_block_keeps_its_rows_together_beside_a_long_environment(browser, tmp_path):
    """The Run block's five rows were spread over the height of the Environment column beside it
    (about 75 px apart at 1400 px, where the environment's rows are 21 px apart)."""
    report = example_report()
    # what a run on a machine records (check's environment: versions, device, threads, timings)
    report.environment.update(
        {k: "x" for k in ("triton", "python", "platform", "torch_threads", "dtype", "backward", "case_timeout_s")}
        | {"kernel_source": "builtin", "kernel_calls": 5, "kernel_seconds": 0.7, "total_seconds": 0.03}
    )
    paths = write_reports(report, tmp_path)
    session, record = browser.open(paths["html"].as_uri(), width=1400)
    try:
        _assert_clean(record, paths["html"].as_uri())
        tops = browser.evaluate(
            session,
            "Array.from(document.querySelectorAll('div.columns > dl.run > dt'))"
            ".map(dt => dt.getBoundingClientRect().top)",
        )
        env = browser.evaluate(
            session,
            "Array.from(document.querySelectorAll('div.columns > div > dl.run > dt'))"
            ".map(dt => dt.getBoundingClientRect().top)",
        )
        assert len(tops) == 5 and len(env) >= 12
        run_step = max(b - a for a, b in zip(tops, tops[1:]))
        env_step = max(b - a for a, b in zip(env, env[1:]))
        assert run_step <= 1.5 * env_step, (tops, env)
    finally:
        browser.close_page(session)


# -- the survey's and the sweep's pages (flamia_verify.reports.survey) ---------------------------------

#: the window the survey and sweep pages must read well in: a laptop's browser
SURVEY_WIDTH = 1400

#: Every word of the page's table that the browser broke over two lines or more (a word: a run of
#: non-space characters of one text node; the pages break long names and paths only between nodes).
_BROKEN_WORDS = """(() => {
  const out = [], walk = document.createTreeWalker(document.querySelector('table'), NodeFilter.SHOW_TEXT);
  for (let node = walk.nextNode(); node; node = walk.nextNode()) {
    for (const m of node.data.matchAll(/\\S+/g)) {
      const range = document.createRange();
      range.setStart(node, m.index);
      range.setEnd(node, m.index + m[0].length);
      const lines = new Set([...range.getClientRects()].filter(r => r.width > 0).map(r => Math.round(r.top)));
      if (lines.size > 1) out.push(m[0] + ' (' + lines.size + ' lines)');
    }
  }
  return out;
})()"""

#: The number of text lines of each header written across, and of each cell of a short column.
_LINES = """(selector => [...document.querySelectorAll(selector)].map(e => {
  const range = document.createRange();
  range.selectNodeContents(e);
  const tops = [...range.getClientRects()].filter(r => r.width > 0 && r.height > 0).map(r => Math.round(r.top));
  return [e.innerText, new Set(tops).size];
}))"""


def _survey_pages(tmp_path):
    """The survey of docs/survey.md (every family, both optional verdicts, long reasons, speed, a kernel
    that hung, two that could not run) as survey.html, and as sweep.html with the sweep's case labels."""
    from reports_examples import SURVEY_UNAVAILABLE, survey_results

    from flamia_verify.reports.survey import render_survey_html, survey_rows

    results = survey_results()
    reports = {r.key: f"kernels/{r.kernel}/report.html" for r in results if r.report}
    rows = survey_rows(results, label=lambda c: str(c["kernel"]), reports=reports, unavailable=SURVEY_UNAVAILABLE)
    survey = tmp_path / "survey.html"
    survey.write_text(render_survey_html(rows, "flamia-verify survey: quick suite on cuda", ["NVIDIA H200"]))
    sweep = tmp_path / "sweep.html"
    sweep.write_text(render_survey_html(survey_rows(survey_results(speed=False)), "flamia-verify sweep: s.toml"))
    return {"survey": survey, "sweep": sweep}


@pytest.mark.parametrize("page", ["survey", "sweep"])
def test_survey_and_sweep_tables_fit_1400_pixels_without_breaking_a_word(browser, tmp_path, page):
    """At 1400 px the failure reasons took the width and every other header and cell wrapped letter by
    letter ("P / A / S / S", "re / ci / p / e"). The reasons are a line under their row now, as wide as
    the table; the columns are as narrow as their longest word, and no word breaks."""
    path = _survey_pages(tmp_path)[page]
    session, record = browser.open(path.as_uri(), width=SURVEY_WIDTH)
    try:
        _assert_clean(record, path.as_uri())
        html_width = browser.evaluate(session, "[document.documentElement.scrollWidth, innerWidth]")
        assert html_width[0] <= html_width[1], f"the page is {html_width[0]} px wide in a {html_width[1]} px window"
        table = browser.evaluate(
            session, "(t => [t.scrollWidth, t.parentElement.clientWidth])(document.querySelector('table'))"
        )
        assert table[0] <= table[1], f"the table is {table[0]} px wide in {table[1]} px"
        broken = browser.evaluate(session, _BROKEN_WORDS)
        assert broken == [], f"words broken inside: {broken[:20]}"
        headers = browser.evaluate(session, _LINES + "('th:not(.rot)')")
        assert headers and all(lines <= 2 for _, lines in headers), headers
        # a verdict, a recipe, a number: one line each
        short = [s for s in browser.evaluate(session, _LINES + "('td.v, td.n')") if s[0]]
        assert short and all(lines == 1 for _, lines in short), [s for s in short if s[1] != 1]
        # every failure's reason is on the page, beside its row
        reasons = browser.evaluate(session, "document.querySelector('table').innerText")
        assert "isolation.neighbours: changed_elements = 477826 breaks <= 0" in reasons
        assert "timed out after 300 s (worker killed)" in reasons
    finally:
        browser.close_page(session)


def test_a_survey_table_sorts_rows_with_their_reasons(browser, tmp_path):
    """A click on a header sorts the rows; each row's line of reasons moves with it."""
    path = _survey_pages(tmp_path)["survey"]
    session, record = browser.open(path.as_uri(), width=SURVEY_WIDTH)
    try:
        _assert_clean(record, path.as_uri())
        click = "[...document.querySelectorAll('th')].find(th => th.innerText === 'time (s)').click()"
        browser.evaluate(session, click)
        browser.evaluate(session, click)  # the second click sorts the other way: the longest first
        order = browser.evaluate(
            session,
            "[...document.querySelector('table').tBodies].map(b => [...b.rows].map(r => r.innerText.trim()))",
        )
        assert order[0][0].startswith("/home/me/attention/kernels/hung_kernel.py:attn")
        assert "timed out after 300 s" in order[0][1]
        assert order[1][0].startswith("sage")
        sage = order[1][1]
        assert "error.out: normalized_error = 368.1" in sage
    finally:
        browser.close_page(session)


def _stored_sweep(tmp_path):
    """A sweep's output directory written by `sweep merge` from stored results (no kernel runs): a case
    that failed, one that passed, the same kernel on another seed, one that hung (no report)."""
    import json

    from reports_examples import example_report, passing_report

    from flamia_verify.sweep import SCHEMA, merge_sweeps

    def result(n, kernel, seed, report, status):
        case = {"kernel": kernel, "suite": "quick", "dtype": "bf16", "seed": seed, "only": []}
        error = None if report else "timed out after 60 s (worker killed)"
        return {"key": f"{n:032x}", "case": case, "status": status, "report": report, "error": error}

    results = [
        result(1, "mxfp8-naive", 0, example_report(seed=0).to_dict(), "fail"),
        result(2, "flamia-mxfp8", 0, passing_report(seed=0).to_dict(), "pass"),
        result(3, "flamia-mxfp8", 1, passing_report(seed=1).to_dict(), "pass"),
        result(4, "hung.py:attn", 0, None, "error"),
    ]
    shard = tmp_path / "shard"
    shard.mkdir()
    labels = {r["key"]: f"{r['case']['kernel']} seed={r['case']['seed']}" for r in results}
    document = {"schema": SCHEMA, "source": "s.toml", "shard": None, "matrix": list(labels), "labels": labels}
    (shard / "sweep.json").write_text(json.dumps({**document, "complete": True, "missing": [], "results": results}))
    merge_sweeps([shard], tmp_path / "out")
    return tmp_path / "out", results


def test_every_sweep_row_links_its_own_case_report(browser, tmp_path):
    """The sweep's "report" column was empty on every row: no case's report could be reached. Each case
    with a report now has its report.html under reports/<key>/, linked by a relative path that the
    browser opens; a case without one (it hung) says so."""
    import json
    from urllib.parse import unquote, urlparse

    out, results = _stored_sweep(tmp_path)
    page = out / "sweep.html"
    session, record = browser.open(page.as_uri(), width=SURVEY_WIDTH)
    try:
        _assert_clean(record, page.as_uri())
        links = browser.evaluate(
            session,
            "[...document.querySelectorAll('table tbody tr:not(.why)')].map(tr => tr.cells[tr.cells.length - 1])"
            ".map(td => { const a = td.querySelector('a'); return a ? [a.getAttribute('href'), a.href] : null; })",
        )
    finally:
        browser.close_page(session)
    assert len(links) == len(results)
    for result, link in zip(results, links):
        if result["report"] is None:
            assert link is None, f"{result['case']} has no report but links {link}"
            continue
        assert link is not None, f"{result['case']}: no report link"
        href, url = link
        assert not href.startswith(("/", "file:")), f"{href} is not relative"
        target = Path(unquote(urlparse(url).path))
        assert target.is_file(), f"{href} does not exist"
        own = json.loads((target.parent / "report.json").read_text())
        assert (own["kernel"], own["seed"]) == (result["report"]["kernel"], result["report"]["seed"])
        session, record = browser.open(url, width=SURVEY_WIDTH)
        try:
            _assert_clean(record, url)
            title = browser.evaluate(session, "document.title")
            assert title == f"flamia-verify {result['status'].upper()}: {result['case']['kernel']}"
        finally:
            browser.close_page(session)
