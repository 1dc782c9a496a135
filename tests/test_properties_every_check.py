"""Every check of the product fails on a kernel that has the bug it looks for.

The zoo of ``zoo/kernels.py`` covers the families; ``zoo/targeted.py`` adds one planted bug for every
check that no zoo kernel was asserted to fail. Here each targeted kernel must make its checks report
``fail`` (with a message and a worst case) while the checks its bug cannot reach pass, and the correct
built-in kernel of its recipe passes the same checks on the same settings. The audit table in
docs/checks.md ("Every check fails on its bug") names, for each of the checks, the test and the
kernel. Bugs that no check catches where it should are kept below as strict expected failures.
"""

from __future__ import annotations

import math

import pytest
import torch
from zoo import fuzz_bugs as FB
from zoo import kernels as Z
from zoo import state_bugs as SB
from zoo import targeted as T
from zoo.convention_bugs import CONVENTION_BUGS
from zoo.dimension_bugs import DIMENSION_BUGS
from zoo.verdicts import assert_caught_and_quiet

from flamia_verify.kernels.designs import FLAMIA_MXFP8
from flamia_verify.kernels.emulation import backward_pass, forward_pass
from flamia_verify.properties import list_checks, run_checks
from flamia_verify.properties.cases import Case, make_inputs
from flamia_verify.properties.harness import KernelHarness


def _run(kernel, only, **kw):
    return run_checks(kernel, suite="quick", only=list(only), **kw)


def test_every_check_has_a_planted_bug_that_must_fail_it():
    """The standard: no check without a kernel that a test asserts it fails on."""
    every = {s.name for s in list_checks("full")}
    assert len(every) == 51
    covered = {c for k in list(Z.BUGS.values()) + list(T.TARGETED.values()) for c in k.catches}
    # the state family's checks, asserted in test_state_family.py
    covered |= {c for k in SB.STATE_BUGS.values() for c in k.catches}
    # the convention and invariance checks, asserted in test_coverage_model.py
    covered |= {c for k in CONVENTION_BUGS.values() for c in k.catches}
    covered |= set(FB.STANDARD)  # standard-suite-only checks, asserted in test_fuzz_coverage.py
    # the checks of the new input dimensions (consistency.homogeneity), asserted in test_new_dimensions.py
    covered |= {c for k in DIMENSION_BUGS.values() for c in k.catches}
    assert covered <= every, f"catches names unknown checks: {sorted(covered - every)}"
    assert every <= covered, f"checks that no planted bug is asserted to fail: {sorted(every - covered)}"
    # the checks of a run on a capture belong to no suite; test_check_inputs.py fails each on its bug
    from flamia_verify.properties.catalog import all_specs
    from flamia_verify.properties.checks.common.captured import CAPTURED_CHECKS

    assert {s.name for s in all_specs()} - every == {n for n in CAPTURED_CHECKS if n.endswith(".captured")}


@pytest.mark.parametrize("name", sorted(T.TARGETED))
def test_targeted_kernel_fails_its_check_and_only_where_its_bug_reaches(name):
    kernel = T.TARGETED[name]
    report = _run(kernel, kernel.catches + kernel.quiet)
    assert_caught_and_quiet(name, kernel, report)


# the correct built-in kernel of each recipe on the targeted checks, same suite and seed
_RECIPE_BUILTIN = {"mxfp8": "flamia-mxfp8", "bf16": "bf16", "fp8": "fp8"}


@pytest.mark.parametrize("recipe", sorted(_RECIPE_BUILTIN))
def test_the_correct_builtin_passes_the_same_checks(recipe):
    checks = sorted({c for k in T.TARGETED.values() if k.recipe == recipe for c in k.catches})
    report = _run(_RECIPE_BUILTIN[recipe], checks)
    loud = [f"{c.name}: {c.status}: {c.message}" for c in report.checks if c.status != "pass"]
    assert not loud, "\n".join(loud)


def test_isolation_offset_rel_diff_fails_a_gross_offset_bug_when_bits_may_differ():
    """A kernel whose tiles only change the rounding at another offset passes isolation.offset (its
    bits are a reproducibility finding of isolation.offset_bitwise, accepted there when
    ``bitwise_mismatches`` is raised); one that loses keys at unaligned offsets fails on rel_diff."""
    report = _run(T.packed_tiles, ["isolation.offset", "isolation.offset_bitwise"])
    ok, bits = report.check("isolation.offset"), report.check("isolation.offset_bitwise")
    assert ok.status == "pass" and "differ" in ok.message and "identical" not in ok.message
    assert bits.status == "fail" and bits.metrics["bitwise_mismatches"] > 0 and report.passed
    relaxed = {"isolation.offset_bitwise": {"bitwise_mismatches": math.inf}}
    accepted = _run(T.packed_tiles, ["isolation.offset_bitwise"], thresholds=relaxed).check("isolation.offset_bitwise")
    assert accepted.status == "pass" and "accepted up to" in accepted.message
    bad = _run(T.packed_tiles_skip_head, ["isolation.offset"]).check("isolation.offset")
    assert bad.status == "fail" and bad.message.startswith("rel_diff"), bad.message
    assert bad.metrics["rel_diff"] > 100 * bad.thresholds["rel_diff"]


def test_a_missing_gradient_fails_interface_backward_and_skips_the_identities_that_need_it():
    report = _run(T.detached_k, ["interface.backward", "error", "consistency"])
    assert "no gradient for k" in report.check("interface.backward").message
    for name in ("error.dk", "consistency.shift_invariance"):
        res = report.check(name)
        assert res.status == "skip" and "no dk" in res.message, (name, res.status, res.message)
    for name in (
        "error.out",
        "error.dq",
        "error.dv",
        "consistency.conservation_backward",
        "consistency.weights",
        "consistency.grad_forward_ratio",
    ):
        assert report.check(name).status == "pass", (name, report.check(name).message)


class _Ungrouped(torch.autograd.Function):
    """A backward that returns dq in float32 and, under GQA, dk and dv per query head (not summed
    over the heads that share a kv head)."""

    @staticmethod
    def forward(ctx, q, k, v, cu_q, cu_k, scale, causal):
        groups = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        out, lse2 = forward_pass(FLAMIA_MXFP8, q, k, v, cu_q, cu_k, scale, causal)
        ctx.save_for_backward(q, k, v, out, lse2, cu_q, cu_k)
        ctx.scale, ctx.causal = scale, causal
        return out

    @staticmethod
    def backward(ctx, g):
        q, k, v, out, lse2, cu_q, cu_k = ctx.saved_tensors
        dq, dk, dv = backward_pass(FLAMIA_MXFP8, q, k, v, out, lse2, g, cu_q, cu_k, ctx.scale, ctx.causal)
        return dq.float(), dk, dv, None, None, None, None


def _ungrouped(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, softmax_scale=None, causal=False):
    return _Ungrouped.apply(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal)


_ungrouped.recipe = "mxfp8"


def test_autograd_gives_every_gradient_the_shape_and_dtype_of_its_input():
    """torch casts a gradient to its input's dtype and sums a broadcastable one to its shape (MQA: a
    forgotten group sum is done for the kernel), and raises on any other shape (GQA 4:2): that
    raise is the kernel's interface violation, so interface.backward reports ``fail``, not ``error``."""
    case = Case((16,), heads=2, heads_k=1)
    res = KernelHarness(_ungrouped).call(make_inputs(case))
    assert res.dq.dtype == torch.bfloat16 and res.dk.shape == (16, 1, 64)
    check = _run(_ungrouped, ["interface.backward"]).check("interface.backward")
    assert check.status == "fail" and "wrong shape" in check.message and "invalid gradient" in check.message, (
        check.message
    )
    assert check.metrics["bad_gradients"] == 1 and check.worst_case["case"]["heads"] == 4


@pytest.mark.parametrize("name", ["dense_mask", "packed_tiles"])
def test_a_correct_kernel_with_an_fp32_output_passes_grad_forward_ratio(name):
    """Regression: a forward more accurate than the recipe's model (fp32 output, as the convention
    allows) made the ratio 10^4; the forward now counts at no less than the band's lower edge."""
    res = _run(T.TARGETED[name], ["consistency.grad_forward_ratio"]).check("consistency.grad_forward_ratio")
    assert res.status == "pass", res.message
    assert res.metrics["normalized_ratio"] < 4


# ---------------------------------------------------------------------------------------------
# former known misses: caught since the suites' inputs include them (docs/checks.md)
# ---------------------------------------------------------------------------------------------


def test_known_misses_are_none():
    assert T.KNOWN_MISSES == {}


def _reproduces(worst_case: dict) -> Case:
    case = Case.from_dict(worst_case["case"])
    assert Case.from_dict(case.to_dict()) == case
    return case


def test_a_gradient_operand_without_a_scale_fails_on_a_small_upstream_gradient():
    """dS cast to E4M3 without a scale: the base packing with dO x 2^-20 flushes dQ to 0."""
    report = _run(T.ds_unscaled, ["error.dq", "error.dk", "consistency.grad_forward_ratio"])
    res = report.check("error.dq")
    assert res.status == "fail" and res.metrics["normalized_error"] > 5, res.message
    case = _reproduces(res.worst_case)
    assert ("scale_do", 2.0**-20) in case.overrides
    assert res.worst_case["worst_element"]["kernel"] == 0.0
    assert report.check("error.dk").status == "pass"


def test_a_kernel_that_ignores_softmax_scale_fails():
    report = _run(T.ignores_softmax_scale, ["error.out", "special.magnitudes"])
    res = report.check("error.out")
    assert res.status == "fail", res.message
    case = _reproduces(res.worst_case)
    assert abs(case.softmax_scale - 0.0883) < 1e-12 and case.softmax_scale != case.headdim**-0.5
    mag = report.check("special.magnitudes")
    assert mag.status == "fail", mag.message
    assert _reproduces(mag.worst_case).softmax_scale != 64**-0.5


def test_constant_rows_sees_a_kernel_that_zeroes_dv_on_constant_dO():
    res = _run(T.range_scale_do_flush, ["special.constant_rows"]).check("special.constant_rows")
    assert res.status == "fail" and res.metrics["nonfinite"] == 0, res.message
    assert res.metrics["violations"] > 0


def test_a_13_bit_accumulator_is_inside_the_random_input_bound_but_not_the_exact_operand_one():
    """The bound checks' sensitivity to GEMM accumulation with MXFP8 operands (docs/checks.md, "What
    the bound resolves"): a model of Hopper's E4M3 MMA (about 13 bits per 32-long slice) stays
    within bound.out and bound.grad, close to the correct kernel, because E4M3's rounding of P
    dwarfs the accumulation error there; on bound.rounding's probes every operand is exact, the
    bound is fp32 accumulation and the output rounding alone, and the 13-bit accumulator leaves it.
    bf16 running sums (8 bits) fail all three. bound.accumulation (uniform weights, a cancelling
    +-448 pair beside values below 2^-5) fails the 13-bit accumulator, which cuts those values; the
    bf16 running sums keep them (the pair cancels exactly within a slice's fp32 sum, and what is left
    has few bits), so it passes them. Not a threshold: the bounds derive from the formats; this pins
    down what each resolves."""
    got = {
        name: _run(kernel, ["bound.out", "bound.grad", "bound.rounding", "bound.accumulation"])
        for name, kernel in (
            ("e4m3_mma", T.e4m3_mma_accumulation),
            ("bf16", T.bf16_accumulation),
            ("correct", "flamia-mxfp8"),
        )
    }
    tight = {name: {c.name: c.metrics["tightness"] for c in rep.checks} for name, rep in got.items()}
    status = {name: {c.name: c.status for c in rep.checks} for name, rep in got.items()}
    assert status["e4m3_mma"] == {
        "bound.out": "pass",
        "bound.grad": "pass",
        "bound.rounding": "fail",
        "bound.accumulation": "fail",
    }, tight
    assert status["bf16"] == {
        "bound.out": "fail",
        "bound.grad": "fail",
        "bound.rounding": "fail",
        "bound.accumulation": "pass",
    }, tight
    assert all(c.status == "pass" for c in got["correct"].checks), tight
    assert tight["e4m3_mma"]["bound.out"] >= tight["correct"]["bound.out"], tight
    assert tight["e4m3_mma"]["bound.rounding"] > 4 * tight["correct"]["bound.rounding"], tight
