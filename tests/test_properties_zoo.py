"""Each family catches what it is for: every planted-bug kernel of the zoo fails the check made for
it, and the known-bad built-in kernels fail where the design table says they leak."""

from __future__ import annotations

import pytest
from zoo import kernels as Z
from zoo.verdicts import matches

from flamia_verify.properties import run_checks


def _run(kernel, only, **kw):
    return run_checks(kernel, suite="quick", only=list(only), **kw)


@pytest.mark.parametrize("name", sorted(Z.BUGS))
def test_zoo_kernel_fails_its_check(name):
    kernel = Z.BUGS[name]
    assert kernel.catches, f"{name} names no check that catches it"
    report = _run(kernel, kernel.catches)
    for check in kernel.catches:
        res = report.check(check)
        assert res.status == "fail", f"{name}: {check} says {res.status}: {res.message}"
        assert res.message, f"{name}: {check} failed without saying why"
        assert res.worst_case, f"{name}: {check} failed without a worst case"


# Each zoo kernel differs from FLAMIA MXFP8 in one place: the checks of the other families stay quiet
# where the bug cannot reach them (so a failure above is the intended family's doing).
_SPECIAL = [
    "special.zero_blocks",
    "special.magnitudes",
    "special.outlier_channels",
    "special.attention_sink",
    "special.constant_rows",
    "special.negative_scores",
    "special.short_documents",
    "special.nonfinite",
]
QUIET = {
    "v_scale_leak": ["isolation", "consistency.conservation_forward", "consistency.weights", "bound", "special"],
    "backward_leak": ["causal.forward", "isolation", "consistency", "bound"],
    # special.nonfinite is reached: a NaN in one document crosses the block into the next
    "document_leak": ["consistency", "bound.out"] + [c for c in _SPECIAL if c != "special.nonfinite"],
    "fwd_bwd_mismatch": ["causal", "isolation", "consistency.conservation_forward", "bound.out"],
    "one_token_wrong": ["causal", "isolation", "consistency.weights"],
    "nondeterministic": ["causal.forward", "consistency.conservation_forward", "bound.out"],
}


@pytest.mark.parametrize("name", sorted(QUIET))
def test_zoo_kernel_is_quiet_elsewhere(name):
    report = _run(Z.BUGS[name], QUIET[name])
    # a family named quiet does not cover its accuracy judges (zoo/verdicts.py ACCURACY_JUDGES)
    loud = [
        f"{c.name}: {c.status}: {c.message}"
        for c in report.checks
        if c.status != "pass" and any(matches(c.name, q) for q in QUIET[name])
    ]
    assert not loud, f"{name} trips checks its bug cannot reach:\n" + "\n".join(loud)


def test_worst_case_of_a_leak_says_how_to_reproduce_it():
    res = _run(Z.v_scale_leak, ["causal.forward"]).check("causal.forward")
    wc = res.worst_case
    for key in ("case", "cu_seqlens_q", "t", "perturbation", "mismatch", "protected"):
        assert key in wc, f"worst_case lacks {key}: {sorted(wc)}"
    # the target document 0 and the causal packs' short last document of another offset
    assert wc["case"]["seed"] == 11 and wc["case"]["lens_q"] == [96, 9]
    mm = wc["mismatch"]
    assert mm["mismatched"] > 0 and mm["total"] > 0 and mm["worst"]["token"] <= wc["t"]
    assert "Mismatched elements" in res.message
    maps = res.details["heatmaps"]
    assert maps and all(len(row) == 96 for row in maps[0]["z"])


@pytest.mark.parametrize("name", ["fp8-tensor", "mxfp8-naive"])
def test_known_bad_builtins_leak_and_mismatch(name):
    report = _run(name, ["causal", "isolation", "consistency.conservation_forward"])  # with the bitwise halves
    for check in (
        "causal.forward",
        "causal.dq",
        "causal.nan",
        "isolation.neighbours",
        "isolation.offset_bitwise",
        "consistency.conservation_forward",
    ):
        assert report.check(check).status == "fail", f"{name}: {check} {report.check(check).message}"


def test_mxfp8_naive_is_caught_by_every_consistency_check_that_reads_its_defects():
    report = _run("mxfp8-naive", ["consistency"])
    for check in ("consistency.conservation_forward", "consistency.shift_invariance", "consistency.weights"):
        res = report.check(check)
        assert res.status == "fail", f"{check}: {res.message}"
    # the separation is wide: several times the threshold (docs/checks.md)
    cf = report.check("consistency.conservation_forward")
    assert cf.metrics["max_rel_dev"] > 4 * cf.thresholds["max_rel_dev"]
    assert report.check("consistency.weights").metrics["weight_mismatch"] > 4


def test_nondeterminism_can_be_downgraded_to_a_warning():
    res = _run(Z.nondeterministic, ["determinism"], thresholds={"determinism.repeat": {"warn_only": True}}).check(
        "determinism.repeat"
    )
    assert res.status == "pass" and res.message.startswith("warning:")
    assert res.metrics["mismatched_elements"] > 0


def test_saturating_floor_rule_shows_in_the_bias_statistics():
    """FLOOR saturates the largest element of a block: visible as a significant shrinkage of dV,
    though within the mxfp8-floor recipe's own gain threshold (it declares the rule)."""
    res = _run("flamia-mxfp8-floor", ["bias.gain"]).check("bias.gain")
    assert res.status == "pass"
    assert res.metrics["gain_dv"] < 0 and res.metrics["gain_z_dv"] < -3
    res = _run("flamia-mxfp8-floor", ["bias.gain"], recipe="mxfp8").check("bias.gain")
    assert res.metrics["gain_dv"] < 0
