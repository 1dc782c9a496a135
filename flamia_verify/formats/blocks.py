"""Block-scaled quantizers: MXFP8 / MXFP4 (E8M0 scales), NVFP4 (UE4M3 + fp32 scales), scaled FP8.

Blocks
------
Blocks are runs of ``block_size`` consecutive positions along ``axis``. Without ``cu_seqlens``
the blocks start at 0 and the last one may be short. With ``cu_seqlens`` (int32 ``(batch + 1,)``
offsets along ``axis``, starting at 0, non-decreasing) the blocks restart at every document
start; a document ``[s, e)`` is cut into ``[s, s + bs), [s + bs, s + 2 bs), ...`` and its last
block may be short. A block never holds positions of two documents, so a document quantizes
bit-identically alone or packed at any offset. Positions after ``cu_seqlens[-1]`` (padding)
form one more segment of their own::

    cu_seqlens = [0, 5, 12], block_size = 4, length 14
    position     0 1 2 3 | 4 | 5 6 7 8 | 9 10 11 | 12 13
    block_index  0 0 0 0 | 1 | 2 2 2 2 | 3  3  3 |  4  4
                 doc 0     ^short       doc 1       padding

``block_index`` (int64, one entry per position along ``axis``) maps positions to blocks; block
amaxes are a ``scatter_reduce`` over it, scales go back to positions with ``gather``.

MX (OCP Microscaling v1.0), scale exponents
--------------------------------------------
The scale exponent is computed exactly from the fp32 (fp64 for float64 input) block amax,
``amax = m * 2^E`` with ``m`` in [1, 2) taken from ``frexp``; no floating ``log2`` and no rounding of
amax to bf16. With ``max_elem = c * 2^emax`` (c = 1.75 for E4M3/E5M2, 1.5 for E2M1):

- FLOOR: ``floor(log2 amax) - emax = E - emax``.
- RCEIL: ``ceil(log2(amax / max_elem)) = E - emax + (m > c)``, since ``m / c`` lies in (1/2, 2).
  This equals NVIDIA's fp32 ``amax / max_elem`` followed by ``cvt.rp.ue8m0`` whenever that
  quotient is a normal fp32 number: no fp32 amax has a quotient that rounds down onto a power
  of two (the gap between fp32 values near ``max_elem * 2^k`` is wider than the rounding
  interval). Below ``max_elem * 2^-126`` the fp32 quotient is subnormal and can round down onto
  2^-127, where the exact rule gives 2^-126 (bytes 0 vs 1): the exact rule is kept.

Exponents are clamped to E8M0's [-127, 127] (bytes 0..254). Special blocks:

- amax == 0: scale byte 0 (2^-127, the clamp of exponent -inf) and all-zero data (signed zeros
  kept). Nothing divides 0 by 0: the scale is never 0.
- any NaN or +-Inf in a block: scale byte 0xFF (NaN) and all-NaN data. Inf is treated like NaN
  (as torchao does; TransformerEngine saturates instead): an Inf has no finite scale that
  represents it, and NaN makes the damage visible downstream.

Elements are ``round_to_format(x / X, elem, saturate=True)``: ``x / X`` divides by a power of two
(exact), then one RNE rounding with saturation to +-max_elem (under FLOOR the largest elements of
a block land in [max_elem, 2^(emax+1)) and saturate; under RCEIL nothing saturates).
``MXTensor.dequantize()`` is ``data * X``, exact whenever the value is an fp32 number. One MX
value is not: under RCEIL an amax within half an element ulp of 2^128 (fp32 max is
``2^128 (1 - 2^-24)``) rounds up to ``256 * 2^120 = 2^128``, which dequantizes to +-Inf.

NVFP4
-----
All in IEEE fp32 operations, in this order (float64 inputs are first rounded to fp32):

1. ``amax`` = whole-tensor ``max |x|``, or ``global_amax`` (broadcastable to x, size 1 along
   ``axis``, e.g. a per-row amax).
2. ``s_global = max(amax / 2688, 2^-126)`` (2688 = 448 * 6); ``amax == 0`` gives ``s_global = 1`` (an
   Inf global scale would turn zeros into 0 * Inf = NaN); a non-finite amax gives NaN. The floor at
   fp32's smallest normal: below amax = 2688 * 2^-126 (3.2e-35) the quotient is subnormal, and for
   amax below about 1344 subnormal ulps it rounds to 0, which made step 3 divide by 0 (an Inf block
   scale, NaN elements: seen in training, in the dS^T rows of keys no query attends to). With the
   floor such a row keeps finite, smaller block scales and may flush to 0 (at most 2 * 2688 * 2^-126
   per element).
3. ``s_block = round_to_format((block_amax / 6) / s_global, UE4M3, saturate=True)``: two fp32
   divisions, then RNE onto UE4M3. Subnormal and zero block scales are allowed (as in
   TransformerEngine; torchao instead clamps to [2^-6, 448]); the two are not interchangeable.
4. ``data = round_to_format(x / (s_block * s_global), E2M1)``: the product first (fp32), then one
   IEEE fp32 division, then RNE with saturation to +-6. A block whose product is 0 (``s_block``
   rounded to 0, or underflow) encodes as zeros with the sign of x.
5. A block holding NaN or +-Inf gets a NaN block scale and all-NaN data.

``NVFP4Tensor.dequantize()`` is ``(data * s_block) * s_global`` in fp32, in that order.

Results carry no autograd history (inputs are detached).

Scaled FP8 (per tensor, per row, per block)
-------------------------------------------
``scale = amax / max_elem`` (fp32 division; clamped below at 2^-126 so that 1/scale stays finite)
or, with ``power_of_two``, ``2^ceil(log2(amax / max_elem))`` (the RCEIL exponent above, clamped to
[-127, 127]). amax == 0 gives scale 1; a non-finite amax gives scale NaN and NaN data.
``data = round_to_format(x / scale, elem, saturate=True)`` with an fp32 division (fp64 for
float64 input); ``x ~= data * scale``. The returned ``scale`` always broadcasts against x.
"""

from __future__ import annotations

import enum
import functools
import math
from dataclasses import dataclass
from typing import Any

import torch

from flamia_verify.errors import InputError
from flamia_verify.formats import constants as C
from flamia_verify.formats.elements import (
    E2M1,
    E4M3,
    UE4M3,
    ElementFormat,
    _check_float,
    _work_dtype,
    e8m0_decode,
    e8m0_from_exponent,
    round_to_format,
)

__all__ = [
    "ScaleRule",
    "MXTensor",
    "NVFP4Tensor",
    "block_layout",
    "mx_quantize",
    "mx_fake_quantize",
    "mx_scale_exponent",
    "nvfp4_quantize",
    "nvfp4_fake_quantize",
    "fp8_tensor_quantize",
    "fp8_row_quantize",
    "fp8_block_quantize",
]


class ScaleRule(enum.Enum):
    """How an MX block's E8M0 scale X is chosen from the block's amax (fp32, exact exponents).

    - RCEIL: X = 2^ceil(log2(amax / max_elem)); nothing saturates.
    - FLOOR: X = 2^(floor(log2 amax) - emax_elem); the largest elements saturate.
    """

    def __new__(cls, value: str, doc: str) -> ScaleRule:
        member = object.__new__(cls)
        member._value_ = value
        member.__doc__ = doc
        return member

    RCEIL = (
        "rceil",
        """X = 2^ceil(log2(amax / max_elem)). NVIDIA hardware (``cvt.rp.ue8m0``), cuDNN, torchao
        training recipes. amax / X <= max_elem, so nothing saturates.""",
    )
    FLOOR = (
        "floor",
        """X = 2^(floor(log2 amax) - emax_elem), emax_elem = 8 (E4M3), 15 (E5M2), 2 (E2M1). The OCP
        MX v1.0 conversion rule, torchao ``to_mx`` default. amax / X lies in [2^emax, 2^(emax+1)),
        so the largest elements saturate to max_elem (a block whose amax is 480 stores 448).""",
    )


# --------------------------------------------------------------------------------------------
# Block layout


def _normalize_axis(axis: int, ndim: int) -> int:
    if ndim == 0:
        raise InputError("a 0-d tensor has no axis to block; reshape it to at least 1-D")
    if not -ndim <= axis < ndim:
        raise InputError(f"axis {axis} is out of range for a tensor with {ndim} dimension(s)")
    return axis % ndim


def _check_block_size(block_size: int) -> None:
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise InputError(f"block_size must be a positive int, got {block_size!r}")


def block_layout(
    length: int,
    *,
    block_size: int | None,
    cu_seqlens: torch.Tensor | None = None,
    device: torch.device | str | None = None,
) -> tuple[torch.Tensor, int]:
    """Block number of every position along an axis of ``length``, and the number of blocks.

    block_size: positions per block; ``None`` makes each document (or the whole axis) one block.
    cu_seqlens: int ``(batch + 1,)`` document offsets along the axis: starts at 0, non-decreasing,
    last entry <= length; blocks restart at each document start. Positions from
    ``cu_seqlens[-1]`` to ``length`` form one more segment.
    Returns ``(block_index, nblocks)``: int64 ``(length,)`` on ``device``, and an int.
    """
    block_index, nblocks = _layout(length, block_size, cu_seqlens, device)
    return block_index.clone(), nblocks  # the caller's own copy: the cached one is shared


def _layout(
    length: int, block_size: int | None, cu_seqlens: torch.Tensor | None, device: torch.device | str | None
) -> tuple[torch.Tensor, int]:
    """``block_layout`` without the copy: its block_index is the cached one, shared by every call
    with the same arguments, so callers only read it (view, expand, gather), never write it."""
    if block_size is not None:
        _check_block_size(block_size)
    cu: tuple[int, ...] | None = None
    if cu_seqlens is not None:
        if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1:
            raise InputError(f"cu_seqlens must be a 1-D integer tensor (batch + 1,), got {cu_seqlens!r}")
        if cu_seqlens.dtype.is_floating_point or cu_seqlens.dtype == torch.bool or cu_seqlens.numel() == 0:
            raise InputError(f"cu_seqlens must be a non-empty integer tensor, got dtype {cu_seqlens.dtype}")
        cu = tuple(cu_seqlens.detach().to("cpu", torch.int64).tolist())
    dev = torch.device("cpu") if device is None else torch.device(device)
    if dev.type != "cpu" and dev.index is None:
        # "cuda" names whichever device is current when the tensor moves: no cache key
        block_index, nblocks = _cached_layout(length, block_size, cu, torch.device("cpu"))
        return block_index.to(dev), nblocks
    return _cached_layout(length, block_size, cu, dev)


@functools.lru_cache(maxsize=512)
def _cached_layout(
    length: int, block_size: int | None, cu_offsets: tuple[int, ...] | None, device: torch.device
) -> tuple[torch.Tensor, int]:
    """The layout of ``block_layout``, a pure function of its (hashable) arguments: the length, the
    block size, the document offsets as a tuple of ints, and the device of the result. Cached: the
    emulation quantizes the same few layouts thousands of times. A bad ``cu_offsets`` raises (and
    nothing is cached)."""
    if cu_offsets is None:
        bounds = torch.tensor([0, length], dtype=torch.int64)
    else:
        cu = torch.tensor(cu_offsets, dtype=torch.int64)
        if int(cu[0]) != 0:
            raise InputError(f"cu_seqlens must start at 0, got cu_seqlens[0] = {int(cu[0])}")
        steps = cu.diff()
        if bool((steps < 0).any()):
            where = int(torch.nonzero(steps < 0)[0, 0])
            raise InputError(
                f"cu_seqlens must be non-decreasing: cu_seqlens[{where}] = {int(cu[where])} > "
                f"cu_seqlens[{where + 1}] = {int(cu[where + 1])}"
            )
        if int(cu[-1]) > length:
            raise InputError(f"cu_seqlens[-1] = {int(cu[-1])} exceeds the length {length} of the quantized axis")
        bounds = cu if int(cu[-1]) == length else torch.cat([cu, torch.tensor([length])])
    lengths = bounds.diff()
    if block_size is None:
        blocks_per_doc = (lengths > 0).to(torch.int64)
    else:
        blocks_per_doc = (lengths + block_size - 1) // block_size
    first_block = torch.cumsum(blocks_per_doc, 0) - blocks_per_doc
    pos = torch.arange(length, dtype=torch.int64)
    doc = torch.searchsorted(bounds[1:], pos, right=True)
    offset = pos - bounds[doc]
    within = torch.zeros_like(offset) if block_size is None else offset // block_size
    block_index = first_block[doc] + within
    return block_index.to(device), int(blocks_per_doc.sum())


def _full_block_size(length: int, nblocks: int, block_size: int | None) -> int | None:
    """The size of every block when all ``nblocks`` blocks of a layout are full, else None.

    A layout cuts the ``length`` positions, in order, into ``nblocks`` blocks of at most
    ``block_size`` positions (``None``: one block per document). If ``nblocks * block_size ==
    length`` every block is full and block b holds positions ``[b * block_size, (b + 1) *
    block_size)``, so a reshape to ``(nblocks, block_size)`` lines the positions up by block; so
    does a layout of one block (any block size) covering all positions.
    """
    if length > 0 and nblocks == 1:
        return length
    if block_size is not None and length > 0 and nblocks * block_size == length:
        return block_size
    return None


def _index_along(block_index: torch.Tensor, axis: int, like: torch.Tensor) -> torch.Tensor:
    shape = [1] * like.dim()
    shape[axis] = block_index.numel()
    return block_index.view(shape).expand_as(like)


def _block_amax(
    a: torch.Tensor, axis: int, block_index: torch.Tensor, nblocks: int, block_size: int | None
) -> torch.Tensor:
    """max |x| of every block (``a`` is already |x|); NaN propagates; shape: axis -> nblocks.

    block_size: the layout's (None: one block per document). Full blocks are a reshape and an
    ``amax``; other layouts a ``scatter_reduce`` over block_index (from 0: ``a`` >= 0)."""
    full = _full_block_size(a.shape[axis], nblocks, block_size)
    if full is not None:
        return torch.unflatten(a, axis, (nblocks, full)).amax(dim=axis + 1)
    shape = list(a.shape)
    shape[axis] = nblocks
    out = torch.zeros(shape, dtype=a.dtype, device=a.device)
    return out.scatter_reduce(axis, _index_along(block_index, axis, a), a, reduce="amax", include_self=True)


@functools.lru_cache(maxsize=64)
def _divisor(value: float, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``_divide``'s divisor as a 0-d tensor, built once per (value, dtype, device) and only read.
    The divisors are nonzero constants (2688, 6): no -0.0 / 0.0 or NaN keys to tell apart."""
    return torch.tensor(value, dtype=dtype, device=device)


def _divide(a: torch.Tensor, divisor: float) -> torch.Tensor:
    """IEEE ``a / divisor`` on every device. CUDA torch turns a division by a Python (CPU) scalar
    into a multiplication by its rounded reciprocal, which differs from the division in the last
    bit (2688 and 6 are no powers of two); a divisor tensor on a's device keeps a true division."""
    return a / _divisor(divisor, a.dtype, a.device)


def _to_positions(
    per_block: torch.Tensor, axis: int, block_index: torch.Tensor, block_size: int | None
) -> torch.Tensor:
    """Broadcast per-block values back to every position along ``axis``: with full blocks (see
    ``_full_block_size``) each value repeated block_size times, else a gather (much faster than
    index_select along an inner axis). Either way a contiguous tensor."""
    nblocks = per_block.shape[axis]
    full = _full_block_size(block_index.numel(), nblocks, block_size)
    if full is not None:
        expanded = list(per_block.shape)
        expanded.insert(axis + 1, full)
        return per_block.unsqueeze(axis + 1).expand(expanded).flatten(axis, axis + 1).contiguous()
    shape = list(per_block.shape)
    shape[axis] = block_index.numel()
    view = [1] * per_block.dim()
    view[axis] = block_index.numel()
    return per_block.gather(axis, block_index.view(view).expand(shape))


def mx_scale_exponent(amax: torch.Tensor, elem: ElementFormat, rule: ScaleRule) -> torch.Tensor:
    """Unclamped scale exponent (int32) of each amax under ``rule``; amax == 0 gives -128.

    -128 lies below E8M0's range, so ``e8m0_from_exponent`` clamps it to byte 0 (2^-127).

    ``amax`` must be non-negative (float32 or float64); non-finite entries give meaningless
    exponents (callers mark those blocks NaN). See the module docstring for the derivation.
    """
    mantissa, e = torch.frexp(amax)  # amax = mantissa * 2^e, mantissa in [0.5, 1)
    emax = elem.emax
    exponent = e - (1 + emax)  # floor(log2 amax) - emax, floor(log2 amax) = e - 1
    if rule is ScaleRule.RCEIL:
        c = elem.max_finite / 2.0**emax  # 1.75 or 1.5, exact
        exponent = exponent + (mantissa > c / 2)  # m > c, m = 2 * mantissa (exact); int32 + bool is int32
    elif rule is not ScaleRule.FLOOR:
        raise InputError(f"unknown scale rule {rule!r}; use ScaleRule.RCEIL or ScaleRule.FLOOR")
    return torch.where(amax == 0, C.E8M0_MIN_EXPONENT - 1, exponent)


# --------------------------------------------------------------------------------------------
# MX


@dataclass
class MXTensor:
    """An MX-quantized tensor.

    data: float32, shape of x, values on ``elem``'s grid.
    scales: uint8 E8M0 bytes, shape of x with ``axis`` replaced by the number of blocks.
    axis: the blocked axis (non-negative). block_index: int64 ``(x.shape[axis],)``, the block of
    every position along ``axis``.
    """

    data: torch.Tensor
    scales: torch.Tensor
    axis: int
    block_size: int
    elem: ElementFormat
    rule: ScaleRule
    block_index: torch.Tensor

    def scale_values(self) -> torch.Tensor:
        """The scales as float32 powers of two (byte 0 is the fp32 subnormal 2^-127; 0xFF NaN)."""
        return e8m0_decode(self.scales)

    def dequantize(self) -> torch.Tensor:
        """float32 ``data * 2^(scale exponent)``, exact (a product with a power of two)."""
        return self.data * _to_positions(self.scale_values(), self.axis, self.block_index, self.block_size)


def mx_quantize(
    x: torch.Tensor,
    *,
    axis: int = -1,
    block_size: int = C.MX_BLOCK_SIZE,
    elem: ElementFormat = E4M3,
    rule: ScaleRule = ScaleRule.RCEIL,
    cu_seqlens: torch.Tensor | None = None,
) -> MXTensor:
    """Quantize ``x`` to MX: blocks of ``block_size`` along ``axis``, one E8M0 scale per block.

    x: any shape, float64/float32/float16/bfloat16. cu_seqlens: optional int32 ``(batch + 1,)``
    document offsets along ``axis`` (blocks restart at each document). See the module docstring
    for the scale rules and special blocks.
    """
    _check_float(x, "x")
    _check_block_size(block_size)
    if not isinstance(rule, ScaleRule):
        raise InputError(f"rule must be a ScaleRule (RCEIL or FLOOR), got {rule!r}")
    ax = _normalize_axis(axis, x.dim())
    xw = x.detach().to(_work_dtype(x))
    block_index, nblocks = _layout(x.shape[ax], block_size, cu_seqlens, x.device)
    amax = _block_amax(xw.abs(), ax, block_index, nblocks, block_size)
    scales = e8m0_from_exponent(mx_scale_exponent(amax, elem, rule))
    scales = torch.where(torch.isfinite(amax), scales, C.E8M0_NAN_BYTE)
    scale_at = _to_positions(e8m0_decode(scales), ax, block_index, block_size).to(xw.dtype)
    data = round_to_format(xw / scale_at, elem, saturate=True)  # power-of-two division: exact
    return MXTensor(
        data=data,
        scales=scales,
        axis=ax,
        block_size=block_size,
        elem=elem,
        rule=rule,
        block_index=block_index.clone(),  # the caller's own copy: the cached layout is shared
    )


def mx_fake_quantize(x: torch.Tensor, **kwargs: Any) -> torch.Tensor:
    """``mx_quantize(x, **kwargs).dequantize()``: float32, shape of x."""
    return mx_quantize(x, **kwargs).dequantize()


# --------------------------------------------------------------------------------------------
# NVFP4


@dataclass
class NVFP4Tensor:
    """An NVFP4-quantized tensor: ``x ~= data * block_scale * global_scale``.

    data: float32, shape of x, values on the E2M1 grid.
    block_scales: float32 on the UE4M3 grid, shape of x with ``axis`` replaced by the number of
    blocks. global_scale: float32, 0-d (per tensor) or broadcastable to x with size 1 along
    ``axis`` (per row). block_index: int64 ``(x.shape[axis],)``.
    """

    data: torch.Tensor
    block_scales: torch.Tensor
    global_scale: torch.Tensor
    axis: int
    block_size: int
    block_index: torch.Tensor

    def dequantize(self) -> torch.Tensor:
        """float32 ``(data * block_scale) * global_scale``, two fp32 products in that order."""
        block_scales = _to_positions(self.block_scales, self.axis, self.block_index, self.block_size)
        return (self.data * block_scales) * self.global_scale


def _global_amax_shape(x: torch.Tensor, axis: int, global_amax: torch.Tensor) -> torch.Tensor:
    ga = torch.as_tensor(global_amax, device=x.device).to(torch.float32)
    target = list(x.shape)
    target[axis] = 1
    try:
        if ga.dim() > x.dim():
            raise RuntimeError
        return ga.expand(target) if ga.dim() else ga
    except RuntimeError:
        raise InputError(
            f"global_amax of shape {tuple(ga.shape)} must broadcast to x {tuple(x.shape)} with size 1 "
            f"along axis {axis}, i.e. to {tuple(target)}"
        ) from None


def nvfp4_quantize(
    x: torch.Tensor,
    *,
    axis: int = -1,
    block_size: int = C.NVFP4_BLOCK_SIZE,
    cu_seqlens: torch.Tensor | None = None,
    global_amax: torch.Tensor | None = None,
) -> NVFP4Tensor:
    """Quantize ``x`` to NVFP4: E2M1 elements, a UE4M3 scale per block, an fp32 global scale.

    x: any shape, floating. global_amax: None (whole-tensor amax) or a tensor broadcastable to x
    with size 1 along ``axis``. The exact fp32 recipe is in the module docstring.
    """
    _check_float(x, "x")
    _check_block_size(block_size)
    ax = _normalize_axis(axis, x.dim())
    xf = x.detach().to(torch.float32)
    a = xf.abs()
    amax = a.amax() if global_amax is None else _global_amax_shape(x, ax, global_amax)
    s_global = torch.where(
        amax == 0, torch.ones_like(amax), _divide(amax, C.NVFP4_GLOBAL_DIVISOR).clamp(min=C.FP32_MIN_NORMAL)
    )
    s_global = torch.where(torch.isfinite(amax), s_global, torch.full_like(s_global, math.nan))
    block_index, nblocks = _layout(x.shape[ax], block_size, cu_seqlens, x.device)
    block_amax = _block_amax(a, ax, block_index, nblocks, block_size)
    s_block = round_to_format(_divide(block_amax, C.E2M1_MAX) / s_global, UE4M3, saturate=True)
    s_block = torch.where(torch.isfinite(block_amax), s_block, math.nan)
    denom = _to_positions(s_block, ax, block_index, block_size) * s_global
    data = round_to_format(xf / denom, E2M1)
    data = torch.where(denom == 0, torch.copysign(torch.zeros_like(xf), xf), data)
    return NVFP4Tensor(
        data=data,
        block_scales=s_block,
        global_scale=s_global,
        axis=ax,
        block_size=block_size,
        block_index=block_index.clone(),  # the caller's own copy: the cached layout is shared
    )


def nvfp4_fake_quantize(x: torch.Tensor, **kwargs: Any) -> torch.Tensor:
    """``nvfp4_quantize(x, **kwargs).dequantize()``: float32, shape of x."""
    return nvfp4_quantize(x, **kwargs).dequantize()


# --------------------------------------------------------------------------------------------
# Scaled FP8


def _fp8_scale(amax: torch.Tensor, elem: ElementFormat, power_of_two: bool) -> torch.Tensor:
    """float32 scale from a non-negative amax (see the module docstring)."""
    if power_of_two:
        exponent = mx_scale_exponent(amax, elem, ScaleRule.RCEIL)
        scale = e8m0_decode(e8m0_from_exponent(exponent))  # exact 2^e, e clamped to [-127, 127]
    else:
        scale = _divide(amax.to(torch.float32), elem.max_finite).clamp(min=C.FP32_MIN_NORMAL)
    scale = torch.where(amax == 0, torch.ones_like(scale), scale)
    return torch.where(torch.isfinite(amax), scale, torch.full_like(scale, math.nan))


def _fp8_apply(xw: torch.Tensor, scale: torch.Tensor, elem: ElementFormat) -> torch.Tensor:
    return round_to_format(xw / scale.to(xw.dtype), elem, saturate=True)


def fp8_tensor_quantize(
    x: torch.Tensor, *, elem: ElementFormat = E4M3, power_of_two: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-tensor scaling: returns ``(data, scale)``, float32, ``x ~= data * scale``; scale is 0-d."""
    _check_float(x, "x")
    xw = x.detach().to(_work_dtype(x))
    scale = _fp8_scale(xw.abs().amax(), elem, power_of_two)
    return _fp8_apply(xw, scale, elem), scale


def fp8_row_quantize(
    x: torch.Tensor,
    *,
    axis: int = -1,
    elem: ElementFormat = E4M3,
    power_of_two: bool = True,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One scale shared along ``axis``: returns ``(data, scale)``, float32, ``x ~= data * scale``.

    Without cu_seqlens the amax is reduced over ``axis`` (keepdim): scale has size 1 there. With
    cu_seqlens each document along ``axis`` gets its own scale, returned at every position
    (scale has the full size along ``axis``) so that it still broadcasts against x.
    """
    _check_float(x, "x")
    ax = _normalize_axis(axis, x.dim())
    xw = x.detach().to(_work_dtype(x))
    if cu_seqlens is None:
        scale = _fp8_scale(xw.abs().amax(dim=ax, keepdim=True), elem, power_of_two)
    else:
        block_index, ndocs = _layout(x.shape[ax], None, cu_seqlens, x.device)
        per_doc = _fp8_scale(_block_amax(xw.abs(), ax, block_index, ndocs, None), elem, power_of_two)
        scale = _to_positions(per_doc, ax, block_index, None)
    return _fp8_apply(xw, scale, elem), scale


def fp8_block_quantize(
    x: torch.Tensor,
    *,
    axis: int,
    block_size: int,
    elem: ElementFormat = E4M3,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Power-of-two scale per block along ``axis`` (MX segmentation, RCEIL exponent).

    Returns ``(data, scale)``, float32, ``x ~= data * scale``; ``scale`` holds each position's
    block scale (same shape as x) so that it broadcasts. The per-block values are
    ``scale.index_select(axis, first position of each block)``; ``block_layout`` gives the
    blocks. Equals ``mx_quantize(..., rule=RCEIL)`` except that an all-zero block gets scale 1.
    """
    _check_float(x, "x")
    _check_block_size(block_size)
    ax = _normalize_axis(axis, x.dim())
    xw = x.detach().to(_work_dtype(x))
    block_index, nblocks = _layout(x.shape[ax], block_size, cu_seqlens, x.device)
    per_block = _fp8_scale(_block_amax(xw.abs(), ax, block_index, nblocks, block_size), elem, power_of_two=True)
    scale = _to_positions(per_block, ax, block_index, block_size)
    return _fp8_apply(xw, scale, elem), scale
