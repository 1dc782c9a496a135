"""Any report, whatever its strings and numbers, round-trips through report.json and renders safely."""

from __future__ import annotations

import io
import re
import xml.etree.ElementTree as ET
from html.parser import HTMLParser

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from rich.console import Console

from flamia_verify.reports import (
    CheckResult,
    Report,
    load_report,
    render_html,
    render_junit,
    render_markdown,
    render_terminal,
    write_reports,
)
from flamia_verify.results import FAMILIES, STATUSES

# Every code point, surrogates and control characters included: kernels and messages are not ours.
any_text = st.text(st.characters(exclude_categories=()), max_size=24)
markup_text = st.text(st.sampled_from("<>&\"'`|*_[]()#\\\n\r\x1b\x00 az/"), max_size=24)
text = st.one_of(any_text, markup_text)
number = st.one_of(st.integers(-(2**60), 2**60), st.floats(allow_nan=True, allow_infinity=True))
scalar = st.one_of(number, text, st.booleans(), st.none())
case_value = st.recursive(
    scalar,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(text, inner, max_size=4)),
    max_leaves=12,
)


@st.composite
def check_results(draw):
    family = draw(st.sampled_from(FAMILIES))
    return CheckResult(
        name=f"{family}.{draw(text)}",
        family=family,
        status=draw(st.sampled_from(STATUSES)),
        metrics=draw(st.dictionaries(text, scalar, max_size=4)),
        thresholds=draw(st.dictionaries(text, scalar, max_size=3)),
        worst_case=draw(st.dictionaries(text, case_value, max_size=4)),
        message=draw(text),
        duration_s=draw(st.floats(0, 1e4)),
    )


reports = st.builds(
    Report,
    kernel=text,
    recipe=text,
    suite=st.one_of(st.sampled_from(["quick", "standard", "full"]), text),
    seed=st.integers(0, 2**63 - 1),
    environment=st.dictionaries(text, scalar, max_size=4),
    checks=st.lists(check_results(), max_size=6, unique_by=lambda c: c.name),
)

PROPERTY_SETTINGS = settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)

# Tags the Markdown renderer writes itself; anything else in its output would be injected markup.
MARKDOWN_TAGS = {"details", "summary", "b"}
ACTIVE_HTML = {"script", "iframe", "object", "embed", "link", "base", "form", "img", "foreignobject"}


class _Tags(HTMLParser):
    def __init__(self, text):
        super().__init__(convert_charrefs=True)
        self.tags = []
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))


@PROPERTY_SETTINGS
@given(report=reports)
def test_any_report_round_trips_through_report_json(tmp_path_factory, report):
    out = tmp_path_factory.mktemp("prop")
    paths = write_reports(report, out)
    assert load_report(paths["json"]).to_dict() == report.to_dict()
    for path in paths.values():
        path.read_bytes().decode("utf-8")  # every file is valid UTF-8


@PROPERTY_SETTINGS
@given(report=reports)
def test_any_report_renders_safely(report):
    junit = ET.fromstring(render_junit(report).encode("utf-8"))
    cases = junit.findall("testsuite/testcase")
    assert len(cases) == len(report.checks)
    child = {"pass": [], "fail": ["failure"], "error": ["error"], "skip": ["skipped"]}
    assert [[e.tag for e in case] for case in cases] == [child[c.status] for c in report.checks]

    md = render_markdown(report)
    md.encode("utf-8")
    injected = {m.lower() for m in re.findall(r"</?([A-Za-z][\w-]*)", md)} - MARKDOWN_TAGS
    assert not injected, f"markup got into the Markdown: {injected}"

    page = render_html(report)
    page.encode("utf-8")
    tags = _Tags(page).tags
    assert not [t for t, _ in tags if t in ACTIVE_HTML]
    assert not [name for _, attrs in tags for name in attrs if name.startswith("on")]
    assert sum(1 for t, _ in tags if t == "section") == len(report.checks)

    buffer = io.StringIO()
    render_terminal(report, Console(file=buffer, width=100, color_system=None))
    out = buffer.getvalue()
    out.encode("utf-8")
    assert "\x1b" not in out
