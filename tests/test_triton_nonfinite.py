"""The fused Triton kernels on non-finite inputs: the NaN and Inf of their specification, the emulation.

The emulation lets a NaN score (a NaN in q or k) make its row NaN instead of hiding it: the row sum
l is NaN, so the output row and the log-sum-exp are NaN (``l != 0``, not ``l > 0``), the backward
rebuilds NaN weights for every row whose lse is not -inf, and FLAMIA's power-of-two P blocks keep a
NaN block maximum NaN (``M_b != -inf``). Rows that see no key still output exactly 0 with zero
gradient. The fused kernels test the same quantities with the same comparisons.

Inputs are exactly summable (``test_triton_attention.exact_case``: small integers, softmax_scale
ln 2), so that on finite inputs the two implementations agree bit for bit on the CPU interpreter.
One element is made non-finite per case (the positions of ``special.nonfinite``: NaN in q, k or dO,
+Inf in v, where queries see it); out, dQ, dK, dV must then be the emulation's:

* the same NaN positions (NaN payloads and signs are not compared), the same infinities, and
* every other element the same bits (signed zeros included),

except in the gradients. The backward rebuilds P = 2^(s - lse) with the real log-sum-exp, and
exp2 is not correctly rounded: the interpreter's (numpy's) and the emulation's (torch's) differ in
the last bit of 6 % of fp32 arguments on an AMD EPYC with numpy 2.4 (and agreed on the Intel
machines these tests were first written on). The finite gradients of the bf16 and MXFP8 designs are
therefore held to the accumulation-order bound of ``test_triton_attention`` (which covers one bf16
ulp); for flamia-nvfp4 a last-bit change of P can cross an FP4 rounding boundary and move a whole
row of dV by one quantum, and on CUDA the tensor cores sum in another order (measured on the H200:
the finite dQ next to a poisoned row moves by up to 5.5 times that bound): there only the
non-finite positions are compared. Their finite values are held by ``test_triton_attention``'s
exact-input tests, which give both sides an integer lse so that P is exact.

The documents fit one tile of every kernel (64 or 128 rows under the interpreter, 128 keys on the
GPU), so the kernels visit the whole of each document as the emulation does: inside a document both
multiply the zero weights of masked positions by the non-finite values (0 x NaN = NaN). For longer
causal documents the kernels skip the tiles past the diagonal and that in-document spread is
smaller than the emulation's (``special.nonfinite`` counts it and does not fail it).
"""

from __future__ import annotations

import math
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from test_kernels_emulation import run
from test_triton_attention import CPU, CUDA, FUSED, LN2, exact_case, fused, gamma, to, ulp_bf16

from flamia_verify.kernels import emulation as E
from flamia_verify.kernels.designs import DESIGNS
from flamia_verify.kernels.triton.config import config_for

# masked lanes compute inf * 0 or 0 / 0 before tl.where discards them, an infinite V overflows its
# products, and the interpreter's tl.max of an all-NaN row (a NaN query) warns where a GPU's
# max.f32 returns NaN silently: numpy's warnings, not the kernels'
pytestmark = [
    pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:All-NaN slice encountered:RuntimeWarning"),
]

CASES = {
    # lens_q, lens_k, heads, heads_k, causal (special.nonfinite's packs: Lq != Lk with 4:2 GQA; 3:1 GQA)
    "causal": ((40, 57), (45, 57), 4, 2, True),
    "full": ((21, 35), None, 3, 1, False),
}
POISONS = ["q", "k", "do", "v"]


@pytest.fixture(params=[CPU, CUDA])
def device(request):
    return request.param


def poisoned(case: str, which: str):
    """The exact inputs of ``case`` with one element of ``which`` made non-finite: NaN in q (the last
    document's middle query, last head), in k (a key every query of that document past its 3rd sees),
    in dO (two queries later), +Inf in v (key 1 of the first document, seen by every query)."""
    lens_q, lens_k, heads, heads_k, causal = CASES[case]
    q, k, v, do, _, cu_q, cu_k = exact_case(list(lens_q), lens_k and list(lens_k), heads=heads, heads_k=heads_k)
    lens_k = lens_k or lens_q
    mid_q = q.shape[0] - lens_q[-1] + lens_q[-1] // 2
    mid_k = k.shape[0] - lens_k[-1] + max(0, lens_k[-1] - lens_q[-1]) + 3
    if which == "q":
        q[mid_q, heads - 1, 5] = math.nan
    elif which == "k":
        k[mid_k, 0, q.shape[-1] - 1] = math.nan
    elif which == "do":
        do[mid_q + 2, 0, 17] = math.nan
    else:
        v[1, heads_k - 1, 9] = math.inf
    return q, k, v, do, cu_q, cu_k, causal


def bitwise_exact(what: str) -> bool:
    """Whether the kernel's finite elements are the emulation's bits (see the module docstring): the
    forward on exact inputs, on both devices; not the gradients, which go through exp2."""
    return what == "out"


def values_compared(device: str, name: str) -> bool:
    """Whether the finite gradients are held to the accumulation-order bound, or only the positions of
    their non-finite elements are compared (flamia-nvfp4's P rounding; CUDA's summation order)."""
    return device == "cpu" and name != "flamia-nvfp4"


def accumulation_bound(name, q, k, v, do, cu_q, cu_k, causal):
    """The accumulation-order tolerance of dQ, dK, dV (``check_backward_on_exact_inputs``): 2 gamma_n
    sum |a||b| from the emulation's backward with |operands| in its last GEMMs, plus one bf16 ulp."""
    design = DESIGNS[name]
    q, k, v, do, cu_q, cu_k = (x.cpu() for x in (q, k, v, do, cu_q, cu_k))
    o, lse2 = E.forward_pass(design, q, k, v, cu_q, cu_k, LN2, causal)
    gemm_seq = E.gemm_seq
    with E.overriding(gemm_seq=lambda a, bq, bhp, full, *g: gemm_seq(a.abs(), bq.abs(), bhp.abs(), full, *g)):
        absolute = E.backward_pass(design, q, k, v, o, lse2, do, cu_q, cu_k, LN2, causal)
    lq, lk = int((cu_q[1:] - cu_q[:-1]).max()), int((cu_k[1:] - cu_k[:-1]).max())
    tols = {}
    for what, a_, n in zip(("dq", "dk", "dv"), absolute, (lk, lq, lq)):
        tol32 = 2 * gamma(n + 2) * a_.double() * (1 + 2.0**-7)
        tols[what] = tol32 + ulp_bf16(tol32 + a_.double())
    return tols


def assert_same(got: torch.Tensor, want: torch.Tensor, what: str, tol: torch.Tensor | None = None):
    """NaN where the emulation has NaN and nowhere else; the same infinities; every other element the
    same bits (``tol`` None) or within ``tol`` of the emulation's."""
    got, want = got.cpu(), want.cpu()
    nan_g, nan_w = torch.isnan(got), torch.isnan(want)
    if not torch.equal(nan_g, nan_w):
        extra, missing = (nan_g & ~nan_w).sum().item(), (nan_w & ~nan_g).sum().item()
        first = torch.nonzero(nan_g != nan_w)[:4].tolist()
        raise AssertionError(f"{what}: {extra} NaN the emulation has not, {missing} missing; first at {first}")
    keep = ~nan_w
    g, w = got[keep], want[keep]
    inf_w = torch.isinf(w)
    assert torch.equal(g[inf_w], w[inf_w]) and not bool(torch.isinf(g[~inf_w]).any()), f"{what}: infinities differ"
    if tol is None:
        bits = torch.int16 if got.element_size() == 2 else torch.int32
        differ = g.view(bits) != w.view(bits)
        assert not bool(differ.any()), (
            f"{what}: {int(differ.sum())} finite elements differ in their bits, e.g. "
            f"{g[differ][:4].tolist()} vs {w[differ][:4].tolist()}"
        )
    else:
        t = tol.cpu()[keep][~inf_w]
        diff = (g[~inf_w].double() - w[~inf_w].double()).abs()
        assert bool((diff <= t).all()), f"{what}: max |diff| / tol {(diff / t.clamp_min(1e-300)).max().item():.3g}"


def check_like_the_emulation(device, name, q, k, v, do, cu_q, cu_k, causal):
    got = run(fused(name), *to(device, q, k, v, do, cu_q, cu_k), causal=causal, scale=LN2)
    want = run(E.make_kernel(DESIGNS[name]), q, k, v, do, cu_q, cu_k, causal=causal, scale=LN2)
    tols = accumulation_bound(name, q, k, v, do, cu_q, cu_k, causal) if values_compared(device, name) else {}
    for what, g_, w_ in zip(("out", "dq", "dk", "dv"), got, want):
        if bitwise_exact(what):
            assert_same(g_, w_, f"{name} {what}")
        else:  # where NaN and Inf land, always; the finite values where the bound holds them
            assert_same(g_, w_, f"{name} {what}", tols.get(what, torch.full(w_.shape, math.inf)))
    return got, want


@pytest.mark.parametrize("which", POISONS)
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("name", FUSED)
def test_a_nonfinite_input_reaches_what_it_reaches_in_the_emulation(device, name, case, which):
    q, k, v, do, cu_q, cu_k, causal = poisoned(case, which)
    _, want = check_like_the_emulation(device, name, q, k, v, do, cu_q, cu_k, causal)
    # not vacuous: the poison reaches what it feeds (dO feeds only the gradients; V not dV = P^T dO)
    reached = [bool((~torch.isfinite(w.float())).any()) for w in want]
    assert reached == [which != "do", True, True, which != "v"], f"{which} reaches out, dq, dk, dv: {reached}"


@pytest.mark.parametrize("name", FUSED)
def test_finite_inputs_and_rows_that_see_no_key_are_unchanged(device, name):
    """Finite inputs: the emulation's bits (out; dQ, dK, dV as above). Causal rows that see no key
    (Lq > Lk: the first Lq - Lk queries) output exactly 0, with lse -inf and zero dQ, also when
    another row of their document holds a NaN."""
    from flamia_verify.kernels.triton.attention import fused_forward

    lens_q, lens_k = [0, 30, 21], [4, 20, 21]  # an empty document; 10 blind queries in the second
    q, k, v, do, _, cu_q, cu_k = exact_case(lens_q, lens_k, heads=2, heads_k=1)
    blind = slice(0, 10)
    got, _ = check_like_the_emulation(device, name, q, k, v, do, cu_q, cu_k, True)
    assert all(bool(torch.isfinite(g.float()).all()) for g in got), f"{name}: non-finite results of finite inputs"
    q[29, 0, 3] = math.nan  # the last query of the second document: it sees every key
    got, _ = check_like_the_emulation(device, name, q, k, v, do, cu_q, cu_k, True)
    assert bool(torch.isnan(got[0][29, 0]).all())
    out, dq = got[0].cpu(), got[1].cpu()
    assert not bool(out[blind].any()) and not bool(dq[blind].any()), f"{name}: rows without keys are not 0"
    _, lse2 = fused_forward(config_for(DESIGNS[name]), *to(device, q, k, v, cu_q, cu_k), 30, 21, LN2, True)
    assert bool((lse2[:, blind].cpu() == -math.inf).all()) and bool(torch.isnan(lse2[0, 29]).cpu())
