"""The process-wide cache of what depends on a case alone: bounded by bytes, least recently used out,
off at 0, never holding a captured case; a run that reads from it gives the verdicts, messages and
metrics of a run that computes everything itself."""

from __future__ import annotations

import json

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
