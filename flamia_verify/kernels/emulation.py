"""FLAMIA-style attention in PyTorch: the executable specification of every built-in kernel.

Each built-in kernel is an :class:`EmulatedDesign`: for every GEMM operand, how it is rounded
(:class:`Quant`), how the probabilities P are formed and normalized, how sequence-direction blocks
are laid out, and how the backward recomputes P. One autograd.Function runs any design with an
explicit FlashAttention-style backward (recompute S and P from the saved log-sum-exp;
D = rowsum(dO * O); dS = P * (dP - D)). GEMMs accumulate in fp32. Runs on any device.

The three FLAMIA fixes, as design switches (docs/kernels.md gives the reasoning and the cost):

* Causal-safe scaling (``diagonal_fallback``): a sequence-direction block of the right-hand operand
  (V in P V, dO in dV, K in dQ, Q in dK) that straddles the causal diagonal of an output row would
  share one scale between visible and masked positions. For that row the block is multiplied in the
  kernel's input precision (BF16/FP16, exact products, fp32 accumulation) instead of MXFP8, so no
  output depends, even by one bit, on a position it must not see. At most one block per row does this.
* Document-safe scaling (``seq_blocks=SeqBlocks.DOCUMENT``): sequence-direction blocks restart at every
  document start (cu_seqlens), so a packed batch needs no padding and a document's result does not
  depend on its neighbours or on its offset in the pack.
* Forward/backward consistency (``p_mode=PMode.POW2_BLOCKS``, ``normalize=Normalize.QUANTIZED``): P is quantized
  in 32-key blocks relative to the block's own power-of-two maximum, so its E4M3 elements depend only
  on the scores of that block (never on the running row maximum, hence not on tile order), and its
  block scale 2^(M_b - 8 - m) is an exact power of two. The row sum l is taken over the quantized P
  that multiplies V, so numerator and denominator agree and mass lost to underflow is lost from both.
  The backward rebuilds exactly these probabilities from the same quantized Q, K and the saved
  log-sum-exp.

Tests that need a kernel with a bug planted inside the specification build it from the public
building blocks: :func:`forward_pass` / :func:`backward_pass` (one design forward or backward, no
autograd) and :func:`overriding`, which swaps one of the :data:`STEPS` (every GEMM, the causal mask,
the causal-safe split, the sequence rounding, the probabilities) for the duration of a block.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any

import torch
from torch.autograd.function import once_differentiable

from flamia_verify.convention import validate_varlen_inputs
from flamia_verify.formats import (
    E4M3,
    ScaleRule,
    mx_fake_quantize,
    nvfp4_fake_quantize,
    round_to_format,
)
from flamia_verify.kernels.metadata import mark_builtin
from flamia_verify.kernels.modes import Normalize, PMode, QuantKind, SeqBlocks
from flamia_verify.kernels.quant_spec import Quant
from flamia_verify.recipes import Recipe
from flamia_verify.recipes.accumulator import MMA_FRACTION_BITS, MMA_GROUP, MMA_SLICE
from flamia_verify.recipes.operands import Gemm, Operand

__all__ = [
    "Quant",
    "EmulatedDesign",
    "SHARED_ROUNDING",
    "emulated_attention",
    "emulated_forward_with_lse",
    "attention_weights",
    "make_kernel",
    "LOG2E",
    "LN2",
    # the building blocks, for tests that plant a bug inside the specification
    "STEPS",
    "overriding",
    "forward_pass",
    "backward_pass",
    "quantize_operand",
    "seq_quantize",
    "visible",
    "full_block_mask",
    "fallback_mask",
    "gemm",
    "mma_gemm",
    "MMA_SLICE",
    "MMA_GROUP",
    "MMA_FRACTION_BITS",
    "gemm_seq",
    "probabilities",
    "pow2_block_elements",
    "recomputed_probabilities",
]

LOG2E = 1.4426950408889634  # log2(e)
LN2 = 0.6931471805599453  # ln(2)
# P elements are E4M3(2^(s - M_b + 8)): the block maximum maps into [128, 256], below E4M3's 448.
P_POW2_OFFSET = 8


#: operands that every design rounds alike: Q and K in S, dO and V in dP (the fused kernels round
#: each pair by one switch)
SHARED_ROUNDING: tuple[tuple[Operand, Operand], ...] = ((Operand.Q_HD, Operand.K_HD), (Operand.DO_HD, Operand.V_HD))


@dataclass(frozen=True)
class EmulatedDesign:
    """A kernel: the rounding of each GEMM operand and the three FLAMIA switches.

    ``quants`` holds one :class:`Quant` for every :class:`Operand` (read one with :meth:`quant`);
    the operands of :data:`SHARED_ROUNDING` must be rounded alike. For P only the block size is used
    in FLAMIA's ``pow2-blocks`` mode (``fa``: P is rounded by it)."""

    name: str
    recipe: Recipe
    #: the rounding of every GEMM operand, keyed by :class:`Operand` (read-only)
    quants: Mapping[Operand, Quant] = field(hash=False)
    p_mode: PMode  # POW2_BLOCKS (FLAMIA) or FA (P = exp(S - m), then rounded by quant(P))
    normalize: Normalize  # QUANTIZED: l sums the P that multiplied V; FP32: l sums unrounded P
    seq_blocks: SeqBlocks = SeqBlocks.DOCUMENT  # DOCUMENT: blocks restart at cu_seqlens; PACKED: absolute positions
    diagonal_fallback: bool = True
    recompute_from_seq: bool = False  # the backward rebuilds S from the sequence-quantized Q, K (a bug)
    #: the GEMMs that run on Hopper's E4M3 tensor cores (:func:`mma_gemm`; both operands E4M3, the
    #: input-precision half of a causal-safe split excepted); the others accumulate in fp32
    mma: frozenset[Gemm] = frozenset()
    description: str = ""

    def __post_init__(self) -> None:
        # the modes may be given as their strings (``p_mode="fa"``): stored as the enums
        object.__setattr__(self, "p_mode", PMode(self.p_mode))
        object.__setattr__(self, "normalize", Normalize(self.normalize))
        object.__setattr__(self, "seq_blocks", SeqBlocks(self.seq_blocks))
        missing = [op.name for op in Operand if op not in self.quants]
        extra = [repr(key) for key in self.quants if not isinstance(key, Operand)]
        if missing or extra:
            raise ValueError(
                f"{self.name}: a design rounds every Operand once; missing {missing or 'none'}, not operands {extra or 'none'}"
            )
        for a, b in SHARED_ROUNDING:
            if self.quants[a] != self.quants[b]:
                raise ValueError(
                    f"{self.name}: {b.name} must be rounded as {a.name} (one rounding in {a.gemm.equation})"
                )
        object.__setattr__(self, "quants", MappingProxyType({op: self.quants[op] for op in Operand}))

    def quant(self, op: Operand) -> Quant:
        """How the design rounds the GEMM operand ``op``."""
        return self.quants[op]

    def with_quants(self, changes: Mapping[Operand, Quant], /, **switches: Any) -> EmulatedDesign:
        """The same design with the operands in ``changes`` rounded otherwise (and the other fields in
        ``switches`` replaced: ``name``, ``p_mode``, ...)."""
        return replace(self, quants={**self.quants, **changes}, **switches)

    @classmethod
    def of(
        cls,
        name: str,
        recipe: Recipe,
        default: Quant,
        overrides: Mapping[Operand, Quant] | None = None,
        /,
        **switches: Any,
    ) -> EmulatedDesign:
        """A design whose every GEMM operand is rounded by ``default`` but those in ``overrides``
        (keyed by :class:`Operand`); ``switches``: the other fields (``p_mode``, ``normalize``, ...).
        Operands that share a rounding (Q and K in S, dO and V in dP) must be given the same one."""
        quants = {op: (overrides or {}).get(op, default) for op in Operand}
        return cls(name=name, recipe=recipe, quants=quants, **switches)


# ----------------------------------------------------------------------------------------------
# rounding of operands
# ----------------------------------------------------------------------------------------------


def _round_input(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if dtype == torch.float32:
        return x
    return x.to(dtype).to(torch.float32)


def _aligned_cu(start: int, length: int, block: int, device) -> torch.Tensor:
    """Segments of a slice [start, start + length) of a packed axis cut at absolute multiples of block."""
    cuts = [0]
    nxt = (start // block + 1) * block - start
    while nxt < length:
        cuts.append(nxt)
        nxt += block
    cuts.append(length)
    return torch.tensor(cuts, dtype=torch.int32, device=device)


def quantize_operand(
    x: torch.Tensor,
    quant: Quant,
    axis: int,
    *,
    input_dtype: torch.dtype,
    cu_seqlens: torch.Tensor | None = None,
) -> torch.Tensor:
    """Round a float32 GEMM operand as ``quant`` says, blocks along ``axis``; returns float32 values."""
    x = x.to(torch.float32)
    kind = quant.kind
    if kind is QuantKind.INPUT:
        return _round_input(x, input_dtype)
    if kind is QuantKind.E4M3:
        return round_to_format(x, E4M3, saturate=True)
    if kind is QuantKind.TENSOR:
        amax = x.abs().amax() if x.numel() else x.new_zeros(())
        scale = torch.where(amax > 0, amax / E4M3.max_finite, torch.ones_like(amax))
        return round_to_format(x / scale, E4M3, saturate=True) * scale
    if x.shape[axis] == 0:
        return x
    if kind is QuantKind.MX:
        block = quant.block if quant.block > 0 else x.shape[axis]
        return mx_fake_quantize(x, axis=axis, block_size=block, elem=E4M3, rule=quant.rule, cu_seqlens=cu_seqlens)
    if kind is QuantKind.NVFP4:
        row_amax = x.abs().amax(dim=axis, keepdim=True)
        return nvfp4_fake_quantize(x, axis=axis, block_size=quant.block, cu_seqlens=cu_seqlens, global_amax=row_amax)
    raise ValueError(f"unknown operand rounding {kind!r}")


def seq_quantize(x: torch.Tensor, quant: Quant, design: EmulatedDesign, cu: torch.Tensor, dtype) -> torch.Tensor:
    """Quantize a packed (tokens, heads, dim) input along the sequence axis 0."""
    seg = cu if design.seq_blocks is SeqBlocks.DOCUMENT else None
    return quantize_operand(x, quant, 0, input_dtype=dtype, cu_seqlens=seg)


def _a_operand(x: torch.Tensor, quant: Quant, design: EmulatedDesign, start: int, dtype) -> torch.Tensor:
    """Quantize an (heads, rows, contraction) left operand of one document along its last axis."""
    seg = None
    if design.seq_blocks is SeqBlocks.PACKED and quant.kind in (QuantKind.MX, QuantKind.NVFP4) and quant.block > 0:
        seg = _aligned_cu(start, x.shape[-1], quant.block, x.device)
    return quantize_operand(x, quant, -1, input_dtype=dtype, cu_seqlens=seg)


# ----------------------------------------------------------------------------------------------
# masks
# ----------------------------------------------------------------------------------------------


def visible(lq: int, lk: int, causal: bool, device=None) -> torch.Tensor:
    """(lq, lk) bool: key j visible to query i iff not causal or j <= i + (lk - lq)."""
    if not causal:
        return torch.ones(lq, lk, dtype=torch.bool, device=device)
    i = torch.arange(lq, device=device)[:, None]
    j = torch.arange(lk, device=device)[None, :]
    return j <= i + (lk - lq)


def full_block_mask(vis: torch.Tensor, block: int) -> torch.Tensor:
    """(R, C) bool: entry (r, c) lies in a block of ``block`` columns (from column 0) that row r sees whole."""
    rows, cols = vis.shape
    if cols == 0 or block <= 0:
        return vis.all(dim=1, keepdim=True).expand(rows, cols) if block <= 0 else vis
    blk = _block_ids(cols, block, vis.device)  # the block of every column
    nblk = (cols + block - 1) // block
    pad = nblk * block - cols
    # visible entries of every row in every block: a row sum per block, the padding columns unseen
    counts = torch.nn.functional.pad(vis.to(torch.int64), (0, pad)).reshape(rows, nblk, block).sum(dim=-1)
    sizes = torch.bincount(blk, minlength=nblk)
    return (counts == sizes)[:, blk]


def gemm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Every GEMM of the emulation: a (..., R, C) @ b (..., C, D) on float32 operands, accumulated in fp32
    (``torch.matmul``). A step that :func:`overriding` can replace, e.g. with a narrower accumulator."""
    return torch.matmul(a, b)


# Hopper's E4M3 tensor-core MMA as :func:`mma_gemm` models it: slices of MMA_SLICE, groups of
# MMA_GROUP, products cut to MMA_FRACTION_BITS below the group's largest (flamia_verify.recipes.accumulator)


def _mma_slice(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """One slice a (..., R, C) @ b (..., C, D), C <= MMA_SLICE, as the E4M3 MMA sums it (float64)."""
    a, b = a.double(), b.double()
    total = a.new_zeros(a.shape[:-1] + b.shape[-1:])
    for g0 in range(0, a.shape[-1], MMA_GROUP):
        prod = a[..., :, None, g0 : g0 + MMA_GROUP] * b[..., g0 : g0 + MMA_GROUP, :].transpose(-1, -2)[..., None, :, :]
        # the group's largest |product|, max(max p, -min p) (no |prod| tensor); NaN if a product is NaN
        big = torch.maximum(prod.amax(-1), prod.amin(-1).neg())
        e = torch.floor(torch.log2(torch.where(big > 0, big, torch.ones_like(big))))
        grid = torch.exp2(e - MMA_FRACTION_BITS)[..., None]
        # every product cut toward zero to the grid: trunc(prod / grid) * grid, in place in prod
        total += prod.div_(grid).trunc_().mul_(grid).sum(-1)  # exact: 32 terms below 2^14 steps each
    return total


def mma_gemm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """A GEMM of two E4M3 operands on the E4M3 tensor cores (``EmulatedDesign.mma``): slices of
    ``MMA_SLICE`` along the contraction from its first index, each summed as :func:`_mma_slice` says
    and rounded to fp32, the slices added in fp32 in order. The operands are fp32 values (E4M3
    elements times power-of-two scales constant along each slice, so the cut is the same as on the
    elements). Rows are taken a few at a time to bound the memory of the products."""
    out = a.new_zeros(a.shape[:-1] + b.shape[-1:])
    if a.shape[-1] == 0:
        return out
    step = max(1, (1 << 22) // max(1, b.shape[-1] * MMA_SLICE * max(1, a[..., :1, :1].numel())))
    for r0 in range(0, a.shape[-2], step):
        rows = a[..., r0 : r0 + step, :]
        acc = _mma_slice(rows[..., :MMA_SLICE], b[..., :MMA_SLICE, :]).float()
        for s0 in range(MMA_SLICE, a.shape[-1], MMA_SLICE):
            acc = acc + _mma_slice(rows[..., s0 : s0 + MMA_SLICE], b[..., s0 : s0 + MMA_SLICE, :]).float()
        out[..., r0 : r0 + step, :] = acc
    return out


def _gemm_of(design: EmulatedDesign, which: Gemm):
    """The GEMM ``which`` of ``design``: :func:`mma_gemm` when the design runs it on the E4M3 tensor
    cores, else :func:`gemm` (both looked up when called, so :func:`overriding` applies)."""
    return mma_gemm if which in design.mma else gemm


def _gemm_seq_of(design: EmulatedDesign, which: Gemm, a, b_q, b_hp, full):
    """:func:`gemm_seq` for the GEMM ``which`` of ``design``: its quantized half on the E4M3 tensor
    cores (:func:`mma_gemm`) when the design runs ``which`` there."""
    if which in design.mma:
        return gemm_seq(a, b_q, b_hp, full, mma_gemm)
    return gemm_seq(a, b_q, b_hp, full)


def gemm_seq(
    a: torch.Tensor,
    b_q: torch.Tensor,
    b_hp: torch.Tensor,
    full: torch.Tensor | None,
    gemm_q: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """a (H, R, C) @ b (H, C, D) with the causal-safe split: partial blocks use b in input precision.
    ``gemm_q`` multiplies the quantized half (:func:`gemm` unless given, :func:`mma_gemm` for the E4M3
    tensor cores); the input-precision half is always :func:`gemm` (a BF16/FP16 GEMM)."""
    gemm_q = gemm if gemm_q is None else gemm_q
    if full is None:
        return gemm_q(a, b_q)
    a_full = torch.where(full, a, a.new_zeros(()))
    a_part = torch.where(full, a.new_zeros(()), a)
    return gemm_q(a_full, b_q) + gemm(a_part, b_hp)


@functools.lru_cache(maxsize=256)
def _block_ids(n: int, block: int, device: torch.device) -> torch.Tensor:
    """``arange(n) // block``: the block of each of n positions. Cached per (n, block, device) and
    shared by every caller, who only index with it (never write it)."""
    return torch.arange(n, device=device) // block


def _per_key(per_block: torch.Tensor, block: int, n: int) -> torch.Tensor:
    """Per-block values (..., nblk) at each of the n keys of their blocks: the values of
    ``per_block[..., _block_ids(n, block)]``, repeated instead of gathered (faster on the CPU)."""
    return per_block.repeat_interleave(block, dim=-1)[..., :n]


def _pow2(e: torch.Tensor) -> torch.Tensor:
    """2^e for integer-valued float32 e, exactly (0 below fp32's range, used only where e is finite)."""
    return torch.ldexp(torch.ones_like(e), e.clamp(-200, 200).to(torch.int32))


def probabilities(s2: torch.Tensor, vis: torch.Tensor, design: EmulatedDesign, start_k: int, dtype):
    """Forward probabilities of one document.

    s2: (H, Lq, Lk) fp32 scores in log2 units (softmax_scale * log2(e) folded in), masked to -inf.
    Returns (p_used, l, m): p_used the unnormalized probabilities that multiply V (fp32, exact values
    of the operand), l the row sums used to normalize, m the row maxima (log2 units).
    """
    H, Lq, Lk = s2.shape
    if design.p_mode is PMode.POW2_BLOCKS:
        block = design.quant(Operand.P).block
        elem, mb = pow2_block_elements(s2, block)
        m = mb.amax(dim=-1)  # (H, Lq)
        ids = _block_ids(Lk, block, s2.device)
        exp = mb[..., ids] - P_POW2_OFFSET - m[..., None]
        # elem != 0 and nan=nan: a NaN score (a NaN in q or k) makes its row NaN, as in the reference
        p_used = torch.where(
            elem != 0, elem * _pow2(torch.nan_to_num(exp, nan=math.nan, neginf=-1000.0)), elem.new_zeros(())
        )
        l = p_used.sum(dim=-1)
        return p_used, l, m
    m = s2.amax(dim=-1)
    m_safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    p = torch.exp2(s2 - m_safe[..., None])
    p = torch.where(vis, p, p.new_zeros(()))
    l = p.sum(dim=-1)
    p_used = _a_operand(p, design.quant(Operand.P), design, start_k, dtype)
    if design.normalize is Normalize.QUANTIZED:
        l = p_used.sum(dim=-1)
    return p_used, l, m


def pow2_block_elements(s2: torch.Tensor, block: int):
    """E4M3 elements 2^(s - M_b + 8) of P per ``block`` keys, M_b = ceil(block max of s) (log2 units)."""
    H, Lq, Lk = s2.shape
    nblk = (Lk + block - 1) // block
    pad = nblk * block - Lk
    padded = torch.nn.functional.pad(s2, (0, pad), value=-math.inf) if pad else s2
    mb = torch.ceil(padded.reshape(H, Lq, nblk, block).amax(dim=-1))  # (H, Lq, nblk), -inf if fully masked
    mb_k = _per_key(mb, block, Lk)
    # fully masked blocks (M_b = -inf) give 0; a NaN block maximum (NaN scores) gives NaN
    arg = torch.where(mb_k != -math.inf, s2 - mb_k + P_POW2_OFFSET, -math.inf)
    elem = round_to_format(torch.exp2(arg), E4M3, saturate=True)
    return elem, mb


def recomputed_probabilities(s2, vis, lse2, design: EmulatedDesign):
    """Backward probabilities A = P / l rebuilt from the recomputed scores and the saved lse (log2)."""
    finite = lse2 != -math.inf  # rows that saw a key; a NaN lse (NaN scores) stays NaN
    lse_safe = torch.where(finite, lse2, torch.zeros_like(lse2))
    if design.p_mode is PMode.POW2_BLOCKS:
        block = design.quant(Operand.P).block
        elem, mb = pow2_block_elements(s2, block)
        mb_k = _per_key(torch.nan_to_num(mb, nan=math.nan, neginf=-1000.0), block, s2.shape[-1])
        scale = torch.exp2(mb_k - P_POW2_OFFSET - lse_safe[..., None])
        a = elem * scale
    else:
        a = torch.exp2(s2 - lse_safe[..., None])
    a = torch.where(vis & finite[..., None], a, a.new_zeros(()))
    return a


# ----------------------------------------------------------------------------------------------
# forward and backward over a packed batch
# ----------------------------------------------------------------------------------------------


def _expand_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def _to_hld(x: torch.Tensor) -> torch.Tensor:
    return x.permute(1, 0, 2)


def _documents(cu_q: torch.Tensor, cu_k: torch.Tensor):
    """(q0, q1, k0, k1) of every document with at least one query and one key."""
    sq, sk = cu_q.tolist(), cu_k.tolist()
    for b in range(len(sq) - 1):
        q0, q1, k0, k1 = sq[b], sq[b + 1], sk[b], sk[b + 1]
        if q1 > q0 and k1 > k0:
            yield q0, q1, k0, k1


def _log2_scale(scale: float) -> float:
    """softmax_scale * log2(e), rounded once to fp32 (scores are kept in log2 units)."""
    return torch.tensor(scale * LOG2E, dtype=torch.float32).item()


def _scores(q_hd, k_hd, groups: int, vis: torch.Tensor, qk_scale: float, design: EmulatedDesign) -> torch.Tensor:
    """(H, Lq, Lk) fp32 scores of one document in log2 units, masked to -inf where not visible."""
    s = _gemm_of(design, Gemm.S)(_to_hld(q_hd), _to_hld(_expand_kv(k_hd, groups)).transpose(1, 2))
    return torch.where(vis, s * qk_scale, s.new_full((), -math.inf))


def _lse2(l: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """log2 of the row normalizer, m + log2(l); -inf for rows that saw nothing (l == 0)."""
    ok = l != 0  # a NaN row sum (NaN scores) gives a NaN lse
    return torch.where(ok, m + torch.log2(torch.where(ok, l, torch.ones_like(l))), l.new_full((), -math.inf))


def fallback_mask(design: EmulatedDesign, quant: Quant, vis: torch.Tensor, causal: bool):
    """Where the causal-safe split applies: entries whose sequence block the row sees whole."""
    if design.diagonal_fallback and causal and quant.kind in (QuantKind.MX, QuantKind.NVFP4):
        return full_block_mask(vis, quant.block)
    return None


def forward_pass(design, q, k, v, cu_q, cu_k, scale, causal):
    """The forward of ``design`` over a packed batch, without autograd: (out in q's dtype, lse2), lse2 the
    log-sum-exp in log2 units, (total_q, nheads) fp32 (-inf for rows that saw no key). ``scale`` is the
    softmax scale (a float), ``causal`` a bool; inputs as in the calling convention, already validated."""
    dtype = q.dtype
    H, Hk = q.shape[1], k.shape[1]
    groups = H // Hk
    qf, kf, vf = q.float(), k.float(), v.float()
    q_hd = quantize_operand(qf, design.quant(Operand.Q_HD), -1, input_dtype=dtype)
    k_hd = quantize_operand(kf, design.quant(Operand.K_HD), -1, input_dtype=dtype)
    v_seq = seq_quantize(vf, design.quant(Operand.V_SEQ), design, cu_k, dtype)
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    lse2 = torch.full((q.shape[0], H), -math.inf, dtype=torch.float32, device=q.device)
    qk_scale = _log2_scale(scale)
    for q0, q1, k0, k1 in _documents(cu_q, cu_k):
        vis = visible(q1 - q0, k1 - k0, causal, q.device)
        s2 = _scores(q_hd[q0:q1], k_hd[k0:k1], groups, vis, qk_scale, design)
        p_used, l, m = probabilities(s2, vis, design, k0, dtype)
        acc = _gemm_seq_of(
            design,
            Gemm.O,
            p_used,
            _to_hld(_expand_kv(v_seq[k0:k1], groups)),
            _to_hld(_expand_kv(_round_input(vf[k0:k1], dtype), groups)),
            fallback_mask(design, design.quant(Operand.V_SEQ), vis, causal),
        )
        ok = l != 0  # rows that saw no key output 0; a NaN row sum stays NaN
        o = torch.where(ok[..., None], acc / torch.where(ok, l, torch.ones_like(l))[..., None], acc.new_zeros(()))
        out[q0:q1] = o.permute(1, 0, 2)
        lse2[q0:q1] = _lse2(l, m).T
    return out.to(dtype), lse2


def backward_pass(design, q, k, v, out, lse2, dout, cu_q, cu_k, scale, causal):
    """The backward of ``design`` from the forward's ``out`` and ``lse2`` (as :func:`forward_pass` returns
    them) and the output gradient ``dout``: (dq, dk, dv) in q's dtype."""
    dtype = q.dtype
    H, Hk = q.shape[1], k.shape[1]
    groups = H // Hk
    qf, kf, vf, dof = q.float(), k.float(), v.float(), dout.to(dtype).float()
    if design.recompute_from_seq:
        q_s = seq_quantize(qf, design.quant(Operand.Q_SEQ), design, cu_q, dtype)
        k_s = seq_quantize(kf, design.quant(Operand.K_SEQ), design, cu_k, dtype)
        q_hd, k_hd = q_s, k_s
    else:
        q_hd = quantize_operand(qf, design.quant(Operand.Q_HD), -1, input_dtype=dtype)
        k_hd = quantize_operand(kf, design.quant(Operand.K_HD), -1, input_dtype=dtype)
    do_hd = quantize_operand(dof, design.quant(Operand.DO_HD), -1, input_dtype=dtype)
    v_hd = quantize_operand(vf, design.quant(Operand.V_HD), -1, input_dtype=dtype)
    do_seq = seq_quantize(dof, design.quant(Operand.DO_SEQ), design, cu_q, dtype)
    k_seq = seq_quantize(kf, design.quant(Operand.K_SEQ), design, cu_k, dtype)
    q_seq = seq_quantize(qf, design.quant(Operand.Q_SEQ), design, cu_q, dtype)
    # D = rowsum(dO * O) from the output as the caller holds it (input dtype), fp32 sum
    delta = (dof * out.to(dtype).float()).sum(dim=-1)  # (Tq, H)

    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dk = torch.zeros((k.shape[0], H, k.shape[2]), dtype=torch.float32, device=q.device)
    dv = torch.zeros((v.shape[0], H, v.shape[2]), dtype=torch.float32, device=q.device)
    qk_scale = _log2_scale(scale)
    scale32 = torch.tensor(scale, dtype=torch.float32).item()
    for q0, q1, k0, k1 in _documents(cu_q, cu_k):
        vis = visible(q1 - q0, k1 - k0, causal, q.device)
        s2 = _scores(q_hd[q0:q1], k_hd[k0:k1], groups, vis, qk_scale, design)
        a = recomputed_probabilities(s2, vis, lse2[q0:q1].T, design)  # (H, Lq, Lk)
        dp = _gemm_of(design, Gemm.DP)(_to_hld(do_hd[q0:q1]), _to_hld(_expand_kv(v_hd[k0:k1], groups)).transpose(1, 2))
        ds = a * (dp - delta[q0:q1].T[..., None])
        # dV = P^T dO and dK = dS^T Q contract over queries (rows: keys); dQ = dS K over keys
        at = _a_operand(a.transpose(1, 2), design.quant(Operand.PT), design, q0, dtype)
        dv_d = _gemm_seq_of(
            design,
            Gemm.DV,
            at,
            _to_hld(do_seq[q0:q1]),
            _to_hld(dof[q0:q1]),
            fallback_mask(design, design.quant(Operand.DO_SEQ), vis.T, causal),
        )
        dst = _a_operand(ds.transpose(1, 2), design.quant(Operand.DST), design, q0, dtype)
        dk_d = _gemm_seq_of(
            design,
            Gemm.DK,
            dst,
            _to_hld(q_seq[q0:q1]),
            _to_hld(_round_input(qf[q0:q1], dtype)),
            fallback_mask(design, design.quant(Operand.Q_SEQ), vis.T, causal),
        )
        dsq = _a_operand(ds, design.quant(Operand.DS), design, k0, dtype)
        dq_d = _gemm_seq_of(
            design,
            Gemm.DQ,
            dsq,
            _to_hld(_expand_kv(k_seq[k0:k1], groups)),
            _to_hld(_expand_kv(_round_input(kf[k0:k1], dtype), groups)),
            fallback_mask(design, design.quant(Operand.K_SEQ), vis, causal),
        )
        dq[q0:q1] = (dq_d * scale32).permute(1, 0, 2)
        dk[k0:k1] = (dk_d * scale32).permute(1, 0, 2)
        dv[k0:k1] = dv_d.permute(1, 0, 2)
    if groups > 1:
        dk = dk.view(k.shape[0], Hk, groups, k.shape[2]).sum(dim=2)
        dv = dv.view(v.shape[0], Hk, groups, v.shape[2]).sum(dim=2)
    return dq.to(dtype), dk.to(dtype), dv.to(dtype)


#: The steps of the emulation that :func:`overriding` replaces, each a function of this module that the
#: forward and backward look up by name on every call: ``gemm`` (every GEMM), ``mma_gemm`` (the
#: GEMMs a design runs on the E4M3 tensor cores, ``EmulatedDesign.mma``), ``gemm_seq`` (a sequence
#: GEMM with its causal-safe split), ``visible`` (the causal mask of one document), ``fallback_mask`` (where the causal-safe split applies), ``seq_quantize``
#: (rounding of an operand along the sequence), ``probabilities`` (the forward's P, l and m) and
#: ``recomputed_probabilities`` (the weights the backward rebuilds).
STEPS = (
    "gemm",
    "mma_gemm",
    "gemm_seq",
    "visible",
    "fallback_mask",
    "seq_quantize",
    "probabilities",
    "recomputed_probabilities",
)


@contextlib.contextmanager
def overriding(**steps: Callable):
    """Within the block, the emulation runs the given replacements of its :data:`STEPS` (same
    signatures), e.g. ``overriding(gemm=my_matmul)``; afterwards the original functions again.

    This is how a test plants a bug inside the specification (another mask, a narrower accumulator):
    the replacement may call the original, which stays reachable under its name captured before the
    block. It changes this module for every caller, so it is for single-threaded tests only.
    """
    unknown = sorted(set(steps) - set(STEPS))
    if unknown:
        raise TypeError(f"unknown emulation step(s) {', '.join(unknown)}; the steps are {', '.join(STEPS)}")
    namespace = globals()
    saved = {name: namespace[name] for name in steps}
    namespace.update(steps)
    try:
        yield
    finally:
        namespace.update(saved)


class _EmulatedAttention(torch.autograd.Function):
    # autocast off inside: a caller's torch.autocast would run the emulation's fp32 GEMMs in bf16/fp16
    # (interface.arguments holds the bits of a call inside autocast to those of the same call outside)
    @staticmethod
    def forward(ctx, q, k, v, cu_q, cu_k, scale, causal, design):
        with torch.autocast(device_type=q.device.type, enabled=False):
            out, lse2 = forward_pass(design, q, k, v, cu_q, cu_k, scale, causal)
        ctx.save_for_backward(q, k, v, out, lse2, cu_q, cu_k)
        ctx.scale, ctx.causal, ctx.design = scale, causal, design
        return out

    @staticmethod
    @once_differentiable  # a double backward through roundings has no meaning: refused in words
    def backward(ctx, dout):
        q, k, v, out, lse2, cu_q, cu_k = ctx.saved_tensors
        with torch.autocast(device_type=q.device.type, enabled=False):
            dq, dk, dv = backward_pass(ctx.design, q, k, v, out, lse2, dout, cu_q, cu_k, ctx.scale, ctx.causal)
        return dq, dk, dv, None, None, None, None, None


def emulated_attention(
    design: EmulatedDesign,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    softmax_scale: float | None = None,
    causal: bool = False,
) -> torch.Tensor:
    """Run ``design`` in the varlen calling convention.

    q: (total_q, nheads, headdim); k, v: (total_k, nheads_k, headdim); cu_seqlens_*: int32 (batch + 1,).
    Returns out: (total_q, nheads, headdim) in q's dtype; differentiable w.r.t. q, k, v.
    """
    validate_varlen_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    if softmax_scale is None:
        softmax_scale = q.shape[-1] ** -0.5
    return _EmulatedAttention.apply(q, k, v, cu_seqlens_q, cu_seqlens_k, float(softmax_scale), bool(causal), design)


def attention_weights(design: EmulatedDesign, q, k, *, softmax_scale: float, causal: bool, backward: bool = False):
    """The normalized attention weights of one dense document, (nheads, Lq, Lk) float32.

    ``backward=False``: P / l as the forward multiplies V (P the rounded operand, l its normalizer).
    ``backward=True``: the probabilities the backward rebuilds from its recomputed scores and the
    forward's saved log-sum-exp. A consistent design gives the same weights both ways (up to fp32
    rounding of the exponent arithmetic); a mismatched one does not.
    """
    dtype = q.dtype
    groups = q.shape[1] // k.shape[1]
    lq, lk = q.shape[0], k.shape[0]
    cu_q = torch.tensor([0, lq], dtype=torch.int32, device=q.device)
    cu_k = torch.tensor([0, lk], dtype=torch.int32, device=q.device)
    qk_scale = _log2_scale(softmax_scale)
    vis = visible(lq, lk, causal, q.device)
    q_hd = quantize_operand(q.float(), design.quant(Operand.Q_HD), -1, input_dtype=dtype)
    k_hd = quantize_operand(k.float(), design.quant(Operand.K_HD), -1, input_dtype=dtype)
    s2 = _scores(q_hd, k_hd, groups, vis, qk_scale, design)
    p_used, l, m = probabilities(s2, vis, design, 0, dtype)
    if not backward:
        ok = (l != 0)[..., None]
        return torch.where(
            ok, p_used / torch.where(ok, l[..., None], torch.ones_like(l[..., None])), p_used.new_zeros(())
        )
    if design.recompute_from_seq:
        q_s = seq_quantize(q.float(), design.quant(Operand.Q_SEQ), design, cu_q, dtype)
        k_s = seq_quantize(k.float(), design.quant(Operand.K_SEQ), design, cu_k, dtype)
        s2 = _scores(q_s, k_s, groups, vis, qk_scale, design)
    return recomputed_probabilities(s2, vis, _lse2(l, m), design)


def emulated_forward_with_lse(design: EmulatedDesign, q, k, v, cu_seqlens_q, cu_seqlens_k, *, softmax_scale, causal):
    """Forward only: (out in q's dtype, lse in natural-log units, (total_q, nheads) fp32)."""
    out, lse2 = forward_pass(design, q, k, v, cu_seqlens_q, cu_seqlens_k, float(softmax_scale), bool(causal))
    return out, lse2 * LN2


def make_kernel(design: EmulatedDesign):
    """A plain function in the calling convention, carrying its design and recipe as attributes
    (:mod:`flamia_verify.kernels.metadata`)."""

    def kernel(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, softmax_scale=None, causal=False):
        kernel.paths["PyTorch emulation"] += 1  # type: ignore[attr-defined]  # function attributes
        return emulated_attention(
            design,
            q,
            k,
            v,
            cu_seqlens_q,
            cu_seqlens_k,
            max_seqlen_q,
            max_seqlen_k,
            softmax_scale=softmax_scale,
            causal=causal,
        )

    kernel.__name__ = design.name.replace("-", "_")
    kernel.__qualname__ = kernel.__name__
    kernel.__doc__ = f"{design.name} (emulation): {design.description}"
    return mark_builtin(kernel, design)  # design, recipe, calls per implementation (kernels.metadata)


def with_rule(design: EmulatedDesign, rule: ScaleRule, name: str, recipe: Recipe) -> EmulatedDesign:
    """The same design with every MX operand on another scale rule."""
    quants = {op: replace(q, rule=rule) if q.kind is QuantKind.MX else q for op, q in design.quants.items()}
    return design.with_quants(quants, name=name, recipe=recipe)
