"""junit.xml: one testsuite, one testcase per check, failure/error/skipped children that CI viewers read."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET

import pytest
from reports_examples import IMG_XSS, XSS, example_report, hostile_report, passing_report

from flamia_verify.reports import render_junit


def _parse(text):
    assert text.startswith('<?xml version="1.0" encoding="UTF-8"?>\n')
    return ET.fromstring(text.encode("utf-8"))


@pytest.fixture(scope="module")
def root():
    return _parse(render_junit(example_report()))


def test_one_suite_with_totals(root):
    assert root.tag == "testsuites"
    suites = root.findall("testsuite")
    assert len(suites) == 1
    for element in (root, suites[0]):
        assert {k: element.get(k) for k in ("tests", "failures", "errors", "skipped")} == {
            "tests": "11",
            "failures": "2",
            "errors": "1",
            "skipped": "1",
        }
        assert element.get("time") == "12.220"
    assert suites[0].get("name") == "flamia-verify mxfp8-naive (mxfp8, quick)"


def test_run_is_recorded_as_properties(root):
    props = {p.get("name"): p.get("value") for p in root.find("testsuite/properties")}
    assert props["kernel"] == "mxfp8-naive" and props["seed"] == "1234" and props["recipe"] == "mxfp8"
    # an entry without a value (no Triton installed) is left out; report.json keeps it as null
    assert props["environment.torch"] == "2.13.0" and "environment.triton" not in props


def test_one_testcase_per_check_with_the_right_children(root):
    report = example_report()
    cases = root.findall("testsuite/testcase")
    assert [(c.get("classname"), c.get("name")) for c in cases] == [(c.family, c.name) for c in report.checks]
    expected_child = {"pass": [], "fail": ["failure"], "error": ["error"], "skip": ["skipped"]}
    for case, check in zip(cases, report.checks, strict=True):
        assert [child.tag for child in case] == expected_child[check.status], check.name
        assert float(case.get("time")) == pytest.approx(check.duration_s, abs=5e-4)


def test_failure_carries_message_metrics_and_worst_case(root):
    case = root.find("testsuite/testcase[@name='error.backward']")
    failure = case.find("failure")
    assert failure.get("type") == "fail"
    assert failure.get("message") == "dK error 9.7x BF16 (limit 4x): K quantized across the causal diagonal"
    text = failure.text
    assert "rel_err_vs_bf16_dK = 9.7  (threshold: at most 4: OUTSIDE)" in text
    assert "max_abs_err_dV = nan" in text
    assert "reproduce: run seed 1234 (--seed of the command below), case seed 1301 (the worst case's own seed)" in text
    assert "flamia-verify check --kernel mxfp8-naive --recipe mxfp8 --suite quick --seed 1234 --only error" in text
    worst = json.loads(text.split("worst case:\n", 1)[1])
    assert worst == example_report().check("error.backward").worst_case


def test_error_and_skip_children(root):
    error = root.find("testsuite/testcase[@name='causal.backward']/error")
    assert error.get("type") == "error" and error.get("message").startswith("KernelCrashError: backward raised")
    skipped = root.find("testsuite/testcase[@name='determinism.backward']/skipped")
    assert skipped.get("message") == "kernel is forward-only: gradient checks skipped"


def test_all_pass_report_has_no_failure_elements():
    root = _parse(render_junit(passing_report()))
    assert root.get("failures") == "0" and root.get("errors") == "0"
    assert not root.findall(".//failure") and not root.findall(".//error")


def test_markup_is_escaped_and_control_characters_kept_visible():
    text = render_junit(hostile_report())
    root = _parse(text)  # parses: NUL and ESC would make the XML invalid
    assert "<script" not in text and "<img" not in text
    assert root.find("testsuite").get("name").startswith(f"flamia-verify {XSS}")
    failure = root.find("testsuite/testcase[@name='error.backward']/failure")
    assert failure.get("message").startswith(IMG_XSS + " | **bold**")
    assert "\\x1b[31m red \\x00" in failure.get("message")
    skipped = root.find(f"testsuite/testcase[@name='special.{XSS}']/skipped")
    assert skipped.get("message") == IMG_XSS
