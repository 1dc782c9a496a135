"""What the fuzzer says about what it found: the family a failure belongs to, the numbers of the search
in words, and minimal cases without the empty documents they do not need.

A cross-document leak or an ignored causal flag is outside the error bound long before anything else,
and the bound is checked first; the fuzzer used to stop there and report ``bound.fuzz`` while
``isolation.fuzz`` and ``causal.fuzz`` read "no failure"."""

from __future__ import annotations

import json

import pytest
from zoo import fuzz_bugs as FB
from zoo import kernels as Z

from flamia_verify.properties import fuzz, replay_case, run_checks
from flamia_verify.properties.cases import Case
from flamia_verify.properties.search import Finding as _Finding
from flamia_verify.properties.search import _drop_empty_documents


def test_a_kernel_that_attends_across_documents_fails_isolation_fuzz():
    res = fuzz(FB.attends_across_documents, examples=30, seed=0)
    assert not res.passed
    rep = res.reproducer
    assert rep["property"] == "isolation", rep["message"]
    assert res.report.check("isolation.fuzz").status == "fail"
    assert res.report.check("isolation.fuzz").worst_case["lens_q"] == rep["lens_q"]
    bound = res.report.check("bound.fuzz")
    assert "outside the bound" in rep["message"]  # the symptom is named beside the cause
    # and the bound's own check does not read "no failure" beside it: it fails, naming the leak
    assert bound.status == "fail" and "no failure" not in bound.message, bound.message
    assert "isolation.fuzz" in bound.message and bound.metrics["failing_examples"] >= 1
    assert len([n for n in rep["lens_q"] if n]) >= 2
    case = json.loads(json.dumps(rep))
    assert replay_case(FB.attends_across_documents, case).status == "fail"
    assert replay_case("bf16", case).status == "pass"


def test_a_kernel_that_ignores_causal_fails_causal_fuzz():
    res = fuzz(FB.ignores_causal, examples=30, seed=0)
    assert not res.passed
    rep = res.reproducer
    assert rep["property"] == "causal" and rep["causal"] is True, rep["message"]
    assert res.report.check("causal.fuzz").status == "fail"
    bound = res.report.check("bound.fuzz")
    assert bound.status == "fail" and "causal.fuzz" in bound.message and "no failure" not in bound.message
    assert replay_case(FB.ignores_causal, json.loads(json.dumps(rep))).status == "fail"


@pytest.mark.parametrize(
    "kernel, prop",
    [(FB.attends_across_documents, "isolation"), (FB.ignores_causal, "causal")],
    ids=["attends_across_documents", "ignores_causal"],
)
def test_the_fuzz_pass_of_check_names_the_leak(kernel, prop):
    res = run_checks(kernel, suite="standard", only=["isolation.fuzz"], seed=0).check("isolation.fuzz")
    assert res.status == "fail"
    assert res.worst_case["property"] == prop and res.worst_case["check"] == f"{prop}.fuzz", res.message
    assert res.metrics[f"failing_{prop}"] >= 1 and "failing_bound" not in res.metrics


def test_a_genuine_bound_failure_stays_bound():
    res = fuzz(Z.one_token_wrong, examples=30, seed=0)
    assert not res.passed and res.reproducer["property"] == "bound"
    assert "also_failed" not in json.dumps(res.reproducer)


def test_the_counts_say_what_they_are():
    """--examples 30 used to read "failed on 11 of 92 examples": the 92 were every draw, shrinking included."""
    res = fuzz(FB.attends_across_documents, examples=30, seed=0)
    check = res.report.check("isolation.fuzz")
    other = res.report.check("bound.fuzz")
    m = other.metrics
    assert m["examples_requested"] == res.requested == 30
    assert m["examples_drawn"] == res.examples > 30
    assert 0 < m["examples_shrinking"] == res.shrinking < res.examples
    assert m["distinct_examples"] <= res.examples
    generated = res.examples - res.shrinking
    words = (
        f"30 examples asked for; {res.examples} drawn: {generated} until the first failure stopped the search and "
        f"{res.shrinking} while shrinking it; {m['distinct_examples']} distinct ones run on the kernel"
    )
    assert words in other.message, other.message
    assert check.metrics["failing_examples"] >= 1
    assert res.report.environment["examples_requested"] == 30
    assert res.report.environment["examples_drawn"] == res.examples
    ok = fuzz("bf16", examples=5, seed=0)
    assert ok.passed and ok.requested == 5 and ok.shrinking == 0
    assert "5 examples asked for; 5 drawn;" in ok.report.check("bound.fuzz").message


# -- minimal cases without the empty documents they do not need ---------------------------------------


def test_shrinking_drops_every_empty_document_the_failure_does_not_need():
    case = Case((0, 0, 0, 0, 2, 0), heads=1)
    seen = []

    def evaluate(c, document, t, kind):
        seen.append((c.lens_q, document))
        # a causal failure of the 2-token document: it must stay the target
        return _Finding("causal", "x", {}) if c.lens_q[document] == 2 else None

    small, document = _drop_empty_documents(case, 4, 0, "huge", evaluate, "causal")
    assert small.lens_q == (2,) and small.lens_k == (2,) and document == 0
    assert all(lens[doc] == 2 for lens, doc in seen)  # the target document moved with the drops


def test_shrinking_keeps_an_empty_document_the_failure_needs():
    # lens_k 0 for document 0: a failure that needs a document without keys keeps it
    case = Case((1, 0, 1), lens_k=(0, 0, 1), heads=1)

    def evaluate(c, document, t, kind):
        return _Finding("crash", "x", {}) if c.lens_k[0] == 0 else None

    small, document = _drop_empty_documents(case, 2, 0, "huge", evaluate, "crash")
    assert small.lens_q == (1, 1) and small.lens_k == (0, 1)
    assert document == 1
    # a failure of another property on the smaller case is not a reproduction
    small, _ = _drop_empty_documents(case, 0, 0, "huge", lambda *a: _Finding("crash", "y", {}), "bound")
    assert small == case


@pytest.mark.parametrize(
    "kernel, seed, prop, docs",
    [(Z.document_leak, 7, "isolation", 2), (FB.attends_across_documents, 6, "isolation", 2)],
    ids=["document_leak-seed7", "attends_across_documents-seed6"],
)
def test_minimal_cases_of_the_fuzz_pass_hold_no_unneeded_empty_documents(kernel, seed, prop, docs):
    """The standard suite's fuzz pass left document_leak (seed 7) at lens_q [128, 0, 0, 0, 0, 0, 0, 0]
    and attends_across_documents (seed 6) at [0, 128, 127] when its shrinking budget ran out; hypothesis
    cannot delete a document before the target without moving the target's index either."""
    res = run_checks(kernel, suite="standard", only=["isolation.fuzz"], seed=seed).check("isolation.fuzz")
    wc = res.worst_case
    assert res.status == "fail" and wc["property"] == prop, res.message
    assert len(wc["lens_q"]) == docs, (wc["lens_q"], wc["lens_k"])
    assert all(q or k for q, k in zip(wc["lens_q"], wc["lens_k"])), (wc["lens_q"], wc["lens_k"])
    assert replay_case(kernel, json.loads(json.dumps(wc))).status == "fail"


def test_a_property_without_failure_says_on_how_many_examples_it_ran():
    """It read "no failure; 50 examples asked for" when the search had stopped after 3."""
    res = fuzz(Z.v_scale_leak, examples=50, seed=0)
    assert res.reproducer["property"] == "causal"
    for name, prop in (("bound.fuzz", "bound"), ("isolation.fuzz", "isolation")):
        check = res.report.check(name)
        n = check.metrics["distinct_examples"]
        assert check.status == "pass"
        assert check.message.startswith(f"{prop}: no failure on the {n} distinct examples run"), check.message
    iso = res.report.check("isolation.fuzz")
    assert f"({iso.metrics['tested_examples']} of them with 2+ documents)" in iso.message
    assert iso.metrics["tested_examples"] <= iso.metrics["distinct_examples"]


def test_a_leak_that_two_tokens_show_shrinks_to_two_tokens():
    """The single-long-document shape starts at 64 tokens, and hypothesis shrinks within it: the
    reproducer of a V-scale causal leak stayed a 64-token document."""
    res = fuzz(Z.v_scale_leak, examples=50, seed=0)
    rep = res.reproducer
    assert rep["property"] == "causal"
    assert sum(rep["lens_q"]) <= 2 and len(rep["lens_q"]) == 1, rep
    assert replay_case(Z.v_scale_leak, json.loads(json.dumps(rep))).status == "fail"
