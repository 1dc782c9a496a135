"""Planted bugs on the five input dimensions the suites' base packings did not draw: positive
homogeneity (a constant somewhere in a scale), head_dims that are not multiples of 16, where a row's
maximum lies along the keys, rows past 2048 keys, and heads of different magnitudes. Each is the
FLAMIA MXFP8 emulation with one change, planted in its forward or backward while it runs; each is
bitwise the correct kernel on the inputs where its bug does not apply (``tests/test_new_dimensions.py``
holds them to that on the base cases of the quick suite before these dimensions were added, where a
bug could hide).

Each is a record of the known-bad registry (tags ``zoo``, ``dimension``), and its kernel carries
``recipe``, ``catches`` (the checks of the quick or standard suite, named in ``suite``, that must
report ``fail`` on it) and ``quiet`` (checks its bug cannot reach).

    tiny_do_flushed        the backward flushes |dO| < 2^-30 to zero (a cast through an unscaled format)
    do_scale_clamped       the backward quantizes dO to MXFP8 (head_dim blocks) with its E8M0 scale
                           exponent clamped at -30 (``amax.clamp_min(eps)``) before its GEMMs
    v_scale_eps            V's E8M0 block scales computed from amax + 2^-4 (a fixed absolute epsilon
                           "against division by zero")
    headdim_tail_dropped   S = QK^T over the head_dim's full 16-channel chunks only: the last
                           head_dim % 16 channels dropped (a k-loop of head_dim // 16 steps)
    headdim_tail_scale     the last, partial 32-block of every head_dim GEMM operand (head_dim % 16 != 0)
                           is dequantized with the E8M0 scale of the block before it (a scale index
                           off by one block)
    lazy_rescale_stale_l   FlashAttention-4's lazy rescale (a 64-key tile's running maximum moves the
                           accumulator only when it has grown by more than 8 in log2 units since the last
                           rescale) that rescales the accumulator but forgets the row sum l
    split_k_drops_tail     rows of more than 2048 visible keys go through a split-K path of 1024-key
                           splits that drops the last, partial split
    long_rows_no_fallback  documents of more than 2048 keys take a long-row path without FLAMIA's
                           causal-safe split: V blocks straddling the diagonal share one scale
    v_scale_head0          V's block scales all taken from kv head 0's block amax (a per-head scale
                           indexed with the wrong head)
    v_scale_across_heads   V's block scales from the block amax over all kv heads (one scale per
                           position block and channel, shared by the heads)

Command-line specs too: ``flamia-verify check --kernel tests/zoo/dimension_bugs.py:split_k_drops_tail``.
"""

from __future__ import annotations

import contextlib
import math

import torch

from flamia_verify.formats import E4M3, ScaleRule, mx_quantize, round_to_format
from flamia_verify.formats.blocks import mx_scale_exponent
from flamia_verify.kernels import emulation as E
from flamia_verify.kernels.modes import QuantKind
from flamia_verify.known_bad import KNOWN_BAD, KnownBad, patched_emulation
from flamia_verify.recipes.operands import Operand

__all__ = ["DIMENSION_BUGS"]

#: E8M0's exponent range
_E8M0_MIN, _E8M0_MAX = -127, 127


#: the tags of this file's records
ZOO = ("zoo", "dimension")
_records: list[KnownBad] = []


def _bug(name: str, build, catches: tuple[str, ...], quiet: tuple[str, ...], why: str, suite: str = "quick") -> None:
    _records.append(
        KnownBad(name, "dimension", why, build, recipe="mxfp8", catches=catches, quiet=quiet, suite=suite, tags=ZOO)
    )


@contextlib.contextmanager
def _patching(**names):
    """Within the block the emulation module's functions ``names`` are replaced (any module-level
    function the forward or backward looks up by name, not only :data:`~flamia_verify.kernels.emulation.STEPS`)."""
    saved = {n: getattr(E, n) for n in names}
    for n, f in names.items():
        setattr(E, n, f)
    try:
        yield
    finally:
        for n, f in saved.items():
            setattr(E, n, f)


def _kernel(fwd=None, bwd=None, do_map=None):
    """A build: the base's design forward and backward, each inside its own patch (None, or a context
    factory called with the call's (total_q, total_k, head_dim)), the upstream gradient first passed
    through ``do_map`` (or not)."""

    def per_pass(patch):
        return None if patch is None else (lambda info: patch(info.shape))

    return lambda base: patched_emulation(base.design, forward=per_pass(fwd), backward=per_pass(bwd), dout=do_map)


def _mx(x: torch.Tensor, axis: int, cu: torch.Tensor | None, exponents) -> torch.Tensor:
    """MXFP8 (E4M3 elements, 32-blocks along ``axis``, restarting at ``cu``) with the block scale
    exponents ``exponents(amax, x_moved)`` computes from the block amaxes (shape (nblocks, ...), the
    blocked axis first) instead of RCEIL's; ``x_moved`` is x with that axis first."""
    xm = x.float().movedim(axis, 0)
    layout = mx_quantize(xm, axis=0, block_size=32, elem=E4M3, rule=ScaleRule.RCEIL, cu_seqlens=cu)
    idx = layout.block_index
    nblk = layout.scales.shape[0]
    amax = torch.zeros((nblk,) + xm.shape[1:], dtype=torch.float32, device=x.device)
    amax = amax.index_reduce(0, idx, xm.abs(), "amax", include_self=True)
    e = exponents(amax, xm).clamp(_E8M0_MIN, _E8M0_MAX)
    scale = torch.ldexp(torch.ones_like(amax), e.to(torch.int32))[idx]
    return (round_to_format(xm / scale, E4M3, saturate=True) * scale).movedim(0, axis)


def _rceil(amax: torch.Tensor) -> torch.Tensor:
    return mx_scale_exponent(amax, E4M3, ScaleRule.RCEIL)


def _is_mx(quant) -> bool:
    return quant.kind is QuantKind.MX and quant.block == 32


# ---------------------------------------------------------------------------------------------
# positive homogeneity: a constant in a scale
# ---------------------------------------------------------------------------------------------

#: the dO magnitude below which tiny_do_flushed flushes, and the scale exponent floor of do_scale_clamped
TINY = 2.0**-30


_bug(
    "tiny_do_flushed",
    _kernel(do_map=lambda d: torch.where(d.abs() < TINY, torch.zeros_like(d), d)),
    ("consistency.homogeneity",),
    ("error", "bound.out", "causal.dq"),
    "FLAMIA MXFP8 whose backward flushes upstream gradients below 2^-30 to zero",
)


def _clamped_do(d: torch.Tensor) -> torch.Tensor:
    """dO whose head_dim blocks with an RCEIL scale exponent below log2(TINY) are quantized to E4M3
    with the scale 2^log2(TINY) instead (their amax clamped); the other blocks pass unchanged."""
    floor = int(math.log2(TINY))
    clamped = _mx(d, -1, None, lambda amax, _: torch.maximum(_rceil(amax), torch.full_like(amax, floor).int()))
    pad = (-d.shape[-1]) % 32
    blocks = torch.nn.functional.pad(d.float(), (0, pad)).unflatten(-1, (-1, 32))
    amax = blocks.abs().amax(-1)
    flag = (_rceil(amax) < floor).repeat_interleave(32, dim=-1)[..., : d.shape[-1]]
    return torch.where(flag, clamped, d.float()).to(d.dtype)


_bug(
    "do_scale_clamped",
    _kernel(do_map=_clamped_do),
    ("consistency.homogeneity",),
    ("error", "bound.out", "causal.dq"),
    "FLAMIA MXFP8 whose backward quantizes dO to MXFP8 with its E8M0 scale exponent clamped at -30",
)

#: the absolute epsilon v_scale_eps adds to V's block amax. An additive epsilon moves a power-of-two
#: scale only where it is comparable to the block amax (about 2^-6.5 at V x 2^-8), and a scale one or
#: two binades too large changes only E4M3's subnormal elements: measured over seeds 0-2 of the quick
#: suite, 2^-6 made 0 to 2 elements differ, 2^-4 made 8 to 15 (2^-3: 58 to 109)
EPS = 2.0**-4


def _patched_seq(exponents):
    """The forward's sequence rounding (of V: the forward's only sequence operand) as MXFP8 with the
    block scale exponents ``exponents(amax, x)`` computes."""
    original = E.seq_quantize

    def call(x, quant, design, cu, dtype):
        return _mx(x, 0, cu, exponents) if _is_mx(quant) else original(x, quant, design, cu, dtype)

    return E.overriding(seq_quantize=call)


_bug(
    "v_scale_eps",
    _kernel(fwd=lambda shape: _patched_seq(lambda amax, _: _rceil(amax + EPS))),
    ("consistency.homogeneity",),
    ("error", "causal.forward"),
    "FLAMIA MXFP8 whose forward computes V's E8M0 block scales from amax + 2^-4",
)

# ---------------------------------------------------------------------------------------------
# head_dims that are not multiples of 16
# ---------------------------------------------------------------------------------------------

_SCORES = E._scores


def _scores_full_chunks(q_hd, k_hd, groups, vis, qk_scale, design):
    d = q_hd.shape[-1]
    keep = d - d % 16
    if keep == d:
        return _SCORES(q_hd, k_hd, groups, vis, qk_scale, design)
    return _SCORES(q_hd[..., :keep], k_hd[..., :keep], groups, vis, qk_scale, design)


_bug(
    "headdim_tail_dropped",
    _kernel(
        fwd=lambda shape: _patching(_scores=_scores_full_chunks),
        bwd=lambda shape: _patching(_scores=_scores_full_chunks),
    ),
    ("error.out",),
    ("causal.forward", "consistency.homogeneity"),
    "FLAMIA MXFP8 whose S = QK^T sums the head_dim's full 16-channel chunks only (the last head_dim % 16 "
    "channels dropped)",
)

_QUANTIZE_OPERAND = E.quantize_operand


def _tail_scale_misread(x: torch.Tensor) -> torch.Tensor:
    """MXFP8 along the last axis whose last, partial block is dequantized with the scale of the block
    before it (its elements were rounded against its own scale: a scale index off by one block)."""
    t = mx_quantize(x, axis=-1, block_size=32, elem=E4M3, rule=ScaleRule.RCEIL)
    scales = t.scale_values()  # (..., nblk)
    read = torch.cat([scales[..., :-1], scales[..., -2:-1]], dim=-1)
    return t.data * read.repeat_interleave(32, dim=-1)[..., : x.shape[-1]]


def _tail_patch(shape):
    """quantize_operand with the bug on the head_dim operands: (tokens, heads, head_dim) tensors of the
    call (P, P^T, dS, dS^T are (heads, rows, keys or queries) and pass unchanged)."""
    tq, tk, d = shape

    def quantize(x, quant, axis, *, input_dtype, cu_seqlens=None):
        head_dim_operand = x.dim() == 3 and x.shape[0] in (tq, tk) and x.shape[-1] == d and axis in (-1, 2)
        if head_dim_operand and _is_mx(quant) and d % 16 and d > 32:
            return _tail_scale_misread(x.float())
        return _QUANTIZE_OPERAND(x, quant, axis, input_dtype=input_dtype, cu_seqlens=cu_seqlens)

    return _patching(quantize_operand=quantize)


_bug(
    "headdim_tail_scale",
    _kernel(fwd=_tail_patch, bwd=_tail_patch),
    ("error.out", "bound.grad"),
    ("causal.forward", "consistency.homogeneity"),
    "FLAMIA MXFP8 whose last, partial 32-block of each head_dim operand (head_dim % 16 != 0) is dequantized with "
    "the E8M0 scale of the block before it",
)

# ---------------------------------------------------------------------------------------------
# where the row maximum lies: a lazy rescale that forgets l
# ---------------------------------------------------------------------------------------------

_PROBABILITIES = E.probabilities
#: the forward's key tile, and the lazy rescale's threshold (log2 units, FlashAttention-4's 8)
FWD_TILE = 64
LAZY_THRESHOLD = 8.0


def _lazy_rescale_probabilities(s2, vis, design, start_k, dtype):
    """FLAMIA's (P, l, m) as a 64-key tile loop with a lazy rescale: the reference maximum moves only when the
    running maximum has grown past it by more than LAZY_THRESHOLD (log2 units); then the accumulator
    is rescaled to the new reference but l is not. The l that normalizes O (and goes into the
    log-sum-exp) then over-weighs every tile before a rescale by 2^(growth at that rescale). Rows
    whose maximum never grows that much (every row of a Gaussian case) are exact."""
    p_used, l, m = _PROBABILITIES(s2, vis, design, start_k, dtype)
    lk = s2.shape[-1]
    if lk <= FWD_TILE:
        return p_used, l, m
    block = design.quant(Operand.P).block
    _, mb = E.pow2_block_elements(s2, block)  # (H, Lq, nblk), integer log2 maxima, -inf where masked
    ntiles = (lk + FWD_TILE - 1) // FWD_TILE
    per_tile = FWD_TILE // block
    pad = ntiles * per_tile - mb.shape[-1]
    mt = torch.nn.functional.pad(mb, (0, pad), value=-math.inf).view(*mb.shape[:-1], ntiles, per_tile).amax(-1)
    # the reference maximum along the tiles, and the growth at every rescale
    ref = mt[..., 0].clone()
    over = torch.zeros_like(mt)  # log2 of the factor by which l over-weighs tile s at the end
    for t in range(1, ntiles):
        grown = mt[..., t] - ref
        fire = torch.isfinite(ref) & torch.isfinite(mt[..., t]) & (grown > LAZY_THRESHOLD)
        over[..., :t] += torch.where(fire, grown, torch.zeros_like(grown))[..., None]
        ref = torch.where(fire | ~torch.isfinite(ref), torch.maximum(ref, mt[..., t]), ref)
    tile_of_key = torch.arange(lk, device=s2.device) // FWD_TILE
    weight = torch.exp2(over[..., tile_of_key])
    return p_used, (p_used * weight).sum(-1), m


_bug(
    "lazy_rescale_stale_l",
    _kernel(fwd=lambda shape: E.overriding(probabilities=_lazy_rescale_probabilities)),
    ("error.out", "bound.out"),
    ("causal.forward", "consistency.homogeneity"),
    "FLAMIA MXFP8 with a lazy online-softmax rescale (only when the running maximum has grown by more than 8 in "
    "log2 units) that rescales the accumulator but not the row sum l",
)

# ---------------------------------------------------------------------------------------------
# rows past 2048 keys
# ---------------------------------------------------------------------------------------------

#: rows of more visible keys than this take the split-K path; its split
LONG_ROW = 2048
SPLIT = 1024


def _split_k_probabilities(s2, vis, design, start_k, dtype):
    """FLAMIA's (P, l, m) with the keys past the last full SPLIT of a row dropped, for rows that see more
    than LONG_ROW keys (a combine loop over n // SPLIT splits)."""
    p_used, l, m = _PROBABILITIES(s2, vis, design, start_k, dtype)
    n = vis.sum(-1)  # (Lq,) visible keys per row
    if int(n.max()) <= LONG_ROW:
        return p_used, l, m
    cut = torch.where(n > LONG_ROW, (n // SPLIT) * SPLIT, n)  # keys kept per row
    keep = torch.arange(s2.shape[-1], device=s2.device)[None, :] < cut[:, None]
    p_bug = torch.where(keep, p_used, torch.zeros_like(p_used))
    return p_bug, p_bug.sum(-1), m


_bug(
    "split_k_drops_tail",
    _kernel(fwd=lambda shape: E.overriding(probabilities=_split_k_probabilities)),
    ("error.dq",),
    ("causal.forward", "causal.dq", "consistency.homogeneity"),
    "FLAMIA MXFP8 whose rows of more than 2048 visible keys drop the keys past their last full 1024-key split",
)

_FALLBACK_MASK = E.fallback_mask


def _no_fallback_on_long(design, quant, vis, causal):
    if vis.shape[-1] > LONG_ROW:  # the forward's P V: (queries, keys); a long document's key axis
        return None
    return _FALLBACK_MASK(design, quant, vis, causal)


_bug(
    "long_rows_no_fallback",
    _kernel(fwd=lambda shape: E.overriding(fallback_mask=_no_fallback_on_long)),
    ("causal.forward", "causal.dq"),
    ("error", "consistency.homogeneity"),
    "FLAMIA MXFP8 whose forward takes, on documents of more than 2048 keys, a path without the causal-safe split "
    "(V blocks straddling the diagonal share one scale)",
)

# ---------------------------------------------------------------------------------------------
# heads of different magnitudes
# ---------------------------------------------------------------------------------------------


def _head0(amax: torch.Tensor, _x) -> torch.Tensor:
    """(nblk, heads, channels): every head takes head 0's exponents."""
    return _rceil(amax[:, :1].expand_as(amax).contiguous())


def _all_heads(amax: torch.Tensor, _x) -> torch.Tensor:
    return _rceil(amax.amax(dim=1, keepdim=True).expand_as(amax).contiguous())


_bug(
    "v_scale_head0",
    _kernel(fwd=lambda shape: _patched_seq(_head0)),
    ("error.out", "bound.out", "consistency.homogeneity"),
    ("causal.forward",),
    "FLAMIA MXFP8 whose forward takes every kv head's V block scales from kv head 0's block amax",
)

_bug(
    "v_scale_across_heads",
    _kernel(fwd=lambda shape: _patched_seq(_all_heads)),
    ("consistency.homogeneity",),
    ("error", "bound.out", "causal.forward"),
    "FLAMIA MXFP8 whose forward takes V's block scales from the block amax over all kv heads",
)

# ---------------------------------------------------------------------------------------------
# head_dim not a multiple of 32: MX blocks laid over the flattened heads
# ---------------------------------------------------------------------------------------------


def _flat_heads(x: torch.Tensor) -> torch.Tensor:
    """MXFP8 of a (tokens, heads, head_dim) operand in 32-blocks along the flattened heads x head_dim
    row: where head_dim % 32 != 0 a block straddles two heads and takes the scale of the larger."""
    t, h, d = x.shape
    flat = x.float().reshape(t, h * d)
    q = mx_quantize(flat, axis=-1, block_size=32, elem=E4M3, rule=ScaleRule.RCEIL)
    return (q.data * q.scale_values().repeat_interleave(32, dim=-1)[..., : h * d]).reshape(t, h, d)


def _flat_heads_patch(shape):
    """quantize_operand with Q's and K's head_dim operands blocked over the flattened heads."""
    tq, tk, d = shape

    def quantize(x, quant, axis, *, input_dtype, cu_seqlens=None):
        head_dim_operand = x.dim() == 3 and x.shape[0] in (tq, tk) and x.shape[-1] == d and axis in (-1, 2)
        if head_dim_operand and _is_mx(quant) and d % 32:
            return _flat_heads(x)
        return _QUANTIZE_OPERAND(x, quant, axis, input_dtype=input_dtype, cu_seqlens=cu_seqlens)

    return _patching(quantize_operand=quantize)


_bug(
    "mx_blocks_straddle_heads",
    _kernel(fwd=_flat_heads_patch, bwd=_flat_heads_patch),
    ("isolation.heads",),
    ("error.out", "causal.forward"),
    "FLAMIA MXFP8 whose head_dim operands take 32-blocks over the flattened heads x head_dim row: at a "
    "head_dim that is not a multiple of 32 a block straddles two heads, and a huge value in one head "
    "flushes its neighbour's small elements",
)

RECORDS = KNOWN_BAD.register(*_records, origin=__file__)

#: every planted kernel of this file, by name
DIMENSION_BUGS = {r.name: r.kernel() for r in RECORDS}
