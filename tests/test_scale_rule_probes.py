"""The scale-rule probes of bound.rounding: their block maxima sit where the recipes' E8M0 rules and
the plausible wrong ones disagree (checked here with ml_dtypes and plain math, not with the
project's quantizer), every correct MX design passes, and every wrong rule of tests/zoo/scale_rules.py
fails."""

from __future__ import annotations

import math
from fractions import Fraction

import ml_dtypes
import numpy as np
import pytest
import torch
from zoo.scale_rules import EXPONENT_RULES, WRONG, WRONG_FOR

from flamia_verify.formats import ScaleRule
from flamia_verify.properties import run_checks
from flamia_verify.properties.mx_probes import (
    SCALE_GRID_M,
    SCALE_PROBES,
    SCALE_SIG,
    TINY_AMAX,
    parse_probe,
    probe_tensors,
    scale_probes,
)
from flamia_verify.settings import DTYPES


def _log2(x: float) -> float:
    """log2 of a positive double, exact at powers of two."""
    m, e = math.frexp(x)
    return e - 1 + math.log2(2 * m)


# the rules in plain math on a float amax (E4M3 elements), the E8M0 clamp left out
RULES = {
    "rceil": lambda a: math.ceil(_log2(a / 448)),
    "floor": lambda a: math.floor(_log2(a)) - 8,
    "ceil_log2": lambda a: math.ceil(_log2(a)) - 8,
    "round_log2": lambda a: round(_log2(a)) - 8,
    "round_quotient": lambda a: round(_log2(a / 448)),
    "floor_quotient": lambda a: math.floor(_log2(a / 448)),
    "floor_plus_one": lambda a: math.floor(_log2(a / 448)) + 1,
    "ceil_minus_one": lambda a: math.ceil(_log2(a)) - 1 - 8,
}


def _exact(x: float, dtype) -> bool:
    return float(np.array(x, dtype=dtype).astype(np.float64)) == x


def test_block_maxima_lie_on_both_sides_of_every_boundary():
    sigs = [Fraction(m) for m in SCALE_SIG]
    for m in SCALE_SIG:
        assert _exact(m, ml_dtypes.bfloat16) and _exact(m, np.float16), m
    # FLOOR / ceil(log2 amax): at a power of two, one BF16 ulp above it, one ulp below the next
    assert Fraction(1) in sigs and Fraction(1) + Fraction(1, 128) in sigs and Fraction(2) - Fraction(1, 128) in sigs
    # the boundaries sqrt 2 and 1.75 / sqrt 2 (irrational): the BF16 neighbours on either side
    for boundary_sq in (Fraction(2), Fraction(49, 32)):  # sqrt 2 squared; (1.75 / sqrt 2) squared
        below = max(m for m in sigs if m * m < boundary_sq)
        above = min(m for m in sigs if m * m > boundary_sq)
        assert above - below == Fraction(1, 128), (float(below), float(above))
    # RCEIL / floor(log2(amax / 448)): 448 2^k exactly and one ulp either side
    assert {Fraction(7, 4) - Fraction(1, 128), Fraction(7, 4), Fraction(7, 4) + Fraction(1, 128)} <= set(sigs)
    # each pair of rules that disagree somewhere disagrees on some probe maximum
    for a in RULES:
        for b in RULES:
            if a < b and any(
                RULES[a](m * 2.0**8) != RULES[b](m * 2.0**8) for m in (1.0, 1.1, 1.3, 1.5, 1.74, 1.75, 1.8)
            ):
                assert any(RULES[a](m * 2.0**8) != RULES[b](m * 2.0**8) for m in SCALE_SIG), (a, b)


@pytest.mark.parametrize("probe", SCALE_PROBES, ids=lambda p: p.tag)
def test_probe_values_are_exact_and_round_as_ml_dtypes_says(probe):
    inputs, _ = probe_tensors(probe, 0)
    dtypes = [torch.bfloat16] + ([torch.float16] if probe.variant == "scale" else [])
    for name, x in inputs.items():
        for dtype in dtypes:
            assert torch.equal(x.to(dtype).double(), x), f"{probe.tag}: {name} is not exact in {dtype}"
    assert scale_probes(torch.float16) == tuple(p for p in SCALE_PROBES if p.variant == "scale")
    name = {"v_seq": "v", "do_seq": "do", "k_seq": "k", "q_seq": "q"}[probe.site]
    col = inputs[name][:, 0].numpy()
    for rule, key in ((ScaleRule.RCEIL, "rceil"), (ScaleRule.FLOOR, "floor")):
        _, rounded = probe_tensors(probe, 0, rule)
        want = np.empty_like(col)
        for b in range(0, col.shape[0], 32):
            blk = col[b : b + 32]
            amaxes = np.abs(blk).max(axis=0)
            for c in range(col.shape[1]):
                a = float(amaxes[c])
                e = max(-127, RULES[key](a)) if a > 0 else -127
                q = np.clip(blk[:, c] / 2.0**e, -448, 448).astype(ml_dtypes.float8_e4m3fn).astype(np.float64)
                want[b : b + 32, c] = q * 2.0**e
        assert np.array_equal(rounded[name][:, 0].numpy(), want), (probe.tag, rule)
        for other in inputs:
            if other != name:
                assert torch.equal(rounded[other], inputs[other])


def test_scale_probe_maxima_cover_every_significand_and_the_grid_is_below_them():
    inputs, _ = probe_tensors("v_seq:scale", 3)
    v = inputs["v"][:, 0]
    seen = set()
    for b in (0, 32):
        blk = v[b : b + 32]
        amax = blk.abs().amax(dim=0)
        for c in range(v.shape[1]):
            m, e = math.frexp(float(amax[c]))
            seen.add(2 * m)
            small = blk[:, c].abs()
            small = small[(small > 0) & (small < amax[c])] / 2.0 ** (e - 1 - 18)
            assert set(small.tolist()) <= set(float(x) for x in SCALE_GRID_M) and len(small) == 30
            assert int((blk[:, c] == amax[c]).sum()) == 1 and int((blk[:, c] == -amax[c]).sum()) == 1
    assert seen == set(SCALE_SIG)


def test_tiny_maxima_straddle_the_bottom_of_e8m0_and_fp32_normal_quotients():
    for a in TINY_AMAX:
        assert _exact(a, ml_dtypes.bfloat16) and not _exact(a, np.float16)
    q = [np.float32(a) / np.float32(448) for a in TINY_AMAX]
    subnormal = [abs(x) < np.finfo(np.float32).tiny for x in q]
    assert subnormal == [True] * 5 + [False]
    rceil = [RULES["rceil"](a) for a in TINY_AMAX]
    assert [max(-127, e) for e in rceil] == [-126, -126, -126, -127, -127, -125]
    assert rceil[4] == -128  # clamped to E8M0's byte 0
    # one exponent too small (2^-127) saturates the first three to 448 2^-127, off their RNE value
    for a in TINY_AMAX[:3]:
        rne = float(np.array(a / 2.0**-126).astype(ml_dtypes.float8_e4m3fn).astype(np.float64))
        assert rne * 2.0**-126 != 448 * 2.0**-127


def test_the_zoo_rules_are_the_rules_they_name():
    amax = torch.tensor(
        [m * 2.0**e for m in SCALE_SIG + (1.1, 1.3, 1.6, 1.9) for e in (-3, 0, 8, 10)], dtype=torch.float32
    )
    for name, fn in EXPONENT_RULES.items():
        if name == "quotient_ftz":
            continue
        got = fn(amax, None, None).tolist()
        want = [RULES[name](float(a)) for a in amax]
        assert got == want, name


def _rounding(kernel, recipe=None, dtype="bf16"):
    report = run_checks(kernel, recipe=recipe, suite="quick", only=["bound.rounding"], dtype=DTYPES[dtype])
    return report.check("bound.rounding")


@pytest.mark.parametrize(
    "name,dtype",
    [("flamia-mxfp8", "bf16"), ("flamia-mxfp8-floor", "bf16"), ("flamia-nvfp4", "bf16"), ("flamia-mxfp8", "fp16")],
)
def test_correct_designs_pass_the_scale_probes(name, dtype):
    from flamia_verify.kernels.designs import DESIGNS
    from flamia_verify.kernels.emulation import make_kernel

    res = _rounding(make_kernel(DESIGNS[name]), recipe=DESIGNS[name].recipe, dtype=dtype)
    assert res.status == "pass", res.message
    assert res.metrics["scale_cases"] == (4 if dtype == "fp16" else 5)


@pytest.mark.parametrize("name", sorted(WRONG))
def test_every_wrong_rule_fails(name):
    kernel = WRONG[name]
    res = _rounding(kernel, recipe=kernel.recipe)
    assert res.status == "fail", f"{name}: {res.message}"
    assert res.metrics["violations"] > 0
    assert res.worst_case["probe"].split(":")[1] in ("scale", "tiny", "grid", "step")


def test_every_wrong_rule_has_a_kernel():
    assert set(WRONG_FOR["rceil"]) | set(WRONG_FOR["floor"]) == set(EXPONENT_RULES)
    assert parse_probe("k_seq:scale").variant == "scale" and parse_probe("v_seq:tiny").variant == "tiny"
