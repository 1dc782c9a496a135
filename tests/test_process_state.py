"""interface.process_state: a kernel call leaves the process as it found it (StateProbe), and the
probe itself gives the caller's random streams back untouched."""

from __future__ import annotations

import pytest
import torch
from zoo.convention_bugs import CONVENTION_BUGS
from zoo.correct import sdpa_bf16

from flamia_verify.properties import run_checks
from flamia_verify.properties.process_state import PROBE_SEED, StateProbe

CPU = torch.device("cpu")


def test_drawing_is_allowed_and_the_callers_stream_comes_back():
    torch.manual_seed(123)
    torch.rand(2)
    saved = torch.get_rng_state()
    probe = StateProbe(CPU)
    assert torch.initial_seed() == probe.seed >= PROBE_SEED  # the call sees the probe's generator
    torch.rand(3)  # a kernel with dropout draws
    assert probe.finish() == []
    assert torch.equal(torch.get_rng_state(), saved) and torch.initial_seed() == 123
    second = StateProbe(CPU)  # another seed for every call: a kernel's random draws differ between calls
    assert second.seed != probe.seed and second.finish() == []


@pytest.mark.parametrize("reseed", ["own seed", "another seed"])
def test_a_reseed_shows_even_to_the_generators_own_seed(reseed):
    probe = StateProbe(CPU)
    torch.manual_seed(torch.initial_seed() if reseed == "own seed" else 7)
    (change,) = probe.finish()
    assert change.what == ("torch.get_rng_state()" if reseed == "own seed" else "torch.initial_seed()")


def test_changed_settings_are_named_and_nothing_else():
    probe = StateProbe(CPU)
    torch.set_default_dtype(torch.bfloat16)
    flag = torch.backends.cudnn.benchmark
    torch.backends.cudnn.benchmark = not flag
    try:
        changes = probe.finish()
    finally:
        torch.set_default_dtype(torch.float32)
        torch.backends.cudnn.benchmark = flag
    assert sorted(c.what for c in changes) == ["torch.backends.cudnn.benchmark", "torch.get_default_dtype()"]
    assert StateProbe(CPU).finish() == []


def test_a_reseeding_backward_fails_and_a_correct_kernel_passes():
    bad = run_checks(CONVENTION_BUGS["backward_reseeds_the_process"], recipe="mxfp8", only=["interface.process_state"])
    (res,) = bad.checks
    assert res.status == "fail" and "torch.get_rng_state()" in res.message, res.message
    good = run_checks(sdpa_bf16, recipe="bf16", only=["interface"])
    assert {c.name: c.status for c in good.checks}["interface.process_state"] == "pass"


def test_the_engine_judges_every_call_of_the_run():
    # the check runs before the backward-heavy checks; the reseed is seen in the calls after it too
    report = run_checks(
        CONVENTION_BUGS["backward_reseeds_the_process"], recipe="mxfp8", only=["interface.process_state", "error.dq"]
    )
    res = {c.name: c for c in report.checks}["interface.process_state"]
    assert res.status == "fail" and res.metrics["calls"] > 5
