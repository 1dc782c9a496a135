"""The @triton.jit pieces that the fused kernels (``forward``, ``backward``, ``prepass``) share:
dot operands and products in the input dtype or on the E4M3 tensor cores, a document's bounds and
key tiles, row loads, and the backward's recomputed probabilities. The module doc of
:mod:`flamia_verify.kernels.triton.attention` says what they compute and why.
"""

from __future__ import annotations

import triton
import triton.language as tl

from flamia_verify.kernels.triton.quant import round_e4m3, round_input

NEG_INF = tl.constexpr(float("-inf"))
P_POW2_OFFSET = tl.constexpr(8.0)  # P elements are E4M3(2^(s - M_b + 8)), as in the emulation


@triton.jit
def _op(x, IS_FP16: tl.constexpr, INTERPRET: tl.constexpr):
    """A dot operand: x rounded to the input dtype (exact for dequantized MX values and for tiles
    loaded in the input dtype). Under the interpreter the values stay fp32 (see the module doc)."""
    if INTERPRET:
        return round_input(x.to(tl.float32), IS_FP16)
    elif IS_FP16:
        return x.to(tl.float16)
    else:
        return x.to(tl.bfloat16)


@triton.jit
def _dot(a, b, acc, INTERPRET: tl.constexpr):
    if INTERPRET:  # fp32 copies of bf16/fp16 values: products exact, fp32 sums as on the tensor cores
        return tl.dot(a, b, acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


@triton.jit
def _mma(a, b, acc, IS_FP16: tl.constexpr, INTERPRET: tl.constexpr):
    """acc + a @ b with both operands rounded to the input dtype (``_op``), fp32 accumulation."""
    return _dot(_op(a, IS_FP16, INTERPRET), _op(b, IS_FP16, INTERPRET), acc, INTERPRET)


@triton.jit
def _mma_t(a, b, acc, IS_FP16: tl.constexpr, INTERPRET: tl.constexpr):
    """acc + a @ b^T: b is rounded to the input dtype before the transpose (half the data to move)."""
    return _dot(_op(a, IS_FP16, INTERPRET), tl.trans(_op(b, IS_FP16, INTERPRET)), acc, INTERPRET)


@triton.jit
def _dot8(a, b, INTERPRET: tl.constexpr):
    """a @ b of E4M3 codes on the E4M3 tensor cores, the fp32 sum promoted after every 32-long slice
    (``max_num_imprecise_acc=32``: the slices of ``emulation.mma_gemm``). Under the interpreter the
    codes are fp32 values and the dot sums exact products in fp32."""
    if INTERPRET:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a.to(tl.float8e4nv), b.to(tl.float8e4nv), max_num_imprecise_acc=32)


@triton.jit
def _to_input(x, IS_FP16: tl.constexpr, INTERPRET: tl.constexpr):
    """Cast fp32 to the input dtype with round-to-nearest-even (the interpreter's cast truncates)."""
    if INTERPRET:
        x = round_input(x, IS_FP16)
    if IS_FP16:
        return x.to(tl.float16)
    else:
        return x.to(tl.bfloat16)


@triton.jit
def _document(CuQ, CuK, doc):
    """(q_start, lq, k_start, lk) of document ``doc`` in the packed batch."""
    q_start = tl.load(CuQ + doc)
    k_start = tl.load(CuK + doc)
    return q_start, tl.load(CuQ + doc + 1) - q_start, k_start, tl.load(CuK + doc + 1) - k_start


@triton.jit
def _key_tiles(start_m, lq, lk, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr):
    """The key tiles a query tile sweeps: [0, full_end) lie inside the document and are visible to
    every row of the tile (no masks); [full_end, hi) need masks (the causal diagonal, bottom-right
    aligned, and the document's last partial tile)."""
    if CAUSAL:
        off = lk - lq
        hi = tl.minimum(lk, tl.minimum(start_m + BLOCK_M, lq) + off)
        full_end = tl.minimum(start_m + off + 1, lk)
    else:
        hi = lk
        full_end = lk
    return tl.maximum(full_end, 0) // BLOCK_N * BLOCK_N, hi


@triton.jit
def _mma_split(a, b_op, b_raw, full, acc, IS_FP16: tl.constexpr, INTERPRET: tl.constexpr):
    """The causal-safe GEMM: acc + a @ b, where the columns of ``a`` marked ``full`` (their sequence
    block of b is wholly visible) multiply the quantized ``b_op`` and the rest the input-precision
    ``b_raw`` (the twin of ``emulation.gemm_seq``)."""
    acc = _mma(tl.where(full, a, 0.0), b_op, acc, IS_FP16, INTERPRET)
    return _mma(tl.where(full, 0.0, a), b_raw, acc, IS_FP16, INTERPRET)


@triton.jit
def _load_rows(Ptr, base, offs, mask, stride, HEAD_DIM: tl.constexpr):
    """Load (len(offs), HEAD_DIM) rows ``base + offs * stride`` in the input dtype, 0 where masked."""
    d = tl.arange(0, HEAD_DIM)
    return tl.load(Ptr + base + offs[:, None].to(tl.int64) * stride + d[None, :], mask=mask[:, None], other=0.0)


@triton.jit
def _p_rows(s2, lse, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, P_POW2: tl.constexpr, P_BLOCK: tl.constexpr):
    """Backward probabilities A = P / l of an (M, N) score tile (keys along axis 1), log2 units.

    Power-of-two P: E4M3(2^(s - M_b + 8)) * 2^((M_b - 8) - lse); FlashAttention P: 2^(s - lse).
    lse must not be -inf (callers zero the rows that saw no key); a NaN lse (a row with NaN scores)
    gives NaN weights, as in ``emulation.recomputed_probabilities``. Fully masked blocks (M_b = -inf)
    give 0; the comparisons are ``!= -inf``, not ``> -inf``, so that a NaN block maximum stays NaN.
    """
    if P_POW2 and BLOCK_N == P_BLOCK:  # one block per row: no 3-d view
        mb = tl.ceil(tl.max(s2, axis=1))
        mb = tl.where(mb != NEG_INF, mb, -1000.0)
        elem = round_e4m3(tl.exp2((s2 - mb[:, None]) + P_POW2_OFFSET))
        return elem * tl.exp2((mb - P_POW2_OFFSET) - lse)[:, None]
    elif P_POW2:
        NB: tl.constexpr = BLOCK_N // P_BLOCK
        s3 = tl.reshape(s2, (BLOCK_M, NB, P_BLOCK))
        mb = tl.ceil(tl.max(s3, axis=2))
        mb = tl.where(mb != NEG_INF, mb, -1000.0)
        elem = round_e4m3(tl.exp2((s3 - mb[:, :, None]) + P_POW2_OFFSET))
        scale = tl.exp2((mb - P_POW2_OFFSET) - lse[:, None])
        return tl.reshape(elem * scale[:, :, None], (BLOCK_M, BLOCK_N))
    else:
        return tl.exp2(s2 - lse[:, None])


@triton.jit
def _p_cols(sT, lse, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, P_POW2: tl.constexpr, P_BLOCK: tl.constexpr):
    """``_p_rows`` of a transposed (N keys, M queries) score tile: key blocks along axis 0."""
    if P_POW2 and BLOCK_N == P_BLOCK:
        mb = tl.ceil(tl.max(sT, axis=0))
        mb = tl.where(mb != NEG_INF, mb, -1000.0)
        elem = round_e4m3(tl.exp2((sT - mb[None, :]) + P_POW2_OFFSET))
        return elem * tl.exp2((mb - P_POW2_OFFSET) - lse)[None, :]
    elif P_POW2:
        NB: tl.constexpr = BLOCK_N // P_BLOCK
        s3 = tl.reshape(sT, (NB, P_BLOCK, BLOCK_M))
        mb = tl.ceil(tl.max(s3, axis=1))
        mb = tl.where(mb != NEG_INF, mb, -1000.0)
        elem = round_e4m3(tl.exp2((s3 - mb[:, None, :]) + P_POW2_OFFSET))
        scale = tl.exp2((mb - P_POW2_OFFSET) - lse[None, :])
        return tl.reshape(elem * scale[:, None, :], (BLOCK_N, BLOCK_M))
    else:
        return tl.exp2(sT - lse[None, :])
