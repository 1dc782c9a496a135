"""Five input dimensions the suites' base packings did not draw, each with the bugs that escaped
through it (``zoo/dimension_bugs.py``):

* positive homogeneity (``consistency.homogeneity``): c V and c dO for powers of two c;
* head_dims that are not multiples of 16 (8, 24, 40, 72, 88, 100);
* where each row's maximum lies along the keys (``late_max``, ``late_sink``);
* documents past 2048 keys per row in the families that judge values (error, causal, special);
* heads 100x apart (``head_spread``).

Every planted bug fails the checks it names in the suite it names, passes the checks its bug cannot
reach, and is bitwise the correct kernel on the quick suite's base packings (the cases the value
checks read before): without the dimension cases it escaped. The correct built-ins that
``test_properties_correct.py`` does not run pass the checks that read the new cases.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from zoo.dimension_bugs import DIMENSION_BUGS
from zoo.verdicts import assert_caught_and_quiet

from flamia_verify.kernels.designs import FLAMIA_MXFP8
from flamia_verify.kernels.emulation import make_kernel
from flamia_verify.properties import run_checks
from flamia_verify.properties.cases import (
    DISTRIBUTIONS,
    HEAD_SPREAD,
    RESIDUE_HEADDIMS,
    Case,
    dimension_cases,
    long_document,
    make_inputs,
)
from flamia_verify.properties.checks.consistency import homogeneity as H
from flamia_verify.properties.checks.error import tensors as error_checks
from flamia_verify.properties.coverage import features
from flamia_verify.properties.harness import KernelHarness
from flamia_verify.properties.strategies import HEADDIMS
from flamia_verify.settings import suite_settings


@pytest.mark.parametrize("name", sorted(DIMENSION_BUGS))
def test_dimension_bug_is_caught_where_it_should_be(name):
    kernel = DIMENSION_BUGS[name]
    report = run_checks(kernel, suite=kernel.suite, only=list(kernel.catches + kernel.quiet))
    assert_caught_and_quiet(name, kernel, report)


def _old_base_cases() -> list[Case]:
    """The quick suite's base packings at their two seeds (what error, bound and bias read before), but
    the realistic packing added after these dimensions (tests/test_realistic_values.py)."""
    s = suite_settings("quick")
    s = replace(s, base=tuple(p for p in s.base if p.distribution != "realistic"))
    return [
        Case(
            p.lens_q,
            p.lens_k,  # type: ignore[arg-type]
            heads=p.heads,
            heads_k=p.heads_k,  # type: ignore[arg-type]
            headdim=p.headdim,
            causal=p.causal,
            distribution=p.distribution,
            softmax_scale=p.softmax_scale,
            overrides=(("scale_do", 2.0**p.do_log2),) if p.do_log2 else (),
            seed=1000 * seed + i,
        )
        for seed in range(s.seeds)
        for i, p in enumerate(s.base)
    ]


# v_scale_head0 and v_scale_across_heads read kv heads together: the GQA 4:2 packing differs (heads of
# equal magnitudes: by a rounding; error.out read v_scale_head0 at 2.8 of the model there already);
# v_scale_eps moves a scale where amax + 2^-4 passes an exponent boundary (a subnormal element more or
# less); tiny_do_flushed flushes the few elements of the dO x 2^-20 packing below 2^-30
_OFF_BASE = sorted(set(DIMENSION_BUGS) - {"v_scale_head0", "v_scale_across_heads", "v_scale_eps", "tiny_do_flushed"})


@pytest.mark.parametrize("name", _OFF_BASE)
def test_dimension_bug_is_bitwise_correct_on_the_old_base_cases(name):
    bug, good = KernelHarness(DIMENSION_BUGS[name]), KernelHarness(make_kernel(FLAMIA_MXFP8))
    for case in _old_base_cases():
        inp = make_inputs(case)
        a, b = bug.call(inp, backward=True), good.call(inp, backward=True)
        for t in ("out", "dq", "dk", "dv"):
            assert torch.equal(getattr(a, t), getattr(b, t)), f"{name} differs on {case.describe()} ({t})"


@pytest.mark.parametrize("name", ["headdim_tail_scale", "lazy_rescale_stale_l"])
def test_without_the_dimension_cases_the_error_family_missed_it(name, monkeypatch):
    """error.out on the base cases alone passes the bug (the kernel is bitwise the correct one there);
    with the dimension cases it fails."""
    kernel = DIMENSION_BUGS[name]
    monkeypatch.setattr(error_checks, "dimension_cases", lambda *a, **k: [])
    report = run_checks(kernel, suite="quick", only=["error.out"])
    assert report.check("error.out").status == "pass", report.check("error.out").message
    monkeypatch.undo()
    assert run_checks(kernel, suite="quick", only=["error.out"]).check("error.out").status == "fail"


def test_a_flushed_tiny_gradient_escapes_the_bound_and_fails_homogeneity():
    """dO x 2^-40 (special.magnitudes has it) with dO below 2^-30 flushed: every gradient is 0, and
    the rigorous bound of those gradients holds 0 (it can exceed the gradient itself), so the bound
    family passes it. consistency.homogeneity compares the scaled result over c with the unscaled
    one: bitwise under the recipe's claim (mxfp8), and through the error model, a relative RMSE that
    zeros cannot meet, where the recipe allows scales that do not follow the data (fp8)."""
    kernel = DIMENSION_BUGS["tiny_do_flushed"]
    report = run_checks(kernel, suite="quick", only=["special.magnitudes", "bound.grad", "consistency.homogeneity"])
    assert report.check("special.magnitudes").status == "pass" and report.check("bound.grad").status == "pass"
    res = report.check("consistency.homogeneity")
    assert res.status == "fail" and res.metrics["mismatched_elements"] > 0
    assert "dO x 2^-40" in res.message and res.worst_case["factor"] == 2.0**-40
    res = run_checks(kernel, recipe="fp8", suite="quick", only=["consistency.homogeneity"]).checks[0]
    assert res.status == "fail" and res.metrics["violations"] == 0 and res.metrics["normalized_error"] > 4


def test_homogeneity_factors_stay_inside_the_dtype():
    x = torch.full((64, 2, 32), 0.5)
    x[0, 0, 0] = 1.0  # amax 1, RMS about 2^-1
    assert H._factor([(x.bfloat16(), 1)], 2.0**-40, torch.bfloat16) == 2.0**-40
    assert H._factor([(x.bfloat16(), 64)], 2.0**8, torch.bfloat16) == 2.0**8
    # fp16: 2^-40 is below its range; pulled in to keep the RMS 2^6 above its smallest normal 2^-14
    assert H._factor([(x.half(), 1)], 2.0**-40, torch.float16) == 2.0**-7
    # already near fp16's floor: no room to scale down
    assert H._factor([(x.half() * 2.0**-10, 1)], 2.0**-40, torch.float16) is None
    # up: 2^8 below fp16's largest value, the headroom shared by the rows one dV element sums
    assert H._factor([(x.half(), 16)], 2.0**8, torch.float16) == 2.0**3
    # a result that moves with the input counts too (gradients of a small dO)
    assert H._factor([(x.half(), 1), (x.half() * 2.0**-6, 1)], 2.0**-40, torch.float16) == 2.0**-1


@pytest.mark.parametrize(
    ("kernel", "dtype", "how"),
    [("flamia-mxfp8", "bf16", "bitwise"), ("fp8", "bf16", "bound"), ("flamia-mxfp8", "fp16", "bound")],
)
def test_homogeneity_is_judged_bitwise_where_the_recipe_and_dtype_promise_bits(kernel, dtype, how):
    res = run_checks(kernel, suite="quick", only=["consistency.homogeneity"], dtype=dtype).checks[0]
    assert res.status == "pass", res.message
    assert ("mismatched_elements" in res.metrics) == (how == "bitwise")
    assert ("violations" in res.metrics) == (how == "bound")
    if how == "bound":
        assert "bitwise_differences" in res.metrics


@pytest.mark.parametrize("name", ["flamia-mxfp8-floor", "mxfp8-naive", "fp8-tensor"])
def test_other_builtins_are_homogeneous(name):
    """FLOOR and the naive design scale exactly; so do fp8-tensor's per-tensor fp32 scales amax/448 in
    the whole-tensor runs, but its one tensor-wide scale spans the heads: V of one kv head x 2^6 moves
    the other heads' rounding, which the fp8 recipe allows (judged by its bound and error model)."""
    res = run_checks(name, suite="quick", only=["consistency.homogeneity"]).checks[0]
    assert res.status == "pass", res.message
    if name == "fp8-tensor":
        assert res.metrics["bitwise_differences"] > 0 and res.metrics["normalized_error"] < 2
    else:
        assert res.metrics["mismatched_elements"] == 0


_CHANGED = [
    "error",
    "bound.out",
    "bound.grad",
    "consistency.homogeneity",
    "causal.forward",
    "causal.dq",
    "causal.dk_dv",
    "special.attention_sink",
]


@pytest.mark.parametrize("name", ["flamia-mxfp8-floor", "fp8-tensor"])
def test_correct_builtins_pass_the_checks_that_read_the_new_cases(name):
    """Built-ins test_properties_correct does not run (fp8-tensor leaks causally by design: its causal
    checks are left out, as its other known failures; fp8-mma, slow in the emulation, was measured)."""
    only = [c for c in _CHANGED if not (name == "fp8-tensor" and c.startswith("causal"))]
    report = run_checks(name, suite="quick", only=only)
    loud = [f"{c.name}: {c.status}: {c.message}" for c in report.checks if c.status != "pass"]
    assert not loud, "\n".join(loud)


def test_dimension_cases_cover_the_five_dimensions():
    quick = dimension_cases("quick", seed=0)
    standard = dimension_cases("standard", seed=0)
    assert {c.headdim for c in standard} >= set(RESIDUE_HEADDIMS)
    assert {c.headdim for c in quick} & set(RESIDUE_HEADDIMS) == {40, 72}
    for cases in (quick, standard):
        assert {"late_max", "late_sink", "head_spread"} <= {c.distribution for c in cases}
    assert max(max(c.lens_k) for c in quick) > 2048 and max(max(c.lens_k) for c in standard) > 4096
    assert long_document("quick", "cuda")[1] > 8192
    assert all(max(c.lens_k) <= 130 for c in dimension_cases("quick", seed=0, long=False))
    assert set(RESIDUE_HEADDIMS) <= set(HEADDIMS) and HEADDIMS[0] == 32
    assert {"late_max", "late_sink", "head_spread"} <= set(DISTRIBUTIONS)


def test_late_distributions_put_each_rows_maximum_late():
    for dist in ("late_max", "late_sink"):
        case = Case((130,), heads=2, heads_k=1, headdim=72, causal=False, distribution=dist, seed=3)
        inp = make_inputs(case)
        s = torch.einsum("qhd,khd->hqk", inp.q.double(), inp.k.double().expand(-1, 2, -1)) * case.scale
        late = (s.argmax(-1) >= 64).double().mean()
        assert late > 0.9, (dist, late)
        # the first tile's maximum is far below the row's: a lazy rescale (threshold 8 log2 units) fires
        growth = (s.amax(-1) - s[..., :64].amax(-1)) / math.log(2)
        assert (growth > 8).double().mean() > 0.3, dist


def test_head_spread_is_one_head_100x_and_a_feature():
    case = Case((40,), heads=4, heads_k=2, distribution="head_spread", seed=1)
    inp = make_inputs(case)
    rms_v = inp.v.double().pow(2).mean(dim=(0, 2)).sqrt()
    rms_do = inp.do.double().pow(2).mean(dim=(0, 2)).sqrt()
    assert 50 < float(rms_v[1] / rms_v[0]) < 200 and 50 < float(rms_do[3] / rms_do[0]) < 200
    assert HEAD_SPREAD == 100.0
    assert "values=head_spread" in features(inp)
    assert "values=head_spread" not in features(make_inputs(case.with_(distribution="gaussian")))
    long = dimension_cases("quick", seed=0)[-1]
    assert "long_document=over_2048_keys" in features(make_inputs(long))
