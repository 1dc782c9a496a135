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

The kernels live in modules of their own: ``tile_ops`` (the @triton.jit pieces they share),
``forward``, ``backward``, ``prepass`` (the operand rounding) and ``resources`` (the launch that
adapts the pipeline depth to shared memory, and what each compiled kernel took); this module
launches them and holds the autograd Function.

docs/triton.md has the derivations, the tolerances and the measured speed.
"""

from __future__ import annotations

import torch
import triton
from torch.autograd.function import once_differentiable

from flamia_verify.convention import validate_varlen_inputs
from flamia_verify.kernels.emulation import LOG2E, EmulatedDesign
from flamia_verify.kernels.triton.backward import _attn_bwd_delta, _attn_bwd_dkdv, _attn_bwd_dq
from flamia_verify.kernels.triton.compat import interpreting as _interpreting
from flamia_verify.kernels.triton.compat import patch_interpreter
from flamia_verify.kernels.triton.config import (
    PART_BOTH,
    PART_DK,
    PART_DV,
    FusedConfig,
    OperandRounding,
    TileConfig,
    config_for,
    head_dim_limit,
    head_dim_supported,
    tiles,
    unsupported_reason,
)
from flamia_verify.kernels.triton.forward import _attn_fwd
from flamia_verify.kernels.triton.prepass import _code_dtype, _first_blocks, _round_operand
from flamia_verify.kernels.triton.quant import KIND_INPUT
from flamia_verify.kernels.triton.resources import _launch, kernel_resources
from flamia_verify.recipes.operands import Operand

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


# ----------------------------------------------------------------------------------------------
# operand rounding: the pre-pass's launches
# ----------------------------------------------------------------------------------------------


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
    power-of-two scales, in one pass (the layouts of ``e4m3_row_codes_reference``, or with ``seq``
    of ``e4m3_block_codes_reference``, whose results these are: ``kernels.codes_reference``,
    tests/test_fp8_mma.py)."""
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
        x, y, cu,
        c, sc, first,
        x.shape[0], x.shape[1], x.stride(0), x.stride(1),
        ROWS=rows, HEAD_DIM=x.shape[-1],
        KIND=kind, BLOCK=block, SEQ=seq, RCEIL=rceil,
        CODES=codes is not None, IS_FP16=x.dtype == torch.float16, INTERPRET=_interpreting(),
        num_warps=4,
    )  # fmt: skip


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


def _seq_block(spec: OperandRounding) -> int:
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
    # the kernels index cu_seqlens as contiguous int32 arrays: a strided view (a slice of a larger
    # metadata tensor) is read through its own strides only after this copy
    cu_q, cu_k = cu_q.contiguous(), cu_k.contiguous()
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
        qh, q_sc = round_operand_codes(q, cu_q, max_q, cfg[Operand.Q_HD], seq=False, rceil=cfg.rceil)
        kc, k_sc = round_operand_codes(k, cu_k, max_k, cfg[Operand.K_HD], seq=False, rceil=cfg.rceil)
        vct, v_sc, v_blk = round_operand_codes(v, cu_k, max_k, cfg[Operand.V_SEQ], seq=True, rceil=cfg.rceil)
        kh = vs = k
    else:
        qh = round_operand(q, cu_q, max_q, cfg[Operand.Q_HD], seq=False, rceil=cfg.rceil)
        kh = round_operand(k, cu_k, max_k, cfg[Operand.K_HD], seq=False, rceil=cfg.rceil)
        vs = round_operand(v, cu_k, max_k, cfg[Operand.V_SEQ], seq=True, rceil=cfg.rceil)
        q_sc = kc = k_sc = vct = v_sc = v_blk = lse2  # not read
    grid = (triton.cdiv(max(max_q, 1), t.block_m), batch, H)
    _launch(
        _attn_fwd, grid, t,
        qh, kh, v, vs, out, lse2, cu_q, cu_k,
        q_sc, kc, k_sc, vct, v_sc, v_blk, k.shape[0],
        qk_scale,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1),
        lse2.stride(0), H // Hk,
        HEAD_DIM=D, BLOCK_M=t.block_m, BLOCK_N=t.block_n, CAUSAL=causal,
        V_KIND=cfg[Operand.V_SEQ].kind, V_BLOCK=_seq_block(cfg[Operand.V_SEQ]),
        P_POW2=cfg.p_pow2, P_BLOCK=cfg.p_block,
        FALLBACK=cfg.fallback, MMA8=cfg.mma8, IS_FP16=q.dtype == torch.float16, INTERPRET=_interpreting(),
    )  # fmt: skip
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
    # the kernels index cu_seqlens as contiguous int32 arrays: a strided view (a slice of a larger
    # metadata tensor) is read through its own strides only after this copy
    cu_q, cu_k = cu_q.contiguous(), cu_k.contiguous()
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
        out, dout, delta, total_q,
        out.stride(0), out.stride(1), dout.stride(0), dout.stride(1), delta.stride(0),
        BLOCK_M=64, HEAD_DIM=D,
    )  # fmt: skip
    # every operand rounded once, in its role (head_dim: S and dP; sequence: dV, dK, dQ)
    r = cfg.rceil
    if cfg.mma8:  # S recomputed on the E4M3 tensor cores from the forward's codes and row scales
        qh, q_sc = round_operand_codes(q, cu_q, max_q, cfg[Operand.Q_HD], seq=False, rceil=r)
        kh, k_sc = round_operand_codes(k, cu_k, max_k, cfg[Operand.K_HD], seq=False, rceil=r)
    else:
        qh = round_operand(q, cu_q, max_q, cfg[Operand.Q_HD], seq=False, rceil=r)
        kh = round_operand(k, cu_k, max_k, cfg[Operand.K_HD], seq=False, rceil=r)
        q_sc = k_sc = lse2  # not read
    vh = round_operand(v, cu_k, max_k, cfg[Operand.V_HD], seq=False, rceil=r)
    doh = round_operand(dout, cu_q, max_q, cfg[Operand.DO_HD], seq=False, rceil=r)
    qs = round_operand(q, cu_q, max_q, cfg[Operand.Q_SEQ], seq=True, rceil=r)
    dos = round_operand(dout, cu_q, max_q, cfg[Operand.DO_SEQ], seq=True, rceil=r)
    ks = round_operand(k, cu_k, max_k, cfg[Operand.K_SEQ], seq=True, rceil=r)
    t = tiles(cfg, D, interpret=_interpreting())
    t1 = tile_dkdv or t["dkdv"]
    t2 = tile_dq or t["dq"]
    qk_scale = float(torch.tensor(scale * LOG2E, dtype=torch.float32))
    # what the dK/dV and the dQ kernels both take: after their tensors, the documents, the MMA8 row
    # scales, the scales and the input strides; and the constexprs of the design that both read
    shared = (
        cu_q, cu_k, q_sc, k_sc, total_k,
        qk_scale, scale,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), dout.stride(0), dout.stride(1),
    )  # fmt: skip
    common = dict(
        HEAD_DIM=D, CAUSAL=causal, QK_KIND=cfg[Operand.Q_HD].kind, P_POW2=cfg.p_pow2, P_BLOCK=cfg.p_block,
        FALLBACK=cfg.fallback, RCEIL=r, MMA8=cfg.mma8, IS_FP16=q.dtype == torch.float16, INTERPRET=_interpreting(),
    )  # fmt: skip
    # split: dV, then dK, each program holding one accumulator
    for part in (PART_DV, PART_DK) if t1.split else (PART_BOTH,):
        _launch(
            _attn_bwd_dkdv, (triton.cdiv(max(max_k, 1), t1.block_n), batch, H), t1,
            q, qh, qs, kh, vh, dout, doh, dos, lse2, delta, dk, dv,
            *shared,
            dk.stride(0), dk.stride(1), dv.stride(0), dv.stride(1),
            lse2.stride(0), groups,
            BLOCK_M=t1.block_m, BLOCK_N=t1.block_n, DP_KIND=cfg[Operand.DO_HD].kind,
            PT_KIND=cfg[Operand.PT].kind, PT_BLOCK=cfg[Operand.PT].block,
            DO_KIND=cfg[Operand.DO_SEQ].kind, DO_BLOCK=_seq_block(cfg[Operand.DO_SEQ]),
            DST_KIND=cfg[Operand.DST].kind, DST_BLOCK=cfg[Operand.DST].block,
            Q_KIND=cfg[Operand.Q_SEQ].kind, Q_BLOCK=_seq_block(cfg[Operand.Q_SEQ]),
            OUT_F32=groups > 1, PART=part, TWO_PASS=cfg.two_pass_dkdv(part),
            **common,
        )  # fmt: skip
    _launch(
        _attn_bwd_dq, (triton.cdiv(max(max_q, 1), t2.block_m), batch, H), t2,
        qh, k, kh, ks, vh, doh, lse2, delta, dq,
        *shared,
        dq.stride(0), dq.stride(1),
        lse2.stride(0), groups,
        BLOCK_M=t2.block_m, BLOCK_N=t2.block_n,
        DS_KIND=cfg[Operand.DS].kind, DS_BLOCK=cfg[Operand.DS].block,
        K_KIND=cfg[Operand.K_SEQ].kind, K_BLOCK=_seq_block(cfg[Operand.K_SEQ]),
        TWO_PASS=cfg.two_pass_dq(),
        **common,
    )  # fmt: skip
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
        with torch.autocast(device_type=q.device.type, enabled=False):  # the glue's torch ops as written
            out, lse2 = fused_forward(cfg, q, k, v, cu_q, cu_k, max_q, max_k, scale, causal)
        ctx.save_for_backward(q, k, v, out, lse2, cu_q, cu_k)
        ctx.args = (max_q, max_k, scale, causal, cfg)
        return out

    @staticmethod
    @once_differentiable  # Triton's gradients are outside autograd: a double backward is refused in words
    def backward(ctx, dout):
        q, k, v, out, lse2, cu_q, cu_k = ctx.saved_tensors
        max_q, max_k, scale, causal, cfg = ctx.args
        with torch.autocast(device_type=q.device.type, enabled=False):
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
