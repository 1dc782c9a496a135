"""The pieces a mutant of the emulation calls instead of the original code (``_mut.<name>`` in an edit).

Each function is the faulty twin of one step of :mod:`flamia_verify.kernels.emulation`: a mask off by
k positions, a block boundary in the wrong place, K/V heads expanded in the wrong order, an operand
rounded in another format, a reduction summed in a random order, an input written in place. They
are plain, obviously-written functions; the source-edit table (:mod:`flamia_verify.known_bad.table`) says
where each one is spliced in.
"""

from __future__ import annotations

import dataclasses
import math
import random

import torch

from flamia_verify.formats import E4M3, E5M2, mx_quantize, round_to_format
from flamia_verify.formats.elements import binade

__all__ = [
    "visible_shift",
    "visible_top_left",
    "shift_vis",
    "resized",
    "shift_cu",
    "expand_repeat",
    "reduce_groups_swapped",
    "mx_variant",
    "running_max_without_rescale",
    "tile_lse",
    "shuffled_matmul",
    "reversed_matmul",
    "write_in_place",
]


# ----------------------------------------------------------------------------------------------
# masks and block boundaries
# ----------------------------------------------------------------------------------------------


def visible_shift(lq: int, lk: int, causal: bool, device, k: int) -> torch.Tensor:
    """The causal mask with its diagonal moved by k keys: j <= i + (lk - lq) + k."""
    if not causal:
        return torch.ones(lq, lk, dtype=torch.bool, device=device)
    i = torch.arange(lq, device=device)[:, None]
    j = torch.arange(lk, device=device)[None, :]
    return j <= i + (lk - lq) + k


def visible_top_left(lq: int, lk: int, causal: bool, device) -> torch.Tensor:
    """The causal mask aligned top-left (j <= i) instead of bottom-right: differs only when lq != lk."""
    return visible_shift(lq, lk, causal, device, lq - lk)


def shift_vis(vis: torch.Tensor, k: int, *, suffix: bool = False) -> torch.Tensor:
    """A causal visibility matrix whose rows see k more columns (k < 0: fewer).

    Rows of the forward mask (queries) see a prefix of the keys; rows of its transpose (keys) see a
    suffix of the queries (``suffix=True``). The diagonal fallback fed with this matrix decides which
    sequence blocks a row sees whole k positions away from the truth.
    """
    cols = vis.shape[-1]
    c = torch.arange(cols, device=vis.device)[None, :]
    n = vis.sum(dim=-1, keepdim=True)
    if suffix:
        return (c >= cols - n - k) & (n + k > 0)
    return c < n + k


def resized(quant, k: int):
    """The same rounding with its block k positions longer (the quantizer's block, not the fallback's)."""
    return dataclasses.replace(quant, block=quant.block + k) if quant.block > 0 else quant


def shift_cu(cu: torch.Tensor, k: int) -> torch.Tensor:
    """Document offsets whose interior boundaries moved by k positions (the ends stay in place)."""
    out = cu.clone()
    if out.numel() > 2:
        total = int(out[-1])
        out[1:-1] = (out[1:-1] + k).clamp(0, total)
        out = torch.cummax(out, dim=0).values  # stay non-decreasing
    return out


# ----------------------------------------------------------------------------------------------
# heads
# ----------------------------------------------------------------------------------------------


def expand_repeat(x: torch.Tensor, groups: int) -> torch.Tensor:
    """K/V heads tiled (h0 h1 h0 h1) with ``repeat`` where GQA needs them interleaved (h0 h0 h1 h1)."""
    return x if groups == 1 else x.repeat(1, groups, 1)


def reduce_groups_swapped(g: torch.Tensor, hk: int, groups: int) -> torch.Tensor:
    """dK/dV of the query heads summed into K/V heads in the tiled order (the ``repeat`` layout)."""
    t, _, d = g.shape
    return g.view(t, groups, hk, d).sum(dim=1)


# ----------------------------------------------------------------------------------------------
# operand formats and rounding
# ----------------------------------------------------------------------------------------------


def _truncate(y: torch.Tensor, fmt) -> torch.Tensor:
    """Round toward zero onto ``fmt``'s grid (saturating)."""
    y = y.clamp(-fmt.max_finite, fmt.max_finite)
    q = binade(y).clamp_(min=math.ldexp(1.0, fmt.emin)).mul_(math.ldexp(1.0, -fmt.man_bits))
    return torch.trunc(y / q) * q


def mx_variant(x: torch.Tensor, quant, axis: int, cu_seqlens, variant: str) -> torch.Tensor:
    """MX quantization of one operand done wrong in one way.

    ``e5m2``: E5M2 elements instead of E4M3 (one significand bit fewer); ``truncate``: elements
    rounded toward zero instead of to nearest; ``scale_down``: the block scale one exponent too
    small (the largest elements saturate); ``scale_up``: one exponent too large (a bit of
    precision lost).
    """
    block = quant.block if quant.block > 0 else x.shape[axis]
    elem = E5M2 if variant == "e5m2" else E4M3
    t = mx_quantize(x, axis=axis, block_size=block, elem=elem, rule=quant.rule, cu_seqlens=cu_seqlens)
    if variant == "e5m2":
        return t.dequantize()
    scale = t.scale_values().index_select(t.axis, t.block_index)
    if variant == "truncate":
        return _truncate(x / scale, E4M3) * scale
    factor = {"scale_down": 0.5, "scale_up": 2.0}[variant]
    scale = scale * factor
    return round_to_format(x / scale, E4M3, saturate=True) * scale


# ----------------------------------------------------------------------------------------------
# normalisation
# ----------------------------------------------------------------------------------------------


def running_max_without_rescale(mb: torch.Tensor, ids: torch.Tensor, m: torch.Tensor, first_blocks: int):
    """Per-key row maximum of an online softmax that stops rescaling after ``first_blocks`` blocks.

    Keys of the first blocks keep the maximum of those blocks; later keys use the final maximum. The
    accumulated sum then mixes two references (the early keys are over-weighted whenever a later key
    holds the row maximum), while the log-sum-exp is written with the final maximum.
    """
    early = mb[..., :first_blocks].amax(dim=-1)
    per_block = torch.where(torch.arange(mb.shape[-1], device=mb.device) < first_blocks, early[..., None], m[..., None])
    per_block = torch.where(torch.isfinite(per_block), per_block, m[..., None])
    return per_block[..., ids]


def tile_lse(s2: torch.Tensor, lse: torch.Tensor, tile: int) -> torch.Tensor:
    """Per-key log-sum-exp (log2) as a backward that rebuilds P tile by tile against the running
    normalizer would see it: keys of tile t use the log-sum-exp of the keys up to the end of tile t.
    Rows that fit in one tile get the true value back."""
    lk = s2.shape[-1]
    out = torch.empty_like(s2)
    for start in range(0, lk, tile):
        end = min(lk, start + tile)
        part = torch.logsumexp(s2[..., :end] * math.log(2.0), dim=-1) / math.log(2.0)
        last = end == lk
        out[..., start:end] = (lse if last else torch.where(torch.isfinite(part), part, lse))[..., None]
    return out


# ----------------------------------------------------------------------------------------------
# reductions and side effects
# ----------------------------------------------------------------------------------------------

_NONDET = random.Random()  # seeded from the OS: a different order on every call, as atomics give


def shuffled_matmul(a: torch.Tensor, b: torch.Tensor, *, tile: int = 16, min_len: int = 0) -> torch.Tensor:
    """a @ b with the contraction cut into ``tile``-long slices summed in a random order (fp32).

    Contractions of at most ``min_len`` elements keep the fixed order (a kernel whose split-K or
    atomics path starts only on long rows)."""
    n = a.shape[-1]
    if n <= max(min_len, tile):
        return torch.matmul(a, b)
    starts = list(range(0, n, tile))
    _NONDET.shuffle(starts)
    acc = None
    for s in starts:
        part = torch.matmul(a[..., s : s + tile], b[..., s : s + tile, :])
        acc = part if acc is None else acc + part
    return acc  # type: ignore[return-value]  # n > tile: at least one part


def reversed_matmul(a: torch.Tensor, b: torch.Tensor, *, tile: int = 16) -> torch.Tensor:
    """a @ b summed slice by slice from the last ``tile``-long slice to the first: a fixed order."""
    n = a.shape[-1]
    acc = None
    for s in reversed(range(0, n, tile)):
        part = torch.matmul(a[..., s : s + tile], b[..., s : s + tile, :])
        acc = part if acc is None else acc + part
    return torch.matmul(a, b) if acc is None else acc


def write_in_place(x: torch.Tensor) -> None:
    """Subtract the per-channel mean over tokens from x, in place (the outputs stay correct: softmax
    is shift-invariant in K; the caller's tensor is changed)."""
    if x.numel():
        x.sub_(x.float().mean(dim=0, keepdim=True).to(x.dtype))
