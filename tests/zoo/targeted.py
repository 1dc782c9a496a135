"""Planted bugs aimed at single checks: one kernel for every check that no kernel of
``zoo/kernels.py`` is asserted to fail (docs/checks.md, "Every check fails on its bug").

Each is a record of the known-bad registry (``flamia_verify.known_bad``, tags ``zoo``, ``targeted``)
built on the correct kernel it names as its base, and the kernel carries ``recipe``, ``catches`` (the
checks that must report ``fail`` on it) and ``quiet`` (checks or families its bug cannot reach, which
must pass, so that the failure is the bug's doing and not a side effect). Four are the package's own
records, held here to the checks they name: ``ignores_softmax_scale`` is the wrapper family's
``wrapper.defaults.scale-ignored``, ``ds_nvfp4`` the source-edit table's ``format.ds_quant-nvfp4``,
``fp8_on_e4m3_tensor_cores`` its ``accumulator.mma-under-fp8``.

    detached_k              k is detached before the GEMMs: dq and dv arrive, dk never does
    dq_without_delta        the separate dQ pass forgets D = rowsum(dO * O): dS = P * dP
    dk_without_delta        the dK/dV pass forgets D in the dS it multiplies with Q
    dv_saturating_do        the dV GEMM scales dO's sequence blocks one exponent too small
    pt_unscaled             dV = P^T dO with P^T cast to E4M3 without a block scale
    non_finite_fallback     any NaN/Inf in q, k, v (or dO) switches the whole call to a BF16 path
    dense_mask              varlen by a block-diagonal mask over the packed batch: O = P V with P = 0
                            across documents, so 0 * NaN from another document reaches the output
    no_row_max              softmax without the row maximum: exp(-1000) underflows, the row loses
                            its mass (and scores above 88 overflow)
    packed_tiles            key tiles aligned to the packed batch: the fp32 summation order, hence
                            the bits, of a document depend on its offset
    packed_tiles_skip_head  the same, with the key loop starting at the first tile boundary after
                            the document start: unaligned documents lose their first keys
    v_unscaled              V cast to E4M3 without a scale (huge values saturate, tiny ones flush)
    static_v_scale          V cast to E4M3 with a fixed scale calibrated on outlier-free data
    range_scale_do          dO's sequence blocks scaled by their range max - min (an int8 habit) and
                            cast without saturation: a constant block becomes NaN (and a scale that
                            is not the recipe's rounds dO's lowest binades otherwise: bound.rounding)
    range_scale_do_flush    the same with a saturating cast: a constant dO block becomes 0, hence dV
    ds_unscaled             dQ = dS K with dS cast to E4M3 without a scale (a small dO flushes dQ to 0)
    ds_nvfp4                claims MXFP8 but rounds dS to NVFP4 for dQ = dS K (a 4x coarser operand;
                            the table's format.ds_quant-nvfp4)
    e8m0_byte0_zero         V's E8M0 scale decoded as (b << 23) read as fp32: byte 0 (2^-127) becomes 0
    top_left_causal         the causal mask aligned top-left (key j visible to query i iff j <= i, as in
                            FlashAttention before 2.1) instead of bottom-right when Lq != Lk
    ignores_softmax_scale   the softmax_scale argument is ignored, headdim^-0.5 used instead (the
                            wrapper family's wrapper.defaults.scale-ignored)
    bf16_accumulation       every GEMM keeps its running sum in bf16: each 32-long slice of the
                            contraction is summed, rounded to bf16 and added to a bf16 accumulator
    v_scale_too_large       V's MX block scale one exponent too large (a bit lost below 2^-13 of the max)
    q_toward_zero           Q rounded toward zero onto its MXFP8 grid (head_dim blocks) before S = QK^T
    fp8_on_e4m3_tensor_cores, fp8_dv_on_e4m3_tensor_cores
                            fp8 with S and O = PV (dV = P^T dO) on the E4M3 tensor cores under the fp8
                            recipe's fp32 sums (the first is the table's accumulator.mma-under-fp8)

Known misses (``KNOWN_MISSES``, kept as strict expected failures in the tests): none at present.

The front quantizers of ``dv_saturating_do``, ``range_scale_do`` and ``v_scale_too_large`` block dO
(V) along the queries (keys) without the FLAMIA kernel's diagonal fallback, so they also leak causally (a second finding, not
the one they are for; their ``quiet`` leaves causal out). The fp32 kernels return out in float32
(the convention allows a wider dtype than q's).
"""

from __future__ import annotations

import math
import operator
from dataclasses import replace

import torch

from flamia_verify.kernels import emulation as E
from flamia_verify.kernels.designs import BF16, FLAMIA_MXFP8
from flamia_verify.kernels.emulation import Quant, backward_pass, forward_pass, make_kernel
from flamia_verify.known_bad import KNOWN_BAD, Forwarding, KnownBad, patched_emulation
from flamia_verify.known_bad.forwarding import scale_of
from flamia_verify.recipes.operands import Gemm, Operand
from zoo.kernels import (
    _STE,
    E4M3_MAX,
    MX_BLOCK,
    _blockwise,
    _e4m3_rne,
    _GradQuant,
    _mx_off_by_one,
    _mx_truncate,
    _v_quant,
)

#: the tags of this file's records
ZOO = ("zoo", "targeted")

_scale_of = scale_of


def _bug(name: str, family: str, why: str, build, catches, quiet, **kw) -> KnownBad:
    """A record of this file; ``build`` is a body (run around the base) or a build(base) made with ``_on``."""
    if not isinstance(build, _On):
        build = Forwarding(build, name)
    return KnownBad(name, family, why, build, catches=catches, quiet=quiet, tags=ZOO, **kw)


class _On:
    """A build that makes the kernel from the base's design (the emulation with a change of its own)."""

    def __init__(self, make):
        self.make = make

    def __call__(self, base):
        return self.make(base.design)


# ---------------------------------------------------------------------------------------------
# interface
# ---------------------------------------------------------------------------------------------


def _detached_k(fn, q, k, v, cq, ck, mq, mk, scale, causal):
    k_op = k.detach()  # pre-quantized operand built outside autograd: the graph no longer reaches k
    return fn(q, k_op, v, cq, ck, mq, mk, softmax_scale=scale, causal=causal)


_records = [
    _bug(
        "detached_k",
        "interface",
        "FLAMIA MXFP8 that detaches k before the GEMMs: dq and dv arrive, dk never does",
        _detached_k,
        ("interface.backward",),
        ("interface.output", "error.dq", "error.dv"),
    )
]

# ---------------------------------------------------------------------------------------------
# one gradient computed differently from the other two (a separate dQ pass, or the dK/dV pass)
# ---------------------------------------------------------------------------------------------


class _OneGradient(torch.autograd.Function):
    """The design's forward and backward, except that gradient ``which`` (0: dQ, 1: dK, 2: dV) comes
    from a backward run on ``change(out, dout, cu_q)`` instead of (out, dout)."""

    @staticmethod
    def forward(ctx, q, k, v, cu_q, cu_k, scale, causal, which, change, design):
        out, lse2 = forward_pass(design, q, k, v, cu_q, cu_k, scale, causal)
        ctx.save_for_backward(q, k, v, out, lse2, cu_q, cu_k)
        ctx.scale, ctx.causal, ctx.which, ctx.change, ctx.design = scale, causal, which, change, design
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse2, cu_q, cu_k = ctx.saved_tensors
        grads = list(backward_pass(ctx.design, q, k, v, out, lse2, dout, cu_q, cu_k, ctx.scale, ctx.causal))
        out2, dout2 = ctx.change(out, dout, cu_q)
        grads[ctx.which] = backward_pass(ctx.design, q, k, v, out2, lse2, dout2, cu_q, cu_k, ctx.scale, ctx.causal)[
            ctx.which
        ]
        return (*grads, None, None, None, None, None, None, None)


def _one_gradient_kernel(which: int, change):
    def make(design):
        def kernel(
            q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, softmax_scale=None, causal=False
        ):
            return _OneGradient.apply(
                q, k, v, cu_seqlens_q, cu_seqlens_k, _scale_of(q, softmax_scale), bool(causal), which, change, design
            )

        return kernel

    return _On(make)


def _without_delta(out, dout, cu_q):
    """D = rowsum(dO * O) = 0: the pass computes dS = P * dP instead of P * (dP - D)."""
    return torch.zeros_like(out), dout


def _do_scale_off_by_one(out, dout, cu_q):
    """dO's MX block scale along the queries (the dV GEMM's operand) one exponent too small."""
    return out, _blockwise(dout, cu_q, 0, _mx_off_by_one)


_records += [
    _bug(
        "dq_without_delta",
        "gradients",
        "FLAMIA MXFP8 whose separate dQ pass forgets the D = rowsum(dO * O) term: dS = P * dP",
        _one_gradient_kernel(0, _without_delta),
        ("error.dq",),
        ("error.out", "error.dk", "error.dv", "consistency.conservation_backward", "causal", "isolation"),
    ),
    _bug(
        "dk_without_delta",
        "gradients",
        "FLAMIA MXFP8 whose dK/dV pass forgets the D term in the dS it multiplies with Q",
        _one_gradient_kernel(1, _without_delta),
        ("error.dk",),
        ("error.out", "error.dq", "error.dv", "consistency.conservation_backward", "causal", "isolation"),
    ),
    _bug(
        "dv_saturating_do",
        "gradients",
        "FLAMIA MXFP8 whose dV GEMM scales dO's blocks one exponent too small (the top half of a block saturates)",
        _one_gradient_kernel(2, _do_scale_off_by_one),
        ("error.dv", "consistency.conservation_backward"),
        ("error.out", "error.dq", "error.dk", "consistency.conservation_forward", "isolation"),
    ),
]

# ---------------------------------------------------------------------------------------------
# one backward GEMM operand cast to E4M3 without a block scale
# ---------------------------------------------------------------------------------------------

_E4M3 = Quant("e4m3")

_records.append(
    _bug(
        "pt_unscaled",
        "rounding",
        "FLAMIA MXFP8 whose dV = P^T dO casts P^T to E4M3 without a block scale (probabilities below 2^-10 "
        "vanish from dV)",
        _On(lambda design: make_kernel(design.with_quants({Operand.PT: _E4M3}, name="pt-unscaled"))),
        ("bound.grad",),
        ("error.out", "error.dq", "error.dk", "error.dv", "bound.out", "causal", "isolation"),
    )
)

#: with dO ~ N(0, 1) the entries of dS are large enough for E4M3 without a scale; the base packing whose
#: dO is scaled by 2^-20 (as small as in training) flushes dS, hence dQ, to 0. The bound of dQ on
#: random q, k lies above |dQ| itself (cancellation in dS K), so dQ = 0 sits inside it; bound.grad's
#: exact-weight one-hot-key case reads dS entry by entry and sees the entries below 2^-10 flushed.
_records.append(
    _bug(
        "ds_unscaled",
        "rounding",
        "FLAMIA MXFP8 whose dQ = dS K casts dS to E4M3 without a block scale (|dS| < 2^-10 flushes to 0)",
        _On(lambda design: make_kernel(design.with_quants({Operand.DS: _E4M3}, name="ds-unscaled"))),
        ("error.dq", "consistency.grad_forward_ratio", "bound.grad"),
        ("error.out", "error.dk", "error.dv", "bound.out", "special.magnitudes", "causal", "isolation"),
    )
)

# ds_nvfp4 (dS in NVFP4 under an MXFP8 claim) is the source-edit table's format.ds_quant-nvfp4: one
# backward operand in a coarser format than the recipe claims: error.dq moves by a factor the model's
# band allows (1.0x), and the dQ bound on random inputs is loose (cancellation in dS K). bound's
# one-hot-key case (exact scores, dQ_i[j] = s dS_ij) reads dS's rounding directly. Its claims are on
# the table's record (flamia_verify/known_bad/table.py).

# ---------------------------------------------------------------------------------------------
# E8M0 byte 0 decoded as zero (FORMATS.md: 2^-127 is an fp32 subnormal; b << 23 gives +0.0)
# ---------------------------------------------------------------------------------------------


def _mx_byte0_as_zero(block: torch.Tensor, axis: int) -> torch.Tensor:
    amax = block.abs().amax(dim=axis, keepdim=True)
    e = torch.where(amax > 0, torch.ceil(torch.log2(amax / E4M3_MAX)), torch.full_like(amax, -127.0)).clamp(-127, 127)
    data = _e4m3_rne((block * torch.exp2(-e)).clamp(-E4M3_MAX, E4M3_MAX))
    decoded = torch.where(e == -127, torch.zeros_like(e), torch.exp2(e))  # ((e + 127) << 23) as fp32
    return data * decoded


#: V blocks with amax below 448 * 2^-127 vanish; special.magnitudes' V x 2^-121 case has them (bf16).
#: The quantizer runs in front of the kernel without the diagonal fallback, so it also leaks causally.
_records.append(
    _bug(
        "e8m0_byte0_zero",
        "rounding",
        "MXFP8 whose V block scale is decoded from its E8M0 byte with an exponent shift: byte 0 (2^-127, an fp32 "
        "subnormal) reads as 0, so blocks with amax below 448 * 2^-127 vanish",
        _v_quant(_mx_byte0_as_zero),
        # bound.rounding's tiny V probe puts block maxima at the bottom of E8M0's range: it reaches the bug too
        ("special.magnitudes", "bound.rounding"),
        ("error", "bound.out", "bound.grad", "bound.accumulation", "bound.shapes", "consistency", "isolation"),
    )
)

# ---------------------------------------------------------------------------------------------
# causal alignment: top-left instead of the convention's bottom-right (differs only when Lq != Lk)
# ---------------------------------------------------------------------------------------------


def _top_left_visible(lq: int, lk: int, causal: bool, device=None) -> torch.Tensor:
    if not causal:
        return torch.ones(lq, lk, dtype=torch.bool, device=device)
    i = torch.arange(lq, device=device)[:, None]
    j = torch.arange(lk, device=device)[None, :]
    return j <= i


def _top_left_masks(info):
    """The emulation with its visibility rule swapped (a pass's context: forward and backward read ``visible``)."""
    return E.overriding(visible=_top_left_visible)


#: the quick suite's base packing (50, 1, 77) against (64, 3, 40) keys has Lq < Lk and Lq > Lk; its
#: causal documents too: with Lq > Lk a query sees keys past its diagonal (causal.forward), with Lq < Lk
#: it misses its last keys (causal.diagonal). The wild zoo's causal_top_left is this record.
_records.append(
    _bug(
        "top_left_causal",
        "causal",
        "FLAMIA MXFP8 with the causal mask aligned top-left (j <= i) instead of bottom-right (j <= i + Lk - Lq)",
        _On(lambda design: patched_emulation(design, forward=_top_left_masks, backward=_top_left_masks)),
        (
            "error.out",
            "error.dq",
            "error.dk",
            "error.dv",
            "bound.out",
            "bound.grad",
            "causal.forward",
            "causal.diagonal",
        ),
        ("isolation", "determinism"),
        where="causal with seqlen_q != seqlen_k",
        source="Causal-mask alignment reports for FMHA kernels and SDPA ports when seqlen_q != seqlen_k "
        "(FlashAttention before 2.1 aligned it top-left).",
    )
)

# ---------------------------------------------------------------------------------------------
# a global non-finite guard: the path taken depends on every row of the packed batch
# ---------------------------------------------------------------------------------------------


def _finite(*xs) -> bool:
    return all(bool(torch.isfinite(x).all()) for x in xs)


class _FiniteFallback(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cu_q, cu_k, scale, causal, finite_design):
        design = finite_design if _finite(q, k, v) else BF16
        out, lse2 = forward_pass(design, q, k, v, cu_q, cu_k, scale, causal)
        ctx.save_for_backward(q, k, v, out, lse2, cu_q, cu_k)
        ctx.scale, ctx.causal, ctx.design = scale, causal, design
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse2, cu_q, cu_k = ctx.saved_tensors
        design = ctx.design if _finite(dout) else BF16
        dq, dk, dv = backward_pass(design, q, k, v, out, lse2, dout, cu_q, cu_k, ctx.scale, ctx.causal)
        return dq, dk, dv, None, None, None, None, None


def _non_finite_fallback(design):
    def kernel(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, softmax_scale=None, causal=False):
        scale = _scale_of(q, softmax_scale)
        return _FiniteFallback.apply(q, k, v, cu_seqlens_q, cu_seqlens_k, scale, bool(causal), design)

    return kernel


_records.append(
    _bug(
        "non_finite_fallback",
        "isolation",
        "FLAMIA MXFP8 that runs the whole call in BF16 when any input (or dO) holds a NaN or Inf",
        _On(_non_finite_fallback),
        ("causal.nan", "isolation.nan"),
        ("causal.forward", "causal.dq", "causal.dk_dv", "isolation.neighbours", "isolation.offset"),
    )
)

# ---------------------------------------------------------------------------------------------
# plain fp32 attention with autograd: a dense block-diagonal mask, no row maximum, packed tiles
# ---------------------------------------------------------------------------------------------


def _positions(cu: torch.Tensor, total: int):
    """(document id, position in document, document length) of every packed token."""
    c = cu.tolist()
    doc = torch.empty(total, dtype=torch.long)
    pos = torch.empty(total, dtype=torch.long)
    length = torch.empty(total, dtype=torch.long)
    for b in range(len(c) - 1):
        doc[c[b] : c[b + 1]] = b
        pos[c[b] : c[b + 1]] = torch.arange(c[b + 1] - c[b])
        length[c[b] : c[b + 1]] = c[b + 1] - c[b]
    return doc, pos, length


def _softmax_pv(q, k, v, allowed, scale, *, row_max: bool, key_tiles=None):
    """(H, Tq, D) fp32 attention of q (Tq, H, D) over k, v (Tk, H, D) where ``allowed`` (Tq, Tk) holds:
    P = exp(S - m) (exp(S) without ``row_max``), O = P V / sum P; ``key_tiles`` lists [a, b) ranges of
    keys whose partial products P V are added one after the other."""
    qf, kf, vf = (x.float().permute(1, 0, 2) for x in (q, k, v))
    s = torch.where(allowed, scale * qf @ kf.transpose(1, 2), torch.full((), -math.inf, device=q.device))
    if row_max:
        m = s.amax(dim=-1, keepdim=True)
        s = s - torch.where(torch.isfinite(m), m, torch.zeros_like(m)).detach()
    p = torch.where(allowed, torch.exp(s), torch.zeros((), device=q.device))
    l = p.sum(dim=-1, keepdim=True)
    if key_tiles is None:
        acc = p @ vf
    else:
        acc = sum(p[..., a:b] @ vf[:, a:b] for a, b in key_tiles)
    return acc / torch.where(l > 0, l, torch.ones_like(l))


def _fp32_attention(
    q, k, v, cu_q, cu_k, scale, causal, *, dense=False, row_max=True, key_tile=0, skip_partial_tile=False
):
    """fp32 attention in the calling convention. ``dense``: one masked product over the whole packed
    batch (P = 0 across documents, but P V still multiplies every packed key's V); otherwise one
    document at a time. ``key_tile`` > 0: P V accumulated over key tiles aligned to absolute
    multiples of ``key_tile`` of the packed batch; ``skip_partial_tile``: the key loop starts at the
    first tile boundary at or after the document start (the keys before it are never seen).
    Returns float32 (the convention allows a wider dtype than q's)."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    dq_, pq, lq = _positions(cu_q, q.shape[0])
    dk_, pk, lk = _positions(cu_k, k.shape[0])
    allowed = dq_[:, None] == dk_[None, :]
    if causal:
        allowed &= pk[None, :] <= pq[:, None] + (lk[None, :] - lq[:, None])
    allowed = allowed.to(q.device)
    if dense:
        return _softmax_pv(q, k, v, allowed, scale, row_max=row_max).permute(1, 0, 2)
    sq, sk = cu_q.tolist(), cu_k.tolist()
    outs = []
    for b in range(len(sq) - 1):
        q0, q1, k0, k1 = sq[b], sq[b + 1], sk[b], sk[b + 1]
        if k1 == k0:  # no key: the convention's zero output (and zero gradient)
            outs.append(q[q0:q1].float().permute(1, 0, 2) * 0)
            continue
        tiles, mask = None, allowed[q0:q1, k0:k1].clone()
        if key_tile and skip_partial_tile and k0 % key_tile:
            mask[:, : (k0 // key_tile + 1) * key_tile - k0] = False
        if key_tile:
            cuts = [k0] + [c for c in range((k0 // key_tile + 1) * key_tile, k1, key_tile)] + [k1]
            tiles = [(a - k0, e - k0) for a, e in zip(cuts[:-1], cuts[1:])]
        outs.append(_softmax_pv(q[q0:q1], k[k0:k1], v[k0:k1], mask, scale, row_max=row_max, key_tiles=tiles))
    return torch.cat(outs, dim=1).permute(1, 0, 2) if outs else q.float() * 0


def _fp32_kernel(**switches):
    def kernel(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, softmax_scale=None, causal=False):
        return _fp32_attention(
            q, k, v, cu_seqlens_q, cu_seqlens_k, _scale_of(q, softmax_scale), bool(causal), **switches
        )

    kernel.recipe = "bf16"  # type: ignore[attr-defined]
    return kernel


#: the correct fp32 attention of this file: the base of the four bugs below, each one switch of it
fp32_attention = _fp32_kernel()
_FP32 = "zoo.targeted:fp32_attention"


class _Switched:
    """A build: this file's fp32 attention (the base) with one of its switches set."""

    def __init__(self, **switches):
        self.switches = switches

    def __call__(self, base):
        return _fp32_kernel(**self.switches)


#: key tile of ``packed_tiles`` (the tile loop of a FlashAttention-style kernel)
KEY_TILE = 16

_FP32_RECORDS = (
    KnownBad(
        "dense_mask",
        "isolation",
        "fp32 attention over the packed batch with a block-diagonal mask: P V multiplies exact zeros with "
        "other documents' values (0 * NaN = NaN)",
        _Switched(dense=True),
        base=_FP32,
        catches=("isolation.nan",),
        quiet=("isolation.neighbours", "causal", "error.out", "bound"),
        tags=ZOO,
    ),
    KnownBad(
        "no_row_max",
        "special",
        "fp32 attention whose softmax does not subtract the row maximum: exp(-1000) = 0, the row loses its "
        "mass (and scores above 88 overflow)",
        _Switched(row_max=False),
        base=_FP32,
        catches=("special.negative_scores",),
        # not causal: in the causal packs whose last document has more keys than the target (max_seqlen_k
        # above the target's Lk), a huge earlier query's overflow reaches the target's later dV as NaN
        quiet=("error.out", "special.constant_rows", "special.short_documents", "special.zero_blocks", "isolation"),
        tags=ZOO,
    ),
    KnownBad(
        "packed_tiles",
        "isolation",
        "fp32 attention whose key tiles are aligned to the packed batch, not to the document: the order of "
        "the fp32 sums, hence the bits of a document's output, depend on its offset",
        _Switched(key_tile=KEY_TILE),
        base=_FP32,
        catches=("isolation.offset_bitwise",),
        quiet=("isolation.neighbours", "isolation.nan", "isolation.offset", "causal", "error", "bound"),
        tags=ZOO,
    ),
    KnownBad(
        "packed_tiles_skip_head",
        "isolation",
        "packed_tiles whose key loop starts at the first tile boundary after the document start: a document "
        "packed at an unaligned offset loses its first keys",
        _Switched(key_tile=KEY_TILE, skip_partial_tile=True),
        base=_FP32,
        catches=("isolation.offset",),
        quiet=("isolation.neighbours",),
        tags=ZOO,
    ),
)
_records += _FP32_RECORDS

# ---------------------------------------------------------------------------------------------
# front quantizers of V and dO (straight-through gradient)
# ---------------------------------------------------------------------------------------------


def _static_e4m3(x: torch.Tensor, scale: float) -> torch.Tensor:
    return (_e4m3_rne(x.float() / scale) * scale).to(x.dtype)


def _v_elementwise(scale: float):
    def body(fn, q, k, v, cq, ck, mq, mk, softmax_scale, causal):
        vq = _STE.apply(v, lambda x: _static_e4m3(x, scale))
        return fn(q, k, vq, cq, ck, mq, mk, softmax_scale=softmax_scale, causal=causal)

    return body


#: the fixed V scale of ``static_v_scale``: 2^-4, so the largest representable |v| is 448 / 16 = 28
#: (a calibration amax of a few standard deviations of N(0, 1) data, no outlier channel in it)
STATIC_V_SCALE = 2.0**-4

_records += [
    _bug(
        "v_unscaled",
        "rounding",
        "MXFP8 whose V is first cast to E4M3 without a scale: |v| > 448 saturates, |v| < 2^-10 flushes to 0",
        _v_elementwise(1.0),
        ("special.magnitudes",),
        ("special.outlier_channels", "error.out", "causal", "isolation"),
    ),
    _bug(
        "static_v_scale",
        "rounding",
        "MXFP8 whose V is cast to E4M3 with a fixed scale calibrated on outlier-free data (|v| > 28 saturates)",
        _v_elementwise(STATIC_V_SCALE),
        # the base cases' loud head (100 times the others' scale) saturates too: error.out and bound.out see it
        ("special.outlier_channels", "error.out", "bound.out"),
        ("causal", "isolation"),
    ),
]


def _mx_range_scale(saturate: bool):
    """E4M3 with the scale 2^ceil(log2((max - min) / 448)) of the block's range (a short block counts
    its zero padding), guarded only against all-zero blocks. A constant block has range 0, scale 0:
    x / 0 = inf, which a saturating cast turns into 448 (times 0: the block flushes to 0) and a cast
    without saturation (torch's E4M3 cast before 2.13) into NaN."""
    from flamia_verify.formats import E4M3, round_to_format

    def quantize(block: torch.Tensor, axis: int) -> torch.Tensor:
        hi, lo = block.amax(dim=axis, keepdim=True), block.amin(dim=axis, keepdim=True)
        if block.shape[axis] < MX_BLOCK:
            hi, lo = hi.clamp_min(0), lo.clamp_max(0)
        amax = block.abs().amax(dim=axis, keepdim=True)
        scale = torch.where(amax > 0, torch.exp2(torch.ceil(torch.log2((hi - lo) / E4M3_MAX))), torch.ones_like(amax))
        return round_to_format(block / scale, E4M3, saturate=saturate) * scale

    return quantize


def _range_scale_do(saturate: bool):
    def body(fn, q, k, v, cq, ck, mq, mk, scale, causal):
        out = fn(q, k, v, cq, ck, mq, mk, softmax_scale=scale, causal=causal)
        return _GradQuant.apply(out, lambda g: _blockwise(g, cq, 0, _mx_range_scale(saturate)))

    return body


_records += [
    _bug(
        "range_scale_do",
        "special",
        "MXFP8 whose dO blocks along the sequence take their scale from the range max - min and are cast "
        "without saturation: a constant block of dO becomes NaN",
        _range_scale_do(saturate=False),
        ("special.constant_rows", "bound.rounding", "bound.accumulation"),
        ("error", "bound", "special.zero_blocks", "special.short_documents", "consistency.weights"),
    ),
    #: the same bug with a saturating cast zeroes the constant dO blocks, hence dV: special.constant_rows
    #: sees it on its case with q and k on the MX-exact grid, where the bound on dV is tight
    _bug(
        "range_scale_do_flush",
        "special",
        "range_scale_do with a saturating cast: a constant block of dO becomes 0",
        _range_scale_do(saturate=True),
        ("special.constant_rows", "bound.rounding", "bound.accumulation"),
        ("error", "bound", "special.zero_blocks", "special.magnitudes", "special.short_documents"),
    ),
]

# ignores_softmax_scale (the softmax_scale passed is ignored, headdim^-0.5 used) is the wrapper family's
# wrapper.defaults.scale-ignored: a base packing passes softmax_scale 0.0883 and two special.magnitudes
# cases 0.5 and 2 times the default. Its claims are on that record (flamia_verify/known_bad/wrapper.py).

# ---------------------------------------------------------------------------------------------
# GEMM accumulators narrower than fp32
# ---------------------------------------------------------------------------------------------

_MATMUL = torch.matmul
ACC_SLICE = 32  # the contraction slice one tensor-core instruction sums (K = 32 for E4M3 on Hopper)


def _sliced_matmul(slice_sum, add):
    """An emulation ``gemm`` whose contraction runs in 32-long slices, as a tensor core's instructions do:
    ``slice_sum(a_s, b_s)`` gives each slice's result and ``add(acc, part)`` accumulates them (fp32
    operands only; anything else goes to torch.matmul)."""

    def matmul(a, b):
        if a.dtype != torch.float32 or b.dtype != torch.float32:
            return _MATMUL(a, b)
        acc = None
        for s in range(0, a.shape[-1], ACC_SLICE):
            part = slice_sum(a[..., s : s + ACC_SLICE], b[..., s : s + ACC_SLICE, :])
            acc = part if acc is None else add(acc, part)
        return acc

    return matmul


def _within_matmul(matmul):
    """A build: the base's design with every GEMM of the emulation (``emulation.gemm``: the sequence GEMMs,
    S and its recompute, dP) replaced by ``matmul``."""

    def within(info):
        return E.overriding(gemm=matmul)

    return _On(lambda design: patched_emulation(design, forward=within, backward=within))


def _to_bf16(x):
    return x.bfloat16().float()


#: a bf16 running sum: each slice's fp32 matmul rounded to bf16 and added to the bf16 accumulator
_bf16_accumulating_matmul = _sliced_matmul(lambda a, b: _to_bf16(_MATMUL(a, b)), lambda acc, part: _to_bf16(acc + part))


def _e4m3_mma_slice(a, b):
    """One slice as a model of Hopper's E4M3 tensor-core MMA, which keeps about 13 bits of each sum
    (experiments/probe_fp8_dot.py: up to 2^-9.5 of the sum of |products| against the float64 sum): the
    exact sum (float64) truncated toward zero onto a grid of 2^-12 times the largest power of two not
    above the slice's sum of |products|. With the slices added in fp32, on E4M3 operands of one binade
    this differs from the fp32 sum in 99.6 % of the results, by up to 2^-12.4 of the magnitude sum (the
    probe measured 97 %, 2^-11.6)."""
    a, b = a.double(), b.double()
    mag = _MATMUL(a.abs(), b.abs())
    grid = torch.exp2(torch.floor(torch.log2(torch.where(mag > 0, mag, torch.ones_like(mag)))) - 12)
    return (torch.trunc(_MATMUL(a, b) / grid) * grid).float()


_e4m3_mma_matmul = _sliced_matmul(_e4m3_mma_slice, operator.add)


#: not a planted bug (a fixture, no record): the accuracy checks accept it (with MXFP8 operands, E4M3's
#: rounding of P dwarfs the scores' accumulation error), which test_properties_every_check.py pins down;
#: only the fused kernels' bitwise tests against the emulation would tell it apart
e4m3_mma_accumulation = _within_matmul(_e4m3_mma_matmul)(make_kernel(FLAMIA_MXFP8))
e4m3_mma_accumulation.recipe = "mxfp8"


#: the operands are the design's (MXFP8); only the sums lose bits. Every error check passes (the
#: scores' error stays far below E4M3's rounding of P on random inputs); the bound, which holds the
#: sums to fp32 accumulation, does not (quick suite, seeds 0 and 1: tightness 1.6 / 2.3 and 2.3 / 1.5
#: for out / grad, the correct kernel 0.38 / 0.56). A model of Hopper's E4M3 MMA (about 13 bits,
#: benchmarks/RESULTS.md, "FP8 tensor cores": each slice's exact sum truncated onto 2^-12 times the largest
#: power of two below the slice's sum of |products|; ``e4m3_mma_accumulation`` above) stays within
#: the bound: 0.43 / 0.56 on seed 0.
_records.append(
    _bug(
        "bf16_accumulation",
        "accumulator",
        "FLAMIA MXFP8 whose GEMMs keep their running sums in bf16 (each 32-long slice of the contraction "
        "rounded to bf16 and added to a bf16 accumulator)",
        _within_matmul(_bf16_accumulating_matmul),
        ("bound.out", "bound.grad"),
        # not the two identities that read O - c with V constant: a bf16 running sum of P V rounds O off
        # c by its own rounding, which sits at their threshold (shift_invariance 0.0079 against 0.0078)
        (
            "error",
            "consistency.conservation_backward",
            "consistency.weights",
            "consistency.grad_forward_ratio",
            "consistency.homogeneity",
            "causal",
            "isolation",
            "interface",
        ),
    )
)

# ---------------------------------------------------------------------------------------------
# bound.rounding: roundings that stay inside every a-priori bound
# ---------------------------------------------------------------------------------------------


def _mx_scale_too_large(block: torch.Tensor, axis: int) -> torch.Tensor:
    """MX with the block scale exponent one too large: ceil(log2(amax / 448)) + 1 (nothing saturates,
    the elements more than 2^-13 below the block maximum lose their last bit)."""
    amax = block.abs().amax(dim=axis, keepdim=True)
    scale = torch.where(amax > 0, torch.exp2(torch.ceil(torch.log2(amax / E4M3_MAX)) + 1), torch.ones_like(amax))
    return _e4m3_rne(block / scale) * scale


def _q_toward_zero(fn, q, k, v, cq, ck, mq, mk, scale, causal):
    qt = _STE.apply(q, lambda x: _blockwise(x, None, 2, _mx_truncate))  # 32-blocks along head_dim
    return fn(qt, k, v, cq, ck, mq, mk, softmax_scale=scale, causal=causal)


_records += [
    _bug(  # its front quantizer has no diagonal fallback: it leaks causally too (not quiet)
        "v_scale_too_large",
        "rounding",
        "FLAMIA MXFP8 whose V block scale exponent is one too large (E4M3's lowest binades lose a bit)",
        _v_quant(_mx_scale_too_large),
        ("bound.rounding",),
        ("error", "bound.out", "bound.grad", "consistency", "isolation", "interface"),
    ),
    _bug(
        "q_toward_zero",
        "rounding",
        "FLAMIA MXFP8 whose Q is rounded toward zero (not to nearest) onto its MXFP8 grid before S = QK^T",
        _q_toward_zero,
        ("bound.rounding",),
        ("error", "bound.out", "bound.grad", "consistency", "causal", "isolation", "interface"),
    ),
]

# ---------------------------------------------------------------------------------------------
# bound.accumulation: a narrower accumulator than the recipe claims
# ---------------------------------------------------------------------------------------------

# fp8_on_e4m3_tensor_cores (the fp8 design with S and O = PV on the E4M3 tensor cores, the fp8-mma
# model: 13 bits below each 32-slice's largest product, while it claims the fp8 recipe's fp32 sums)
# is the source-edit table's accumulator.mma-under-fp8; on random inputs the cut stays far inside
# E4M3's rounding of the operands, which every other bound must allow. Its claims are on that record.

#: fp8 whose dV = P^T dO runs on the E4M3 tensor cores (the backward's GEMM of the forward's P V
#: shape) under the fp8 recipe's fp32 sums; its forward is fp8's, bit for bit
_records.append(
    _bug(
        "fp8_dv_on_e4m3_tensor_cores",
        "accumulator",
        "fp8 with dV = P^T dO on Hopper's E4M3 tensor cores under the fp8 recipe's claim of fp32 sums",
        _On(lambda design: make_kernel(replace(design, name="fp8-dv-on-e4m3-tensor-cores", mma=frozenset({Gemm.DV})))),
        ("bound.accumulation",),
        ("error", "bound.out", "bound.grad", "consistency", "causal", "isolation", "interface"),
        base="fp8",
    )
)

RECORDS = KNOWN_BAD.register(*_records, origin=__file__)

_built = {r.name: r.kernel(fp32_attention if r.base == _FP32 else None) for r in RECORDS}
#: the package's records this file holds to the checks they name, under the names the tests give them
_PACKAGE = {
    "ignores_softmax_scale": "wrapper.defaults.scale-ignored",
    "ds_nvfp4": "format.ds_quant-nvfp4",
    "fp8_on_e4m3_tensor_cores": "accumulator.mma-under-fp8",
}
_built.update({name: KNOWN_BAD.kernel(record) for name, record in _PACKAGE.items()})

#: the kernels that some check must fail, by name
TARGETED = {
    name: _built[name]
    for name in (
        "detached_k",
        "dq_without_delta",
        "dk_without_delta",
        "dv_saturating_do",
        "pt_unscaled",
        "non_finite_fallback",
        "dense_mask",
        "packed_tiles",
        "packed_tiles_skip_head",
        "v_unscaled",
        "static_v_scale",
        "range_scale_do",
        "no_row_max",
        "ds_unscaled",
        "ds_nvfp4",
        "e8m0_byte0_zero",
        "top_left_causal",
        "ignores_softmax_scale",
        "range_scale_do_flush",
        "bf16_accumulation",
        "v_scale_too_large",
        "q_toward_zero",
        "fp8_on_e4m3_tensor_cores",
        "fp8_dv_on_e4m3_tensor_cores",
    )
}
globals().update(TARGETED)  # each kernel also by its name: ``targeted.detached_k``

#: bugs that no check of the quick suite catches where it should (known misses, kept as strict
#: expected failures): kernel name -> the check that should fail on it (None: any check)
KNOWN_MISSES: dict[str, str | None] = {}

__all__ = ["TARGETED", "KNOWN_MISSES", "RECORDS", "fp32_attention", "e4m3_mma_accumulation", *TARGETED]
