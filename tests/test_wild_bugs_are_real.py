"""The held-out wild zoo is what it says: every bug is wrong somewhere (and right on ordinary inputs), and
every correct kernel agrees with a float64 reference on strided, GQA, empty-document and scale=None inputs."""

from __future__ import annotations

import pytest
import torch
from zoo.wild_bugs import CORRECT_WILD, WILD, demonstrate, make_case, ordinary_case, run_case, run_reference

# loose agreement with float64, relative to the reference's largest magnitude: (output, gradients, lse abs)
_TOL = {"bf16": (0.02, 0.03, 0.02), "fp8": (0.25, 0.3, 0.3), "mxfp8": (0.25, 0.3, 0.3)}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    assert a.shape == b.shape
    assert torch.equal(torch.isnan(a), torch.isnan(b))
    same = (a == b) | torch.isnan(a)
    d = torch.where(same, torch.zeros((), dtype=a.dtype), (a - b).abs())
    scale = float(torch.where(torch.isfinite(b), b.abs(), 0).max()) if b.numel() else 1.0
    return float(d.max()) / max(scale, 1e-6) if d.numel() else 0.0


def _agrees(fn, case, tol):
    t_out, t_grad, t_lse = tol
    dout = torch.randn(case["q"].shape, generator=torch.Generator().manual_seed(7)).to(case["q"].dtype)
    out, lse, grads = run_case(fn, case, dout)
    ref_out, ref_lse, ref_grads = run_reference(case, dout)
    assert out.dtype == case["q"].dtype and out.shape == case["q"].shape
    assert _rel(out, ref_out) <= t_out
    for g, r in zip(grads, ref_grads, strict=True):
        assert _rel(g, r) <= t_grad
    if lse is not None:
        assert lse.shape == ref_lse.shape
        finite = torch.isfinite(ref_lse)
        assert torch.equal(finite, torch.isfinite(lse))
        gap = (lse.double() - ref_lse)[finite].abs()
        assert (float(gap.max()) if gap.numel() else 0.0) <= t_lse


@pytest.mark.parametrize("name", sorted(WILD))
def test_bug_is_real(name):
    line = demonstrate(name)
    assert line.startswith(name) and "\n" not in line


@pytest.mark.parametrize("name", sorted(WILD))
def test_bug_is_subtle_and_documented(name):
    fn = WILD[name]
    for attr in ("recipe", "description", "source", "dimension"):
        assert isinstance(getattr(fn, attr), str) and getattr(fn, attr)
    for causal in (False, True):
        for hk in (1, 2):
            _agrees(fn, ordinary_case(causal=causal, hk=hk), _TOL[fn.recipe])


def _strided_cases():
    return {
        "fused-gqa-empty-scale-none": make_case(
            [5, 0, 9, 1], h=4, hk=2, d=32, layout="fused", causal=True, scale=None, seed=11
        ),
        "transposed-fp16-unequal": make_case(
            [3, 6, 2],
            [7, 4, 0],
            h=3,
            hk=1,
            d=48,
            dtype=torch.float16,
            layout="transposed",
            causal=True,
            scale=0.3,
            max_q=10,
            max_k=16,
            seed=12,
        ),
        "ordinary": ordinary_case(causal=False),
    }


@pytest.mark.parametrize("case_name", ["fused-gqa-empty-scale-none", "transposed-fp16-unequal", "ordinary"])
@pytest.mark.parametrize("name", sorted(CORRECT_WILD))
def test_correct_kernel_agrees(name, case_name):
    fn = CORRECT_WILD[name]
    assert fn.recipe in _TOL and fn.description
    _agrees(fn, _strided_cases()[case_name], _TOL[fn.recipe])


@pytest.mark.parametrize("name", sorted(n for n in CORRECT_WILD if CORRECT_WILD[n].recipe == "bf16"))
def test_correct_kernel_keeps_masked_nonfinite_out(name):
    """inf in V at a key that only later rows see, NaN in K at another: NaN/inf exactly where float64 has them."""
    case = make_case([6, 5], h=4, hk=2, d=32, causal=True, seed=13)
    v, k = case["v"].detach().clone(), case["k"].detach().clone()
    v[4, 1, 3] = float("inf")
    k[3, 0, 2] = float("nan")
    case = dict(case, v=v.requires_grad_(), k=k.requires_grad_())
    out = run_case(CORRECT_WILD[name], case)[0].detach().double()
    ref = run_reference(case)[0].detach()
    assert torch.equal(torch.isnan(out), torch.isnan(ref))
    assert torch.equal(torch.isinf(out), torch.isinf(ref))
    finite = torch.isfinite(ref)
    assert float((out - ref)[finite].abs().max()) <= 0.02
