"""The process-wide cache of what depends on a case alone: bounded by bytes, least recently used out,
off at 0, never holding a captured case; a run that reads from it gives the verdicts, messages and
metrics of a run that computes everything itself."""

from __future__ import annotations

import json

import pytest
import torch

from flamia_verify.properties import run_checks
from flamia_verify.properties.case_cache import CASE_CACHE, CaseCache, nbytes


def test_the_cache_keeps_values_within_its_budget_least_recently_used_out():
    cache = CaseCache(max_bytes=3 * 400)
    calls = []

    def make(n):
        def compute():
            calls.append(n)
            return {"t": torch.zeros(100), "n": n}  # 400 bytes

        return compute

    for n in range(3):
        assert cache.get(("k", n), make(n))["n"] == n
    assert cache.bytes == 1200 and len(cache) == 3
    cache.get(("k", 0), make(0))  # a hit: 0 becomes the most recent
    cache.get(("k", 3), make(3))  # evicts 1, the least recently used
    assert calls == [0, 1, 2, 3] and cache.hits == 1
    cache.get(("k", 1), make(1))
    assert calls[-1] == 1 and cache.bytes <= 1200
    too_big = CaseCache(max_bytes=100)
    too_big.get("x", make(9))
    assert len(too_big) == 0  # computed, not kept
    off = CaseCache(max_bytes=0)
    off.get("x", make(5))
    off.get("x", make(5))
    assert calls[-2:] == [5, 5] and len(off) == 0


def test_nbytes_counts_each_tensor_once_through_containers_and_dataclasses():
    from dataclasses import dataclass

    t = torch.zeros(10, dtype=torch.float64)

    @dataclass
    class Box:
        a: torch.Tensor
        b: tuple

    assert nbytes(Box(t, (t, torch.zeros(2, dtype=torch.int32)))) == 80 + 8


def _verdicts(report):
    return [(c.name, c.status, c.message, json.dumps(c.metrics, sort_keys=True, default=str)) for c in report.checks]


def test_a_run_that_reads_the_cache_gives_the_verdicts_of_one_that_computes_everything():
    only = ["error.out", "bound.out", "causal.forward", "consistency.grad_forward_ratio"]
    saved = CASE_CACHE.max_bytes
    try:
        CASE_CACHE.clear()
        CASE_CACHE.max_bytes = 0
        cold = run_checks("fp8", suite="quick", only=only, seed=3)
        CASE_CACHE.max_bytes = 2**30
        first = run_checks("fp8", suite="quick", only=only, seed=3)
        hits = CASE_CACHE.hits
        warm = run_checks("fp8", suite="quick", only=only, seed=3)
        assert CASE_CACHE.hits > hits  # the second run read what the first kept
    finally:
        CASE_CACHE.clear()
        CASE_CACHE.max_bytes = saved
    assert _verdicts(cold) == _verdicts(first) == _verdicts(warm)


def test_a_shared_value_written_into_after_it_was_kept_raises_on_its_next_hit():
    """With verification on (the test suite's setting), a value whose tensors changed in place since it
    was kept is no cache hit but an error naming the key: a kernel or check that wrote into shared
    inputs would otherwise hand every later run of the process the edited tensors."""
    from flamia_verify.properties.case_cache import CaseCache

    cache = CaseCache(2**20, verify=True)
    kept = cache.get(("inputs", "case-a"), lambda: {"q": torch.ones(4, 2, dtype=torch.bfloat16)})
    assert cache.get(("inputs", "case-a"), lambda: None) is kept  # unchanged: a hit
    kept["q"][1, 0] = 2.0
    with pytest.raises(RuntimeError, match=r"changed after it was kept.*FLAMIA_VERIFY_CASE_CACHE_VERIFY"):
        cache.get(("inputs", "case-a"), lambda: None)
    quiet = CaseCache(2**20)  # off: the caller's contract, not checked
    value = quiet.get("k", lambda: torch.zeros(3))
    value += 1
    assert quiet.get("k", lambda: None) is value


def test_the_suite_runs_with_the_case_cache_verified():
    assert CASE_CACHE.verify, "tests/conftest.py sets FLAMIA_VERIFY_CASE_CACHE_VERIFY before the package is imported"
