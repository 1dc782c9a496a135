"""Issue 26: a correct BF16-recipe kernel that holds P in FP16 raised false alarms.

``bf16_p_fp16`` (tests/zoo/correct.py) is FlashAttention-2's numerics with the probabilities P and
P^T rounded to FP16 while the inputs are BF16: more accurate than the BF16 baseline on every norm,
but probabilities below FP16's normal range (6.1e-5) keep only an absolute precision of 2^-25, which
the all-BF16 bound model (BF16 has fp32's exponent range) did not admit: bound.grad, consistency.weights,
special.attention_sink and special.negative_scores failed on dV elements of 1e-9 to 1e-7.

The BF16 recipe now admits FP16 probabilities (docs/checks.md, "FP16 probabilities in a BF16
recipe"): P and P^T are bounded by 1 whatever the inputs' magnitudes, so FP16's floor is a fixed,
scale-free absolute error per element. The admission is narrow: the same kernel with subnormals
flushed (an error of 2^-14 instead of 2^-25 on the same small probabilities), or with dS in FP16 (dS
has no unit: it scales with dO, and FP16 flushes or overflows it), still fails.
"""

from __future__ import annotations

import pytest
import torch
from zoo.correct import bf16_p_fp16, fa2_rounded, to_dtype, to_input

from flamia_verify.properties import run_checks
from flamia_verify.recipes.bounds import ALPHA_BF16, ALPHA_FP16, FP16_MIN_NORMAL
from flamia_verify.recipes.operands import Operand
from flamia_verify.recipes.recipe import RECIPES, get_recipe

#: the checks issue 26's kernel failed
ISSUE_CHECKS = ("bound.grad", "consistency.weights", "special.attention_sink", "special.negative_scores")
ADMITTED = "admitted P and P^T held in FP16"


def _ftz16(x: torch.Tensor, input_dtype: torch.dtype) -> torch.Tensor:
    """FP16 with subnormals flushed to zero: the probabilities below 2^-14 vanish (error up to 2^-14,
    2048 times the admitted 2^-25), on the same keys the admission is about."""
    y = x.to(torch.float16).float()
    return torch.where(y.abs() < FP16_MIN_NORMAL, torch.zeros_like(y), y)


p_fp16_ftz = fa2_rounded(_ftz16, to_input, "p_fp16_ftz")
ds_fp16 = fa2_rounded(to_dtype(torch.float16), to_dtype(torch.float16), "ds_fp16")


def _report(kernel, suite="quick", seed=0, only=None):
    return run_checks(kernel, recipe="bf16", suite=suite, seed=seed, device="cpu", only=only)


def _failures(report) -> dict[str, str]:
    return {c.name: c.message for c in report.checks if c.status not in ("pass", "skip")}


def test_the_bf16_recipe_admits_fp16_probabilities_only():
    """The model: P and P^T gain FP16's floor on BF16 (and fp32) inputs, nothing else changes; the
    nominal model is the all-BF16 one; FP16 inputs and the other recipes have nothing to admit."""
    for dtype in (torch.bfloat16, torch.float32):
        model = get_recipe("bf16").bound_model(dtype)
        nominal = model.nominal()
        assert [a.nominal_name for a in model.admissions] == ["all-BF16"]
        for op in Operand:
            if op in (Operand.P, Operand.PT):
                assert model[op].alpha == ALPHA_FP16 and nominal[op].alpha == ALPHA_BF16
                assert model[op].u == nominal[op].u == 2.0**-8
            else:
                assert model[op] == nominal[op], op
        assert not nominal.admissions
    assert not get_recipe("bf16").bound_model(torch.float16).admissions
    for name in RECIPES:
        if name != "bf16":
            assert not get_recipe(name).bound_model(torch.bfloat16).admissions, name


@pytest.mark.parametrize("seed", [0, 1])
def test_fp16_probabilities_pass_quick_and_say_so(seed):
    report = _report(bf16_p_fp16, seed=seed)
    assert report.passed, _failures(report)
    checks = {c.name: c for c in report.checks}
    for name in ISSUE_CHECKS:
        c = checks[name]
        # the admission was needed there, and the report says where and how much
        assert c.metrics["admitted_elements"] > 0, (name, c.metrics)
        assert ADMITTED in c.message, c.message
    grad = checks["bound.grad"]
    assert " of dv on " in grad.message and "keys" in grad.message
    # the accepted errors are tiny against the tensor: below 1e-5 of its RMS, at most 1e-6 absolute
    assert 0 < grad.metrics["admitted_rms_share"] < 1e-5
    assert 0 < grad.metrics["admitted_max_abs"] < 1e-6


def test_fp16_probabilities_pass_the_issue_checks_in_standard():
    report = _report(bf16_p_fp16, suite="standard", only=list(ISSUE_CHECKS))
    assert [c.name for c in report.checks] == list(ISSUE_CHECKS)
    assert report.passed, _failures(report)


def test_bf16_probabilities_need_no_admission():
    """The built-in BF16 kernel never leaves the all-BF16 bound: nothing is admitted for it."""
    report = _report("bf16", only=list(ISSUE_CHECKS))
    assert report.passed, _failures(report)
    for c in report.checks:
        assert c.metrics["admitted_elements"] == 0, (c.name, c.metrics)
        assert ADMITTED not in c.message


def test_flushed_fp16_probabilities_still_fail():
    """The same small probabilities flushed instead of rounded to FP16's subnormals: the error per
    element is 2^-14, not 2^-25, and every check that issue 26 tripped still fails."""
    failed = _failures(_report(p_fp16_ftz, only=list(ISSUE_CHECKS)))
    assert set(ISSUE_CHECKS) <= set(failed), failed
    assert "violations" in failed["bound.grad"]


def test_fp16_ds_still_fails():
    """dS in FP16: the same underflow mechanism and errors of the same size (1e-8 to 1e-7 on dQ, dK)
    on ordinary inputs, but dS has no unit (it scales with dO): the admission does not cover it, so
    bound.grad fails on dQ, and the upstream gradient scaled by 2^-40 or 2^20 flushes or overflows."""
    failed = _failures(_report(ds_fp16, only=["bound.grad", "special.magnitudes"]))
    assert "|dq - reference|" in failed.get("bound.grad", ""), failed
    assert "special.magnitudes" in failed, failed
