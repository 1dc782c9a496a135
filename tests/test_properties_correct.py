"""No false alarms: the correct built-in kernels, the float64 reference and torch SDPA in BF16 pass
every check of the quick suite, over several seeds."""

from __future__ import annotations

import pytest
from zoo import sdpa_bf16
from zoo.quick_reports import GROUP, quick_report
from zoo.verdicts import quiet_for_recipe

from flamia_verify.properties import list_checks
from flamia_verify.reference import reference_attention

pytestmark = pytest.mark.xdist_group(GROUP)

CORRECT = {
    "bf16": ("bf16", None),
    "fp8": ("fp8", None),
    "flamia-mxfp8": ("flamia-mxfp8", None),
    "flamia-nvfp4": ("flamia-nvfp4", None),
    "reference": (reference_attention, "bf16"),
    "sdpa-bf16": (sdpa_bf16, "bf16"),
}


#: reproducibility findings a correct kernel may have, with the reason: the float64 reference in the
#: convention returns float64 results whose last bit depends on the order of the heads (measured: about
#: 1.2% of out's elements move by one float64 unit under a head permutation, seeds 0 and 1): correct,
#: not head-order invariant bit for bit
FINDINGS = {"reference": {"isolation.heads_bitwise"}}


def _explain(report) -> str:
    lines = []
    for c in report.checks:
        if not quiet_for_recipe(report, c):
            lines.append(f"  {c.name}: {c.status}: {c.message}")
    return "\n".join(lines)


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("name", list(CORRECT))
def test_correct_kernel_passes_every_check(name, seed):
    kernel, recipe = CORRECT[name]
    report = quick_report(kernel, seed, recipe)
    assert [c.name for c in report.checks] == [s.name for s in list_checks("quick")]
    assert report.passed, f"{name} (seed {seed}) raised false alarms:\n{_explain(report)}"
    allowed = FINDINGS.get(name, set())
    loud = [c for c in report.checks if not quiet_for_recipe(report, c) and c.name not in allowed]
    assert not loud, _explain(report)
    assert all(report.check(c).verdict == "reproducibility" for c in allowed)
