"""FP16 inputs: no false alarm on correct kernels, and planted bugs are still caught.

FP16 has the same kind of unit roundoff as BF16 (2^-11) but a narrow exponent range: below 2^-14
its spacing is the constant 2^-24, so an operand rounded to FP16 without a scale (P, P^T, dS, dS^T
of a BF16-recipe kernel) and every output (O, dQ, dK, dV) carry an absolute error of up to 2^-25
besides the relative one. The bound model holds that floor (docs/checks.md, "Underflow of FP16
operands and outputs"); without it the built-in `bf16` kernel failed bound.grad,
consistency.weights and three special checks with FP16 inputs.
"""

from __future__ import annotations

import pytest
import torch
from zoo import kernels as Z
from zoo import targeted as T
from zoo.verdicts import quiet_for_recipe

from flamia_verify.properties import list_checks, run_checks
from flamia_verify.recipes.bounds import OperandModel
from flamia_verify.recipes.operands import Operand
from flamia_verify.recipes.recipe import get_recipe


def _explain(report) -> str:
    return "\n".join(f"  {c.name}: {c.status}: {c.message}" for c in report.checks if not quiet_for_recipe(report, c))


def test_fp16_operand_model_covers_rounding_through_the_subnormal_range():
    model = get_recipe("bf16").bound_model(torch.float16)
    for op in (model[Operand.P], model[Operand.PT], model[Operand.DS], model[Operand.DST]):
        assert op.u == 2.0**-11 and op.alpha == 2.0**-25
    assert model.u_out == 2.0**-11 and model.alpha_out == 2.0**-25
    assert get_recipe("mxfp8").bound_model(torch.float16).alpha_out == 2.0**-25
    # every magnitude from FP16's overflow-free top down past its smallest subnormal
    g = torch.Generator().manual_seed(0)
    x = torch.exp2(torch.empty(200_000, dtype=torch.float64).uniform_(-30, 15, generator=g))
    x = x * torch.where(torch.rand(x.shape, generator=g) < 0.5, -1.0, 1.0).double()
    err = (x.to(torch.float16).double() - x).abs()
    rho = model[Operand.DS].rho(x.abs(), 0.0, 0.0)
    assert bool((err <= rho).all())
    # the floor is needed: the relative term alone does not cover the subnormal range
    assert bool((err > OperandModel(2.0**-11).rho(x.abs(), 0.0, 0.0)).any())


@pytest.mark.parametrize("name", ["bf16", "flamia-mxfp8", "fp8", "flamia-nvfp4"])
def test_correct_kernel_passes_the_quick_suite_with_fp16_inputs(name):
    report = run_checks(name, suite="quick", dtype=torch.float16, seed=0)
    assert [c.name for c in report.checks] == [s.name for s in list_checks("quick")]
    assert all(quiet_for_recipe(report, c) for c in report.checks), (
        f"{name} (fp16) raised false alarms:\n{_explain(report)}"
    )


# planted bugs that must still fail their checks with FP16 inputs; the BF16-recipe ones
# (no_row_max) run under the recipe whose operand model gained the underflow floor
CAUGHT_WITH_FP16 = {
    "fwd_bwd_mismatch": (Z.BUGS["fwd_bwd_mismatch"], ("consistency.weights",)),
    "scale_off_by_one": (Z.BUGS["scale_off_by_one"], ("bound.out",)),
    "pt_unscaled": (T.TARGETED["pt_unscaled"], ("bound.grad",)),
    "no_row_max": (T.TARGETED["no_row_max"], ("special.negative_scores",)),
    # dO x 2^-10 (the fp16 floor of the small-dO packing) puts dS below E4M3's normal range
    "ds_unscaled": (T.TARGETED["ds_unscaled"], ("error.dq", "consistency.grad_forward_ratio")),
}


@pytest.mark.parametrize("name", sorted(CAUGHT_WITH_FP16))
def test_planted_bug_is_still_caught_with_fp16_inputs(name):
    kernel, checks = CAUGHT_WITH_FP16[name]
    report = run_checks(
        kernel, recipe=getattr(kernel, "recipe", None), suite="quick", only=list(checks), dtype=torch.float16
    )
    for check in checks:
        res = report.check(check)
        assert res.status == "fail", f"{name} (fp16): {check} says {res.status}: {res.message}"
