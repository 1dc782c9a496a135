"""The fp8-mma design: its accumulator model, its bound term, and the fused kernels' E4M3 codes.

The model (``emulation.mma_gemm``) is checked against a scalar twin written from its docstring; the
design against ``fp8`` (the same roundings: with the accumulator replaced by fp32 the two are the
same function, bit for bit); the fused kernels' codes against the values they stand for; and, under
the Triton interpreter (whose dots sum exact products in fp32), the fused fp8-mma kernels against
the fused fp8 kernels, bit for bit.
"""

from __future__ import annotations

import math

import pytest
import torch
from test_kernels_emulation import make_case, run

from flamia_verify.kernels import emulation as E
from flamia_verify.kernels.designs import DESIGNS
from flamia_verify.kernels.triton import triton_available
from flamia_verify.kernels.triton.compat import interpreting
from flamia_verify.recipes.operands import Gemm, Operand
from flamia_verify.recipes.recipe import RECIPES, get_recipe


def _slow_mma(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The model, one element at a time: slices of 32 along the contraction, every exact product cut
    toward zero to a multiple of 2^(e - 13) (e: exponent of the slice's largest |product|), the cut
    products summed exactly, each slice rounded to fp32, the slices added in fp32 in order."""
    R, C = a.shape
    D = b.shape[1]
    out = torch.zeros(R, D, dtype=torch.float32)
    for r in range(R):
        for d in range(D):
            acc = None
            for s0 in range(0, C, E.MMA_SLICE):
                prods = [float(a[r, c]) * float(b[c, d]) for c in range(s0, min(s0 + E.MMA_SLICE, C))]
                big = max(abs(p) for p in prods)
                if big == 0:
                    part = 0.0
                else:
                    grid = 2.0 ** (math.floor(math.log2(big)) - E.MMA_FRACTION_BITS)
                    part = sum(math.trunc(p / grid) * grid for p in prods)
                part32 = torch.tensor(part, dtype=torch.float32)
                acc = part32 if acc is None else acc + part32
            out[r, d] = acc
    return out


def _e4m3(shape, seed, spread=3):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.exp2(torch.randint(-spread, spread + 1, shape, generator=g).float())
    return x.to(torch.float8_e4m3fn).float()


def test_mma_gemm_is_its_scalar_model():
    a, b = _e4m3((5, 70), 0), _e4m3((70, 3), 1)  # 70: two whole slices and a partial one
    assert torch.equal(E.mma_gemm(a, b), _slow_mma(a, b))


def test_mma_gemm_cuts_products_far_below_the_slice_maximum():
    # one product 1 and 31 products 0.9375 * 2^-13: each is below the grid 2^-13 and is cut to 0
    a = torch.full((1, 32), 1.875 * 2.0**-6)
    b = torch.full((32, 1), 2.0**-8)
    a[0, 0], b[0, 0] = 1.0, 1.0
    assert E.mma_gemm(a, b).item() == 1.0
    assert torch.matmul(a, b).item() == 1.0 + 31 * 0.9375 * 2.0**-13  # fp32 keeps them


def test_mma_gemm_is_exact_where_every_product_fits_13_bits_below_the_largest():
    g = torch.Generator().manual_seed(3)
    a = torch.randint(-15, 16, (4, 3, 96), generator=g).float()
    b = torch.randint(-15, 16, (4, 96, 5), generator=g).float()
    assert torch.equal(E.mma_gemm(a, b), torch.matmul(a, b))


def test_the_design_is_fp8_with_s_and_o_on_the_tensor_cores():
    mma, fp8 = DESIGNS["fp8-mma"], DESIGNS["fp8"]
    assert mma.mma == {Gemm.S, Gemm.O} and not fp8.mma
    assert all(mma.quant(op) == fp8.quant(op) for op in Operand)
    assert mma.recipe is RECIPES["fp8-mma"] and get_recipe("fp8-mma").operand_models is RECIPES["fp8"].operand_models


@pytest.mark.parametrize("causal", [False, True])
def test_with_fp32_sums_fp8_mma_is_fp8_bit_for_bit(causal):
    case = make_case([70, 33], heads=4, heads_k=2, dim=64, seed=5)
    want = run(E.make_kernel(DESIGNS["fp8"]), *case, causal=causal)
    with E.overriding(mma_gemm=E.gemm):
        got = run(E.make_kernel(DESIGNS["fp8-mma"]), *case, causal=causal)
    for g_, w_ in zip(got, want):
        assert torch.equal(g_, w_)
    mma = run(E.make_kernel(DESIGNS["fp8-mma"]), *case, causal=causal)
    assert not torch.equal(mma[0], want[0]), "the tensor-core model changed nothing"


def test_the_recipe_charges_each_gemm_its_slices():
    fp32 = RECIPES["fp8"].bound_model(torch.bfloat16)
    mma = RECIPES["fp8-mma"].bound_model(torch.bfloat16)
    u32 = 2.0**-24
    assert fp32.gamma(128) == pytest.approx(128 * u32 / (1 - 128 * u32), rel=1e-12)
    u = E.MMA_GROUP * 2.0**-E.MMA_FRACTION_BITS  # 2^-8
    m = 4  # 128 = 4 slices of 32
    assert mma.gamma(128) == pytest.approx((1 + u) * (1 + u32) * (1 + m * u32 / (1 - m * u32)) - 1, rel=1e-12)
    assert mma.gamma(100) == mma.gamma(128)  # a partial slice counts as one
    assert mma.gamma(32) < mma.gamma(33)


def test_the_bound_covers_the_model_on_a_spread_of_magnitudes():
    """Every slice of the model moves by less than u_slice of its sum of |products|."""
    for seed in range(4):
        a, b = _e4m3((16, 128), 10 + seed, spread=6), _e4m3((128, 16), 20 + seed, spread=6)
        err = (E.mma_gemm(a, b).double() - a.double() @ b.double()).abs()
        mag = a.double().abs() @ b.double().abs()
        assert bool((err <= RECIPES["fp8-mma"].bound_model(torch.bfloat16).gamma(128) * mag).all())


# ---------------------------------------------------------------------------------------------
# the fused kernels' E4M3 codes
# ---------------------------------------------------------------------------------------------

needs_triton = pytest.mark.skipif(not triton_available(), reason="needs Triton")


@needs_triton
def test_row_codes_are_exact_e4m3_values_of_the_rounded_operand():
    from flamia_verify.kernels.codes_reference import e4m3_row_codes_reference as e4m3_row_codes
    from flamia_verify.kernels.triton.attention import round_operand
    from flamia_verify.kernels.triton.config import config_for

    cfg = config_for(DESIGNS["fp8-mma"])
    cu = torch.tensor([0, 90, 130], dtype=torch.int32)
    x = (torch.randn(130, 2, 64) * torch.exp2(torch.randint(-6, 7, (130, 2, 1)).float())).bfloat16()
    x[5, 1] = 0  # a zero row: scale 1, codes 0
    xh = round_operand(x, cu, 90, cfg[Operand.Q_HD], seq=False, rceil=cfg.rceil)
    codes, scale = e4m3_row_codes(xh)
    assert scale.shape == (2, 130)
    c = codes.float()
    assert torch.equal(c * scale.T[..., None], xh.float())
    assert torch.equal(c.to(torch.float8_e4m3fn).float(), c)  # every code is an E4M3 value
    assert c.abs().max() <= 448 and scale[1, 5] == 1


@needs_triton
def test_block_codes_restart_at_each_document_and_are_exact():
    from flamia_verify.kernels.codes_reference import e4m3_block_codes_reference as e4m3_block_codes
    from flamia_verify.kernels.triton.attention import round_operand
    from flamia_verify.kernels.triton.config import config_for

    cfg = config_for(DESIGNS["fp8-mma"])
    lens = [300, 0, 77, 129]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    x = (torch.randn(506, 2, 32) * torch.exp2(torch.randint(-6, 7, (506, 1, 32)).float())).bfloat16()
    xs = round_operand(x, cu, 300, cfg[Operand.V_SEQ], seq=True, rceil=cfg.rceil)
    codes_t, scale, first = e4m3_block_codes(xs, cu, 128)
    assert first.tolist() == [0, 3, 3, 4]  # ceil(300/128) = 3 blocks, none, 1, 2
    codes = codes_t.permute(2, 0, 1).float()
    for d, (start, n) in enumerate(zip(cu[:-1].tolist(), lens)):
        for t in range(start, start + n):
            blk = int(first[d]) + (t - start) // 128
            assert torch.equal(codes[t] * scale[blk], xs[t].float()), (d, t)
    assert torch.equal(codes.to(torch.float8_e4m3fn).float(), codes)


@needs_triton
@pytest.mark.skipif(not interpreting(), reason="the interpreter's dots sum exact products in fp32")
@pytest.mark.parametrize("causal", [False, True])
def test_fused_fp8_mma_is_the_fused_fp8_kernel_under_the_interpreter(causal):
    from test_triton_attention import fused

    case = make_case([300, 77], heads=4, heads_k=2, dim=64, seed=9)
    want = run(fused("fp8"), *case, causal=causal)
    got = run(fused("fp8-mma"), *case, causal=causal)
    for what, g_, w_ in zip(("out", "dq", "dk", "dv"), got, want):
        assert torch.equal(g_.view(torch.int16), w_.view(torch.int16)), what


@needs_triton
@pytest.mark.skipif(not interpreting(), reason="CPU runs need TRITON_INTERPRET=1 (the GPU suite runs it on CUDA)")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_one_pass_codes_are_the_pytorch_twins_codes(dtype):
    from flamia_verify.kernels.codes_reference import e4m3_block_codes_reference as e4m3_block_codes
    from flamia_verify.kernels.codes_reference import e4m3_row_codes_reference as e4m3_row_codes
    from flamia_verify.kernels.triton.attention import round_operand, round_operand_codes
    from flamia_verify.kernels.triton.config import config_for

    cfg = config_for(DESIGNS["fp8-mma"])
    lens = [300, 0, 77, 129]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    x = (torch.randn(506, 2, 32) * torch.exp2(torch.randint(-8, 9, (506, 2, 1)).float())).to(dtype)
    x[7] = 0
    rows = round_operand_codes(x, cu, 300, cfg[Operand.Q_HD], seq=False, rceil=cfg.rceil)
    want = e4m3_row_codes(round_operand(x, cu, 300, cfg[Operand.Q_HD], seq=False, rceil=cfg.rceil))
    assert all(torch.equal(g_, w_) for g_, w_ in zip(rows, want))
    codes_t, scale, first = round_operand_codes(x, cu, 300, cfg[Operand.V_SEQ], seq=True, rceil=cfg.rceil)
    w_codes, w_scale, w_first = e4m3_block_codes(
        round_operand(x, cu, 300, cfg[Operand.V_SEQ], seq=True, rceil=cfg.rceil), cu, 128
    )
    assert torch.equal(first, w_first) and torch.equal(codes_t, w_codes)
    used = int((w_first[-1] + (lens[-1] + 127) // 128).item())  # the blocks that hold tokens
    assert torch.equal(scale[:used], w_scale[:used])
