"""Hypothesis strategies and the fuzzer: valid cases, clear argument errors, shrinking to a minimal
reproducer that replays deterministically, and no failure on a correct kernel."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.errors import InvalidArgument
from zoo import kernels as Z

from flamia_verify.properties import FuzzResult, fuzz, replay_case
from flamia_verify.properties.cases import Case, make_inputs
from flamia_verify.properties.strategies import (
    BOUNDARY_LENGTHS,
    GQA_RATIOS,
    HEADDIMS,
    attention_cases,
    document_lengths,
    head_configs,
    packings,
    value_distributions,
)
from flamia_verify.results import Report


@settings(max_examples=60, deadline=None)
@given(attention_cases(max_tokens=200))
def test_generated_cases_are_valid_and_buildable(case):
    assert isinstance(case, Case)
    assert sum(case.lens_q) <= 200 and sum(case.lens_k) <= 200
    assert case.heads % case.heads_k == 0 and case.headdim in HEADDIMS and case.heads // case.heads_k in GQA_RATIOS
    inp = make_inputs(case)
    assert inp.q.shape == (case.total_q, case.heads, case.headdim)
    assert inp.cu_q[-1] == case.total_q and inp.cu_k[-1] == case.total_k


@settings(max_examples=200, deadline=None)
@given(packings(max_tokens=300))
def test_packings_cover_the_shapes_training_feeds(p):
    lens_q, lens_k = p
    assert len(lens_q) == len(lens_k) >= 1
    assert sum(lens_q) <= 300 and sum(lens_k) <= 300 and min(lens_q + lens_k) >= 0


def test_strategies_reach_boundary_lengths_and_gqa():
    seen = set()

    @settings(max_examples=300, deadline=None)
    @given(document_lengths())
    def collect(n):
        seen.add(n)

    collect()
    assert {0, 1, 31, 32, 33, 63, 64, 65, 127, 128, 129} <= seen
    assert set(BOUNDARY_LENGTHS) >= {31, 32, 33}
    pairs = set()

    @settings(max_examples=100, deadline=None)
    @given(head_configs(max_heads=4))
    def heads(p):
        pairs.add(p)

    heads()
    assert (4, 1) in pairs and (2, 1) in pairs and (1, 1) in pairs


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: document_lengths(min_len=5, max_len=2), "max_len=2 must be >= min_len=5"),
        (lambda: document_lengths(max_len=-1), "max_len=-1 must be at least 0"),
        (lambda: packings(max_docs=0), "max_docs=0 must be at least 1"),
        (lambda: packings(lengths=7), "lengths=7 must be a strategy"),
        (lambda: head_configs(ratios=(0,)), "ratios=\\(0,\\) must be a non-empty sequence of positive ints"),
        (lambda: value_distributions(include=["cauchy"]), "unknown distribution"),
        (lambda: attention_cases(headdims=()), "headdims=\\(\\) must be a non-empty sequence"),
        (lambda: attention_cases(dtype="fp8"), "dtype='fp8' is not one of"),
    ],
)
def test_invalid_arguments_name_the_value(make, match):
    with pytest.raises(InvalidArgument, match=match):
        make().example()


def test_fuzz_finds_a_leak_shrinks_it_and_replays_it():
    res = fuzz(Z.v_scale_leak, examples=25, seed=1)
    assert isinstance(res, FuzzResult) and not res.passed
    rep = res.reproducer
    assert rep["property"] == "causal" and rep["causal"] is True
    for key in (
        "seed",
        "lens_q",
        "lens_k",
        "heads",
        "heads_k",
        "headdim",
        "dtype",
        "distribution",
        "document",
        "t",
        "perturbation",
    ):
        assert key in rep, key
    assert sum(rep["lens_q"]) <= 129  # shrunk from up to 256 tokens
    assert isinstance(res.report, Report) and res.report.check("causal.fuzz").status == "fail"
    assert res.report.check("causal.fuzz").worst_case["lens_q"] == rep["lens_q"]
    data = json.loads(json.dumps(res.to_dict()))
    case = data["reproducer"]
    for _ in range(2):  # deterministic
        check = replay_case(Z.v_scale_leak, case)
        assert check.name == "causal.fuzz" and check.status == "fail", check.message
    fixed = replay_case("flamia-mxfp8", case)
    assert fixed.status == "pass", fixed.message


def test_fuzz_finds_cross_document_leaks_and_one_token_bugs():
    res = fuzz(Z.document_leak, examples=30, seed=0)
    assert not res.passed and res.reproducer["property"] in ("isolation", "causal")
    res = fuzz(Z.one_token_wrong, examples=30, seed=0)
    assert not res.passed and res.reproducer["property"] == "bound"
    assert 1 in res.reproducer["lens_q"]


@pytest.mark.parametrize("name", ["flamia-mxfp8", "bf16"])
def test_fuzz_passes_a_correct_kernel(name):
    events = []
    res = fuzz(name, examples=15, seed=2, on_progress=events.append)
    assert res.passed, res.message
    assert res.reproducer is None and res.examples == 15
    assert all(c.status == "pass" for c in res.report.checks)
    assert events and events[-1].fraction == pytest.approx(1.0)


def test_replay_rejects_bad_reproducers():
    from flamia_verify.errors import ConfigError

    with pytest.raises(ConfigError, match="unknown property 'speed'"):
        replay_case("bf16", {"lens_q": [4], "property": "speed"})
    with pytest.raises(ConfigError, match="needs lens_q"):
        replay_case("bf16", {"property": "bound"})


@settings(max_examples=5, deadline=None)
@given(st.data())
def test_strategies_accept_strategies_as_arguments(data):
    case = data.draw(attention_cases(causal=st.just(True), heads=st.just((2, 1)), distributions="sink", max_tokens=64))
    assert case.causal and (case.heads, case.heads_k) == (2, 1) and case.distribution == "sink"


def test_fuzz_varies_softmax_scale_and_catches_a_kernel_that_ignores_it():
    from zoo import targeted

    bad = fuzz(targeted.ignores_softmax_scale, examples=30, seed=0)
    assert not bad.passed, bad.message
    case = bad.reproducer
    assert case["softmax_scale"] != case["headdim"] ** -0.5, case  # the minimal case keeps the unusual scale
    assert replay_case(targeted.ignores_softmax_scale, case).status == "fail"
    assert replay_case("flamia-mxfp8", case).status == "pass"
    good = fuzz("flamia-mxfp8", examples=30, seed=0)
    assert good.passed, good.message
