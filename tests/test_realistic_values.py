"""The realistic value families (rotary q and k, massive-activation tokens, heavy-tailed dO, all at
once as ``realistic``): each reproduces the statistics it is calibrated on (cases.py names them,
docs/checks.md "Realistic input families" has the measurements), every suite's base packings hold
them, ``list --coverage`` lists them, the fuzzer draws them, and a bug that only realistic values show
(``zoo/value_bugs.py``) is caught by the quick suite through them while it passes on Gaussian inputs.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from hypothesis import find, settings
from zoo.value_bugs import VALUE_BUGS
from zoo.verdicts import assert_caught_and_quiet

import flamia_verify.settings as S
from flamia_verify.capture.stats import (
    call_statistics,
    channel_norm_ratio,
    frequency_shares,
    relative_position_r2,
    sink_weight,
    token_norm_ratio,
)
from flamia_verify.properties import run_checks
from flamia_verify.properties.cases import (
    DISTRIBUTIONS,
    MASSIVE_FACTOR,
    ROTARY_SHARES,
    Case,
    cu_from_lens,
    dimension_cases,
    make_tensors,
)
from flamia_verify.properties.checks.bound import tensors as bound_checks
from flamia_verify.properties.checks.consistency import homogeneity as homogeneity_checks
from flamia_verify.properties.checks.error import tensors as error_checks
from flamia_verify.properties.coverage import MODEL
from flamia_verify.properties.strategies import value_distributions

FAMILIES = ("rotary", "massive", "heavy_do", "realistic")
#: the packing of the statistics: the capture's shape (512 tokens in documents of at most 128)
LENS = (128, 128, 128, 128)


def _stats(dist: str, headdim: int = 64, seed: int = 0) -> dict:
    case = Case(LENS, heads=2, heads_k=2, headdim=headdim, distribution=dist, seed=seed, dtype="fp32")
    q, k, v, do = make_tensors(case)
    cu = cu_from_lens(LENS)
    return call_statistics(q, k, v, do, cu, cu, case.scale)


@pytest.mark.parametrize("headdim", [32, 64])
def test_rotary_reproduces_the_models_statistics(headdim):
    """The quarters of the rotary pairs hold ROTARY_SHARES of the norm, the distance explains a share
    of the scores' variance within the measured range (Gaussian: ~0), channel ratios and kurtosis as
    measured (docs/checks.md)."""
    g, r = _stats("gaussian", headdim), _stats("rotary", headdim)
    for name in ("q", "k"):
        shares = [r[f"freq{i}_{name}"] for i in range(4)]
        assert all(abs(a - b) < 0.08 for a, b in zip(shares, ROTARY_SHARES)), shares
        assert 1.8 < r[f"chan_{name}"] < 3.6 and 3.3 < r[f"kurt_{name}"] < 5.0
    assert 0.07 <= r["relpos_r2"] <= 0.41 and g["relpos_r2"] < 0.01
    assert abs(r["sink"] - r["sink_uniform"]) < 0.01  # no sink: the model shows none


def test_heavy_do_reproduces_the_models_row_norms():
    st = _stats("heavy_do")
    assert 2.2 < st["do_p90"] < 3.6 and 4.0 < st["do_p99"] < 6.5 and st["do_max"] > 5.0
    assert 7.0 < st["kurt_do"] < 16.0
    assert _stats("gaussian")["kurt_do"] < 3.3


def test_massive_tokens_are_each_documents_first_key_and_one_more():
    lens = (40, 1, 77, 0, 50)
    case = Case(lens, heads=4, heads_k=2, distribution="massive", seed=3, dtype="fp32")
    _, k, v, _ = make_tensors(case)
    huge = v.abs() >= MASSIVE_FACTOR
    big = huge.all(dim=1).any(dim=-1)  # tokens with a massive channel in every head
    starts = cu_from_lens(lens)[:-1].tolist()
    rows = big.nonzero().flatten().tolist()
    for start, n in zip(starts, lens):
        inside = [t for t in rows if start <= t < start + n]
        assert start in inside if n else not inside
        assert len(inside) == min(n, 2)
    assert huge.sum() == 2 * 2 * len(rows) and huge[big].sum(dim=-1).eq(2).all()  # two channels, every head
    assert (v[huge].abs() < 1.5 * MASSIVE_FACTOR).all()
    assert torch.allclose(k[big].abs().amax(dim=-1), v[big].abs().amax(dim=-1) / 8)
    assert token_norm_ratio(v) > 10 and channel_norm_ratio(v) > 5


def test_statistics_of_known_inputs():
    """The statistics on inputs whose values are known: white noise, a pure rotation, a sink."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4096, 2, 32, generator=g)
    assert all(abs(s - 0.25) < 0.02 for s in frequency_shares(x))
    assert channel_norm_ratio(x) < 1.1
    x[:, :, 5] *= 10
    assert 9 < channel_norm_ratio(x) < 11
    # one document whose first key is every query's direction: the sink takes nearly all the weight
    q = torch.ones(64, 1, 8)
    k = torch.zeros(64, 1, 8)
    k[0] = 4.0
    cu = cu_from_lens((64,))
    sink, uniform = sink_weight(q, k, cu, cu, 1.0)
    assert sink > 0.99 and abs(uniform - sum(1 / n for n in range(32, 65)) / 33) < 1e-9
    # scores that are a function of i - j alone
    pos = torch.arange(64, dtype=torch.float64)
    q = torch.stack([pos.cos(), pos.sin()], dim=-1)[:, None].float()
    assert relative_position_r2(q, q, cu, cu, 1.0) > 0.999


def test_every_suite_holds_the_realistic_families():
    for suite in S.SUITES:
        assert "realistic" in {p.distribution for p in S.suite_settings(suite).base}, suite
    standard = {c.distribution for c in dimension_cases("standard", seed=0)}
    assert {"rotary", "massive", "heavy_do"} <= standard
    assert set(FAMILIES) <= set(DISTRIBUTIONS)
    rows = {r.value: r for r in MODEL if r.dimension == "distribution"}
    assert set(FAMILIES) <= set(rows) and all(rows[f].meaning != f"{f} values" for f in FAMILIES)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_fuzzer_draws_the_realistic_families(family):
    assert find(value_distributions(), lambda d: d == family, settings=settings(database=None)) == family


# -- the planted bug --------------------------------------------------------------------------------


def test_strided_amax_is_caught_by_the_quick_suite_through_the_realistic_families():
    kernel = VALUE_BUGS["strided_tensor_amax"]
    report = run_checks(kernel, suite="quick", only=list(kernel.catches + kernel.quiet))
    assert_caught_and_quiet("strided_tensor_amax", kernel, report)
    for check in ("error.out", "error.dq", "error.dk", "error.dv", "bound.out"):
        assert report.check(check).worst_case["case"]["distribution"] == "realistic", check


def _gaussian(case: Case) -> Case:
    """The case with Gaussian values, but the long document of the dimension cases: its rows of 2000
    keys need their recency shape (late_max), where fp8-tensor's unscaled E4M3 P^T itself flushes
    Gaussian weights below 2^-10 (docs/checks.md, "Five input dimensions")."""
    return case if max(case.lens_k) > 2048 else replace(case, distribution="gaussian")


def test_strided_amax_passes_the_quick_suite_on_gaussian_inputs(monkeypatch):
    """Every case of the value checks made Gaussian (the base packings and the dimension cases, shapes
    and seeds kept; :func:`_gaussian`): the bug passes them, as fp8-tensor does."""
    quick = S.suite_settings("quick")
    gaussian = replace(quick, base=tuple(replace(p, distribution="gaussian") for p in quick.base))
    monkeypatch.setitem(S._BY_NAME, "quick", gaussian)
    for module in (error_checks, bound_checks, homogeneity_checks):
        monkeypatch.setattr(module, "dimension_cases", lambda *a, **k: [_gaussian(c) for c in dimension_cases(*a, **k)])
    kernel = VALUE_BUGS["strided_tensor_amax"]
    for name in (kernel, "fp8-tensor"):
        report = run_checks(name, suite="quick", only=list(kernel.gaussian_quiet))
        loud = [f"{c.name}: {c.status}: {c.message}" for c in report.checks if c.status != "pass"]
        assert not loud, f"{name}: " + "\n".join(loud)
