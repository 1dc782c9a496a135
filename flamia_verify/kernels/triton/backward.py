"""The fused backward kernels: ``D = rowsum(dO * O)``; dK and dV (one program per key tile, a sweep
over the query tiles that see it, in the transposed orientation); dQ (one program per query tile, a
sweep over its key tiles). P is recomputed from the forward's log-sum-exp; P^T, dS^T and dS are
rounded in registers, in two sweeps where an NVFP4 row scale needs the amax first. The module doc
of :mod:`flamia_verify.kernels.triton.attention` has the derivation; ``attention.fused_backward``
launches them.
"""

from __future__ import annotations

import triton
import triton.language as tl

from flamia_verify.kernels.triton import config
from flamia_verify.kernels.triton.quant import (
    KIND_INPUT,
    KIND_NVFP4,
    amax,
    max_keep_nan,
    nvfp4_row_scale,
    quantize_last,
)
from flamia_verify.kernels.triton.tile_ops import (
    NEG_INF,
    _document,
    _dot8,
    _key_tiles,
    _load_rows,
    _mma,
    _mma_split,
    _mma_t,
    _p_cols,
    _p_rows,
    _to_input,
)

#: the parts of a dK/dV launch (config.PART_*): both gradients, dV only (no dP), dK only
PART_BOTH = tl.constexpr(config.PART_BOTH)
PART_DV = tl.constexpr(config.PART_DV)
PART_DK = tl.constexpr(config.PART_DK)


@triton.jit(do_not_specialize=["total_q", "stride_lh"])  # lengths: no recompilation per packing
def _attn_bwd_delta(
    O, DO, Delta, total_q,
    stride_ot, stride_oh, stride_dot, stride_doh, stride_lh,
    BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr,
):  # fmt: skip
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
    a, raw, Raw, Seq, base, offs, mask, stride, full, acc,
    HEAD_DIM: tl.constexpr, KIND: tl.constexpr, RAW_LOADED: tl.constexpr, SPLIT: tl.constexpr,
    IS_FP16: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
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
    dk, dv, amax_pt, amax_dst,  # the accumulators, the row amaxes of P^T and dS^T
    k_op, v_op,  # this key tile
    Q, Qh, Qs, DO, DOh, DOs, Lse2, Delta,  # the query side
    q_base, do_base, l_base, stride_qt, stride_dot,  # its offsets and strides
    start_m, offs_n, lq, lk, off, qk_scale, k_sc, Qsc,  # positions; scale; MMA8 row scales
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
    CAUSAL: tl.constexpr, AMAX_PASS: tl.constexpr,
    QK_KIND: tl.constexpr, P_POW2: tl.constexpr, P_BLOCK: tl.constexpr, DP_KIND: tl.constexpr,
    PT_KIND: tl.constexpr, PT_BLOCK: tl.constexpr, DO_KIND: tl.constexpr, DO_BLOCK: tl.constexpr,
    DST_KIND: tl.constexpr, DST_BLOCK: tl.constexpr, Q_KIND: tl.constexpr, Q_BLOCK: tl.constexpr,
    FALLBACK: tl.constexpr, RCEIL: tl.constexpr, PART: tl.constexpr, MMA8: tl.constexpr,
    IS_FP16: tl.constexpr, INTERPRET: tl.constexpr,
    MASKED: tl.constexpr,  # the tile crosses the causal diagonal or the document's end: mask it
):  # fmt: skip
    """One query tile of the dK, dV sweep, in the transposed orientation (keys along rows).
    Q, DO: input values; Qh, DOh: rounded along head_dim (S, dP); Qs, DOs: along queries (dK, dV).
    PART: PART_BOTH, PART_DV (no dP) or PART_DK."""
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
    if PART != PART_DV:
        dpT = _mma_t(v_op, do_op, tl.zeros((BLOCK_N, BLOCK_M), tl.float32), IS_FP16, INTERPRET)
        dsT = aT * (dpT - delta[None, :])
    else:
        dsT = aT  # not used: the dV-only part needs no dP
    SPLIT: tl.constexpr = MASKED and FALLBACK and CAUSAL
    if AMAX_PASS:
        if PART != PART_DK:
            amax_pt = max_keep_nan(amax_pt, amax(aT, 1))
        if PART != PART_DV:
            amax_dst = max_keep_nan(amax_dst, amax(dsT, 1))
    else:
        if PART != PART_DK:
            pt_op = quantize_last(aT, amax_pt, BLOCK_N, BLOCK_M, PT_KIND, PT_BLOCK, RCEIL, IS_FP16)
            # dV = P^T dO: dO blocked along queries; a block that key j sees only partly in the input precision
            full = ((offs_m // DO_BLOCK) * DO_BLOCK)[None, :] + off >= offs_n[:, None]
            dv = _seq_rhs(
                pt_op, do_op, DO, DOs, do_base, offs_m, qmask, stride_dot, full, dv,
                HEAD_DIM, DO_KIND, DP_KIND == KIND_INPUT, SPLIT, IS_FP16, INTERPRET,
            )  # fmt: skip
        if PART != PART_DV:
            dst_op = quantize_last(dsT, amax_dst, BLOCK_N, BLOCK_M, DST_KIND, DST_BLOCK, RCEIL, IS_FP16)
            # dK = dS^T Q: Q blocked along queries
            full = ((offs_m // Q_BLOCK) * Q_BLOCK)[None, :] + off >= offs_n[:, None]
            dk = _seq_rhs(
                dst_op, q_op, Q, Qs, q_base, offs_m, qmask, stride_qt, full, dk,
                HEAD_DIM, Q_KIND, QK_KIND == KIND_INPUT, SPLIT, IS_FP16, INTERPRET,
            )  # fmt: skip
    return dk, dv, amax_pt, amax_dst


@triton.jit
def _attn_bwd_dkdv_sweep(
    dk, dv, amax_pt, amax_dst,  # the accumulators, the row amaxes of P^T and dS^T
    k_op, v_op,  # this key tile
    Q, Qh, Qs, DO, DOh, DOs, Lse2, Delta,  # the query side
    q_base, do_base, l_base, stride_qt, stride_dot,  # its offsets and strides
    start_n, lq, lk, off, qk_scale, k_sc, Qsc,  # positions; scale; MMA8 row scales
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
    CAUSAL: tl.constexpr, AMAX_PASS: tl.constexpr,
    QK_KIND: tl.constexpr, P_POW2: tl.constexpr, P_BLOCK: tl.constexpr, DP_KIND: tl.constexpr,
    PT_KIND: tl.constexpr, PT_BLOCK: tl.constexpr, DO_KIND: tl.constexpr, DO_BLOCK: tl.constexpr,
    DST_KIND: tl.constexpr, DST_BLOCK: tl.constexpr, Q_KIND: tl.constexpr, Q_BLOCK: tl.constexpr,
    FALLBACK: tl.constexpr, RCEIL: tl.constexpr, PART: tl.constexpr, MMA8: tl.constexpr,
    IS_FP16: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
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
            dk, dv, amax_pt, amax_dst,
            k_op, v_op,
            Q, Qh, Qs, DO, DOh, DOs, Lse2, Delta,
            q_base, do_base, l_base, stride_qt, stride_dot,
            start_m, offs_n, lq, lk, off, qk_scale, k_sc, Qsc,
            BLOCK_M, BLOCK_N, HEAD_DIM, CAUSAL, AMAX_PASS, QK_KIND, P_POW2, P_BLOCK, DP_KIND,
            PT_KIND, PT_BLOCK, DO_KIND, DO_BLOCK, DST_KIND, DST_BLOCK, Q_KIND, Q_BLOCK, FALLBACK, RCEIL, PART, MMA8,
            IS_FP16, INTERPRET, MASKED=True,
        )  # fmt: skip
    for start_m in range(m_diag_end, m_full_end, BLOCK_M):
        dk, dv, amax_pt, amax_dst = _attn_bwd_dkdv_tile(
            dk, dv, amax_pt, amax_dst,
            k_op, v_op,
            Q, Qh, Qs, DO, DOh, DOs, Lse2, Delta,
            q_base, do_base, l_base, stride_qt, stride_dot,
            start_m, offs_n, lq, lk, off, qk_scale, k_sc, Qsc,
            BLOCK_M, BLOCK_N, HEAD_DIM, CAUSAL, AMAX_PASS, QK_KIND, P_POW2, P_BLOCK, DP_KIND,
            PT_KIND, PT_BLOCK, DO_KIND, DO_BLOCK, DST_KIND, DST_BLOCK, Q_KIND, Q_BLOCK, FALLBACK, RCEIL, PART, MMA8,
            IS_FP16, INTERPRET, MASKED=False,
        )  # fmt: skip
    for start_m in range(m_full_end, lq_end, BLOCK_M):
        dk, dv, amax_pt, amax_dst = _attn_bwd_dkdv_tile(
            dk, dv, amax_pt, amax_dst,
            k_op, v_op,
            Q, Qh, Qs, DO, DOh, DOs, Lse2, Delta,
            q_base, do_base, l_base, stride_qt, stride_dot,
            start_m, offs_n, lq, lk, off, qk_scale, k_sc, Qsc,
            BLOCK_M, BLOCK_N, HEAD_DIM, CAUSAL, AMAX_PASS, QK_KIND, P_POW2, P_BLOCK, DP_KIND,
            PT_KIND, PT_BLOCK, DO_KIND, DO_BLOCK, DST_KIND, DST_BLOCK, Q_KIND, Q_BLOCK, FALLBACK, RCEIL, PART, MMA8,
            IS_FP16, INTERPRET, MASKED=True,
        )  # fmt: skip
    return dk, dv, amax_pt, amax_dst


@triton.jit(do_not_specialize=["stride_lh", "GROUPS", "total_k"])  # lengths, GQA ratio: one compilation for all
def _attn_bwd_dkdv(
    Q, Qh, Qs, Kh, Vh, DO, DOh, DOs, Lse2, Delta, DK, DV,  # operands, outputs
    CuQ, CuK, Qsc, Ksc, total_k,  # document starts; MMA8 row scales; tokens
    qk_scale, sm_scale,  # the softmax scale in log2 units, and as it is
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh,  # strides: Q, K, V, dO
    stride_dkt, stride_dkh, stride_dvt, stride_dvh,  # dK, dV
    stride_lh, GROUPS,  # row stride of Lse2, Delta and Qsc; query heads per key head
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
    QK_KIND: tl.constexpr, P_POW2: tl.constexpr, P_BLOCK: tl.constexpr, DP_KIND: tl.constexpr,
    PT_KIND: tl.constexpr, PT_BLOCK: tl.constexpr, DO_KIND: tl.constexpr, DO_BLOCK: tl.constexpr,
    DST_KIND: tl.constexpr, DST_BLOCK: tl.constexpr, Q_KIND: tl.constexpr, Q_BLOCK: tl.constexpr,
    FALLBACK: tl.constexpr, RCEIL: tl.constexpr, TWO_PASS: tl.constexpr, OUT_F32: tl.constexpr,
    PART: tl.constexpr, MMA8: tl.constexpr, IS_FP16: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
    """Grid (key tiles of the longest document, documents, query heads). Each program owns a key
    tile of one query head: dK = scale * sum dS^T Q, dV = sum P^T dO over the query tiles that see it.
    Kh, Vh: K and V rounded along head_dim (S, dP); the query-side operands as in the tile function.
    OUT_F32 (GQA): write fp32 per query head; the caller sums each group. PART: PART_BOTH (both gradients),
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
            dk, dv, amax_pt, amax_dst,
            k_op, v_op,
            Q, Qh, Qs, DO, DOh, DOs, Lse2, Delta,
            q_base, do_base, l_base, stride_qt, stride_dot,
            start_n, lq, lk, off, qk_scale, k_sc, Qsc,
            BLOCK_M, BLOCK_N, HEAD_DIM, CAUSAL, True, QK_KIND, P_POW2, P_BLOCK, DP_KIND,
            PT_KIND, PT_BLOCK, DO_KIND, DO_BLOCK, DST_KIND, DST_BLOCK, Q_KIND, Q_BLOCK, FALLBACK, RCEIL, PART, MMA8,
            IS_FP16, INTERPRET,
        )  # fmt: skip
    dk, dv, amax_pt, amax_dst = _attn_bwd_dkdv_sweep(
        dk, dv, amax_pt, amax_dst,
        k_op, v_op,
        Q, Qh, Qs, DO, DOh, DOs, Lse2, Delta,
        q_base, do_base, l_base, stride_qt, stride_dot,
        start_n, lq, lk, off, qk_scale, k_sc, Qsc,
        BLOCK_M, BLOCK_N, HEAD_DIM, CAUSAL, False, QK_KIND, P_POW2, P_BLOCK, DP_KIND,
        PT_KIND, PT_BLOCK, DO_KIND, DO_BLOCK, DST_KIND, DST_BLOCK, Q_KIND, Q_BLOCK, FALLBACK, RCEIL, PART, MMA8,
        IS_FP16, INTERPRET,
    )  # fmt: skip
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
    if PART != PART_DV:
        if OUT_F32:
            tl.store(dk_ptrs, dk, mask=kmask[:, None])
        else:
            tl.store(dk_ptrs, _to_input(dk, IS_FP16, INTERPRET), mask=kmask[:, None])
    if PART != PART_DK:
        if OUT_F32:
            tl.store(dv_ptrs, dv, mask=kmask[:, None])
        else:
            tl.store(dv_ptrs, _to_input(dv, IS_FP16, INTERPRET), mask=kmask[:, None])


@triton.jit
def _attn_bwd_dq_tile(
    dq, amax_ds,  # the accumulator, the row amax of dS
    q_op, do_op, lse, delta,  # this query tile
    K, Kh, Ks, Vh, k_base, v_base, stride_kt, stride_vt,  # keys, values
    start_n, offs_m, lk, off, qk_scale, q_sc, Ksc, ks_base,  # positions; scale; MMA8 scales
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
    CAUSAL: tl.constexpr, AMAX_PASS: tl.constexpr,
    QK_KIND: tl.constexpr, P_POW2: tl.constexpr, P_BLOCK: tl.constexpr,
    DS_KIND: tl.constexpr, DS_BLOCK: tl.constexpr, K_KIND: tl.constexpr, K_BLOCK: tl.constexpr,
    FALLBACK: tl.constexpr, RCEIL: tl.constexpr, MMA8: tl.constexpr, IS_FP16: tl.constexpr, INTERPRET: tl.constexpr,
    MASKED: tl.constexpr,  # the tile crosses the causal diagonal or the document's end: mask it
):  # fmt: skip
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
            ds_op, k_op, K, Ks, k_base, offs_n, kmask, stride_kt, full, dq,
            HEAD_DIM, K_KIND, QK_KIND == KIND_INPUT, MASKED and FALLBACK and CAUSAL, IS_FP16, INTERPRET,
        )  # fmt: skip
    return dq, amax_ds


@triton.jit
def _attn_bwd_dq_sweep(
    dq, amax_ds,  # the accumulator, the row amax of dS
    q_op, do_op, lse, delta,  # this query tile
    K, Kh, Ks, Vh, k_base, v_base, stride_kt, stride_vt,  # keys, values
    full_end, hi, offs_m, lk, off, qk_scale, q_sc, Ksc, ks_base,  # positions; scale; MMA8
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
    CAUSAL: tl.constexpr, AMAX_PASS: tl.constexpr,
    QK_KIND: tl.constexpr, P_POW2: tl.constexpr, P_BLOCK: tl.constexpr,
    DS_KIND: tl.constexpr, DS_BLOCK: tl.constexpr, K_KIND: tl.constexpr, K_BLOCK: tl.constexpr,
    FALLBACK: tl.constexpr, RCEIL: tl.constexpr, MMA8: tl.constexpr, IS_FP16: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
    for start_n in range(0, full_end, BLOCK_N):
        dq, amax_ds = _attn_bwd_dq_tile(
            dq, amax_ds,
            q_op, do_op, lse, delta,
            K, Kh, Ks, Vh, k_base, v_base, stride_kt, stride_vt,
            start_n, offs_m, lk, off, qk_scale, q_sc, Ksc, ks_base,
            BLOCK_M, BLOCK_N, HEAD_DIM, CAUSAL, AMAX_PASS, QK_KIND, P_POW2, P_BLOCK,
            DS_KIND, DS_BLOCK, K_KIND, K_BLOCK, FALLBACK, RCEIL, MMA8, IS_FP16, INTERPRET, MASKED=False,
        )  # fmt: skip
    for start_n in range(full_end, hi, BLOCK_N):
        dq, amax_ds = _attn_bwd_dq_tile(
            dq, amax_ds,
            q_op, do_op, lse, delta,
            K, Kh, Ks, Vh, k_base, v_base, stride_kt, stride_vt,
            start_n, offs_m, lk, off, qk_scale, q_sc, Ksc, ks_base,
            BLOCK_M, BLOCK_N, HEAD_DIM, CAUSAL, AMAX_PASS, QK_KIND, P_POW2, P_BLOCK,
            DS_KIND, DS_BLOCK, K_KIND, K_BLOCK, FALLBACK, RCEIL, MMA8, IS_FP16, INTERPRET, MASKED=True,
        )  # fmt: skip
    return dq, amax_ds


@triton.jit(do_not_specialize=["stride_lh", "GROUPS", "total_k"])  # lengths, GQA ratio: one compilation for all
def _attn_bwd_dq(
    Qh, K, Kh, Ks, Vh, DOh, Lse2, Delta, DQ,  # operands, output
    CuQ, CuK, Qsc, Ksc, total_k,  # document starts; MMA8 row scales; tokens
    qk_scale, sm_scale,  # the softmax scale in log2 units, and as it is
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh,  # strides: Q, K, V, dO
    stride_dqt, stride_dqh,  # dQ
    stride_lh, GROUPS,  # row stride of Lse2, Delta and Qsc; query heads per key head
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
    QK_KIND: tl.constexpr, P_POW2: tl.constexpr, P_BLOCK: tl.constexpr,
    DS_KIND: tl.constexpr, DS_BLOCK: tl.constexpr, K_KIND: tl.constexpr, K_BLOCK: tl.constexpr,
    FALLBACK: tl.constexpr, RCEIL: tl.constexpr, TWO_PASS: tl.constexpr,
    MMA8: tl.constexpr, IS_FP16: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
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
            dq, amax_ds,
            q_op, do_op, lse, delta,
            K, Kh, Ks, Vh, k_base, v_base, stride_kt, stride_vt,
            full_end, hi, offs_m, lk, off, qk_scale, q_sc, Ksc, ks_base,
            BLOCK_M, BLOCK_N, HEAD_DIM, CAUSAL, True, QK_KIND, P_POW2, P_BLOCK, DS_KIND, DS_BLOCK, K_KIND, K_BLOCK,
            FALLBACK, RCEIL, MMA8, IS_FP16, INTERPRET,
        )  # fmt: skip
    dq, amax_ds = _attn_bwd_dq_sweep(
        dq, amax_ds,
        q_op, do_op, lse, delta,
        K, Kh, Ks, Vh, k_base, v_base, stride_kt, stride_vt,
        full_end, hi, offs_m, lk, off, qk_scale, q_sc, Ksc, ks_base,
        BLOCK_M, BLOCK_N, HEAD_DIM, CAUSAL, False, QK_KIND, P_POW2, P_BLOCK, DS_KIND, DS_BLOCK, K_KIND, K_BLOCK,
        FALLBACK, RCEIL, MMA8, IS_FP16, INTERPRET,
    )  # fmt: skip
    if DS_KIND == KIND_NVFP4:
        dq = dq * nvfp4_row_scale(amax_ds)[:, None]
    dq = dq * sm_scale
    offs_d = tl.arange(0, HEAD_DIM)
    ptrs = DQ + (q_start + offs_m)[:, None].to(tl.int64) * stride_dqt + h * stride_dqh + offs_d[None, :]
    tl.store(ptrs, _to_input(dq, IS_FP16, INTERPRET), mask=qmask[:, None])
