"""The state family: a kernel called the way training calls it (several layers through one kernel or
one instance per layer, magnitudes that differ and drift, a backward for every forward) is judged at
every call; the planted stateful bugs fail it with the call and the stale scale named, correct kernels
(stateless built-ins, delayed scaling per instance) pass it; the declaration of a kernel's state is
read, reported and used (factories give one instance per layer; a restorable state is pinned for the
checks that judge one call at a time)."""

from __future__ import annotations

import math
import re

import pytest
import torch
from zoo import state_bugs as SB
from zoo.verdicts import assert_caught_and_quiet

from flamia_verify.errors import ConfigError
from flamia_verify.kernels import load_kernel
from flamia_verify.kernels.cudnn_fp8.scaling import ROLES, ScalingRecipe, ScalingState
from flamia_verify.kernels.delayed import DelayedScalingAttention
from flamia_verify.kernels.state import (
    StateKind,
    StatePolicy,
    StateSharing,
    declared_state,
    is_factory,
    layer_kernels,
)
from flamia_verify.properties import run_checks
from flamia_verify.properties.cases import Case, make_inputs
from flamia_verify.properties.checks.state.sequences import DRIFT, LAYER_OFFSETS, training_schedule
from flamia_verify.properties.harness import KernelHarness, StatePin
from flamia_verify.reports.wording import run_line


def _state(kernel, only=("state",), **kw):
    return run_checks(kernel, suite="quick", only=list(only), **kw)


# ------------------------------------------------------------------------------------------------
# the planted bugs fail, naming the call and the stale scale
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(SB.STATE_BUGS))
def test_a_planted_stateful_bug_fails_the_state_family_naming_the_call_and_the_scale(name):
    kernel = SB.fresh(name)
    quiet = tuple(q for q in kernel.quiet if q.startswith("state"))  # the pure checks: the next test
    report = _state(kernel, only=kernel.catches + quiet + ("state",))
    assert_caught_and_quiet(name, kernel, report)
    for check in kernel.catches:
        res = report.check(check)
        assert re.search(r"call \d+", res.message), res.message
        if callable(getattr(kernel, "state_describe", None)):  # the scale that was stale, where it can be read
            assert re.search(r"scale 2\^-?\d+", res.message), res.message
        else:  # else the bits that show it
            assert re.search(r"differs in \d+ elements", res.message), res.message
        assert res.verdict == "gating"


def test_the_former_cudnn_default_passes_the_pure_checks_and_fails_from_its_first_call():
    """cudnn-fp8's former default, emulated (frozen after the first call, one state for every layer):
    the checks that judge one call at a time pass it (each runs at a state calibrated on its own
    case), and state.training fails it at the very first call: the backward runs in reverse layer
    order, so the last layer's dS (2^-8 of the first layer's) froze dS's scale, and the first layer's
    backward saturates; the forward of the second layer (v 2^6 larger than the first's, which froze
    v's scale) saturates as well."""
    kernel = SB.fresh("frozen_shared")
    report = _state(kernel, only=kernel.catches + kernel.quiet)
    assert_caught_and_quiet("frozen_shared", kernel, report)
    res = report.check("state.training")
    assert "call 1 of 39 (step 0, layer 0" in res.message, res.message
    assert "dp's scale 2^13" in res.message and "saturates by" in res.message, res.message
    wc = res.worst_case
    assert wc["call"] == 1 and wc["layer"] == 0 and wc["step"] == 0
    assert wc["stale_scales"][0]["role"] == "dp" and wc["stale_scales"][0]["ratio"] > 8
    assert wc["state_before_backward"]["dp"]["frozen"] is True
    second = res.details["per_call"][1]
    assert second["layer"] == 1 and second["violations"] > 0 and second["normalized_error"] > 8
    assert Case.from_dict(wc["case"]).lens_q == (24, 40)
    env = report.environment["kernel_state"]
    assert env["declared"]["kind"] == "frozen" and env["declared"]["sharing"] == "shared" and not env["factory"]


# ------------------------------------------------------------------------------------------------
# correct kernels pass
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("spec", ["bf16", "fp8", "flamia-mxfp8", "fp8-delayed"])
def test_correct_kernels_pass_the_state_family(spec):
    report = _state(spec)
    training = report.check("state.training")
    assert training.status == "pass", training.message
    assert training.metrics["calls"] == len(DRIFT) * len(LAYER_OFFSETS)
    assert training.metrics["normalized_error"] < 1.5 and training.metrics["violations"] == 0
    history = report.check("state.history")
    if spec == "fp8-delayed":
        assert history.status == "pass", history.message
        assert training.metrics["state_detected"] == 1
        assert "one instance per layer" in training.message
    else:  # a stateless kernel declares no history: nothing for state.history to forget
        assert history.status == "skip" and "declares no amax history" in history.message
        assert training.metrics["state_detected"] == 0


def test_the_schedule_moves_one_binade_per_call_and_layers_differ_by_2_4_to_2_8():
    """The premise a correct delayed kernel is held to: no tensor (nor dS ~ v dO, dQ ~ dS k, dK ~ dS q)
    exceeds the largest amax of its layer's earlier calls by more than 2x."""
    by_layer: dict[int, list] = {}
    for _, layer, (eq, ek, ev, edo) in training_schedule():
        by_layer.setdefault(layer, []).append({"q": eq, "k": ek, "v": ev, "do": edo, "ds": ev + edo,
                                               "dq": ev + edo + ek, "dk": ev + edo + eq, "o": ev, "dv": edo})  # fmt: skip
    for calls in by_layer.values():
        for i in range(1, len(calls)):
            for role in calls[i]:
                assert calls[i][role] - max(c[role] for c in calls[:i]) <= 1, (role, i)
    for off in LAYER_OFFSETS[1:]:
        assert all(4 <= abs(x) <= 8 for x in off)


# ------------------------------------------------------------------------------------------------
# the declaration, factories and the pinned state
# ------------------------------------------------------------------------------------------------


def test_state_policies_read_from_objects_mappings_and_strings():
    assert StatePolicy.from_value("none").kind is StateKind.NONE
    p = StatePolicy.from_value({"kind": "delayed", "history_len": 16, "margin": 1, "sharing": "shared"})
    assert p == StatePolicy(StateKind.DELAYED, 16, 1, StateSharing.SHARED)
    assert p.describe() == "delayed scaling, amax history of 16 calls, margin 1, one state shared by every caller"
    assert StatePolicy.from_value(p.to_dict()) == p
    for bad in ("sometimes", {"kind": "delayed", "window": 3}, {"kind": "delayed", "history_len": 0}, 7):
        with pytest.raises(ValueError):
            StatePolicy.from_value(bad)


def test_a_malformed_declaration_is_a_configuration_error():
    def attn(q, k, v, cu_q, cu_k, mq, mk, *, softmax_scale=None, causal=False):
        return load_kernel("bf16").fn(q, k, v, cu_q, cu_k, mq, mk, softmax_scale=softmax_scale, causal=causal)

    attn.recipe = "bf16"
    attn.state_policy = {"kind": "delayed", "window": 16}
    with pytest.raises(ConfigError, match="state_policy"):
        _state(attn)


def test_a_factory_gives_each_layer_its_own_instance_and_a_function_is_shared():
    fn = DelayedScalingAttention()
    layers = layer_kernels(fn, 3)
    assert is_factory(fn) and len({id(k) for k in layers}) == 3 and all(k is not fn for k in layers)
    assert len({id(k.state) for k in layers}) == 3
    bf16 = load_kernel("bf16").fn
    assert layer_kernels(bf16, 3) == [bf16] * 3 and declared_state(bf16) is None


def test_the_report_shows_the_declared_state():
    report = _state("fp8-delayed", only=("state.history",))
    env = report.environment["kernel_state"]
    assert env == {
        "declared": {"kind": "delayed", "history_len": 16, "margin": 1, "sharing": "per-instance"},
        "description": "delayed scaling, amax history of 16 calls, margin 1, one state per instance",
        "factory": True,
        "pinned": True,
    }
    assert "state: delayed scaling, amax history of 16 calls" in run_line(report)
    assert "state:" not in run_line(_state("bf16", only=("state.history",)))


def test_scaling_state_snapshots_restore_every_scale_and_record():
    st = ScalingState(ScalingRecipe(history_len=4, margin=1))
    dev = torch.device("cpu")
    st.scales(("q", "k", "v"), dev, measured=torch.tensor([4.0, 2.0, 1.0]))
    snap = st.snapshot()
    before = st.describe()
    st.record(("q", "k", "v"), torch.tensor([400.0, 2.0, 1.0]))
    st.scales(("q", "k", "v"), dev)
    assert st.describe()["q"]["scale"] != before["q"]["scale"]
    st.restore(snap)
    assert st.describe() == before
    st.restore(snap)  # a snapshot may be restored again
    assert st.describe() == before
    d = before["q"]
    assert d["scale"] == 32.0 and d["scale_log2"] == 5 and d["window_amax"] == 4.0 and d["records"] == 1
    assert set(st.describe()) == set(ROLES)


def test_a_frozen_role_still_reports_the_amax_of_the_last_call():
    st = ScalingState(ScalingRecipe(history_len=4, freeze_after_calibration=True))
    st.scales(("q", "k", "v"), torch.device("cpu"), measured=torch.tensor([4.0, 2.0, 1.0]))
    st.record(("q", "k", "v"), torch.tensor([64.0, 2.0, 1.0]))
    d = st.describe(("q",))["q"]
    assert d["frozen"] and d["window_amax"] == 4.0 and d["last_amax"] == 64.0


def test_the_pin_runs_a_case_and_its_perturbation_at_one_state_adapted_to_the_case():
    """Every call of a case at the state one call on the case leaves in a fresh kernel: a perturbed
    copy of the case (a huge future token) runs at that state too, and another case at its own."""
    fn = DelayedScalingAttention()
    fresh = fn.state_snapshot()
    harness = KernelHarness(fn)
    harness.pin = StatePin(fn, fresh, backward=True)
    small = Case((24, 40), heads=2, heads_k=1, seed=3)
    big = Case((24, 40), heads=2, heads_k=1, seed=3, overrides=(("scale_v", 2.0**20),))
    inp = make_inputs(small, "cpu")
    first = harness.call(inp)
    harness.call(make_inputs(big, "cpu"))  # another case: its own state, then back
    again = harness.call(inp)
    assert torch.equal(first.out, again.out) and torch.equal(first.dq, again.dq)
    poked = inp.clone()
    poked.v[-1] = 1.0e4  # the last key of the last document: no query before it sees it
    late = harness.call(poked)
    assert torch.equal(late.out[:-1], first.out[:-1])
    assert harness.pin.warmups == 2
    scales = fn.state_describe()
    assert scales["v"]["scale_log2"] == fn.state.describe(("v",))["v"]["scale_log2"]


def test_training_parity_gives_a_factory_one_instance_per_layer():
    from flamia_verify.training.model import ModelConfig, TinyLM

    made = []

    class Counting(DelayedScalingAttention):
        def new_instance(self):
            inst = Counting()
            made.append(inst)
            return inst

    cfg = ModelConfig(layers=3, d_model=32, heads=2)
    model = TinyLM(cfg)
    tokens = torch.randint(0, 256, (24,))
    cu = torch.tensor([0, 10, 24], dtype=torch.int32)
    kernels = layer_kernels(Counting(), cfg.layers)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(tokens, cu, 14, kernels)
    logits.float().sum().backward()
    assert len(made) == 3 and [k.paths.total() for k in made] == [1, 1, 1]
    assert all(k.state.records("do") == 1 for k in made)


def test_history_check_skips_what_declares_no_history():
    report = _state(SB.fresh("frozen_per_layer"), only=("state.history",))
    res = report.check("state.history")
    assert res.status == "skip" and "no amax history" in res.message


@pytest.mark.parametrize("dtype", ["fp16"])
def test_fp16_runs_the_schedule_at_half_the_exponents(dtype):
    sched = training_schedule(dtype)
    assert (
        max(max(abs(e) for e in exps) for _, _, exps in sched)
        <= math.ceil(max(abs(x) for x in LAYER_OFFSETS[2]) / 2) + 2
    )
    report = _state("fp8-delayed", only=("state.training",), dtype=dtype)
    assert report.check("state.training").status == "pass", report.check("state.training").message
