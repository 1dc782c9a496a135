"""A backward that does not repeat itself bitwise (atomics) is a reproducibility finding, not a leak:
the information-flow checks judge a perturbation's changes beyond the kernel's own run-to-run noise
(compare.run_to_run_noise), bitwise where the kernel repeats itself, and still fail a leaking kernel
with the same noise."""

from __future__ import annotations

import pytest
import torch
from zoo.nondeterministic import NONDETERMINISTIC

from flamia_verify.properties import run_checks
from flamia_verify.properties.compare import compare_beyond_noise, run_to_run_noise

FLOW = ["causal", "isolation.neighbours", "isolation.nan", "consistency.homogeneity", "interface.arguments"]


def test_a_correct_atomics_kernel_passes_the_gate_and_is_reported_unrepeatable():
    kernel, _ = NONDETERMINISTIC["bf16_atomics"]
    report = run_checks(kernel, suite="quick", only=FLOW + ["determinism"])
    loud = [f"{c.name}: {c.status}: {c.message}" for c in report.gating_checks if c.status != "pass"]
    assert not loud, "\n".join(loud)
    assert report.passed
    assert report.check("determinism.repeat").status == "fail"  # the finding, under reproducibility
    assert report.check("determinism.repeat").verdict == "reproducibility"


def test_a_leaking_kernel_with_the_same_noise_still_fails_its_flow_checks():
    kernel, catches = NONDETERMINISTIC["mxfp8_naive_atomics"]
    report = run_checks(kernel, suite="quick", only=list(catches))
    for name in catches:
        res = report.check(name)
        assert res.status == "fail", f"{name}: {res.status}: {res.message}"


def test_noise_is_none_for_equal_runs_and_judged_beyond_one_unit_otherwise():
    a = torch.tensor([1.0, 0.5, -3.0, 1e-3], dtype=torch.bfloat16)
    assert run_to_run_noise({"x": a}, {"x": a.clone()}) == {"x": None}
    b = a.clone()
    b[0] = torch.nextafter(a[0], torch.tensor(2.0, dtype=torch.bfloat16))  # one unit
    assert run_to_run_noise({"x": a}, {"x": b}) == {"x": 0.0}
    # None: bitwise, so one unit counts; 0.0: two units are noise, three are not
    assert compare_beyond_noise(b, a, None).mismatched == 1
    assert compare_beyond_noise(b, a, 0.0).mismatched == 0
    c = a.clone()
    c[2] = -3.0 - 3 * 0.015625  # three units at 3
    assert compare_beyond_noise(c, a, 0.0).mismatched == 1
    d = a.clone()
    d[1] = float("nan")  # finite on one side only: always a change
    assert compare_beyond_noise(d, a, 1.0).mismatched == 1


@pytest.mark.parametrize("name", sorted(NONDETERMINISTIC))
def test_the_noisy_kernels_are_not_bitwise_repeatable(name):
    from flamia_verify.properties.cases import Case, make_inputs
    from flamia_verify.properties.harness import KernelHarness

    kernel, _ = NONDETERMINISTIC[name]
    harness = KernelHarness(kernel)
    inputs = make_inputs(Case((300, 200), heads=2, heads_k=1, causal=True, seed=1), "cpu")
    first, again = harness.call(inputs, backward=True), harness.call(inputs, backward=True)
    noise = run_to_run_noise(first.tensors(), again.tensors())
    assert noise["out"] is None and all(noise[t] is not None for t in ("dq", "dk", "dv")), noise


def test_ulp_is_the_spacing_of_the_dtype():
    from flamia_verify.properties.compare import ulp

    x = torch.tensor([1.0, 3.0, 0.125, 0.0, -2.0, 1e-40, 1.99], dtype=torch.bfloat16)
    sub = torch.finfo(torch.bfloat16).smallest_normal * 2.0**-7
    assert ulp(x).tolist() == [2.0**-7, 2.0**-6, 2.0**-10, sub, 2.0**-6, sub, 2.0**-7]
    nxt = torch.nextafter(x, torch.full_like(x, float("inf"))).double() - x.double()
    assert torch.equal(ulp(x)[x.double() >= 0], nxt[x.double() >= 0])
