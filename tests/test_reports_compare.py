"""The regression gate: status and metric regressions, directions, exit codes, readable output."""

from __future__ import annotations

import copy
import io
import math

import pytest
from reports_examples import example_report, passing_report
from rich.console import Console

from flamia_verify.errors import ConfigError
from flamia_verify.reports import CheckResult, Report, compare_reports, default_higher_is_worse, render_comparison
from flamia_verify.reports.compare import metric_badness


def _changed(report, name, *, status=None, **metrics):
    new = copy.deepcopy(report)
    check = new.check(name)
    if status:
        check.status = status
    check.metrics.update(metrics)
    return new


def _text(cmp, width=160, plain=False):
    """The comparison as a terminal shows it (``plain=False``: tables) or as a CI log gets it."""
    buffer = io.StringIO()
    render_comparison(cmp, Console(file=buffer, width=width, color_system=None), plain=plain)
    return buffer.getvalue()


def test_identical_reports_pass_the_gate():
    cmp = compare_reports(example_report(), example_report())
    assert cmp.exit_code == 0 and not cmp.regressions and not cmp.improvements
    assert not cmp.new_checks and not cmp.removed_checks and not cmp.context_notes
    assert _text(cmp).splitlines()[-1] == "OK  no regressions (metric factor 1.5, headroom share 0.5, 0 improvements)"


@pytest.mark.parametrize(
    "before, after, regressed",
    [
        ("pass", "fail", True),
        ("pass", "error", True),
        ("skip", "fail", True),
        ("skip", "error", True),
        ("fail", "pass", False),
        ("pass", "skip", False),
        ("fail", "error", False),
        ("error", "fail", False),
    ],
)
def test_status_changes(before, after, regressed):
    base = _changed(passing_report(), "causal.forward", status=before)
    new = _changed(passing_report(), "causal.forward", status=after)
    cmp = compare_reports(base, new)
    assert cmp.exit_code == int(regressed)
    change = (cmp.regressions + cmp.improvements + cmp.status_notes)[0]
    assert (change.kind, change.base, change.new) == ("status", before, after)
    if before in ("fail", "error") and after == "pass":
        assert cmp.improvements == [change]
    elif not regressed:
        assert cmp.status_notes == [change]
        assert f"status change (does not gate): causal.forward: {before.upper()} -> {after.upper()}" in _text(cmp)


def test_metric_regression_beyond_factor_and_headroom_fails_and_explains_itself():
    base = passing_report()
    new = _changed(base, "error.backward", rel_err_vs_bf16_dK=1.6 * 2.5)  # still passes its 4x threshold
    cmp = compare_reports(base, new)
    assert cmp.exit_code == 1
    (change,) = cmp.regressions
    assert (change.check, change.metric, change.base, change.new) == ("error.backward", "rel_err_vs_bf16_dK", 1.6, 4.0)
    assert change.times == pytest.approx(2.5)
    assert change.headroom == pytest.approx((4.0 - 1.6) / 4.0)
    assert change.describe() == (
        "error.backward: rel_err_vs_bf16_dK 1.6 -> 4, 2.5x worse (lower is better), 60% of the headroom to 4"
    )
    text = _text(cmp, width=200)
    assert "Regressions (1)" in text
    assert " ".join(next(line for line in text.splitlines() if "rel_err_vs_bf16_dK" in line).split()) == (
        "│ error.backward │ rel_err_vs_bf16_dK │ 1.6 │ 4 │ 2.5x worse (lower is better), 60% of the headroom to 4 │"
    )
    assert text.splitlines()[-1] == "REGRESSED  1 regression (metric factor 1.5, headroom share 0.5)"


def test_metric_change_within_factor_passes():
    base = _changed(passing_report(), "error.backward", rel_err_vs_bf16_dK=0.4)
    new = _changed(base, "error.backward", rel_err_vs_bf16_dK=0.4 + 0.5 * 4.0)  # 6x, half the headroom
    assert compare_reports(base, new).exit_code == 1
    close = _changed(base, "error.backward", rel_err_vs_bf16_dK=2.6)
    new = _changed(base, "error.backward", rel_err_vs_bf16_dK=2.6 * 1.49)  # 1.49x, 37% of the headroom
    assert compare_reports(close, new).exit_code == 0
    wide = _changed(base, "error.backward", rel_err_vs_bf16_dK=1.9)
    new = _changed(base, "error.backward", rel_err_vs_bf16_dK=1.9 * 2.1)  # 2.1x, 52% of the headroom
    assert compare_reports(wide, new, factor=2.0).exit_code == 1
    assert compare_reports(wide, new, factor=2.2).exit_code == 0


def test_a_large_ratio_inside_half_the_headroom_is_noise():
    base = _changed(passing_report(), "error.backward", rel_err_vs_bf16_dK=0.01)
    new = _changed(base, "error.backward", rel_err_vs_bf16_dK=1.9)  # 190x, 47% of the headroom to 4
    cmp = compare_reports(base, new)
    assert cmp.exit_code == 0 and not cmp.regressions
    assert compare_reports(new, base).improvements == []  # the mirror image is no improvement either


def test_improvement_is_listed_and_does_not_gate():
    base = _changed(passing_report(), "error.backward", rel_err_vs_bf16_dK=3.0)
    cmp = compare_reports(base, _changed(base, "error.backward", rel_err_vs_bf16_dK=0.4))
    assert cmp.exit_code == 0
    assert [c.describe() for c in cmp.improvements] == [
        "error.backward: rel_err_vs_bf16_dK 3 -> 0.4, 7.5x better (lower is better), 65% of the headroom to 4"
    ]
    assert "Improvements (1)" in _text(cmp)


def test_sqnr_drop_is_measured_in_noise_power():
    base = _changed(passing_report(), "error.forward", sqnr_O_db=26.5)  # threshold >= 25 dB
    small = compare_reports(base, _changed(base, "error.forward", sqnr_O_db=26.5 - 1.5))
    assert small.exit_code == 0, "1.5 dB is less than 10*log10(1.5) = 1.76 dB"
    base = _changed(passing_report(), "error.forward", sqnr_O_db=35.0)
    big = compare_reports(base, _changed(base, "error.forward", sqnr_O_db=35.0 - 9.0))
    assert big.exit_code == 1
    assert big.regressions[0].times == pytest.approx(10**0.9)
    # noise power 10^-2.6 - 10^-3.5 against the limit's 10^-2.5
    assert big.regressions[0].headroom == pytest.approx((10**-2.6 - 10**-3.5) / 10**-2.5)
    assert "higher is better" in big.regressions[0].describe()
    far = compare_reports(passing_report(), _changed(passing_report(), "error.forward", sqnr_O_db=36.0 - 3.0))
    assert far.exit_code == 0, "36 -> 33 dB spends 8% of the noise power the 25 dB limit allows"


def test_cosine_is_compared_by_its_distance_from_one():
    base = example_report()  # cos_dQ = 0.99991, threshold 0.999
    cmp = compare_reports(base, _changed(base, "bias.gradient_shrinkage", cos_dQ=0.9993))
    (change,) = [c for c in cmp.regressions if c.metric == "cos_dQ"]
    assert change.times == pytest.approx((1 - 0.9993) / (1 - 0.99991))
    assert change.headroom == pytest.approx((0.99991 - 0.9993) / (1 - 0.999))
    cmp = compare_reports(base, _changed(base, "bias.gradient_shrinkage", cos_dQ=0.9997))  # 3.3x, 21%
    assert [c for c in cmp.regressions if c.metric == "cos_dQ"] == []


def test_zero_leak_becoming_nonzero_regresses_without_a_finite_ratio():
    base = passing_report()
    cmp = compare_reports(base, _changed(base, "causal.forward", max_leak=1e-9))
    (change,) = cmp.regressions
    assert math.isinf(change.times)
    assert change.describe() == "causal.forward: max_leak 0 -> 1e-09, worse, no finite ratio (lower is better)"


def test_nan_is_worst_and_strings_round_trip():
    base = passing_report()
    cmp = compare_reports(base, _changed(base, "error.forward", rel_err_vs_bf16_O="nan"))
    assert [c.metric for c in cmp.regressions] == ["rel_err_vs_bf16_O"]
    assert cmp.regressions[0].describe() == (
        "error.forward: rel_err_vs_bf16_O 1.3 -> nan, worse, no finite ratio (lower is better)"
    )
    # nan is past the limit: nan -> 1.3 is an improvement, nan -> nan no change, nan -> inf a note
    back = compare_reports(_changed(base, "error.forward", rel_err_vs_bf16_O="nan"), base)
    assert back.exit_code == 0 and [c.metric for c in back.improvements] == ["rel_err_vs_bf16_O"]


def test_metrics_without_thresholds_are_informational_by_default():
    base = example_report()
    new = _changed(base, "error.forward", rms_err_O=1.0)  # rms_err_O has no threshold
    assert compare_reports(base, new).exit_code == 0
    assert default_higher_is_worse(new.check("error.forward"), "rms_err_O") is None
    assert default_higher_is_worse(new.check("error.forward"), "sqnr_O_db") is False


def test_custom_direction_compares_more_metrics():
    base = example_report()
    new = _changed(base, "error.forward", rms_err_O=1.0)

    def everything_lower_is_better(check: CheckResult, metric: str):
        return True

    cmp = compare_reports(base, new, higher_is_worse=everything_lower_is_better)
    assert [c.metric for c in cmp.regressions] == ["rms_err_O"]
    flipped = compare_reports(base, new, higher_is_worse=lambda check, metric: False if metric == "rms_err_O" else None)
    assert flipped.exit_code == 0 and [c.metric for c in flipped.improvements] == ["rms_err_O"]


def test_new_and_removed_checks_and_context_are_reported_and_lost_coverage_gates():
    base = passing_report()
    new = copy.deepcopy(base)
    new.seed = 99
    new.checks = [c for c in new.checks if c.name != "determinism.forward"]
    new.checks.append(CheckResult("bound.forward", "bound", "fail", {"bound_violations": 3}, {"bound_violations": 0}))
    cmp = compare_reports(base, new)
    # a passing check that went missing, and a new check that fails, both close the gate
    assert cmp.exit_code == 1
    assert sorted((c.check, c.base, c.new) for c in cmp.regressions) == [
        ("bound.forward", "absent", "fail"),
        ("determinism.forward", "skip", "missing"),
    ]
    narrower = compare_reports(base, new, allow_missing=True)
    assert [c.check for c in narrower.regressions] == ["bound.forward"]
    new.checks = [c for c in new.checks if c.name != "bound.forward"]
    assert compare_reports(base, new, allow_missing=True).exit_code == 0
    new.checks.append(CheckResult("bound.forward", "bound", "fail", {"bound_violations": 3}, {"bound_violations": 0}))
    assert cmp.new_checks == ["bound.forward"] and cmp.removed_checks == ["determinism.forward"]
    assert cmp.context_notes == ["seed differs: 1234 in base, 99 in new"]
    text = _text(cmp)
    assert "new checks: bound.forward (FAIL)" in text
    assert "removed checks: determinism.forward" in text
    assert "note: seed differs: 1234 in base, 99 in new; metrics come from different cases" in text


def test_example_against_passing_baseline():
    cmp = compare_reports(passing_report(), example_report())
    assert cmp.exit_code == 1
    assert [c.describe() for c in cmp.regressions if c.kind == "status"] == [
        "determinism.forward: SKIP -> missing",
        "causal.backward: absent -> ERROR",
        "error.backward: PASS -> FAIL",
        "causal.forward: PASS -> FAIL",
    ]


@pytest.mark.parametrize("factor", [0.5, 1, 1.0, float("nan"), float("inf"), True, "2"])
def test_bad_factor_is_a_config_error(factor):
    """One rule for the API, the CLI's --factor and the config's compare_factor (settings.compare_factor)."""
    with pytest.raises(ConfigError, match="compare factor must be a finite number greater than 1"):
        compare_reports(passing_report(), passing_report(), factor=factor)


@pytest.mark.parametrize(
    "metric, value, worse_if_higher, badness",
    [
        ("err", -2.0, True, 2.0),
        ("cos", 0.99, False, 0.01),
        ("sqnr", 20.0, False, 0.01),
        ("x_db", 10.0, False, 0.1),
        ("tokens_min", 4.0, False, 0.25),
        ("tokens_min", 0.0, False, math.inf),
        ("err", "nan", True, math.inf),
        ("err", "text", True, None),
    ],
)
def test_metric_badness(metric, value, worse_if_higher, badness):
    result = metric_badness(metric, value, worse_if_higher)
    assert result == (pytest.approx(badness) if badness not in (None, math.inf) else badness)


def test_an_incomplete_new_report_fails_the_gate_even_with_allow_missing():
    base = passing_report()
    new = copy.deepcopy(base)
    new.checks = new.checks[:1]
    new.complete, new.incomplete_reason = False, "interrupted (SIGTERM) after 1 of 3 checks"
    for allow in (False, True):
        cmp = compare_reports(base, new, allow_missing=allow)
        assert cmp.exit_code == 1
        assert any(c.check == "run.complete" and c.new == "incomplete" for c in cmp.regressions)
    # an incomplete baseline is a note, not a regression of the new run
    cmp = compare_reports(new, base)
    assert cmp.exit_code == 0 and any("baseline run is incomplete" in n for n in cmp.context_notes)


def test_off_a_terminal_each_change_is_one_unwrapped_line():
    """A CI log (a console that is not a terminal) gets one line per regression, never a table whose
    narrow columns break check and metric names mid-word."""
    base = passing_report()
    new = _changed(base, "error.backward", rel_err_vs_bf16_dK=4.0)
    cmp = compare_reports(base, new)
    buffer = io.StringIO()
    render_comparison(cmp, Console(file=buffer, width=40, color_system=None))  # not a terminal: plain
    lines = buffer.getvalue().splitlines()
    assert any(
        line.startswith("regression: error.backward: rel_err_vs_bf16_dK ") and line.endswith("headroom to 4")
        for line in lines
    ), lines
    assert not any("│" in line or "┃" in line for line in lines)


@pytest.mark.parametrize(
    "base_kernel,new_kernel,same",
    [
        ("kern.py:attn", "./kern.py:attn", True),
        ("sub/../kern.py:attn", "kern.py:attn", True),
        ("/home/ci/repo/kern.py:attn", "kern.py:attn", True),
        ("kern.py:attn", "kern.py:attn_fast", False),
        ("a/kern.py:attn", "b/kern.py:attn", False),
        ("bf16", "flamia-mxfp8", False),
    ],
)
def test_a_kernel_path_spelled_another_way_is_the_same_cases(base_kernel, new_kernel, same):
    base = passing_report()
    new = copy.deepcopy(base)
    base.kernel, new.kernel = base_kernel, new_kernel
    cmp = compare_reports(base, new)
    text = _text(cmp)
    if same:
        assert cmp.context_notes == [] and "metrics come from different cases" not in text
        assert "the same file and function" in text
    else:
        assert cmp.context_notes == [f"kernel differs: {base_kernel!r} in base, {new_kernel!r} in new"]


def test_reports_on_different_captures_say_their_cases_differ():
    """Two runs on captures (check --inputs) judge different calls when the captures differ."""
    a = Report(kernel="k", recipe="bf16", suite="quick", seed=0, environment={"capture_sha256": "aa"})
    b = Report(kernel="k", recipe="bf16", suite="quick", seed=0, environment={"capture_sha256": "bb"})
    assert compare_reports(a, b).context_notes == ["capture differs: 'aa' in base, 'bb' in new"]
    assert compare_reports(a, a).context_notes == []
