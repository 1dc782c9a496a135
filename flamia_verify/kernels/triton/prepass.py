"""The operand-rounding pre-pass: one Triton pass per input tensor and GEMM role rounds it as a GEMM
operand (blocked along head_dim or along the sequence, blocks restarting at each document) and
stores it dequantized in the input dtype, or, for the E4M3 tensor cores, as E4M3 codes and
power-of-two scales. ``attention.round_operand`` and ``attention.round_operand_codes`` launch it;
the layouts of the codes are ``codes_reference``'s (:mod:`flamia_verify.kernels.codes_reference`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flamia_verify.kernels.triton.compat import interpreting as _interpreting
from flamia_verify.kernels.triton.quant import (
    E4M3_MAX,
    KIND_INPUT,
    biased_exponent,
    exp2i,
    quantize_first,
    quantize_last,
)
from flamia_verify.kernels.triton.tile_ops import _load_rows, _to_input


@triton.jit
def _quant_head(
    x,
    R: tl.constexpr, D: tl.constexpr, KIND: tl.constexpr, BLOCK: tl.constexpr,
    RCEIL: tl.constexpr, IS_FP16: tl.constexpr,
):  # fmt: skip
    """Round an (R, D) input tile as a head_dim-contracted operand (BLOCK 0: one scale per row).
    Input-precision operands stay in their dtype; quantized ones come back as fp32 values."""
    if KIND == KIND_INPUT:
        return x
    elif BLOCK == 0:
        return quantize_last(x.to(tl.float32), x, R, D, KIND, D, RCEIL, IS_FP16)
    else:
        return quantize_last(x.to(tl.float32), x, R, D, KIND, BLOCK, RCEIL, IS_FP16)


@triton.jit
def _quant_seq(
    x,
    R: tl.constexpr, D: tl.constexpr, KIND: tl.constexpr, BLOCK: tl.constexpr,
    RCEIL: tl.constexpr, IS_FP16: tl.constexpr,
):  # fmt: skip
    """Round an (R, D) input tile as a sequence-contracted operand (blocks along its rows)."""
    if KIND == KIND_INPUT:
        return x
    else:
        return quantize_first(x.to(tl.float32), R, D, KIND, BLOCK, RCEIL, IS_FP16)


@triton.jit
def _code_scale(a):
    """The power of two t of ``codes_reference._pow2_scale`` for amaxes ``a``: 2^(floor(log2 a) - 8),
    doubled where a / t would exceed 448, 1 for a = 0 (floor(log2 a) read off the exponent bits:
    exact)."""
    t = exp2i(biased_exponent(a) - 127 - 8)
    t = tl.where(a > E4M3_MAX * t, t * 2.0, t)
    return tl.where(a > 0, t, 1.0)


@triton.jit
def _round_operand(
    X, Y, Cu,  # input, output, document starts
    C, Sc, First,  # CODES: E4M3 codes, scales, each document's first block
    total, heads, stride_t, stride_h,
    ROWS: tl.constexpr, HEAD_DIM: tl.constexpr,
    KIND: tl.constexpr, BLOCK: tl.constexpr, SEQ: tl.constexpr, RCEIL: tl.constexpr,
    CODES: tl.constexpr, IS_FP16: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
    """Grid (row tiles of the longest document, documents, heads): Y = X rounded as a GEMM operand,
    blocked along head_dim (SEQ False; BLOCK 0: one scale per row) or along the sequence (SEQ True;
    tiles start at the document's first row, so blocks restart there), stored in the input dtype
    (exact: E4M3 values times power-of-two scales).

    CODES (the E4M3 tensor cores): instead of Y, the rounded values as E4M3 codes C and power-of-two
    scales Sc (``codes_reference``'s ``e4m3_row_codes_reference`` / ``e4m3_block_codes_reference``
    are the PyTorch twins): head_dim operands keep X's layout with scales (heads, total); sequence
    operands (one block per tile) are stored transposed, (heads, head_dim, total), with scales
    (blocks, heads, head_dim), the document's first block at First[doc]."""
    start = tl.program_id(0) * ROWS
    doc = tl.program_id(1)
    h = tl.program_id(2)
    t0 = tl.load(Cu + doc)
    n = tl.load(Cu + doc + 1) - t0
    if start >= n:
        return
    offs = start + tl.arange(0, ROWS)
    mask = offs < n
    base = t0.to(tl.int64) * stride_t + h * stride_h
    x = _load_rows(X, base, offs, mask, stride_t, HEAD_DIM)
    if SEQ:
        y = _quant_seq(x, ROWS, HEAD_DIM, KIND, BLOCK, RCEIL, IS_FP16)
    else:
        y = _quant_head(x, ROWS, HEAD_DIM, KIND, BLOCK, RCEIL, IS_FP16)
    d = tl.arange(0, HEAD_DIM)
    if CODES:
        yf = y.to(tl.float32)
        if SEQ:
            tl.static_assert(ROWS == BLOCK, "one sequence block per tile")
            t = _code_scale(tl.max(tl.abs(yf), axis=0))
            cptrs = C + (h * HEAD_DIM + d[None, :]).to(tl.int64) * total + (t0 + offs)[:, None]
            tl.store(cptrs, (yf / t[None, :]).to(C.dtype.element_ty), mask=mask[:, None])
            blk = tl.load(First + doc) + start // ROWS
            tl.store(Sc + (blk.to(tl.int64) * heads + h) * HEAD_DIM + d, t)
        else:
            t = _code_scale(tl.max(tl.abs(yf), axis=1))
            cptrs = C + base + offs[:, None].to(tl.int64) * stride_t + d[None, :]
            tl.store(cptrs, (yf / t[:, None]).to(C.dtype.element_ty), mask=mask[:, None])
            tl.store(Sc + h.to(tl.int64) * total + t0 + offs, t, mask=mask)
    else:
        ptrs = Y + base + offs[:, None].to(tl.int64) * stride_t + d[None, :]
        tl.store(ptrs, _to_input(y, IS_FP16, INTERPRET), mask=mask[:, None])


def _code_dtype() -> torch.dtype:
    """E4M3 codes in memory: float8_e4m3fn on the GPU; fp32 values under the interpreter."""
    return torch.float32 if _interpreting() else torch.float8_e4m3fn


def _first_blocks(cu: torch.Tensor, block: int, total: int) -> tuple[torch.Tensor, int]:
    """Each document's first sequence block (int64, (batch,)), blocks of ``block`` tokens restarting at
    every document of ``cu``, and an upper bound on the number of blocks (no host sync for it)."""
    cu64 = cu.to(torch.int64)
    nblk = (cu64[1:] - cu64[:-1] + block - 1) // block
    return torch.cumsum(nblk, 0) - nblk, total // block + cu.numel()
