"""The fused Triton kernels against their specification, the emulation.

Faithfulness (docs/triton.md derives every tolerance):

* Exactly summable inputs (q, k in {-1, 0, 1} with two non-zeros per row, softmax_scale = ln 2 so
  that scores are small integers in log2 units; v, dO small integers; for the backward, O in
  halves and an integer log-sum-exp). Every score, every probability (a power of two), the row sum,
  every P V sum, dP, D and dS are then exact in fp32 in any order, and every quantizer sees the same
  input in both implementations. Hence:
  - forward: ``out`` is bitwise the emulation's (tolerance 0); lse differs only through the log2
    implementation (elementary-function accuracy, not accumulation order);
  - backward: dQ, dK, dV differ only through the fp32 accumulation order of the last GEMMs:
    ``|x_kernel - x_emulation| <= 2 gamma_n sum_j |a_j| |b_j|`` (both within ``gamma_n`` of the
    exact sum, ``gamma_n = n u / (1 - n u)``, ``u = 2^-23``), plus one bf16 ulp for the final cast.
* Random inputs: rounding decisions may flip between the two fp32 evaluations, so no fp32 bound
  applies; the check is that the kernel's distance to the emulation is below the emulation's own
  error against the float64 reference.

Bitwise properties, reusing the emulation tests' logic on the fused kernels: causal and anticausal
leakage, document isolation at any offset, determinism.

CPU: Triton's interpreter (TRITON_INTERPRET=1, set here before Triton is imported), small sizes.
GPU (``-m gpu``, TRITON_INTERPRET unset): the same checks on CUDA, plus larger documents.
"""

from __future__ import annotations

import functools
import math
import os
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from test_kernels_emulation import (
    _perturb_after,
    make_case,
    packed_among_neighbours,
    reference,
    rel_rmse,
    run,
)

from flamia_verify.kernels import builtin_kernels
from flamia_verify.kernels import emulation as E
from flamia_verify.kernels.designs import DESIGNS
from flamia_verify.kernels.metadata import emulated_twin
from flamia_verify.kernels.triton.compat import interpreting
from flamia_verify.kernels.triton.config import config_for, unsupported_reason
from flamia_verify.recipes.operands import Operand

# masked lanes compute inf * 0 or 0 / 0 before tl.where discards them (as on a GPU); numpy warns
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")

FUSED = ["bf16", "fp8", "fp8-mma", "flamia-mxfp8", "flamia-nvfp4"]
LN2 = math.log(2.0)  # softmax_scale whose log2(e) multiple rounds to exactly 1.0 in fp32
U_ACC = 2.0**-23  # fp32 accumulation: one ulp per addition covers round-to-nearest and tensor-core truncation

CPU = pytest.param("cpu", marks=pytest.mark.skipif(not interpreting(), reason="CPU runs need TRITON_INTERPRET=1"))
CUDA = pytest.param(
    "cuda",
    marks=[
        pytest.mark.gpu,
        pytest.mark.skipif(
            interpreting() or not torch.cuda.is_available(), reason="needs CUDA with TRITON_INTERPRET unset"
        ),
    ],
)


@pytest.fixture(params=[CPU, CUDA])
def device(request):
    return request.param


def fused(name):
    from flamia_verify.kernels.triton.attention import fused_attention

    return functools.partial(fused_attention, DESIGNS[name])


def to(device, *xs):
    return [x.to(device) for x in xs]


def gamma(n: int) -> float:
    return n * U_ACC / (1 - n * U_ACC)


def ulp_fp32(x: torch.Tensor) -> torch.Tensor:
    """fp32 spacing at |x| (24 significant bits)."""
    a = x.abs().double().clamp_min(2.0**-126)
    return torch.exp2(torch.floor(torch.log2(a)) - 23)


def ulp_bf16(x: torch.Tensor) -> torch.Tensor:
    """bf16 spacing at |x| (8 significant bits; subnormal spacing 2^-133 below 2^-126)."""
    a = x.abs().double().clamp_min(2.0**-126)
    return torch.exp2(torch.floor(torch.log2(a)) - 7)


def assert_within(got, want, tol, what: str):
    """|got - want| <= tol elementwise, with a numpy.testing-style message."""
    got, want, tol = got.double().cpu(), want.double().cpu(), tol.double().cpu()
    diff = (got - want).abs()
    bad = ~(diff <= tol)
    if not bool(bad.any()):
        return
    idx = torch.nonzero(bad)
    lines = [
        f"{what}: {idx.shape[0]} / {got.numel()} elements ({100 * idx.shape[0] / got.numel():.2g}%) "
        f"outside the tolerance; max |diff| {diff[bad].max().item():.3g}, max |diff| / tol "
        f"{(diff[bad] / tol[bad].clamp_min(1e-300)).max().item():.3g}; first (token, head, dim): kernel, "
        f"emulation, tol"
    ]
    for i in idx[:6].tolist():
        i = tuple(i)
        lines.append(f"  {i}: {got[i].item()!r}, {want[i].item()!r}, {tol[i].item():.3g}")
    raise AssertionError("\n".join(lines))


# ---------------------------------------------------------------------------------------------
# exactly summable inputs
# ---------------------------------------------------------------------------------------------


def _two_signs_per_row(n: int, heads: int, dim: int, g) -> torch.Tensor:
    """Rows with exactly two entries +-1 at random places: |q . k| <= 2, so scores are tiny integers."""
    x = torch.zeros(n * heads, dim)
    if n * heads:
        idx = torch.stack([torch.randperm(dim, generator=g)[:2] for _ in range(n * heads)])
        sign = (torch.randint(0, 2, (n * heads, 2), generator=g) * 2 - 1).float()
        x.scatter_(1, idx, sign)
    return x.view(n, heads, dim).bfloat16()


def exact_case(lens_q, lens_k=None, *, heads=2, heads_k=None, dim=64, seed=0):
    """q, k, v, dO, O, cu_q, cu_k on which every sum of the forward and of dP, D, dS is exact in fp32.

    scores s = q.k in {-2..2} (log2 units with softmax_scale = ln 2), P = 2^(s - m) in [2^-4, 1];
    V integers |v| <= 63 (MX-rounded V stays integral); P V terms are multiples of 2^-4 below 2^6,
    at most 80 of them: 17 bits < 24. dO integers |dO| <= 3, O halves |O| <= 4: dP <= 64*3*64,
    D <= 768 in halves, dS = 2^(s - lse) (dP - D) with an integer lse: one exact product.
    """
    lens_k = lens_q if lens_k is None else lens_k
    heads_k = heads if heads_k is None else heads_k
    g = torch.Generator().manual_seed(seed)
    tq, tk = sum(lens_q), sum(lens_k)
    q = _two_signs_per_row(tq, heads, dim, g)
    k = _two_signs_per_row(tk, heads_k, dim, g)
    v = torch.randint(-63, 64, (tk, heads_k, dim), generator=g).bfloat16()
    do = torch.randint(-3, 4, (tq, heads, dim), generator=g).bfloat16()
    o = (torch.randint(-8, 9, (tq, heads, dim), generator=g) / 2).bfloat16()
    cu_q = torch.tensor([0] + torch.tensor(lens_q).cumsum(0).tolist(), dtype=torch.int32)
    cu_k = torch.tensor([0] + torch.tensor(lens_k).cumsum(0).tolist(), dtype=torch.int32)
    return q, k, v, do, o, cu_q, cu_k


SHAPES = [
    pytest.param([0, 1, 31, 32, 33, 70], None, 2, 2, id="varlen-0-1-31-32-33-70"),
    pytest.param([17, 50, 9], [30, 20, 9], 4, 2, id="lq!=lk-gqa"),
    pytest.param([40], None, 4, 1, id="mqa"),
]


@pytest.mark.parametrize("name", FUSED)
@pytest.mark.parametrize("lens_q,lens_k,heads,heads_k", SHAPES)
@pytest.mark.parametrize("causal", [False, True])
def test_forward_is_bitwise_the_emulation_on_exact_inputs(device, name, lens_q, lens_k, heads, heads_k, causal):
    from flamia_verify.kernels.triton.attention import fused_forward

    q, k, v, _, _, cu_q, cu_k = to(device, *exact_case(lens_q, lens_k, heads=heads, heads_k=heads_k))
    lq = max(lens_q)
    lk = max(lens_k or lens_q)
    out, lse2 = fused_forward(config_for(DESIGNS[name]), q, k, v, cu_q, cu_k, lq, lk, LN2, causal)
    out_e, lse2_e = E.forward_pass(DESIGNS[name], q, k, v, cu_q, cu_k, LN2, causal)
    assert_within(out, out_e, torch.zeros_like(out_e, dtype=torch.float64), f"{name} out (exact inputs)")
    # lse2 = m + log2(l): m and l are exact; only the two log2 implementations differ (each within
    # 2 ulp of log2(l) < 7, i.e. 2^-21 absolute), then one fp32 rounding of the sum (ulp of lse2)
    lse2_e = lse2_e.T
    finite = torch.isfinite(lse2_e)
    assert torch.equal(finite, torch.isfinite(lse2)), f"{name}: rows without visible keys differ"
    tol = 2.0**-20 + ulp_fp32(lse2_e[finite])
    assert_within(lse2[finite], lse2_e[finite], tol, f"{name} lse (log2 units)")


def _exact_backward_inputs(device, name, lens_q, lens_k, heads, heads_k, causal):
    q, k, v, do, o, cu_q, cu_k = to(device, *exact_case(lens_q, lens_k, heads=heads, heads_k=heads_k))
    _, lse2 = E.forward_pass(DESIGNS[name], q, k, v, cu_q, cu_k, LN2, causal)
    lse2 = torch.ceil(lse2)  # an integer log-sum-exp >= the row maximum: 2^(s - lse) is exact
    return q, k, v, do, o, lse2, cu_q, cu_k


def check_backward_on_exact_inputs(device, name, lens_q, lens_k, heads, heads_k, causal):
    """dQ, dK, dV within 2 gamma_n sum |a||b| (+ one bf16 ulp) of the emulation's, given the same
    O and (integer) lse; see the module docstring."""
    from flamia_verify.kernels.triton.attention import fused_backward

    design = DESIGNS[name]
    q, k, v, do, o, lse2, cu_q, cu_k = _exact_backward_inputs(device, name, lens_q, lens_k, heads, heads_k, causal)
    lq, lk = max(lens_q), max(lens_k or lens_q)
    got = fused_backward(config_for(design), q, k, v, o, lse2.T.contiguous(), do, cu_q, cu_k, lq, lk, LN2, causal)
    want = E.backward_pass(design, q, k, v, o, lse2, do, cu_q, cu_k, LN2, causal)
    # sum_j |a_j| |b_j| of each output: the emulation's own backward with |operands| in its last GEMMs
    # (its scale multiply and GQA group sum included); its bf16 cast may round down by 2^-8 relative
    gemm_seq = E.gemm_seq
    with E.overriding(gemm_seq=lambda a, bq, bhp, full, *q: gemm_seq(a.abs(), bq.abs(), bhp.abs(), full, *q)):
        absolute = E.backward_pass(design, q, k, v, o, lse2, do, cu_q, cu_k, LN2, causal)
    for what, g_, w_, a_, n in zip(("dq", "dk", "dv"), got, want, absolute, (lk, lq, lq)):
        # n terms plus two roundings (the scale multiply; NVFP4's row scale applied after the sum)
        tol32 = 2 * gamma(n + 2) * a_.double() * (1 + 2.0**-7)
        tol = tol32 + torch.where(tol32 > 0, ulp_bf16(w_.double().abs() + tol32), torch.zeros_like(tol32))
        assert_within(g_, w_, tol, f"{name} {what} causal={causal} (exact inputs)")


@pytest.mark.parametrize("name", FUSED)
@pytest.mark.parametrize(
    "lens_q,lens_k,heads,heads_k,causal",
    [
        pytest.param([0, 1, 31, 32, 33, 70], None, 2, 2, True, id="varlen-causal"),
        pytest.param([17, 50, 9], [30, 20, 9], 4, 2, True, id="lq!=lk-gqa-causal"),
        pytest.param([17, 50, 9], [30, 20, 9], 4, 2, False, id="lq!=lk-gqa"),
    ],
)
def test_backward_within_the_accumulation_order_bound_on_exact_inputs(
    device, name, lens_q, lens_k, heads, heads_k, causal
):
    check_backward_on_exact_inputs(device, name, lens_q, lens_k, heads, heads_k, causal)


_LEN = st.sampled_from([0, 1, 2, 15, 16, 17, 31, 32, 33, 47, 63, 64, 65, 70])


@st.composite
def _packings(draw):
    """Odd varlen packings: 1-3 documents of lengths around the block sizes (0 included), Lq != Lk
    sometimes, MHA or GQA 2:1, causal or not, any fused design."""
    n = draw(st.integers(1, 3))
    lens_q = draw(st.lists(_LEN, min_size=n, max_size=n))
    lens_k = draw(st.one_of(st.none(), st.lists(_LEN, min_size=n, max_size=n)))
    heads, heads_k = draw(st.sampled_from([(2, 2), (2, 1)]))
    return draw(st.sampled_from(FUSED)), lens_q, lens_k, heads, heads_k, draw(st.booleans())


def _gpu_unless_interpreting(fn):
    """Selected by `-m gpu` on a GPU machine; a plain CPU test under the interpreter."""
    return fn if interpreting() else pytest.mark.gpu(fn)


@_gpu_unless_interpreting
@settings(
    max_examples=int(os.environ.get("FLAMIA_VERIFY_FUZZ_EXAMPLES", 6 if interpreting() else 40)),
    deadline=None,
    derandomize=True,
    database=None,
)
@given(_packings())
def test_fuzzed_packings_forward_bitwise_and_backward_within_bound(packing):
    """Hypothesis over odd packings (the device is the interpreter on the CPU, CUDA on a GPU run):
    the forward bitwise the emulation's, the backward within the accumulation-order bound.
    FLAMIA_VERIFY_FUZZ_EXAMPLES sets the number of packings (6 on the CPU by default; 80 passed)."""
    from flamia_verify.kernels.triton.attention import fused_forward

    name, lens_q, lens_k, heads, heads_k, causal = packing
    device = "cpu" if interpreting() else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no device")
    q, k, v, _, _, cu_q, cu_k = to(device, *exact_case(lens_q, lens_k, heads=heads, heads_k=heads_k))
    lq, lk = max(lens_q), max(lens_k or lens_q)
    out, _ = fused_forward(config_for(DESIGNS[name]), q, k, v, cu_q, cu_k, lq, lk, LN2, causal)
    out_e, _ = E.forward_pass(DESIGNS[name], q, k, v, cu_q, cu_k, LN2, causal)
    assert_within(out, out_e, torch.zeros_like(out_e, dtype=torch.float64), f"{name} out {packing}")
    check_backward_on_exact_inputs(device, name, lens_q, lens_k, heads, heads_k, causal)


# ---------------------------------------------------------------------------------------------
# random inputs: implementation noise below the design's own error
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", FUSED)
def test_random_inputs_deviate_from_the_spec_less_than_the_spec_errs(device, name):
    q, k, v, do, cu_q, cu_k = make_case([64, 1, 45], heads=2, dim=64, seed=7)
    ref = reference(q, k, v, do, cu_q, cu_k, causal=True)
    got = run(fused(name), *to(device, q, k, v, do, cu_q, cu_k), causal=True)
    spec = run(emulated_twin(builtin_kernels()[name].fn), q, k, v, do, cu_q, cu_k, causal=True)
    for what, g_, s_, r_ in zip(("out", "dq", "dk", "dv"), got, spec, ref):
        assert torch.isfinite(g_).all(), f"{name}: non-finite {what}"
        noise, error = rel_rmse(g_.cpu(), s_), rel_rmse(s_, r_)
        assert noise <= error, f"{name} {what}: kernel vs emulation {noise:.3g} > emulation vs float64 {error:.3g}"


# ---------------------------------------------------------------------------------------------
# bitwise properties of the fused kernels (the logic of test_kernels_emulation)
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", FUSED)
def test_causal_leakage_bitwise(device, name):
    q, k, v, do, cu_q, cu_k = to(device, *make_case([80], heads=2, dim=64, seed=3))
    base = run(fused(name), q, k, v, do, cu_q, cu_k, causal=True)
    for t in (40,):  # inside a 32-key block: the diagonal fallback decides it
        g = torch.Generator().manual_seed(t)
        q2, k2, v2, do2 = (_perturb_after(t, x.cpu(), g).to(device) for x in (q, k, v, do))
        new = run(fused(name), q2, k2, v2, do2, cu_q, cu_k, causal=True)
        assert torch.equal(base[0][: t + 1], new[0][: t + 1]), f"{name}: out[:{t + 1}] changed (positions > {t})"
        assert torch.equal(base[1][: t + 1], new[1][: t + 1]), f"{name}: dq[:{t + 1}] changed (positions > {t})"


@pytest.mark.parametrize("name", FUSED)
def test_anticausal_gradient_leakage_bitwise(device, name):
    q, k, v, do, cu_q, cu_k = to(device, *make_case([80], heads=2, dim=64, seed=4))
    base = run(fused(name), q, k, v, do, cu_q, cu_k, causal=True)
    for t in (40,):
        g = torch.Generator().manual_seed(t)
        q2, do2 = q.clone(), do.clone()
        q2[:t] = (torch.randn(q2[:t].shape, generator=g) * 1e3).to(q.dtype).to(device)
        do2[:t] = (torch.randn(do2[:t].shape, generator=g) * 1e3).to(q.dtype).to(device)
        new = run(fused(name), q2, k, v, do2, cu_q, cu_k, causal=True)
        assert torch.equal(base[2][t:], new[2][t:]), f"{name}: dk[{t}:] changed when only queries before {t} changed"
        assert torch.equal(base[3][t:], new[3][t:]), f"{name}: dv[{t}:] changed when only queries before {t} changed"


@pytest.mark.parametrize("name", FUSED)
@pytest.mark.parametrize("causal", [False, True])
def test_document_isolation_bitwise(device, name, causal):
    """A document's outputs and gradients are the same bits alone and packed among huge neighbours
    at an unaligned offset; repeated runs are bitwise identical (determinism)."""
    g = torch.Generator().manual_seed(11)
    doc = [torch.randn(45, 2, 64, generator=g).to(torch.bfloat16) for _ in range(4)]  # q, k, v, dO
    one = torch.tensor([0, 45], dtype=torch.int32)
    alone = run(fused(name), *to(device, *doc, one, one), causal=causal)
    for before, after in ((13, 30),):
        parts, cu = packed_among_neighbours(doc, before, after, g)
        packed = run(fused(name), *to(device, *parts, cu, cu), causal=causal)
        sl = slice(before, before + 45)
        for what, a, p in zip(("out", "dq", "dk", "dv"), alone, packed):
            assert torch.equal(a, p[sl]), f"{name}: {what} of a document packed at offset {before} differs"
    again = run(fused(name), *to(device, *doc, one, one), causal=causal)
    assert all(torch.equal(a, b) for a, b in zip(alone, again)), f"{name}: two identical runs differ"


# ---------------------------------------------------------------------------------------------
# dispatch
# ---------------------------------------------------------------------------------------------


def test_registry_dispatches_cuda_inputs_to_the_fused_kernels_and_keeps_the_emulation_elsewhere():
    kernels = builtin_kernels()
    for name in FUSED + ["flamia-mxfp8-floor"]:
        assert unsupported_reason(DESIGNS[name]) is None, name
        assert emulated_twin(kernels[name].fn) is not None, f"{name} should dispatch to a fused kernel on CUDA"
    for name in ("fp8-tensor", "mxfp8-naive"):
        assert unsupported_reason(DESIGNS[name]), name
        assert emulated_twin(kernels[name].fn) is None, f"{name} has no fused kernel"
    q, k, v, do, cu_q, cu_k = make_case([20, 33], heads=2, dim=64, seed=2)
    a = run(kernels["flamia-mxfp8"].fn, q, k, v, do, cu_q, cu_k, causal=True)
    b = run(emulated_twin(kernels["flamia-mxfp8"].fn), q, k, v, do, cu_q, cu_k, causal=True)
    assert all(torch.equal(x, y) for x, y in zip(a, b)), "CPU inputs must run the emulation"


def test_import_and_registry_do_not_import_triton():
    code = (
        "import sys, flamia_verify; from flamia_verify.kernels import builtin_kernels; builtin_kernels(); "
        "sys.exit(1 if 'triton' in sys.modules else 0)"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert res.returncode == 0, f"import flamia_verify or the registry imported triton: {res.stderr[-500:]}"


@pytest.mark.gpu
@pytest.mark.skipif(interpreting() or not torch.cuda.is_available(), reason="needs CUDA with TRITON_INTERPRET unset")
@pytest.mark.parametrize("name", FUSED)
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_long_documents_on_exact_inputs(name, causal):
    """Several query and key tiles per document (pipelined loops, unmasked tiles) on CUDA: the
    forward bitwise, the backward within the accumulation-order bound (sums of <= 1030 terms stay
    exact: P V terms are multiples of 2^-4 below 2^6, 1030 * 2^10 < 2^24)."""
    from flamia_verify.kernels.triton.attention import fused_forward

    lens = [700, 129, 1030]
    q, k, v, _, _, cu_q, cu_k = to("cuda", *exact_case(lens, heads=2))
    out, _ = fused_forward(config_for(DESIGNS[name]), q, k, v, cu_q, cu_k, max(lens), max(lens), LN2, causal)
    out_e, _ = E.forward_pass(DESIGNS[name], q, k, v, cu_q, cu_k, LN2, causal)
    assert_within(out, out_e, torch.zeros_like(out_e, dtype=torch.float64), f"{name} out (exact inputs)")
    check_backward_on_exact_inputs("cuda", name, lens, None, 2, 2, causal)


def test_a_kernel_that_does_not_fit_shared_memory_is_relaunched_with_fewer_stages():
    """_launch: OutOfResources at launch -> one pipeline stage fewer, down to one; the depth that fit
    is remembered; at one stage the error names the kernel and the way out (the emulation)."""
    from triton.runtime.errors import OutOfResources

    from flamia_verify.kernels.triton import attention as A

    class Kernel:  # stands in for a JITFunction: kernel[grid](*args, **kw); kernel.fn.__name__
        def __init__(self, fits_at):
            self.fits_at, self.tried = fits_at, []
            self.fn = self._attn_stand_in

        def _attn_stand_in(self):
            pass

        def __getitem__(self, grid):
            def launch(*args, num_warps, num_stages, **kw):
                self.tried.append(num_stages)
                if num_stages > self.fits_at:
                    raise OutOfResources(num_stages * 100_000, 232_448, "shared memory")

            return launch

    tile = A.TileConfig(128, 64, num_warps=8, num_stages=3)
    k = Kernel(fits_at=1)
    assert A._launch(k, (1,), tile, 0, HEAD_DIM=256) == 1 and k.tried == [3, 2, 1]
    assert A._launch(k, (1,), tile, 0, HEAD_DIM=256) == 1 and k.tried == [3, 2, 1, 1]  # remembered
    fits = Kernel(fits_at=3)
    assert A._launch(fits, (1,), tile, 0, HEAD_DIM=64) == 3 and fits.tried == [3]
    never = Kernel(fits_at=0)
    with pytest.raises(RuntimeError, match="does not fit this GPU even with one pipeline stage.*emulation"):
        A._launch(never, (1,), tile, 0, HEAD_DIM=512)
    assert never.tried == [3, 2, 1]


def test_tiles_are_multiples_of_every_block_along_their_axes():
    """tiles(): every default tile (GPU and interpreter) is a multiple of each block along its axis,
    for the built-in designs and for a supported design with other block sizes (64-row sequence
    blocks); the kernels' static asserts hold the same rule for explicit tiles."""

    from flamia_verify.kernels.emulation import Quant
    from flamia_verify.kernels.triton.config import tiles

    mx64 = Quant("mx", 64)
    designs = [DESIGNS[n] for n in FUSED + ["flamia-mxfp8-floor"]]
    seq_ops = (Operand.V_SEQ, Operand.DO_SEQ, Operand.K_SEQ, Operand.Q_SEQ)
    designs.append(DESIGNS["bf16"].with_quants(dict.fromkeys(seq_ops, mx64), name="seq64"))
    for design in designs:
        assert unsupported_reason(design) is None, design.name
        cfg = config_for(design)
        p = cfg.p_block if cfg.p_pow2 else 1
        blocks = {
            axis: [b for kind, b in (cfg[o] for o in ops) if kind != 0]
            for axis, ops in (
                ("fwd_n", (Operand.V_SEQ,)),
                ("dkdv_m", (Operand.PT, Operand.DO_SEQ, Operand.DST, Operand.Q_SEQ)),
                ("dq_n", (Operand.DS, Operand.K_SEQ)),
            )
        }
        for interpret in (False, True):
            t = tiles(cfg, 64, interpret=interpret)
            for size, axis in ((t["fwd"].block_n, "fwd_n"), (t["dkdv"].block_m, "dkdv_m"), (t["dq"].block_n, "dq_n")):
                assert all(size % b == 0 for b in blocks[axis]), (design.name, interpret, axis, size, blocks[axis])
            assert t["fwd"].block_n % p == 0 and t["dkdv"].block_n % p == 0 and t["dq"].block_n % p == 0
    bad = DESIGNS["bf16"].with_quants({Operand.V_SEQ: Quant("mx", 48)}, name="seq48")
    assert "powers of two" in unsupported_reason(bad)


def test_a_tile_that_cuts_sequence_blocks_is_refused_at_compile_time():
    """A dK/dV tile of 16 queries under 32-query blocks of dO and Q would skip the causal fallback on
    partly visible blocks; the kernel's static assert refuses it instead of computing it."""
    from flamia_verify.kernels.triton.attention import fused_backward
    from flamia_verify.kernels.triton.config import TileConfig

    # flamia-nvfp4: P^T and dS^T come in 16-blocks, so only the dO and Q blocks (32) refuse the tile
    q, k, v, do, o, lse2, cu_q, cu_k = _exact_backward_inputs("cpu", "flamia-nvfp4", [40], None, 2, 2, True)
    with pytest.raises(Exception, match="query tiles must hold whole blocks of dO"):
        fused_backward(
            config_for(DESIGNS["flamia-nvfp4"]),
            q,
            k,
            v,
            o,
            lse2.T.contiguous(),
            do,
            cu_q,
            cu_k,
            40,
            40,
            LN2,
            True,
            tile_dkdv=TileConfig(16, 64),
        )


def test_inputs_the_fused_kernels_do_not_take_run_the_emulation():
    """A head_dim that is not a power of two from 32 to 256, fp32 inputs or CPU tensors go to the
    emulation instead of an error from the fused kernels."""
    from types import SimpleNamespace

    from flamia_verify.kernels.triton import fused_applies, triton_available

    def inputs(d, dtype=torch.bfloat16, cuda=True):
        return SimpleNamespace(is_cuda=cuda, dtype=dtype, shape=(8, 2, d))

    assert all(fused_applies(inputs(d)) == triton_available() for d in (32, 64, 128, 256))
    assert not any(fused_applies(inputs(d)) for d in (16, 80, 96, 160, 512))
    assert not fused_applies(inputs(64, torch.float32)) and not fused_applies(inputs(64, cuda=False))
    # fp8's 128-query tiles hold four (128, head_dim) tiles in the dK/dV kernel: 256 KiB at head_dim 256
    for name in ("bf16", "flamia-mxfp8", "flamia-nvfp4"):
        assert fused_applies(inputs(256), DESIGNS[name]) == triton_available()
    assert fused_applies(inputs(128), DESIGNS["fp8"]) == triton_available()
    assert not fused_applies(inputs(256), DESIGNS["fp8"])


def test_bf16_subnormal_inputs_reach_the_kernel_exactly(device):
    """V below 2^-126 (bf16 subnormals, special.magnitudes' V x 2^-121 case): the first causal query
    sees only key 0, so its output is V_0 bit for bit (the interpreter needed a shim for this)."""
    from flamia_verify.kernels.triton.attention import fused_forward

    g = torch.Generator().manual_seed(3)
    q, k = (torch.randn(40, 2, 64, generator=g).bfloat16() for _ in range(2))
    v = (torch.randn(40, 2, 64, generator=g) * 2.0**-130).bfloat16()
    assert bool(((v != 0) & (v.abs() < 2.0**-126)).any())
    cu = torch.tensor([0, 40], dtype=torch.int32)
    q, k, v, cu = to(device, q, k, v, cu)
    out, _ = fused_forward(config_for(DESIGNS["bf16"]), q, k, v, cu, cu, 40, 40, 0.125, True)
    assert torch.equal(out[0].cpu(), v[0].cpu())


@pytest.mark.parametrize("name", ["fp8", "flamia-nvfp4", "bf16"])
def test_split_dkdv_launches_give_the_same_bits(device, name):
    """``TileConfig.split`` (dV, then dK, in two launches that each hold one accumulator) computes
    the same arithmetic in the same order as the one-launch kernel: dK and dV bit for bit, with GQA
    (fp32 per-head outputs), causal diagonals, a partial last tile and NVFP4's two-pass sweep."""
    from dataclasses import replace

    from flamia_verify.kernels.triton.attention import fused_backward, fused_forward
    from flamia_verify.kernels.triton.config import tiles

    cfg = config_for(DESIGNS[name])
    q, k, v, do, cu_q, cu_k = (t.to(device) for t in make_case([150, 70], heads=4, heads_k=2, seed=3))
    out, lse2 = fused_forward(cfg, q, k, v, cu_q, cu_k, 150, 150, 0.125, True)
    t = tiles(cfg, q.shape[-1], interpret=interpreting())["dkdv"]
    one = fused_backward(
        cfg, q, k, v, out, lse2, do, cu_q, cu_k, 150, 150, 0.125, True, tile_dkdv=replace(t, split=False)
    )
    two = fused_backward(
        cfg, q, k, v, out, lse2, do, cu_q, cu_k, 150, 150, 0.125, True, tile_dkdv=replace(t, split=True)
    )
    for what, a, b in zip(("dq", "dk", "dv"), one, two):
        assert torch.equal(a, b), (name, what)
    assert all(bool(torch.isfinite(g).all()) and g.abs().sum() > 0 for g in two)


@pytest.mark.gpu
@pytest.mark.skipif(interpreting() or not torch.cuda.is_available(), reason="needs CUDA with TRITON_INTERPRET unset")
def test_kernel_resources_report_each_compiled_kernel():
    """``kernel_resources`` lists the forward, dK/dV and dQ kernels of a run with their registers
    (at most 255 per thread on NVIDIA GPUs), spills and shared memory."""
    from flamia_verify.kernels.triton.attention import fused_attention, kernel_resources

    q, k, v, do, cu_q, cu_k = (t.cuda() for t in make_case([100, 60], heads=2, seed=4))
    q.requires_grad_(True)
    fused_attention(DESIGNS["flamia-mxfp8"], q, k, v, cu_q, cu_k, 100, 100, causal=True).backward(do)
    rows = [r for r in kernel_resources() if r["constexprs"].get("P_POW2") and r["constexprs"].get("CAUSAL")]
    assert {"_attn_fwd", "_attn_bwd_dkdv", "_attn_bwd_dq"} <= {r["kernel"] for r in rows}
    for r in rows:
        assert 0 < r["n_regs"] <= 255 and r["n_spills"] >= 0 and r["shared"] > 0 and r["stages"] >= 1


def test_only_the_kernel_with_an_nvfp4_operand_sweeps_twice(device, monkeypatch):
    """NVFP4 needs whole-row amaxes before quantizing, so a kernel that rounds an NVFP4 operand sweeps
    its loop twice; a design with only dS in NVFP4 (dQ = dS K) sweeps twice in dQ alone, and its dK/dV
    launches stay single-pass. The mixed design's fused backward stays within the accumulation-order
    bound of its emulation."""

    design = DESIGNS["flamia-mxfp8"].with_quants({Operand.DS: E.Quant("nvfp4", 16)}, name="ds-nvfp4")
    assert unsupported_reason(design) is None
    cfg = config_for(design)
    assert [cfg.two_pass_dkdv(p) for p in (0, 1, 2)] == [False, False, False] and cfg.two_pass_dq()
    nv = config_for(DESIGNS["flamia-nvfp4"])
    assert all(nv.two_pass_dkdv(p) for p in (0, 1, 2)) and nv.two_pass_dq()
    monkeypatch.setitem(DESIGNS, design.name, design)
    check_backward_on_exact_inputs(device, design.name, [17, 50, 9], [30, 20, 9], 4, 2, True)


@pytest.mark.parametrize("name", ["bf16", "flamia-mxfp8"])
def test_strided_cu_seqlens_views_give_the_contiguous_calls_bits_and_leave_do_alone(device, name):
    """cu_seqlens as views with stride 2 into buffers whose other elements are -1 (a slice of a larger
    metadata tensor; interface.arguments' cu_layout=strided): the same bits as contiguous cu_seqlens,
    and dO unmodified. Measured on an H100 before the fix: the kernels read the view's storage as
    contiguous (documents from -1 offsets), out 99 % wrong and NaN written into dO."""
    q, k, v, do, _, cu_q, cu_k = to(device, *exact_case([37, 20, 51], [40, 20, 45], heads=4, heads_k=2))
    plain = run(fused(name), q, k, v, do, cu_q, cu_k, causal=True, scale=LN2)

    def strided(cu):
        buf = torch.full((2 * cu.numel() + 1,), -1, dtype=cu.dtype, device=cu.device)
        buf[1::2] = cu
        return buf[1::2]

    do_before = do.clone()
    got = run(fused(name), q, k, v, do, strided(cu_q), strided(cu_k), causal=True, scale=LN2)
    assert torch.equal(do, do_before), "the kernel wrote into dO"
    for what, a, b in zip(("out", "dq", "dk", "dv"), got, plain):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16)), f"{name} {what} differs with strided cu_seqlens"
