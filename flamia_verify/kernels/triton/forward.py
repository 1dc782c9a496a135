"""The fused forward kernel: one program per query tile, an online softmax over the key tiles that
it sees (the unmasked ones, then the causal diagonal and the document's last partial tile), with
P rounded in registers (FLAMIA's power-of-two P, or FlashAttention's) and optionally both GEMMs on
the E4M3 tensor cores (``MMA8``). The module doc of :mod:`flamia_verify.kernels.triton.attention`
has the derivation; ``attention.fused_forward`` launches it.
"""

from __future__ import annotations

import triton
import triton.language as tl

from flamia_verify.kernels.triton.quant import KIND_INPUT, exp2i, round_e4m3
from flamia_verify.kernels.triton.tile_ops import (
    NEG_INF,
    P_POW2_OFFSET,
    _document,
    _dot8,
    _key_tiles,
    _load_rows,
    _mma,
    _mma_split,
    _mma_t,
    _to_input,
)


@triton.jit
def _attn_fwd_tile(
    acc, l_i, m_i,  # the running output, row sum and row maximum
    q_op, K, V, Vop, k_base, v_base, stride_kt, stride_vt,  # the query tile; keys, values
    start_n, offs_m, lk, off, qk_scale,  # this key tile, the query rows, the causal offset; scale
    q_sc, Kc, Ksc, ks_base, VcT, vt_base, stride_vtd, Vsc, vs_base,  # MMA8: codes, scales
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr,
    V_KIND: tl.constexpr, V_BLOCK: tl.constexpr, P_POW2: tl.constexpr, P_BLOCK: tl.constexpr,
    FALLBACK: tl.constexpr, MMA8: tl.constexpr, IS_FP16: tl.constexpr, INTERPRET: tl.constexpr,
    MASKED: tl.constexpr,  # the tile crosses the causal diagonal or the document's end: mask it
):  # fmt: skip
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
    Q, K, V, Vop, Out, Lse2, CuQ, CuK,  # operands, outputs, document starts
    Qsc, Kc, Ksc, VcT, Vsc, VBlk, stride_vtd,  # MMA8: codes, scales, first V blocks; tokens
    qk_scale,  # the softmax scale in log2 units
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,  # strides: Q, K, V, O
    stride_lh, GROUPS,  # row stride of Lse2 and Qsc; query heads per key head
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
    V_KIND: tl.constexpr, V_BLOCK: tl.constexpr, P_POW2: tl.constexpr, P_BLOCK: tl.constexpr,
    FALLBACK: tl.constexpr, MMA8: tl.constexpr, IS_FP16: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
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
            acc, l_i, m_i,
            q_op, K, V, Vop, k_base, v_base, stride_kt, stride_vt,
            start_n, offs_m, lk, off, qk_scale,
            q_sc, Kc, Ksc, ks_base, VcT, vt_base, stride_vtd, Vsc, vs_base,
            BLOCK_M, BLOCK_N, HEAD_DIM, CAUSAL, V_KIND, V_BLOCK, P_POW2, P_BLOCK,
            FALLBACK, MMA8, IS_FP16, INTERPRET, MASKED=False,
        )  # fmt: skip
    for start_n in range(full_end, hi, BLOCK_N):
        acc, l_i, m_i = _attn_fwd_tile(
            acc, l_i, m_i,
            q_op, K, V, Vop, k_base, v_base, stride_kt, stride_vt,
            start_n, offs_m, lk, off, qk_scale,
            q_sc, Kc, Ksc, ks_base, VcT, vt_base, stride_vtd, Vsc, vs_base,
            BLOCK_M, BLOCK_N, HEAD_DIM, CAUSAL, V_KIND, V_BLOCK, P_POW2, P_BLOCK,
            FALLBACK, MMA8, IS_FP16, INTERPRET, MASKED=True,
        )  # fmt: skip
    ok = l_i != 0  # rows that saw no key output 0 (lse -inf); a NaN row sum (NaN scores) stays NaN
    l_s = tl.where(ok, l_i, 1.0)
    o = tl.math.div_rn(acc, tl.broadcast_to(l_s[:, None], (BLOCK_M, HEAD_DIM)))
    o = tl.where(ok[:, None], o, 0.0)
    lse2 = tl.where(ok, m_i + tl.log2(l_s), NEG_INF)
    offs_d = tl.arange(0, HEAD_DIM)
    o_ptrs = Out + (q_start + offs_m)[:, None].to(tl.int64) * stride_ot + h * stride_oh + offs_d[None, :]
    tl.store(o_ptrs, _to_input(o, IS_FP16, INTERPRET), mask=qmask[:, None])
    tl.store(Lse2 + h * stride_lh + q_start + offs_m, lse2, mask=qmask)
