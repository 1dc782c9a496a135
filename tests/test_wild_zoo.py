"""The checks against the held-out zoo of tests/zoo/wild_bugs.py: kernels with realistic wrapper and
coverage bugs (and correct kernels of varied construction), written from public bug reports by a
reviewer who did not read the checks. Every bug but one fails the quick suite's gate (the
nondeterministic dQ above 1024 keys needs the standard suite's long rows and is a reproducibility
finding); every correct kernel passes it. docs/checks.md ("The wild zoo") gives the measurement and its history.
"""

from __future__ import annotations

import pytest
from zoo.wild_bugs import CORRECT_WILD, WILD

from flamia_verify.mutation.runner import FAMILY_ORDER
from flamia_verify.properties import run_checks

#: bugs whose dimension the quick suite does not reach, with the suite and check that catch them
NEEDS_STANDARD = {"nondeterministic_dq_long": "determinism.repeat"}
#: bugs reported beside the gate, in the verdict that gates only when required (docs/checks.md): bits
#: that change under a structural change only (another run, another layout), within the recipe
#: (reproducibility). (negative_scale_rowmax_before_scale's negative scale is a robustness finding of
#: special.degenerate; the kernel fails the gate on interface.arguments all the same: its einsums run
#: the scores in bf16 under autocast, beyond the BF16 recipe's bound.)
BESIDE_THE_GATE = {"nondeterministic_dq_long": "reproducibility"}
REPRODUCIBILITY_ONLY = {n for n, v in BESIDE_THE_GATE.items() if v == "reproducibility"}


def _reported(report) -> list[str]:
    return [c.name for c in report.checks if c.status in ("fail", "error")]


@pytest.mark.parametrize("name", sorted(set(WILD) - set(NEEDS_STANDARD)))
def test_wild_bug_fails_the_quick_suite(name):
    """Family by family, cheap ones first, up to the first check that gates and fails (as `mutate`
    does); a bug reported only in the reproducibility or robustness verdict must be one named so."""
    kernel = WILD[name]
    findings: list[str] = []
    verdicts: set[str] = set()
    for family in FAMILY_ORDER:
        report = run_checks(kernel, recipe=getattr(kernel, "recipe", None), suite="quick", only=[family])
        if not report.passed:
            assert name not in BESIDE_THE_GATE, f"{name} now fails the gate: {_reported(report)}"
            return
        findings += _reported(report)
        verdicts |= {c.verdict for c in report.checks if c.status in ("fail", "error")}
    assert findings, f"{name} ({kernel.dimension}) passed the quick suite"
    assert name in BESIDE_THE_GATE, f"{name} ({kernel.dimension}) is only reported beside the gate: {findings}"
    assert BESIDE_THE_GATE[name] in verdicts, f"{name}: reported as {verdicts}, not {BESIDE_THE_GATE[name]}"


@pytest.mark.parametrize("name", sorted(NEEDS_STANDARD))
def test_wild_bug_fails_its_standard_check(name):
    kernel = WILD[name]
    report = run_checks(kernel, recipe=getattr(kernel, "recipe", None), suite="standard", only=[NEEDS_STANDARD[name]])
    assert _reported(report), f"{name} passed {NEEDS_STANDARD[name]} in the standard suite"
    assert report.passed == (name in REPRODUCIBILITY_ONLY)


@pytest.mark.parametrize("name", sorted(CORRECT_WILD))
def test_wild_correct_kernel_passes_the_quick_suite(name):
    kernel = CORRECT_WILD[name]
    report = run_checks(kernel, recipe=getattr(kernel, "recipe", None), suite="quick")
    loud = [f"{c.name}: {c.status}: {c.message}" for c in report.checks if c.status in ("fail", "error")]
    assert not loud, f"{name} raised false alarms:\n" + "\n".join(loud)
