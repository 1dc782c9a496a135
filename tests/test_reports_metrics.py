"""The rules every renderer shares: key metric, direction of a metric, value formatting, safe JSON."""

from __future__ import annotations

import json
import math

import pytest

from flamia_verify.reports import CheckResult, key_metric
from flamia_verify.reports.metrics import (
    as_number,
    format_threshold,
    format_value,
    higher_is_better,
    safe_json,
    threshold_verdict,
)


def _check(status="pass", metrics=None, thresholds=None):
    return CheckResult("error.forward", "error", status, metrics or {}, thresholds or {}, {})


def test_key_metric_is_first_threshold_with_same_named_metric():
    key = key_metric(_check(metrics={"a": 1.0, "b": 2.0, "c": 3.0}, thresholds={"b": 4.0, "c": 5.0}))
    assert (key.name, key.metric, key.value, key.threshold, key.within) == ("b", "b", 2.0, 4.0, True)
    assert key.label == "b"


def test_key_metric_of_failed_check_is_first_violated_threshold():
    check = _check("fail", metrics={"dq": 1.0, "dk": 9.7, "dv": 8.0}, thresholds={"dq": 4.0, "dk": 4.0, "dv": 4.0})
    key = key_metric(check)
    assert (key.name, key.value, key.within) == ("dk", 9.7, False)


def test_key_metric_falls_back_to_first_metric_when_names_differ():
    key = key_metric(_check(metrics={"leak": 0.0, "count": 0}, thresholds={"leak_max": 0.0}))
    assert (key.name, key.metric, key.value, key.threshold, key.within) == ("leak_max", "leak", 0.0, 0.0, None)
    assert key.label == "leak_max (leak)"


def test_key_metric_without_thresholds_or_metrics():
    key = key_metric(_check(metrics={"x": 1, "y": 2}))
    assert (key.name, key.value, key.threshold) == ("x", 1, None)
    assert key_metric(_check()) is None
    errored = key_metric(_check("error", thresholds={"leak": 0.0}))
    assert (errored.name, errored.metric, errored.value, errored.threshold) == ("leak", None, None, 0.0)


@pytest.mark.parametrize(
    "name, higher",
    [
        ("rel_err_vs_bf16_dK", False),
        ("max_leak", False),
        ("bound_violations", False),
        ("sqnr_O_db", True),
        ("SQNR", True),
        ("cos_dQ", True),
        ("cosine", True),
        ("tokens_min", True),
        ("min_ratio", False),
    ],
)
def test_direction_rule(name, higher):
    assert higher_is_better(name) is higher


@pytest.mark.parametrize(
    "metric, value, threshold, expected",
    [
        ("err", 1.0, 4.0, True),
        ("err", 4.0, 4.0, True),
        ("err", 4.1, 4.0, False),
        ("sqnr_db", 30.0, 25.0, True),
        ("sqnr_db", 20.0, 25.0, False),
        ("err", "nan", 4.0, False),
        ("err", float("nan"), 4.0, False),
        ("err", "inf", 4.0, False),
        ("cos", "-inf", 0.9, False),
        ("ok", True, True, True),
        ("ok", False, True, False),
        ("dtype", "bf16", "bf16", True),
        ("err", None, 4.0, None),
        ("err", "big", 4.0, None),
        ("err", 1.0, None, None),
    ],
)
def test_threshold_verdict(metric, value, threshold, expected):
    assert threshold_verdict(metric, value, threshold) is expected


@pytest.mark.parametrize(
    "value, text",
    [
        (None, "—"),
        (True, "true"),
        (3, "3"),
        (0.0, "0"),
        (2.7, "2.7"),
        (3.2e-7, "3.2e-07"),
        (123456.0, "1.235e+05"),
        (float("nan"), "nan"),
        (float("-inf"), "-inf"),
        ("nan", "nan"),
        ("bf16", "bf16"),
    ],
)
def test_format_value(value, text):
    assert format_value(value) == text


@pytest.mark.parametrize(
    "metric, threshold, text",
    [
        ("err", 4.0, "≤ 4"),
        ("sqnr_db", 25, "≥ 25"),
        ("cos", "nan", "≥ nan"),
        ("ok", True, "= true"),
        ("dtype", "bf16", "= bf16"),
        ("err", None, "—"),
    ],
)
def test_format_threshold(metric, threshold, text):
    assert format_threshold(metric, threshold) == text


def test_as_number_reads_nonfinite_strings_not_bools():
    assert math.isnan(as_number("nan")) and as_number("-inf") == -math.inf and as_number("INF") == math.inf
    assert as_number(True) is None and as_number("1.0") is None and as_number(None) is None


def test_safe_json_has_no_markup_and_parses_back():
    value = {"<script>": "a & b </pre>", "shape": [1, 2, 3], "nan": float("nan"), "nested": [{"x": [1]}]}
    text = safe_json(value)
    assert not set("<>&") & set(text)
    assert json.loads(text) == {"<script>": "a & b </pre>", "shape": [1, 2, 3], "nan": "nan", "nested": [{"x": [1]}]}
    assert '"shape": [1, 2, 3]' in text, "short lists of scalars stay on one line"
    assert json.loads(safe_json(value, indent=None)) == json.loads(text)


def test_safe_json_escapes_what_json_leaves_raw():
    value = {"k\udcff": "del\x7f c1\x85 sep\u2028 esc\x1b"}
    text = safe_json(value)
    assert text.isascii() or not any(0x7F <= ord(c) <= 0x9F or 0xD800 <= ord(c) <= 0xDFFF for c in text)
    assert "\\udcff" in text and "\\u007f" in text and "\\u0085" in text and "\\u2028" in text
    assert json.loads(text) == value
