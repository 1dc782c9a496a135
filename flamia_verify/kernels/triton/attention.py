"""Fused FlashAttention-style Triton kernels of the built-in designs: forward and backward, varlen
(``cu_seqlens``, no padding or repacking), causal (bottom-right aligned), GQA/MQA.

One kernel source serves every design: an :class:`~flamia_verify.kernels.emulation.EmulatedDesign`
is compiled into constexpr switches (:class:`FusedConfig`) that say how each GEMM operand is rounded
in registers. The emulation is the specification; this module computes the same numbers tile by
tile:

* Tiles start at each document's first query / key (``cu_seqlens``), and every tile size is a
  multiple of every block size along its axis, so quantization blocks along the sequence restart
  at document starts without any bookkeeping, and a document's tiles are the same wherever it is
  packed.
* Each input operand is rounded once per GEMM role by a pre-pass (``round_operand``: Q, K along
  head_dim; V along keys; in the backward also V, dO along head_dim and Q, K, dO along the
  sequence) and stored dequantized in the input dtype; the loops round only P, P^T, dS, dS^T, in
  registers (``quant.py``; both bit-exact twins of :mod:`flamia_verify.formats`). The dots run in
  BF16 on dequantized values, which is exact wherever the value lies in bf16's normal range: E4M3
  values have 4 significant bits and E8M0 scales are powers of two. Values below 2^-126 (tiny dS
  blocks, inputs near E8M0's smallest scale) lose bits in the bf16 operand that the emulation keeps
  in fp32; the bound covers that, bitwise agreement does not hold there.
* FLAMIA's P: per 32-key block (128 for ``fp8``) ``M_b = ceil(block max of s)`` (log2 units),
  elements ``E4M3(2^(s - M_b + 8))``, block scale ``2^(M_b - 8 - m)``. The running maximum ``m``
  is the max of the integers ``M_b``, so the online-softmax rescaling ``2^(m_old - m_new)`` is an
  exact power of two and the result does not depend on the tile order. ``l`` sums the rounded P.
* Causal diagonal fallback: where an output row sees a sequence block of the right-hand operand
  only partly, that block is multiplied in the input precision. Only diagonal tiles take the
  masked path, and only they split the dot in two.
* Backward: ``D = rowsum(dO * O)``, P recomputed from the same quantized Q, K and the saved
  log-sum-exp (log2 units); dK, dV in one kernel (loop over query tiles), dQ in another (loop
  over key tiles); no atomics, so runs are bitwise repeatable. GQA: each query head writes its
  scaled fp32 dK, dV and the group sum is taken in fp32, in the emulation's order.

Triton's interpreter (``TRITON_INTERPRET=1``) multiplies bf16 dot operands as raw integers and
truncates fp32 -> bf16 casts; under it the kernels round in fp32 arithmetic and multiply fp32
copies of the (exactly representable) operands (``INTERPRET`` constexpr).

docs/triton.md has the derivations, the tolerances and the measured speed.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources

from flamia_verify.convention import validate_varlen_inputs
from flamia_verify.kernels.emulation import LOG2E, EmulatedDesign
from flamia_verify.kernels.triton.compat import interpreting as _interpreting
from flamia_verify.kernels.triton.compat import patch_interpreter
from flamia_verify.kernels.triton.config import (
    FusedConfig,
    TileConfig,
    config_for,
    head_dim_limit,
    head_dim_supported,
    tiles,
    unsupported_reason,
)
from flamia_verify.kernels.triton.quant import (
    KIND_INPUT,
    KIND_NVFP4,
    amax,
    biased_exponent,
    exp2i,
    max_keep_nan,
    nvfp4_row_scale,
    quantize_first,
    quantize_last,
    round_e4m3,
    round_input,
)

__all__ = [
    "FusedConfig",
    "TileConfig",
    "config_for",
    "tiles",
    "unsupported_reason",
    "fused_attention",
    "fused_forward",
    "fused_backward",
    "kernel_resources",
]

patch_interpreter()

NEG_INF = tl.constexpr(float("-inf"))
P_POW2_OFFSET = tl.constexpr(8.0)  # P elements are E4M3(2^(s - M_b + 8)), as in the emulation


# ----------------------------------------------------------------------------------------------
# small pieces shared by the kernels
# ----------------------------------------------------------------------------------------------


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
def _quant_head(
    x,
    R: tl.constexpr,
    D: tl.constexpr,
    KIND: tl.constexpr,
    BLOCK: tl.constexpr,
    RCEIL: tl.constexpr,
    IS_FP16: tl.constexpr,
):
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
    R: tl.constexpr,
    D: tl.constexpr,
    KIND: tl.constexpr,
    BLOCK: tl.constexpr,
    RCEIL: tl.constexpr,
    IS_FP16: tl.constexpr,
):
    """Round an (R, D) input tile as a sequence-contracted operand (blocks along its rows)."""
    if KIND == KIND_INPUT:
        return x
    else:
        return quantize_first(x.to(tl.float32), R, D, KIND, BLOCK, RCEIL, IS_FP16)


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


# ----------------------------------------------------------------------------------------------
# forward
# ----------------------------------------------------------------------------------------------


@triton.jit
def _attn_fwd_tile(
    acc,
    l_i,
    m_i,
    q_op,
    K,
    V,
    Vop,
    k_base,
    v_base,
    stride_kt,
    stride_vt,
    start_n,
    offs_m,
    lk,
    off,
    qk_scale,
    q_sc,
    Kc,
    Ksc,
    ks_base,
    VcT,
    vt_base,
    stride_vtd,
    Vsc,
    vs_base,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    CAUSAL: tl.constexpr,
    MASKED: tl.constexpr,
    V_KIND: tl.constexpr,
    V_BLOCK: tl.constexpr,
    P_POW2: tl.constexpr,
    P_BLOCK: tl.constexpr,
    FALLBACK: tl.constexpr,
    MMA8: tl.constexpr,
    IS_FP16: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    """One key tile of the online softmax: returns the updated (acc, l_i, m_i). K holds the
    head_dim-rounded keys, Vop the sequence-rounded values (V itself when they are in the input
    precision), V the input values for the diagonal fallback.

    MMA8 (S and O = PV on the E4M3 tensor cores): q_op holds Q's E4M3 codes and q_sc their row
    scales; Kc, Ksc the keys' codes and row scales; VcT the values' codes transposed (head_dim,
    tokens), Vsc their scale per 128-key block and channel (``round_operand_codes``)."""
    offs_n = start_n + tl.arange(0, BLOCK_N)
    kmask = offs_n < lk
    if MMA8:
        kc = _load_rows(Kc, k_base, offs_n, kmask, stride_kt, HEAD_DIM)
        k_sc = tl.load(Ksc + ks_base + offs_n, mask=kmask, other=1.0)
        s = _dot8(q_op, tl.trans(kc), INTERPRET) * (q_sc[:, None] * k_sc[None, :])
    else:
        k_op = _load_rows(K, k_base, offs_n, kmask, stride_kt, HEAD_DIM)
        s = _mma_t(q_op, k_op, tl.zeros((BLOCK_M, BLOCK_N), tl.float32), IS_FP16, INTERPRET)
    s2 = s * qk_scale
    if MASKED:
        vis = kmask[None, :]
        if CAUSAL:
            vis = vis & (offs_n[None, :] <= offs_m[:, None] + off)
        s2 = tl.where(vis, s2, NEG_INF)
    if P_POW2 and BLOCK_N == P_BLOCK:
        # FLAMIA P, one block per tile row: M_b = ceil(max s); E4M3(2^(s - M_b + 8)) * 2^(M_b - 8 - m)
        mb = tl.ceil(tl.max(s2, axis=1))
        m_new = tl.maximum(m_i, mb)
        live = mb != NEG_INF  # fully masked blocks give 0; a NaN block maximum stays NaN (the emulation's rule)
        mb_s = tl.where(live, mb, 0.0)
        m_new_s = tl.where(m_new > NEG_INF, m_new, 0.0)
        elem = round_e4m3(tl.exp2((s2 - mb_s[:, None]) + P_POW2_OFFSET))
        e = tl.where(live, tl.maximum((mb_s - P_POW2_OFFSET) - m_new_s, -1000.0), -1000.0)
        p_sc = exp2i(e.to(tl.int32))
        p = elem * p_sc[:, None]
        alpha = exp2i(tl.maximum(tl.where(m_i > NEG_INF, m_i - m_new_s, 0.0), -1000.0).to(tl.int32))
    elif P_POW2:
        # the same per block of P_BLOCK keys, through a 3-d view of the tile
        NB: tl.constexpr = BLOCK_N // P_BLOCK
        s3 = tl.reshape(s2, (BLOCK_M, NB, P_BLOCK))
        mb = tl.ceil(tl.max(s3, axis=2))
        m_new = tl.maximum(m_i, tl.max(mb, axis=1))
        live = mb != NEG_INF
        mb_s = tl.where(live, mb, 0.0)
        m_new_s = tl.where(m_new > NEG_INF, m_new, 0.0)
        elem = round_e4m3(tl.exp2((s3 - mb_s[:, :, None]) + P_POW2_OFFSET))
        e = tl.where(live, tl.maximum((mb_s - P_POW2_OFFSET) - m_new_s[:, None], -1000.0), -1000.0)
        p = tl.reshape(elem * exp2i(e.to(tl.int32))[:, :, None], (BLOCK_M, BLOCK_N))
        alpha = exp2i(tl.maximum(tl.where(m_i > NEG_INF, m_i - m_new_s, 0.0), -1000.0).to(tl.int32))
    else:
        # FlashAttention-2: P = 2^(s - m) in fp32 for l, rounded to the input dtype for P V
        m_new = tl.maximum(m_i, tl.max(s2, axis=1))
        m_new_s = tl.where(m_new > NEG_INF, m_new, 0.0)
        p = tl.exp2(s2 - m_new_s[:, None])
        alpha = tl.exp2(tl.where(m_i > NEG_INF, m_i - m_new_s, 0.0))
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None]
    if MMA8:
        # P's codes are its E4M3 elements (one block per tile row, scale p_sc); V's block scale per channel
        tl.static_assert(P_POW2 and BLOCK_N == P_BLOCK and BLOCK_N == V_BLOCK)
        d = tl.arange(0, HEAD_DIM)
        vt = tl.load(
            VcT + vt_base + d[:, None].to(tl.int64) * stride_vtd + offs_n[None, :], mask=kmask[None, :], other=0.0
        )
        v_sc = tl.load(Vsc + vs_base + (start_n // V_BLOCK) * stride_vt + d)  # block stride heads * head_dim
        sc = p_sc[:, None] * v_sc[None, :]
        if MASKED and FALLBACK and CAUSAL:
            # the block that row i sees only partly: input-precision V (the causal-safe split)
            v = _load_rows(V, v_base, offs_n, kmask, stride_vt, HEAD_DIM)
            blk_last = tl.minimum((offs_n // V_BLOCK) * V_BLOCK + (V_BLOCK - 1), lk - 1)
            full = blk_last[None, :] <= offs_m[:, None] + off
            acc = acc + _dot8(tl.where(full, elem, 0.0), tl.trans(vt), INTERPRET) * sc
            acc = _mma(tl.where(full, 0.0, p), v, acc, IS_FP16, INTERPRET)
        else:
            acc = acc + _dot8(elem, tl.trans(vt), INTERPRET) * sc
        return acc, l_i, m_new
    v_op = _load_rows(Vop, v_base, offs_n, kmask, stride_vt, HEAD_DIM)
    if V_KIND != KIND_INPUT and MASKED and FALLBACK and CAUSAL:
        # a V block that row i sees only partly is multiplied in the input precision
        v = _load_rows(V, v_base, offs_n, kmask, stride_vt, HEAD_DIM)
        blk_last = tl.minimum((offs_n // V_BLOCK) * V_BLOCK + (V_BLOCK - 1), lk - 1)
        acc = _mma_split(p, v_op, v, blk_last[None, :] <= offs_m[:, None] + off, acc, IS_FP16, INTERPRET)
    else:
        acc = _mma(p, v_op, acc, IS_FP16, INTERPRET)
    return acc, l_i, m_new


@triton.jit(do_not_specialize=["stride_lh", "GROUPS", "stride_vtd"])  # lengths, GQA ratio: one compilation for all
def _attn_fwd(
    Q,
    K,
    V,
    Vop,
    Out,
    Lse2,
    CuQ,
    CuK,
    Qsc,
    Kc,
    Ksc,
    VcT,
    Vsc,
    VBlk,
    stride_vtd,
    qk_scale,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_ot,
    stride_oh,
    stride_lh,
    GROUPS,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    V_KIND: tl.constexpr,
    V_BLOCK: tl.constexpr,
    P_POW2: tl.constexpr,
    P_BLOCK: tl.constexpr,
    FALLBACK: tl.constexpr,
    MMA8: tl.constexpr,
    IS_FP16: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    """Grid (query tiles of the longest document, documents, heads); longest-running tiles first.
    Q, K: the head_dim-rounded operands; Vop: V rounded along keys; V: the input values (all in
    the input dtype, with the strides of V for V and Vop). MMA8: Q holds Q's E4M3 codes, Qsc,
    Kc, Ksc, VcT, Vsc the rest of ``round_operand_codes``'s, VBlk each document's first V block."""
    tl.static_assert(BLOCK_N % 16 == 0)
    if V_KIND != KIND_INPUT:
        tl.static_assert(BLOCK_N % V_BLOCK == 0)
    if P_POW2:
        tl.static_assert(BLOCK_N % P_BLOCK == 0)
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)
    doc = tl.program_id(1)
    h = tl.program_id(2)
    hk = h // GROUPS
    q_start, lq, k_start, lk = _document(CuQ, CuK, doc)
    start_m = pid_m * BLOCK_M
    if start_m >= lq:
        return
    off = lk - lq  # bottom-right causal alignment: key j visible to query i iff j <= i + off
    offs_m = start_m + tl.arange(0, BLOCK_M)
    qmask = offs_m < lq
    q_op = _load_rows(Q, q_start.to(tl.int64) * stride_qt + h * stride_qh, offs_m, qmask, stride_qt, HEAD_DIM)
    if MMA8:
        # row scales (heads, tokens) like Lse2, block scales (blocks, heads, head_dim); v contiguous
        q_sc = tl.load(Qsc + h.to(tl.int64) * stride_lh + q_start + offs_m, mask=qmask, other=1.0)
        ks_base = hk.to(tl.int64) * stride_vtd + k_start
        vt_base = hk.to(tl.int64) * HEAD_DIM * stride_vtd + k_start
        vs_base = (tl.load(VBlk + doc).to(tl.int64) * (stride_vt // HEAD_DIM) + hk) * HEAD_DIM
    else:
        q_sc = tl.zeros((BLOCK_M,), tl.float32)
        ks_base = 0
        vt_base = 0
        vs_base = 0
    m_i = tl.full((BLOCK_M,), NEG_INF, tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, HEAD_DIM), tl.float32)
    k_base = k_start.to(tl.int64) * stride_kt + hk * stride_kh
    v_base = k_start.to(tl.int64) * stride_vt + hk * stride_vh
    full_end, hi = _key_tiles(start_m, lq, lk, BLOCK_M, BLOCK_N, CAUSAL)
    for start_n in range(0, full_end, BLOCK_N):
        acc, l_i, m_i = _attn_fwd_tile(
            acc,
            l_i,
            m_i,
            q_op,
            K,
            V,
            Vop,
            k_base,
            v_base,
            stride_kt,
            stride_vt,
            start_n,
            offs_m,
            lk,
            off,
            qk_scale,
            q_sc,
            Kc,
            Ksc,
            ks_base,
            VcT,
            vt_base,
            stride_vtd,
            Vsc,
            vs_base,
            BLOCK_M,
            BLOCK_N,
            HEAD_DIM,
            CAUSAL,
            False,
            V_KIND,
            V_BLOCK,
            P_POW2,
            P_BLOCK,
            FALLBACK,
            MMA8,
            IS_FP16,
            INTERPRET,
        )
    for start_n in range(full_end, hi, BLOCK_N):
        acc, l_i, m_i = _attn_fwd_tile(
            acc,
            l_i,
            m_i,
            q_op,
            K,
            V,
            Vop,
            k_base,
            v_base,
            stride_kt,
            stride_vt,
            start_n,
            offs_m,
            lk,
            off,
            qk_scale,
            q_sc,
            Kc,
            Ksc,
            ks_base,
            VcT,
            vt_base,
            stride_vtd,
            Vsc,
            vs_base,
            BLOCK_M,
            BLOCK_N,
            HEAD_DIM,
            CAUSAL,
            True,
            V_KIND,
            V_BLOCK,
            P_POW2,
            P_BLOCK,
            FALLBACK,
            MMA8,
            IS_FP16,
            INTERPRET,
        )
    ok = l_i != 0  # rows that saw no key output 0 (lse -inf); a NaN row sum (NaN scores) stays NaN
    l_s = tl.where(ok, l_i, 1.0)
    o = tl.math.div_rn(acc, tl.broadcast_to(l_s[:, None], (BLOCK_M, HEAD_DIM)))
    o = tl.where(ok[:, None], o, 0.0)
    lse2 = tl.where(ok, m_i + tl.log2(l_s), NEG_INF)
    offs_d = tl.arange(0, HEAD_DIM)
    o_ptrs = Out + (q_start + offs_m)[:, None].to(tl.int64) * stride_ot + h * stride_oh + offs_d[None, :]
    tl.store(o_ptrs, _to_input(o, IS_FP16, INTERPRET), mask=qmask[:, None])
    tl.store(Lse2 + h * stride_lh + q_start + offs_m, lse2, mask=qmask)


# ----------------------------------------------------------------------------------------------
# backward
# ----------------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["total_q", "stride_lh"])  # lengths: no recompilation per packing
def _attn_bwd_delta(
    O,
    DO,
    Delta,
    total_q,
    stride_ot,
    stride_oh,
    stride_dot,
    stride_doh,
    stride_lh,
    BLOCK_M: tl.constexpr,
    HEAD_DIM: tl.constexpr,
):
    """D = rowsum(dO * O) in fp32, from O and dO in the input dtype."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    h = tl.program_id(1)
    mask = offs_m < total_q
    o = _load_rows(O, h * stride_oh, offs_m, mask, stride_ot, HEAD_DIM).to(tl.float32)
    do = _load_rows(DO, h * stride_doh, offs_m, mask, stride_dot, HEAD_DIM).to(tl.float32)
    tl.store(Delta + h * stride_lh + offs_m, tl.sum(o * do, axis=1), mask=mask)


@triton.jit
def _load_op(Raw, Op, base, offs, mask, stride, HEAD_DIM: tl.constexpr, KIND: tl.constexpr):
    """An operand's rows for one GEMM: the input tile with KIND_INPUT (callers may then reuse it as
    the input values), else the rounded tile ``Op`` (the input values are loaded only where a
    causal-safe split needs them)."""
    if KIND == KIND_INPUT:
        return _load_rows(Raw, base, offs, mask, stride, HEAD_DIM)
    else:
        return _load_rows(Op, base, offs, mask, stride, HEAD_DIM)


@triton.jit
def _seq_rhs(
    a,
    raw,
    Raw,
    Seq,
    base,
    offs,
    mask,
    stride,
    full,
    acc,
    HEAD_DIM: tl.constexpr,
    KIND: tl.constexpr,
    RAW_LOADED: tl.constexpr,
    SPLIT: tl.constexpr,
    IS_FP16: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    """acc + a @ b for a sequence-contracted right operand b: its sequence rounding (``Seq``), with
    the causal-safe split where SPLIT (``full`` marks a's columns whose block of b is wholly visible).
    ``raw`` is b's input tile when RAW_LOADED (else it is loaded here when needed)."""
    if KIND == KIND_INPUT:
        if not RAW_LOADED:
            raw = _load_rows(Raw, base, offs, mask, stride, HEAD_DIM)
        return _mma(a, raw, acc, IS_FP16, INTERPRET)
    else:
        b_seq = _load_rows(Seq, base, offs, mask, stride, HEAD_DIM)
        if SPLIT:
            if not RAW_LOADED:
                raw = _load_rows(Raw, base, offs, mask, stride, HEAD_DIM)
            return _mma_split(a, b_seq, raw, full, acc, IS_FP16, INTERPRET)
        else:
            return _mma(a, b_seq, acc, IS_FP16, INTERPRET)


@triton.jit
def _attn_bwd_dkdv_tile(
    dk,
    dv,
    amax_pt,
    amax_dst,
    k_op,
    v_op,
    Q,
    Qh,
    Qs,
    DO,
    DOh,
    DOs,
    Lse2,
    Delta,
    q_base,
    do_base,
    l_base,
    stride_qt,
    stride_dot,
    start_m,
    offs_n,
    lq,
    lk,
    off,
    qk_scale,
    k_sc,
    Qsc,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    CAUSAL: tl.constexpr,
    MASKED: tl.constexpr,
    AMAX_PASS: tl.constexpr,
    QK_KIND: tl.constexpr,
    P_POW2: tl.constexpr,
    P_BLOCK: tl.constexpr,
    DP_KIND: tl.constexpr,
    PT_KIND: tl.constexpr,
    PT_BLOCK: tl.constexpr,
    DO_KIND: tl.constexpr,
    DO_BLOCK: tl.constexpr,
    DST_KIND: tl.constexpr,
    DST_BLOCK: tl.constexpr,
    Q_KIND: tl.constexpr,
    Q_BLOCK: tl.constexpr,
    FALLBACK: tl.constexpr,
    RCEIL: tl.constexpr,
    PART: tl.constexpr,
    MMA8: tl.constexpr,
    IS_FP16: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    """One query tile of the dK, dV sweep, in the transposed orientation (keys along rows).
    Q, DO: input values; Qh, DOh: rounded along head_dim (S, dP); Qs, DOs: along queries (dK, dV).
    PART: 0 both gradients, 1 dV only (no dP), 2 dK only."""
    offs_m = start_m + tl.arange(0, BLOCK_M)
    qmask = offs_m < lq
    q_op = _load_op(Q, Qh, q_base, offs_m, qmask, stride_qt, HEAD_DIM, QK_KIND)
    do_op = _load_op(DO, DOh, do_base, offs_m, qmask, stride_dot, HEAD_DIM, DP_KIND)
    lse = tl.load(Lse2 + l_base + offs_m, mask=qmask, other=0.0)
    delta = tl.load(Delta + l_base + offs_m, mask=qmask, other=0.0)
    if MMA8:  # k_op, q_op hold E4M3 codes; k_sc, Qsc their row scales (S recomputed as the forward's)
        q_sc = tl.load(Qsc + l_base + offs_m, mask=qmask, other=1.0)
        sT = (_dot8(k_op, tl.trans(q_op), INTERPRET) * (k_sc[:, None] * q_sc[None, :])) * qk_scale
    else:
        sT = _mma_t(k_op, q_op, tl.zeros((BLOCK_N, BLOCK_M), tl.float32), IS_FP16, INTERPRET) * qk_scale
    if MASKED:
        vis = (offs_n < lk)[:, None] & qmask[None, :]
        if CAUSAL:
            vis = vis & (offs_n[:, None] <= offs_m[None, :] + off)
        sT = tl.where(vis, sT, NEG_INF)
    lse_ok = lse != NEG_INF  # rows that saw a key; a NaN lse (NaN scores) gives NaN weights
    aT = _p_cols(sT, tl.where(lse_ok, lse, 0.0), BLOCK_N, BLOCK_M, P_POW2, P_BLOCK)
    aT = tl.where(lse_ok[None, :], aT, 0.0)
    if MASKED:
        aT = tl.where(vis, aT, 0.0)
    if PART != 1:
        dpT = _mma_t(v_op, do_op, tl.zeros((BLOCK_N, BLOCK_M), tl.float32), IS_FP16, INTERPRET)
        dsT = aT * (dpT - delta[None, :])
    else:
        dsT = aT  # not used: the dV-only part needs no dP
    SPLIT: tl.constexpr = MASKED and FALLBACK and CAUSAL
    if AMAX_PASS:
        if PART != 2:
            amax_pt = max_keep_nan(amax_pt, amax(aT, 1))
        if PART != 1:
            amax_dst = max_keep_nan(amax_dst, amax(dsT, 1))
    else:
        if PART != 2:
            pt_op = quantize_last(aT, amax_pt, BLOCK_N, BLOCK_M, PT_KIND, PT_BLOCK, RCEIL, IS_FP16)
            # dV = P^T dO: dO blocked along queries; a block that key j sees only partly in the input precision
            full = ((offs_m // DO_BLOCK) * DO_BLOCK)[None, :] + off >= offs_n[:, None]
            dv = _seq_rhs(
                pt_op,
                do_op,
                DO,
                DOs,
                do_base,
                offs_m,
                qmask,
                stride_dot,
                full,
                dv,
                HEAD_DIM,
                DO_KIND,
                DP_KIND == KIND_INPUT,
                SPLIT,
                IS_FP16,
                INTERPRET,
            )
        if PART != 1:
            dst_op = quantize_last(dsT, amax_dst, BLOCK_N, BLOCK_M, DST_KIND, DST_BLOCK, RCEIL, IS_FP16)
            # dK = dS^T Q: Q blocked along queries
            full = ((offs_m // Q_BLOCK) * Q_BLOCK)[None, :] + off >= offs_n[:, None]
            dk = _seq_rhs(
                dst_op,
                q_op,
                Q,
                Qs,
                q_base,
                offs_m,
                qmask,
                stride_qt,
                full,
                dk,
                HEAD_DIM,
                Q_KIND,
                QK_KIND == KIND_INPUT,
                SPLIT,
                IS_FP16,
                INTERPRET,
            )
    return dk, dv, amax_pt, amax_dst


@triton.jit
def _attn_bwd_dkdv_sweep(
    dk,
    dv,
    amax_pt,
    amax_dst,
    k_op,
    v_op,
    Q,
    Qh,
    Qs,
    DO,
    DOh,
    DOs,
    Lse2,
    Delta,
    q_base,
    do_base,
    l_base,
    stride_qt,
    stride_dot,
    start_n,
    lq,
    lk,
    off,
    qk_scale,
    k_sc,
    Qsc,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    CAUSAL: tl.constexpr,
    AMAX_PASS: tl.constexpr,
    QK_KIND: tl.constexpr,
    P_POW2: tl.constexpr,
    P_BLOCK: tl.constexpr,
    DP_KIND: tl.constexpr,
    PT_KIND: tl.constexpr,
    PT_BLOCK: tl.constexpr,
    DO_KIND: tl.constexpr,
    DO_BLOCK: tl.constexpr,
    DST_KIND: tl.constexpr,
    DST_BLOCK: tl.constexpr,
    Q_KIND: tl.constexpr,
    Q_BLOCK: tl.constexpr,
    FALLBACK: tl.constexpr,
    RCEIL: tl.constexpr,
    PART: tl.constexpr,
    MMA8: tl.constexpr,
    IS_FP16: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    """All query tiles that see this key tile: masked diagonal tiles, unmasked ones, the masked last one."""
    offs_n = start_n + tl.arange(0, BLOCK_N)
    lq_end = tl.cdiv(lq, BLOCK_M) * BLOCK_M
    if CAUSAL:
        m_lo = tl.maximum(start_n - off, 0) // BLOCK_M * BLOCK_M  # first query that sees key start_n
        m_diag_end = tl.minimum(tl.cdiv(tl.maximum(start_n + BLOCK_N - 1 - off, 0), BLOCK_M) * BLOCK_M, lq_end)
    else:
        m_lo = 0
        m_diag_end = 0
    if start_n + BLOCK_N > lk:  # the document's partial last key tile: mask every query tile
        m_diag_end = lq_end
    m_full_end = tl.maximum(lq // BLOCK_M * BLOCK_M, m_diag_end)
    for start_m in range(m_lo, m_diag_end, BLOCK_M):
        dk, dv, amax_pt, amax_dst = _attn_bwd_dkdv_tile(
            dk,
            dv,
            amax_pt,
            amax_dst,
            k_op,
            v_op,
            Q,
            Qh,
            Qs,
            DO,
            DOh,
            DOs,
            Lse2,
            Delta,
            q_base,
            do_base,
            l_base,
            stride_qt,
            stride_dot,
            start_m,
            offs_n,
            lq,
            lk,
            off,
            qk_scale,
            k_sc,
            Qsc,
            BLOCK_M,
            BLOCK_N,
            HEAD_DIM,
            CAUSAL,
            True,
            AMAX_PASS,
            QK_KIND,
            P_POW2,
            P_BLOCK,
            DP_KIND,
            PT_KIND,
            PT_BLOCK,
            DO_KIND,
            DO_BLOCK,
            DST_KIND,
            DST_BLOCK,
            Q_KIND,
            Q_BLOCK,
            FALLBACK,
            RCEIL,
            PART,
            MMA8,
            IS_FP16,
            INTERPRET,
        )
    for start_m in range(m_diag_end, m_full_end, BLOCK_M):
        dk, dv, amax_pt, amax_dst = _attn_bwd_dkdv_tile(
            dk,
            dv,
            amax_pt,
            amax_dst,
            k_op,
            v_op,
            Q,
            Qh,
            Qs,
            DO,
            DOh,
            DOs,
            Lse2,
            Delta,
            q_base,
            do_base,
            l_base,
            stride_qt,
            stride_dot,
            start_m,
            offs_n,
            lq,
            lk,
            off,
            qk_scale,
            k_sc,
            Qsc,
            BLOCK_M,
            BLOCK_N,
            HEAD_DIM,
            CAUSAL,
            False,
            AMAX_PASS,
            QK_KIND,
            P_POW2,
            P_BLOCK,
            DP_KIND,
            PT_KIND,
            PT_BLOCK,
            DO_KIND,
            DO_BLOCK,
            DST_KIND,
            DST_BLOCK,
            Q_KIND,
            Q_BLOCK,
            FALLBACK,
            RCEIL,
            PART,
            MMA8,
            IS_FP16,
            INTERPRET,
        )
    for start_m in range(m_full_end, lq_end, BLOCK_M):
        dk, dv, amax_pt, amax_dst = _attn_bwd_dkdv_tile(
            dk,
            dv,
            amax_pt,
            amax_dst,
            k_op,
            v_op,
            Q,
            Qh,
            Qs,
            DO,
            DOh,
            DOs,
            Lse2,
            Delta,
            q_base,
            do_base,
            l_base,
            stride_qt,
            stride_dot,
            start_m,
            offs_n,
            lq,
            lk,
            off,
            qk_scale,
            k_sc,
            Qsc,
            BLOCK_M,
            BLOCK_N,
            HEAD_DIM,
            CAUSAL,
            True,
            AMAX_PASS,
            QK_KIND,
            P_POW2,
            P_BLOCK,
            DP_KIND,
            PT_KIND,
            PT_BLOCK,
            DO_KIND,
            DO_BLOCK,
            DST_KIND,
            DST_BLOCK,
            Q_KIND,
            Q_BLOCK,
            FALLBACK,
            RCEIL,
            PART,
            MMA8,
            IS_FP16,
            INTERPRET,
        )
    return dk, dv, amax_pt, amax_dst


@triton.jit(do_not_specialize=["stride_lh", "GROUPS", "total_k"])  # lengths, GQA ratio: one compilation for all
def _attn_bwd_dkdv(
    Q,
    Qh,
    Qs,
    Kh,
    Vh,
    DO,
    DOh,
    DOs,
    Lse2,
    Delta,
    DK,
    DV,
    CuQ,
    CuK,
    Qsc,
    Ksc,
    total_k,
    qk_scale,
    sm_scale,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_dot,
    stride_doh,
    stride_dkt,
    stride_dkh,
    stride_dvt,
    stride_dvh,
    stride_lh,
    GROUPS,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    QK_KIND: tl.constexpr,
    P_POW2: tl.constexpr,
    P_BLOCK: tl.constexpr,
    DP_KIND: tl.constexpr,
    PT_KIND: tl.constexpr,
    PT_BLOCK: tl.constexpr,
    DO_KIND: tl.constexpr,
    DO_BLOCK: tl.constexpr,
    DST_KIND: tl.constexpr,
    DST_BLOCK: tl.constexpr,
    Q_KIND: tl.constexpr,
    Q_BLOCK: tl.constexpr,
    FALLBACK: tl.constexpr,
    RCEIL: tl.constexpr,
    TWO_PASS: tl.constexpr,
    OUT_F32: tl.constexpr,
    PART: tl.constexpr,
    MMA8: tl.constexpr,
    IS_FP16: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    """Grid (key tiles of the longest document, documents, query heads). Each program owns a key
    tile of one query head: dK = scale * sum dS^T Q, dV = sum P^T dO over the query tiles that see it.
    Kh, Vh: K and V rounded along head_dim (S, dP); the query-side operands as in the tile function.
    OUT_F32 (GQA): write fp32 per query head; the caller sums each group. PART: 0 both gradients,
    1 dV only, 2 dK only (``TileConfig.split``: two launches that each hold one accumulator)."""
    tl.static_assert(BLOCK_M % 16 == 0 and BLOCK_N % 16 == 0)
    if P_POW2:
        tl.static_assert(BLOCK_N % P_BLOCK == 0)
    if DO_KIND != KIND_INPUT:  # sequence blocks of dO and Q along the query tiles (the fallback split too)
        tl.static_assert(BLOCK_M % DO_BLOCK == 0, "query tiles must hold whole blocks of dO")
    if Q_KIND != KIND_INPUT:
        tl.static_assert(BLOCK_M % Q_BLOCK == 0, "query tiles must hold whole blocks of Q")
    start_n = tl.program_id(0) * BLOCK_N
    doc = tl.program_id(1)
    h = tl.program_id(2)
    hk = h // GROUPS
    q_start, lq, k_start, lk = _document(CuQ, CuK, doc)
    if start_n >= lk:
        return
    off = lk - lq
    offs_n = start_n + tl.arange(0, BLOCK_N)
    kmask = offs_n < lk
    k_op = _load_rows(Kh, k_start.to(tl.int64) * stride_kt + hk * stride_kh, offs_n, kmask, stride_kt, HEAD_DIM)
    v_op = _load_rows(Vh, k_start.to(tl.int64) * stride_vt + hk * stride_vh, offs_n, kmask, stride_vt, HEAD_DIM)
    if MMA8:  # Kh, Qh hold E4M3 codes, Ksc and Qsc their row scales (heads, tokens)
        k_sc = tl.load(Ksc + hk.to(tl.int64) * total_k + k_start + offs_n, mask=kmask, other=1.0)
    else:
        k_sc = tl.zeros((BLOCK_N,), tl.float32)
    q_base = q_start.to(tl.int64) * stride_qt + h * stride_qh
    do_base = q_start.to(tl.int64) * stride_dot + h * stride_doh
    l_base = h * stride_lh + q_start
    dk = tl.zeros((BLOCK_N, HEAD_DIM), tl.float32)
    dv = tl.zeros((BLOCK_N, HEAD_DIM), tl.float32)
    amax_pt = tl.zeros((BLOCK_N,), tl.float32)
    amax_dst = tl.zeros((BLOCK_N,), tl.float32)
    if TWO_PASS:  # NVFP4 P^T, dS^T: the row scale needs the amax over every query first
        dk, dv, amax_pt, amax_dst = _attn_bwd_dkdv_sweep(
            dk,
            dv,
            amax_pt,
            amax_dst,
            k_op,
            v_op,
            Q,
            Qh,
            Qs,
            DO,
            DOh,
            DOs,
            Lse2,
            Delta,
            q_base,
            do_base,
            l_base,
            stride_qt,
            stride_dot,
            start_n,
            lq,
            lk,
            off,
            qk_scale,
            k_sc,
            Qsc,
            BLOCK_M,
            BLOCK_N,
            HEAD_DIM,
            CAUSAL,
            True,
            QK_KIND,
            P_POW2,
            P_BLOCK,
            DP_KIND,
            PT_KIND,
            PT_BLOCK,
            DO_KIND,
            DO_BLOCK,
            DST_KIND,
            DST_BLOCK,
            Q_KIND,
            Q_BLOCK,
            FALLBACK,
            RCEIL,
            PART,
            MMA8,
            IS_FP16,
            INTERPRET,
        )
    dk, dv, amax_pt, amax_dst = _attn_bwd_dkdv_sweep(
        dk,
        dv,
        amax_pt,
        amax_dst,
        k_op,
        v_op,
        Q,
        Qh,
        Qs,
        DO,
        DOh,
        DOs,
        Lse2,
        Delta,
        q_base,
        do_base,
        l_base,
        stride_qt,
        stride_dot,
        start_n,
        lq,
        lk,
        off,
        qk_scale,
        k_sc,
        Qsc,
        BLOCK_M,
        BLOCK_N,
        HEAD_DIM,
        CAUSAL,
        False,
        QK_KIND,
        P_POW2,
        P_BLOCK,
        DP_KIND,
        PT_KIND,
        PT_BLOCK,
        DO_KIND,
        DO_BLOCK,
        DST_KIND,
        DST_BLOCK,
        Q_KIND,
        Q_BLOCK,
        FALLBACK,
        RCEIL,
        PART,
        MMA8,
        IS_FP16,
        INTERPRET,
    )
    if PT_KIND == KIND_NVFP4:  # NVFP4's fp32 row scale, factored out of every product of the row
        dv = dv * nvfp4_row_scale(amax_pt)[:, None]
    if DST_KIND == KIND_NVFP4:
        dk = dk * nvfp4_row_scale(amax_dst)[:, None]
    dk = dk * sm_scale
    offs_d = tl.arange(0, HEAD_DIM)
    rows = (k_start + offs_n)[:, None].to(tl.int64)
    head = h if OUT_F32 else hk
    dk_ptrs = DK + rows * stride_dkt + head * stride_dkh + offs_d[None, :]
    dv_ptrs = DV + rows * stride_dvt + head * stride_dvh + offs_d[None, :]
    if PART != 1:
        if OUT_F32:
            tl.store(dk_ptrs, dk, mask=kmask[:, None])
        else:
            tl.store(dk_ptrs, _to_input(dk, IS_FP16, INTERPRET), mask=kmask[:, None])
    if PART != 2:
        if OUT_F32:
            tl.store(dv_ptrs, dv, mask=kmask[:, None])
        else:
            tl.store(dv_ptrs, _to_input(dv, IS_FP16, INTERPRET), mask=kmask[:, None])


@triton.jit
def _attn_bwd_dq_tile(
    dq,
    amax_ds,
    q_op,
    do_op,
    lse,
    delta,
    K,
    Kh,
    Ks,
    Vh,
    k_base,
    v_base,
    stride_kt,
    stride_vt,
    start_n,
    offs_m,
    lk,
    off,
    qk_scale,
    q_sc,
    Ksc,
    ks_base,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    CAUSAL: tl.constexpr,
    MASKED: tl.constexpr,
    AMAX_PASS: tl.constexpr,
    QK_KIND: tl.constexpr,
    P_POW2: tl.constexpr,
    P_BLOCK: tl.constexpr,
    DS_KIND: tl.constexpr,
    DS_BLOCK: tl.constexpr,
    K_KIND: tl.constexpr,
    K_BLOCK: tl.constexpr,
    FALLBACK: tl.constexpr,
    RCEIL: tl.constexpr,
    MMA8: tl.constexpr,
    IS_FP16: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    """One key tile of the dQ sweep. K: input keys; Kh, Vh: rounded along head_dim (S, dP); Ks:
    keys rounded along the sequence (dQ = dS K)."""
    offs_n = start_n + tl.arange(0, BLOCK_N)
    kmask = offs_n < lk
    k_op = _load_op(K, Kh, k_base, offs_n, kmask, stride_kt, HEAD_DIM, QK_KIND)
    v_op = _load_rows(Vh, v_base, offs_n, kmask, stride_vt, HEAD_DIM)
    if MMA8:  # q_op, k_op hold E4M3 codes; q_sc, Ksc their row scales (S recomputed as the forward's)
        k_sc = tl.load(Ksc + ks_base + offs_n, mask=kmask, other=1.0)
        s2 = (_dot8(q_op, tl.trans(k_op), INTERPRET) * (q_sc[:, None] * k_sc[None, :])) * qk_scale
    else:
        s2 = _mma_t(q_op, k_op, tl.zeros((BLOCK_M, BLOCK_N), tl.float32), IS_FP16, INTERPRET) * qk_scale
    if MASKED:
        vis = kmask[None, :]
        if CAUSAL:
            vis = vis & (offs_n[None, :] <= offs_m[:, None] + off)
        s2 = tl.where(vis, s2, NEG_INF)
    lse_ok = lse != NEG_INF  # rows that saw a key; a NaN lse (NaN scores) gives NaN weights
    a = _p_rows(s2, tl.where(lse_ok, lse, 0.0), BLOCK_M, BLOCK_N, P_POW2, P_BLOCK)
    a = tl.where(lse_ok[:, None], a, 0.0)
    if MASKED:
        a = tl.where(vis, a, 0.0)
    dp = _mma_t(do_op, v_op, tl.zeros((BLOCK_M, BLOCK_N), tl.float32), IS_FP16, INTERPRET)
    ds = a * (dp - delta[:, None])
    if AMAX_PASS:
        amax_ds = max_keep_nan(amax_ds, amax(ds, 1))
    else:
        ds_op = quantize_last(ds, amax_ds, BLOCK_M, BLOCK_N, DS_KIND, DS_BLOCK, RCEIL, IS_FP16)
        blk_last = tl.minimum((offs_n // K_BLOCK) * K_BLOCK + (K_BLOCK - 1), lk - 1)
        full = blk_last[None, :] <= offs_m[:, None] + off
        dq = _seq_rhs(
            ds_op,
            k_op,
            K,
            Ks,
            k_base,
            offs_n,
            kmask,
            stride_kt,
            full,
            dq,
            HEAD_DIM,
            K_KIND,
            QK_KIND == KIND_INPUT,
            MASKED and FALLBACK and CAUSAL,
            IS_FP16,
            INTERPRET,
        )
    return dq, amax_ds


@triton.jit
def _attn_bwd_dq_sweep(
    dq,
    amax_ds,
    q_op,
    do_op,
    lse,
    delta,
    K,
    Kh,
    Ks,
    Vh,
    k_base,
    v_base,
    stride_kt,
    stride_vt,
    full_end,
    hi,
    offs_m,
    lk,
    off,
    qk_scale,
    q_sc,
    Ksc,
    ks_base,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    CAUSAL: tl.constexpr,
    AMAX_PASS: tl.constexpr,
    QK_KIND: tl.constexpr,
    P_POW2: tl.constexpr,
    P_BLOCK: tl.constexpr,
    DS_KIND: tl.constexpr,
    DS_BLOCK: tl.constexpr,
    K_KIND: tl.constexpr,
    K_BLOCK: tl.constexpr,
    FALLBACK: tl.constexpr,
    RCEIL: tl.constexpr,
    MMA8: tl.constexpr,
    IS_FP16: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    for start_n in range(0, full_end, BLOCK_N):
        dq, amax_ds = _attn_bwd_dq_tile(
            dq,
            amax_ds,
            q_op,
            do_op,
            lse,
            delta,
            K,
            Kh,
            Ks,
            Vh,
            k_base,
            v_base,
            stride_kt,
            stride_vt,
            start_n,
            offs_m,
            lk,
            off,
            qk_scale,
            q_sc,
            Ksc,
            ks_base,
            BLOCK_M,
            BLOCK_N,
            HEAD_DIM,
            CAUSAL,
            False,
            AMAX_PASS,
            QK_KIND,
            P_POW2,
            P_BLOCK,
            DS_KIND,
            DS_BLOCK,
            K_KIND,
            K_BLOCK,
            FALLBACK,
            RCEIL,
            MMA8,
            IS_FP16,
            INTERPRET,
        )
    for start_n in range(full_end, hi, BLOCK_N):
        dq, amax_ds = _attn_bwd_dq_tile(
            dq,
            amax_ds,
            q_op,
            do_op,
            lse,
            delta,
            K,
            Kh,
            Ks,
            Vh,
            k_base,
            v_base,
            stride_kt,
            stride_vt,
            start_n,
            offs_m,
            lk,
            off,
            qk_scale,
            q_sc,
            Ksc,
            ks_base,
            BLOCK_M,
            BLOCK_N,
            HEAD_DIM,
            CAUSAL,
            True,
            AMAX_PASS,
            QK_KIND,
            P_POW2,
            P_BLOCK,
            DS_KIND,
            DS_BLOCK,
            K_KIND,
            K_BLOCK,
            FALLBACK,
            RCEIL,
            MMA8,
            IS_FP16,
            INTERPRET,
        )
    return dq, amax_ds


@triton.jit(do_not_specialize=["stride_lh", "GROUPS", "total_k"])  # lengths, GQA ratio: one compilation for all
def _attn_bwd_dq(
    Qh,
    K,
    Kh,
    Ks,
    Vh,
    DOh,
    Lse2,
    Delta,
    DQ,
    CuQ,
    CuK,
    Qsc,
    Ksc,
    total_k,
    qk_scale,
    sm_scale,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_dot,
    stride_doh,
    stride_dqt,
    stride_dqh,
    stride_lh,
    GROUPS,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    QK_KIND: tl.constexpr,
    P_POW2: tl.constexpr,
    P_BLOCK: tl.constexpr,
    DS_KIND: tl.constexpr,
    DS_BLOCK: tl.constexpr,
    K_KIND: tl.constexpr,
    K_BLOCK: tl.constexpr,
    FALLBACK: tl.constexpr,
    RCEIL: tl.constexpr,
    TWO_PASS: tl.constexpr,
    MMA8: tl.constexpr,
    IS_FP16: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    """Grid (query tiles of the longest document, documents, heads): dQ = scale * sum dS K.
    Qh, DOh: Q and dO rounded along head_dim (S, dP)."""
    tl.static_assert(BLOCK_M % 16 == 0 and BLOCK_N % 16 == 0)
    if P_POW2:
        tl.static_assert(BLOCK_N % P_BLOCK == 0)
    if K_KIND != KIND_INPUT:  # sequence blocks of K along the key tiles (the fallback split too)
        tl.static_assert(BLOCK_N % K_BLOCK == 0, "key tiles must hold whole blocks of K")
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)
    doc = tl.program_id(1)
    h = tl.program_id(2)
    hk = h // GROUPS
    q_start, lq, k_start, lk = _document(CuQ, CuK, doc)
    start_m = pid_m * BLOCK_M
    if start_m >= lq:
        return
    off = lk - lq
    offs_m = start_m + tl.arange(0, BLOCK_M)
    qmask = offs_m < lq
    q_op = _load_rows(Qh, q_start.to(tl.int64) * stride_qt + h * stride_qh, offs_m, qmask, stride_qt, HEAD_DIM)
    do_op = _load_rows(DOh, q_start.to(tl.int64) * stride_dot + h * stride_doh, offs_m, qmask, stride_dot, HEAD_DIM)
    lse = tl.load(Lse2 + h * stride_lh + q_start + offs_m, mask=qmask, other=0.0)
    delta = tl.load(Delta + h * stride_lh + q_start + offs_m, mask=qmask, other=0.0)
    if MMA8:  # Qh, Kh hold E4M3 codes, Qsc and Ksc their row scales (heads, tokens)
        q_sc = tl.load(Qsc + h * stride_lh + q_start + offs_m, mask=qmask, other=1.0)
        ks_base = hk.to(tl.int64) * total_k + k_start
    else:
        q_sc = tl.zeros((BLOCK_M,), tl.float32)
        ks_base = 0
    k_base = k_start.to(tl.int64) * stride_kt + hk * stride_kh
    v_base = k_start.to(tl.int64) * stride_vt + hk * stride_vh
    full_end, hi = _key_tiles(start_m, lq, lk, BLOCK_M, BLOCK_N, CAUSAL)
    dq = tl.zeros((BLOCK_M, HEAD_DIM), tl.float32)
    amax_ds = tl.zeros((BLOCK_M,), tl.float32)
    if TWO_PASS:  # NVFP4 dS: the row scale needs the amax over every key first
        dq, amax_ds = _attn_bwd_dq_sweep(
            dq,
            amax_ds,
            q_op,
            do_op,
            lse,
            delta,
            K,
            Kh,
            Ks,
            Vh,
            k_base,
            v_base,
            stride_kt,
            stride_vt,
            full_end,
            hi,
            offs_m,
            lk,
            off,
            qk_scale,
            q_sc,
            Ksc,
            ks_base,
            BLOCK_M,
            BLOCK_N,
            HEAD_DIM,
            CAUSAL,
            True,
            QK_KIND,
            P_POW2,
            P_BLOCK,
            DS_KIND,
            DS_BLOCK,
            K_KIND,
            K_BLOCK,
            FALLBACK,
            RCEIL,
            MMA8,
            IS_FP16,
            INTERPRET,
        )
    dq, amax_ds = _attn_bwd_dq_sweep(
        dq,
        amax_ds,
        q_op,
        do_op,
        lse,
        delta,
        K,
        Kh,
        Ks,
        Vh,
        k_base,
        v_base,
        stride_kt,
        stride_vt,
        full_end,
        hi,
        offs_m,
        lk,
        off,
        qk_scale,
        q_sc,
        Ksc,
        ks_base,
        BLOCK_M,
        BLOCK_N,
        HEAD_DIM,
        CAUSAL,
        False,
        QK_KIND,
        P_POW2,
        P_BLOCK,
        DS_KIND,
        DS_BLOCK,
        K_KIND,
        K_BLOCK,
        FALLBACK,
        RCEIL,
        MMA8,
        IS_FP16,
        INTERPRET,
    )
    if DS_KIND == KIND_NVFP4:
        dq = dq * nvfp4_row_scale(amax_ds)[:, None]
    dq = dq * sm_scale
    offs_d = tl.arange(0, HEAD_DIM)
    ptrs = DQ + (q_start + offs_m)[:, None].to(tl.int64) * stride_dqt + h * stride_dqh + offs_d[None, :]
    tl.store(ptrs, _to_input(dq, IS_FP16, INTERPRET), mask=qmask[:, None])


# ----------------------------------------------------------------------------------------------
# operand rounding: one pass per input tensor and GEMM role
# ----------------------------------------------------------------------------------------------


@triton.jit
def _code_scale(a):
    """The power of two t of ``_pow2_scale`` for amaxes ``a``: 2^(floor(log2 a) - 8), doubled where
    a / t would exceed 448, 1 for a = 0 (floor(log2 a) read off the exponent bits: exact)."""
    t = exp2i(biased_exponent(a) - 127 - 8)
    t = tl.where(a > 448.0 * t, t * 2.0, t)
    return tl.where(a > 0, t, 1.0)


@triton.jit
def _round_operand(
    X,
    Y,
    Cu,
    C,
    Sc,
    First,
    total,
    heads,
    stride_t,
    stride_h,
    ROWS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    KIND: tl.constexpr,
    BLOCK: tl.constexpr,
    SEQ: tl.constexpr,
    RCEIL: tl.constexpr,
    CODES: tl.constexpr,
    IS_FP16: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    """Grid (row tiles of the longest document, documents, heads): Y = X rounded as a GEMM operand,
    blocked along head_dim (SEQ False; BLOCK 0: one scale per row) or along the sequence (SEQ True;
    tiles start at the document's first row, so blocks restart there), stored in the input dtype
    (exact: E4M3 values times power-of-two scales).

    CODES (the E4M3 tensor cores): instead of Y, the rounded values as E4M3 codes C and power-of-two
    scales Sc (``e4m3_row_codes`` / ``e4m3_block_codes`` are the PyTorch twins): head_dim operands
    keep X's layout with scales (heads, total); sequence operands (one block per tile) are stored
    transposed, (heads, head_dim, total), with scales (blocks, heads, head_dim), the document's
    first block at First[doc]."""
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


def round_operand(x: torch.Tensor, cu: torch.Tensor, max_len: int, spec: tuple, *, seq: bool, rceil: bool):
    """``x`` (total, heads, head_dim) rounded as a GEMM operand of kind ``spec = (kind, block)``:
    along the sequence (``seq``, blocks restarting at each document of ``cu``) or along head_dim.
    Returns ``x`` itself for input-precision operands; otherwise a new tensor with x's strides
    (rows outside every document are left unwritten: no kernel reads them)."""
    kind, block = spec
    if kind == KIND_INPUT:
        return x
    y = torch.empty_like(x)
    batch = cu.numel() - 1
    if x.numel() == 0 or batch == 0 or max_len == 0:
        return y
    _round_operand_launch(x, y, cu, max_len, kind, block, seq, rceil, None)
    return y


def round_operand_codes(x: torch.Tensor, cu: torch.Tensor, max_len: int, spec: tuple, *, seq: bool, rceil: bool):
    """``round_operand`` for the E4M3 tensor cores: the rounded operand as E4M3 codes and
    power-of-two scales, in one pass (the layouts of ``e4m3_row_codes``, or with ``seq`` of
    ``e4m3_block_codes``, whose results these are: tests/test_fp8_mma.py)."""
    kind, block = spec
    total, heads, dim = x.shape
    codes = torch.zeros(((heads, dim, total) if seq else x.shape), dtype=_code_dtype(), device=x.device)
    if seq:
        first, bound = _first_blocks(cu, block, total)
        first = first.to(torch.int32)
        scales = torch.ones((bound, heads, dim), dtype=torch.float32, device=x.device)
    else:
        first = cu
        scales = torch.ones((heads, total), dtype=torch.float32, device=x.device)
    if total and cu.numel() > 1 and max_len:
        _round_operand_launch(x, x, cu, max_len, kind, block, seq, rceil, (codes, scales, first))
    return (codes, scales, first) if seq else (codes, scales)


def _round_operand_launch(x, y, cu, max_len, kind, block, seq, rceil, codes):
    rows = max(64, block) if seq else 64
    grid = (triton.cdiv(max_len, rows), cu.numel() - 1, x.shape[1])
    c, sc, first = codes if codes is not None else (x, x, cu)
    _round_operand[grid](
        x,
        y,
        cu,
        c,
        sc,
        first,
        x.shape[0],
        x.shape[1],
        x.stride(0),
        x.stride(1),
        ROWS=rows,
        HEAD_DIM=x.shape[-1],
        KIND=kind,
        BLOCK=block,
        SEQ=seq,
        RCEIL=rceil,
        CODES=codes is not None,
        IS_FP16=x.dtype == torch.float16,
        INTERPRET=_interpreting(),
        num_warps=4,
    )


def _pow2_scale(amax: torch.Tensor) -> torch.Tensor:
    """A power of two t per amax with amax / t <= 448: 2^(floor(log2 amax) - 8), doubled where that
    leaves amax / t above 448 (1 where amax is 0). For an operand of E4M3 values times a
    power-of-two scale s (RCEIL: amax <= 448 s), t <= s, so x / t = (x / s) 2^j, j >= 0, is again an
    E4M3 value: the codes below are exact."""
    _, ex = torch.frexp(amax)  # amax = m 2^ex, m in [0.5, 1): floor(log2 amax) = ex - 1
    t = torch.ldexp(torch.ones_like(amax), ex - 9)
    t = torch.where(amax > 448.0 * t, t * 2, t)
    return torch.where(amax > 0, t, torch.ones_like(t))


def _code_dtype() -> torch.dtype:
    """E4M3 codes in memory: float8_e4m3fn on the GPU; fp32 values under the interpreter."""
    return torch.float32 if _interpreting() else torch.float8_e4m3fn


def e4m3_row_codes(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A head_dim-rounded operand (total, heads, head_dim) of E4M3 values times a row scale, as
    (codes with x's layout, scales (heads, total) fp32) with codes * scale == x exactly."""
    xf = x.float()
    t = _pow2_scale(xf.abs().amax(-1))
    return (xf / t[..., None]).to(_code_dtype()), t.T.contiguous()


def _first_blocks(cu: torch.Tensor, block: int, total: int) -> tuple[torch.Tensor, int]:
    """Each document's first sequence block (int64, (batch,)), blocks of ``block`` tokens restarting at
    every document of ``cu``, and an upper bound on the number of blocks (no host sync for it)."""
    cu64 = cu.to(torch.int64)
    nblk = (cu64[1:] - cu64[:-1] + block - 1) // block
    return torch.cumsum(nblk, 0) - nblk, total // block + cu.numel()


def e4m3_block_codes(x: torch.Tensor, cu: torch.Tensor, block: int):
    """A sequence-rounded operand (total, heads, head_dim) of E4M3 values times a scale per block of
    ``block`` tokens (restarting at each document of ``cu``) and channel, as (codes transposed to
    (heads, head_dim, total) so that they are the K-major B operand of P V, scales (blocks, heads,
    head_dim) fp32, each document's first block (batch,) int32)."""
    total, heads, dim = x.shape
    cu64 = cu.to(torch.int64)
    first, bound = _first_blocks(cu, block, total)
    tok = torch.arange(total, device=x.device)
    doc = torch.searchsorted(cu64[1:].contiguous(), tok, right=True).clamp_max(max(cu.numel() - 2, 0))
    ids = first[doc] + (tok - cu64[doc]) // block
    xf = x.float()
    amax = torch.zeros((bound, heads, dim), dtype=torch.float32, device=x.device)
    amax.scatter_reduce_(0, ids[:, None, None].expand(total, heads, dim), xf.abs(), "amax")
    t = _pow2_scale(amax)
    codes = (xf / t[ids]).to(_code_dtype())
    return codes.permute(1, 2, 0).contiguous(), t, first.to(torch.int32)


# ----------------------------------------------------------------------------------------------
# launch
# ----------------------------------------------------------------------------------------------


def _check_inputs(cfg: FusedConfig, q):
    if q.dtype not in (torch.bfloat16, torch.float16):
        raise TypeError(f"the fused kernels take bf16 or fp16 inputs, got {q.dtype}; use the emulation for fp32")
    if not head_dim_supported(q.shape[-1]):
        raise ValueError(f"the fused kernels take head_dim 32, 64, 128 or 256, got {q.shape[-1]}")
    if not head_dim_supported(q.shape[-1], cfg):
        raise ValueError(
            f"this design's fused kernels take head_dim up to {head_dim_limit(cfg)} (its 128-query "
            f"tiles would not fit shared memory), got {q.shape[-1]}; the emulation computes it"
        )


#: the pipeline depth that fit, per (kernel, constexprs, tile): a GPU with less shared memory than
#: the H200 (or a large head_dim) gets fewer stages once, not an error at every call
_STAGES_THAT_FIT: dict = {}

#: what each compiled kernel took on the GPU, per the same key: registers per thread, spilled
#: registers, shared memory bytes, pipeline stages (``kernel_resources``; empty under the interpreter)
_RESOURCES: dict = {}


def kernel_resources() -> list[dict]:
    """The registers, spills and shared memory of every fused kernel launched so far in this process
    (one dict per kernel specialization and tile; benchmarks/kernel_resources.py prints them)."""
    rows = []
    for (name, constexprs, tile), res in _RESOURCES.items():
        rows.append({"kernel": name, "constexprs": dict(constexprs), "tile": tile, **res})
    return rows


def _launch(kernel, grid, tile: TileConfig, *args, **constexprs):
    """Launch ``kernel`` with ``tile``'s warps and stages; when the compiled kernel does not fit the
    GPU's shared memory, retry with one pipeline stage fewer (results do not depend on the depth:
    the stages only prefetch the same tiles) down to one."""
    key = (kernel.fn.__name__, tuple(sorted(constexprs.items())), tile)
    stages = _STAGES_THAT_FIT.get(key, tile.num_stages)
    while True:
        try:
            compiled = kernel[grid](*args, **constexprs, num_warps=tile.num_warps, num_stages=stages)
        except OutOfResources as exc:
            if stages <= 1:
                raise RuntimeError(
                    f"the fused {kernel.fn.__name__} kernel does not fit this GPU even with one pipeline stage "
                    f"(tile {tile.block_m} x {tile.block_n}, head_dim {constexprs.get('HEAD_DIM')}): {exc}; "
                    "the emulation (CPU tensors) computes the same design"
                ) from exc
            stages -= 1
            continue
        _STAGES_THAT_FIT[key] = stages
        if key not in _RESOURCES and getattr(compiled, "n_regs", None) is not None:  # diagnostics only:
            _RESOURCES[key] = {
                "stages": stages,
                "n_regs": compiled.n_regs,  # never fail a launch over them
                "n_spills": getattr(compiled, "n_spills", None),
                "shared": getattr(getattr(compiled, "metadata", None), "shared", None),
            }
        return stages


def _seq_block(spec: tuple) -> int:
    """A sequence operand's block as a constexpr (1 for input-precision operands, never used)."""
    return max(spec[1], 1)


def fused_forward(
    cfg: FusedConfig,
    q,
    k,
    v,
    cu_q,
    cu_k,
    max_q: int,
    max_k: int,
    scale: float,
    causal: bool,
    *,
    tile: TileConfig | None = None,
):
    """Forward kernel: (out in q's dtype, lse2 (nheads, total_q) fp32 in log2 units)."""
    _check_inputs(cfg, q)
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    total_q, H, D = q.shape
    Hk = k.shape[1]
    out = torch.empty_like(q)
    lse2 = torch.empty((H, total_q), dtype=torch.float32, device=q.device)
    batch = cu_q.numel() - 1
    if total_q == 0 or batch == 0:
        return out, lse2
    t = tile or tiles(cfg, D, interpret=_interpreting())["fwd"]
    qk_scale = float(torch.tensor(scale * LOG2E, dtype=torch.float32))
    if cfg.mma8:  # E4M3 codes and scales for the tensor cores (kh, vs are not read)
        qh, q_sc = round_operand_codes(q, cu_q, max_q, cfg.qk, seq=False, rceil=cfg.rceil)
        kc, k_sc = round_operand_codes(k, cu_k, max_k, cfg.qk, seq=False, rceil=cfg.rceil)
        vct, v_sc, v_blk = round_operand_codes(v, cu_k, max_k, cfg.v_seq, seq=True, rceil=cfg.rceil)
        kh = vs = k
    else:
        qh = round_operand(q, cu_q, max_q, cfg.qk, seq=False, rceil=cfg.rceil)
        kh = round_operand(k, cu_k, max_k, cfg.qk, seq=False, rceil=cfg.rceil)
        vs = round_operand(v, cu_k, max_k, cfg.v_seq, seq=True, rceil=cfg.rceil)
        q_sc = kc = k_sc = vct = v_sc = v_blk = lse2  # not read
    grid = (triton.cdiv(max(max_q, 1), t.block_m), batch, H)
    _launch(
        _attn_fwd,
        grid,
        t,
        qh,
        kh,
        v,
        vs,
        out,
        lse2,
        cu_q,
        cu_k,
        q_sc,
        kc,
        k_sc,
        vct,
        v_sc,
        v_blk,
        k.shape[0],
        qk_scale,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        out.stride(0),
        out.stride(1),
        lse2.stride(0),
        H // Hk,
        HEAD_DIM=D,
        BLOCK_M=t.block_m,
        BLOCK_N=t.block_n,
        CAUSAL=causal,
        V_KIND=cfg.v_seq[0],
        V_BLOCK=_seq_block(cfg.v_seq),
        P_POW2=cfg.p_pow2,
        P_BLOCK=cfg.p_block,
        FALLBACK=cfg.fallback,
        MMA8=cfg.mma8,
        IS_FP16=q.dtype == torch.float16,
        INTERPRET=_interpreting(),
    )
    return out, lse2


def fused_backward(
    cfg: FusedConfig,
    q,
    k,
    v,
    out,
    lse2,
    dout,
    cu_q,
    cu_k,
    max_q: int,
    max_k: int,
    scale: float,
    causal: bool,
    *,
    tile_dkdv: TileConfig | None = None,
    tile_dq: TileConfig | None = None,
):
    """Backward kernels from the forward's out and lse2 ((nheads, total_q), log2 units): (dq, dk, dv)."""
    _check_inputs(cfg, q)
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    total_q, H, D = q.shape
    total_k, Hk, _ = k.shape
    groups = H // Hk
    dout = dout.to(q.dtype).contiguous()
    out = out.contiguous()
    lse2 = lse2.contiguous()
    dq = torch.empty_like(q)
    batch = cu_q.numel() - 1
    if groups > 1:
        dk = torch.zeros((total_k, H, D), dtype=torch.float32, device=q.device)
        dv = torch.zeros((total_k, H, D), dtype=torch.float32, device=q.device)
    else:
        dk = torch.zeros_like(k)
        dv = torch.zeros_like(v)
    if total_q == 0 or total_k == 0 or batch == 0:
        dq.zero_()
        return dq, _group_sum(dk, k, groups), _group_sum(dv, v, groups)
    delta = torch.empty((H, total_q), dtype=torch.float32, device=q.device)
    _attn_bwd_delta[(triton.cdiv(total_q, 64), H)](
        out,
        dout,
        delta,
        total_q,
        out.stride(0),
        out.stride(1),
        dout.stride(0),
        dout.stride(1),
        delta.stride(0),
        BLOCK_M=64,
        HEAD_DIM=D,
    )
    # every operand rounded once, in its role (head_dim: S and dP; sequence: dV, dK, dQ)
    r = cfg.rceil
    if cfg.mma8:  # S recomputed on the E4M3 tensor cores from the forward's codes and row scales
        qh, q_sc = round_operand_codes(q, cu_q, max_q, cfg.qk, seq=False, rceil=r)
        kh, k_sc = round_operand_codes(k, cu_k, max_k, cfg.qk, seq=False, rceil=r)
    else:
        qh = round_operand(q, cu_q, max_q, cfg.qk, seq=False, rceil=r)
        kh = round_operand(k, cu_k, max_k, cfg.qk, seq=False, rceil=r)
        q_sc = k_sc = lse2  # not read
    vh = round_operand(v, cu_k, max_k, cfg.dp, seq=False, rceil=r)
    doh = round_operand(dout, cu_q, max_q, cfg.dp, seq=False, rceil=r)
    qs = round_operand(q, cu_q, max_q, cfg.q_seq, seq=True, rceil=r)
    dos = round_operand(dout, cu_q, max_q, cfg.do_seq, seq=True, rceil=r)
    ks = round_operand(k, cu_k, max_k, cfg.k_seq, seq=True, rceil=r)
    t = tiles(cfg, D, interpret=_interpreting())
    t1 = tile_dkdv or t["dkdv"]
    t2 = tile_dq or t["dq"]
    qk_scale = float(torch.tensor(scale * LOG2E, dtype=torch.float32))
    common = dict(
        HEAD_DIM=D,
        CAUSAL=causal,
        QK_KIND=cfg.qk[0],
        P_POW2=cfg.p_pow2,
        P_BLOCK=cfg.p_block,
        FALLBACK=cfg.fallback,
        RCEIL=r,
        MMA8=cfg.mma8,
        IS_FP16=q.dtype == torch.float16,
        INTERPRET=_interpreting(),
    )
    for part in (1, 2) if t1.split else (0,):  # split: dV, then dK, each program holding one accumulator
        _launch(
            _attn_bwd_dkdv,
            (triton.cdiv(max(max_k, 1), t1.block_n), batch, H),
            t1,
            q,
            qh,
            qs,
            kh,
            vh,
            dout,
            doh,
            dos,
            lse2,
            delta,
            dk,
            dv,
            cu_q,
            cu_k,
            q_sc,
            k_sc,
            total_k,
            qk_scale,
            scale,
            q.stride(0),
            q.stride(1),
            k.stride(0),
            k.stride(1),
            v.stride(0),
            v.stride(1),
            dout.stride(0),
            dout.stride(1),
            dk.stride(0),
            dk.stride(1),
            dv.stride(0),
            dv.stride(1),
            lse2.stride(0),
            groups,
            BLOCK_M=t1.block_m,
            BLOCK_N=t1.block_n,
            DP_KIND=cfg.dp[0],
            PT_KIND=cfg.pt[0],
            PT_BLOCK=cfg.pt[1],
            DO_KIND=cfg.do_seq[0],
            DO_BLOCK=_seq_block(cfg.do_seq),
            DST_KIND=cfg.dst[0],
            DST_BLOCK=cfg.dst[1],
            Q_KIND=cfg.q_seq[0],
            Q_BLOCK=_seq_block(cfg.q_seq),
            OUT_F32=groups > 1,
            PART=part,
            TWO_PASS=cfg.two_pass_dkdv(part),
            **common,
        )
    _launch(
        _attn_bwd_dq,
        (triton.cdiv(max(max_q, 1), t2.block_m), batch, H),
        t2,
        qh,
        k,
        kh,
        ks,
        vh,
        doh,
        lse2,
        delta,
        dq,
        cu_q,
        cu_k,
        q_sc,
        k_sc,
        total_k,
        qk_scale,
        scale,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        dout.stride(0),
        dout.stride(1),
        dq.stride(0),
        dq.stride(1),
        lse2.stride(0),
        groups,
        BLOCK_M=t2.block_m,
        BLOCK_N=t2.block_n,
        DS_KIND=cfg.ds[0],
        DS_BLOCK=cfg.ds[1],
        K_KIND=cfg.k_seq[0],
        K_BLOCK=_seq_block(cfg.k_seq),
        TWO_PASS=cfg.two_pass_dq(),
        **common,
    )
    return dq, _group_sum(dk, k, groups), _group_sum(dv, v, groups)


def _group_sum(x: torch.Tensor, like: torch.Tensor, groups: int) -> torch.Tensor:
    """GQA: fp32 per-query-head gradients summed over each group (the emulation's order), then cast."""
    if groups == 1:
        return x
    total_k, Hk, D = like.shape
    return x.view(total_k, Hk, groups, D).sum(dim=2).to(like.dtype)


class _FusedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cu_q, cu_k, max_q, max_k, scale, causal, cfg):
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        out, lse2 = fused_forward(cfg, q, k, v, cu_q, cu_k, max_q, max_k, scale, causal)
        ctx.save_for_backward(q, k, v, out, lse2, cu_q, cu_k)
        ctx.args = (max_q, max_k, scale, causal, cfg)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse2, cu_q, cu_k = ctx.saved_tensors
        max_q, max_k, scale, causal, cfg = ctx.args
        dq, dk, dv = fused_backward(cfg, q, k, v, out, lse2, dout, cu_q, cu_k, max_q, max_k, scale, causal)
        return dq, dk, dv, None, None, None, None, None, None, None


def fused_attention(
    design: EmulatedDesign,
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    *,
    softmax_scale: float | None = None,
    causal: bool = False,
    validate: bool = True,
):
    """Run ``design`` with the fused kernels in the varlen calling convention.

    q: (total_q, nheads, headdim); k, v: (total_k, nheads_k, headdim), bf16 or fp16;
    cu_seqlens_*: int32 (batch + 1,). Returns out: (total_q, nheads, headdim); differentiable.
    ``validate=False`` skips the host-side checks of cu_seqlens (they synchronize with the GPU).
    """
    if validate:
        validate_varlen_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    if softmax_scale is None:
        softmax_scale = q.shape[-1] ** -0.5
    cfg = config_for(design)
    return _FusedAttention.apply(
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        int(max_seqlen_q),
        int(max_seqlen_k),
        float(softmax_scale),
        bool(causal),
        cfg,
    )
