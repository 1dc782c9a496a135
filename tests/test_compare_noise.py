"""`compare` gates on what a reviewer cares about, not on noise: the same kernel at two seeds gives no
regression, planted regressions (zoo kernels against FLAMIA MXFP8 on the same inputs) are caught."""

from __future__ import annotations

import copy
import sys
from dataclasses import replace
from pathlib import Path

import pytest

import flamia_verify.settings as settings_module
from flamia_verify.properties import run_checks
from flamia_verify.properties.thresholds import BIAS_Z
from flamia_verify.reports import CheckResult, Report, compare_reports
from flamia_verify.reports.compare import HEADROOM_SHARE, NOISE_Z, standard_error
from flamia_verify.settings import suite_settings

sys.path.insert(0, str(Path(__file__).parent))
from zoo import kernels as Z
from zoo import targeted as T
from zoo.quick_reports import GROUP, quick_report

#: the built-ins whose seed-to-seed noise is measured: every recipe family and scaling (the quick reports of
#: the four shared with test_properties_correct are computed once); flamia-mxfp8-floor (mxfp8 with another
#: scale rule) and mxfp8-naive (whose report fails) add CPU time to CI and no other kind of noise
BUILT_INS = ("bf16", "fp8", "fp8-tensor", "flamia-mxfp8", "flamia-nvfp4")


pytestmark = pytest.mark.xdist_group(GROUP)


def _report(kernel, seed: int = 0) -> Report:
    return quick_report(kernel, seed)


def _planted(kernel, only: list[str]) -> Report:
    """The quick suite's checks ``only`` at seed 0: a check draws its cases from the run's seed and its
    own name, so its metrics are those of the whole suite's run (the planted-regression tests compare
    the checks they assert about, on the same inputs for both kernels)."""
    return run_checks(kernel, suite="quick", seed=0, only=only)


def _gain_report(gain: float, z: float, *, limit: float = 2.0**-6) -> Report:
    metrics = {"gain_error_dk": abs(gain), "gain_dk": -abs(gain), "gain_z_dk": -z}
    check = CheckResult("bias.gain", "bias", "pass", metrics, {"gain_error_dk": limit})
    return Report(kernel="k", recipe="mxfp8", suite="quick", seed=0, checks=[check])


# -- the rule on its own ---------------------------------------------------------------------------


def test_a_tenfold_change_inside_the_headroom_is_not_a_regression():
    # the gain error of a correct kernel moving from 1e-4 to 1e-3 against 2^-6 = 0.0156: 10x, 6% of it
    base, new = _gain_report(1e-4, 0.1), _gain_report(1e-3, 1.0)
    cmp = compare_reports(base, new)
    assert cmp.exit_code == 0 and not cmp.regressions
    # the same ratio spending most of the headroom is one (z-scores of a well-measured statistic)
    cmp = compare_reports(_gain_report(1e-3, 1.0), _gain_report(1.2e-2, 120.0))
    (change,) = cmp.regressions
    assert change.headroom == pytest.approx((1.2e-2 - 1e-3) / 2.0**-6) and change.headroom >= HEADROOM_SHARE


def test_gain_changes_within_the_statistics_noise_do_not_gate():
    assert NOISE_Z == BIAS_Z
    # standard error |gain| / |z|: 0.0026 each (fp8-tensor's dK gain at seeds 0 and 1 of the quick suite)
    base, new = _gain_report(0.00187, 0.72), _gain_report(0.01412, 5.50)
    assert standard_error(base.checks[0], "gain_error_dk") == pytest.approx(0.00187 / 0.72)
    assert compare_reports(base, new).exit_code == 0  # 0.0123 apart: 3.4 standard errors of the difference
    sharp = _gain_report(0.01412, 50.0)  # the same values measured 10x more precisely
    assert compare_reports(_gain_report(0.00187, 6.6), sharp).exit_code == 1
    # without a z-score the headroom rule alone decides
    bare = copy.deepcopy(new)
    del bare.checks[0].metrics["gain_z_dk"]
    bare_base = copy.deepcopy(base)
    del bare_base.checks[0].metrics["gain_z_dk"]
    assert compare_reports(bare_base, bare).exit_code == 1


def test_a_metric_past_its_limit_in_both_reports_is_a_note():
    base = Report(
        kernel="k",
        recipe="fp8",
        suite="quick",
        seed=0,
        checks=[CheckResult("causal.dk_dv", "causal", "fail", {"leaked_elements": 30794}, {"leaked_elements": 0})],
    )
    new = copy.deepcopy(base)
    new.checks[0].metrics["leaked_elements"] = 49632
    cmp = compare_reports(base, new)
    assert cmp.exit_code == 0 and [c.metric for c in cmp.past_limit] == ["leaked_elements"]
    assert not compare_reports(new, base).improvements
    fixed = copy.deepcopy(base)
    fixed.checks[0].metrics["leaked_elements"] = 0
    fixed.checks[0].status = "pass"
    assert [c.metric for c in compare_reports(base, fixed).improvements if c.kind == "metric"] == ["leaked_elements"]
    assert compare_reports(fixed, base).exit_code == 1


def test_a_threshold_switched_off_never_gates_a_metric():
    base, new = _gain_report(1e-4, 0.1, limit=float("inf")), _gain_report(1.0, 1000.0, limit=float("inf"))
    assert compare_reports(base, new).exit_code == 0


# -- measured: seed-to-seed noise of every built-in kernel, and planted regressions -----------------


@pytest.mark.slow
@pytest.mark.parametrize("kernel", BUILT_INS)
def test_the_same_kernel_at_another_seed_does_not_regress(kernel):
    a, b = _report(kernel, 0), _report(kernel, 1)
    for base, new in ((a, b), (b, a)):
        cmp = compare_reports(base, new)
        assert cmp.regressions == [], [c.describe() for c in cmp.regressions]
        assert cmp.context_notes == [f"seed differs: {base.seed} in base, {new.seed} in new"]


@pytest.mark.slow
def test_a_larger_error_that_still_passes_is_caught(monkeypatch):
    # truncation toward zero instead of RNE: on the base packings but the realistic one, O's error grows
    # 2.8x and spends 57% of error.out's headroom while error.out still passes; bias.gain fails. (The
    # realistic packing's massive-activation tokens take it past the error model: error.out fails there.)
    assert _planted(Z.truncating, ["error.out"]).check("error.out").status == "fail"
    quick = suite_settings("quick")
    without = replace(quick, base=tuple(p for p in quick.base if p.distribution != "realistic"))
    monkeypatch.setitem(settings_module._BY_NAME, "quick", without)
    only = ["error.out", "bias.gain"]
    base, new = _planted("flamia-mxfp8", only), _planted(Z.truncating, only)
    assert new.check("error.out").status == "pass"
    cmp = compare_reports(base, new)
    metric = {(c.check, c.metric) for c in cmp.regressions if c.kind == "metric"}
    status = {c.check for c in cmp.regressions if c.kind == "status"}
    assert ("error.out", "normalized_error") in metric
    assert "bias.gain" in status and ("bias.gain", "gain_error_out") in metric


@pytest.mark.slow
def test_a_passing_consistency_metric_that_loses_its_headroom_is_caught():
    # bf16 running sums: the forward's probabilities no longer sum to 1 within fp32 rounding; the check
    # still passes (at its limit) while bound.out fails
    only = ["consistency.conservation_forward"]
    base, new = _planted("flamia-mxfp8", only), _planted(T.bf16_accumulation, only)
    assert new.check("consistency.conservation_forward").status == "pass"
    cmp = compare_reports(base, new)
    assert ("consistency.conservation_forward", "max_rel_dev") in {(c.check, c.metric) for c in cmp.regressions}


@pytest.mark.slow
def test_a_check_that_newly_fails_is_caught():
    # dS in NVFP4 under an MXFP8 claim: only bound.grad fails, every error metric passes
    base, new = _planted("flamia-mxfp8", ["bound.grad"]), _planted(T.ds_nvfp4, ["bound.grad"])
    cmp = compare_reports(base, new)
    assert cmp.exit_code == 1
    assert ("bound.grad", "pass", "fail") in {(c.check, c.base, c.new) for c in cmp.regressions if c.kind == "status"}
