"""Fused E4M3 quantization around cuDNN's FP8 attention, and its PyTorch twins.

Three kernels, each reading its input once:

* :func:`amax_many`: the amax of up to three tensors (q, k, v) in one launch (``current`` scaling and
  the calibration of ``delayed`` scaling need it before they can quantize).
* :func:`quantize_e4m3`: multiply by a given scale, round to E4M3 and write the codes in cuDNN's layout
  (packed THD or padded BSHD, :mod:`.layout`), and reduce the input's amax in the same pass (for the
  ``delayed`` history). The input may be any strided (T, H, D) view: nothing is copied first.
* :func:`dequantize_e4m3`: E4M3 codes in a layout times a descale, rounded to the input dtype, back
  in the packed rows of the calling convention.

Each has a slow, obviously correct twin (``*_reference``) built on :mod:`flamia_verify.formats`;
tests/test_cudnn_fp8.py holds them together bit for bit (under ``TRITON_INTERPRET=1`` on the CPU,
natively on a GPU).

Numerics (the choices):

* **Rounding**: round to nearest even onto the E4M3 grid (subnormals down to 2^-9 included), after
  one fp32 multiply ``x * scale`` (exact for the power-of-two scales of :mod:`.scaling`, unless it
  leaves fp32's range).
* **Saturation**: finite values beyond +-448 become +-448 (E4M3 ``fn`` has no infinity; a finite value
  above the scale's amax is a delayed-scaling overflow, kept as large as the format allows).
* **Inf and NaN inputs become NaN** (code 0x7F): mapping an infinity to 448 would hide it; NaN stays
  NaN. Both then propagate through the attention as the float reference's would.
* **Amax**: ``max |x|`` in fp32 over every element, **NaN when any element is NaN** (``tl.max`` alone
  drops NaN; the reduction here keeps it, :func:`flamia_verify.kernels.triton.quant.amax`), Inf when
  an element is infinite, 0 for an all-zero or empty tensor. Across programs the amax is combined with
  an integer atomic maximum on its fp32 bit pattern (non-negative floats order as their bits; every NaN
  is written as 0x7FC00000, above +Inf's 0x7F800000), so the result is exact and independent of the
  order in which programs finish.
* **Dequantization**: ``code * descale`` in fp32, rounded to nearest even to the output dtype (bf16 or
  fp16); exact for power-of-two descales within the output's normal range.

On a GPU with the fp8 type (compute capability 8.9+) the kernels convert with the hardware (``cvt`` with
RNE and saturation, as :mod:`flamia_verify.kernels.triton.quant` does); under the interpreter, whose
float8 casts mis-round, with integer arithmetic on the code's fields.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from flamia_verify.formats import E4M3, decode, encode
from flamia_verify.kernels.cudnn_fp8.layout import Layout, from_layout_reference, to_layout_reference
from flamia_verify.kernels.triton import quant
from flamia_verify.kernels.triton.compat import interpreting, patch_interpreter

__all__ = [
    "amax_many",
    "amax_reference",
    "dequantize_e4m3",
    "dequantize_e4m3_reference",
    "quantize_e4m3",
    "quantize_e4m3_reference",
]

E4M3_MAX = quant.E4M3_MAX
_NAN_BITS = tl.constexpr(0x7FC00000)


# ----------------------------------------------------------------------------------------------
# in-register helpers
# ----------------------------------------------------------------------------------------------


@triton.jit
def _rows(pid, BLOCK_R: tl.constexpr):
    return (pid * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)


@triton.jit
def _source_tokens(r, NROWS, H, T, S_PAD, Cu, PADDED: tl.constexpr):
    """For buffer rows ``r`` (token row * H + head): whether each holds a token of the pack, and which
    packed token it holds. Packed: the same token (rows past T are padding); padded: document
    ``row // S_PAD``, position ``row % S_PAD`` in it."""
    in_buf = r < NROWS
    tok = r // H
    if PADDED:
        b = tok // S_PAD
        s = tok - b * S_PAD
        start = tl.load(Cu + b, mask=in_buf, other=0).to(tl.int64)
        end = tl.load(Cu + b + 1, mask=in_buf, other=0).to(tl.int64)
        valid = in_buf & (s < end - start)
        src = start + s
    else:
        valid = in_buf & (tok < T)
        src = tok
    return in_buf, valid, src


@triton.jit
def _amax_bits(x):
    """The amax of a 2-d fp32 tile (NaN kept) as the int32 bit pattern that the atomic maximum
    combines: every NaN as 0x7FC00000, above +Inf."""
    m = quant.amax(quant.amax(x, 1), 0)
    bits = m.to(tl.int32, bitcast=True)
    return tl.where(m != m, _NAN_BITS, bits)


@triton.jit
def _encode_e4m3(y):
    """E4M3 codes (uint8) of fp32 ``y`` with |y| <= 448 or NaN: RNE onto the grid, then the fields."""
    sign = (y.to(tl.int32, bitcast=True) >> 31) & 1
    a = quant.round_grid(tl.abs(y), -6, 3, E4M3_MAX)
    abits = a.to(tl.int32, bitcast=True)
    normal = (((abits >> 23) & 0xFF) - 120) << 3 | ((abits >> 20) & 7)  # (e + 7) << 3 | mantissa
    sub = (tl.where(a == a, a, 0.0) * 512.0).to(tl.int32)  # a = m * 2^-9, m in 0..7 (NaN: replaced below)
    code = tl.where(a >= 0.015625, normal, sub) | (sign << 7)
    return tl.where(a != a, 0x7F, code).to(tl.uint8)


@triton.jit
def _decode_e4m3(codes):
    """fp32 values of E4M3 codes (uint8): exact."""
    c = codes.to(tl.int32)
    e = (c >> 3) & 0xF
    m = c & 7
    normal = ((e + 120) << 23 | (m << 20)).to(tl.float32, bitcast=True)
    mag = tl.where(e == 0, m.to(tl.float32) * 0.001953125, normal)  # subnormal: m * 2^-9
    mag = tl.where((e == 15) & (m == 7), float("nan"), mag)
    return tl.where(((c >> 7) & 1) == 1, -mag, mag)


# ----------------------------------------------------------------------------------------------
# kernels
# ----------------------------------------------------------------------------------------------


@triton.jit
def _tile_amax_bits(X, pid, T, H, D, sT, sH, sD, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    r = _rows(pid, BLOCK_R)
    tok = r // H
    h = r - tok * H
    cols = tl.arange(0, BLOCK_D)
    mask = (tok < T)[:, None] & (cols < D)[None, :]
    ptrs = X + tok[:, None] * sT + h[:, None] * sH + cols[None, :] * sD
    x = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    return _amax_bits(x)


@triton.jit
def _amax_kernel(
    X0,
    T0,
    H0,
    sT0,
    sH0,
    sD0,
    X1,
    T1,
    H1,
    sT1,
    sH1,
    sD1,
    X2,
    T2,
    H2,
    sT2,
    sH2,
    sD2,
    D,
    Out,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Program (i, j) reduces row block i of tensor j (grid axis 1 = number of tensors) into Out[j]."""
    pid = tl.program_id(0)
    j = tl.program_id(1)
    if j == 0:
        tl.atomic_max(Out, _tile_amax_bits(X0, pid, T0, H0, D, sT0, sH0, sD0, BLOCK_R, BLOCK_D))
    elif j == 1:
        tl.atomic_max(Out + 1, _tile_amax_bits(X1, pid, T1, H1, D, sT1, sH1, sD1, BLOCK_R, BLOCK_D))
    else:
        tl.atomic_max(Out + 2, _tile_amax_bits(X2, pid, T2, H2, D, sT2, sH2, sD2, BLOCK_R, BLOCK_D))


@triton.jit
def _quantize_kernel(
    X,
    sT,
    sH,
    sD,
    T,
    H,
    D,
    Y,
    NROWS,
    S_PAD,
    Cu,
    Scale,
    AmaxOut,
    PADDED: tl.constexpr,
    RECORD: tl.constexpr,
    NATIVE: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Buffer rows of one program: gather their tokens from X (zeros for pad rows), scale, round to
    E4M3, store the codes; with RECORD, fold the tile's amax into AmaxOut (int32 bits)."""
    r = _rows(tl.program_id(0), BLOCK_R)
    in_buf, valid, src = _source_tokens(r, NROWS, H, T, S_PAD, Cu, PADDED)
    h = r - (r // H) * H
    cols = tl.arange(0, BLOCK_D)
    cmask = (cols < D)[None, :]
    x = tl.load(X + src[:, None] * sT + h[:, None] * sH + cols[None, :] * sD, mask=valid[:, None] & cmask, other=0.0)
    x = x.to(tl.float32)
    y = x * tl.load(Scale)
    y = tl.where(y > E4M3_MAX, E4M3_MAX, y)  # NaN compares false and passes through
    y = tl.where(y < -E4M3_MAX, -E4M3_MAX, y)
    y = tl.where((x != x) | (tl.abs(x) == float("inf")), float("nan"), y)
    out = Y + r[:, None] * D + cols[None, :]
    if NATIVE:
        tl.store(out, y.to(tl.float8e4nv), mask=in_buf[:, None] & cmask)
    else:
        tl.store(out, _encode_e4m3(y), mask=in_buf[:, None] & cmask)
    if RECORD:
        tl.atomic_max(AmaxOut, _amax_bits(x))


@triton.jit
def _dequantize_kernel(
    Y,
    NROWS,
    T,
    H,
    D,
    S_PAD,
    Cu,
    Out,
    Descale,
    PADDED: tl.constexpr,
    IS_FP16: tl.constexpr,
    NATIVE: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Buffer rows of one program: decode the codes of the rows that hold a token, times the descale,
    rounded to the output dtype, stored at that token's packed row."""
    r = _rows(tl.program_id(0), BLOCK_R)
    in_buf, valid, src = _source_tokens(r, NROWS, H, T, S_PAD, Cu, PADDED)
    h = r - (r // H) * H
    cols = tl.arange(0, BLOCK_D)
    mask = valid[:, None] & (cols < D)[None, :]
    codes = tl.load(Y + r[:, None] * D + cols[None, :], mask=mask, other=0)  # uint8 codes
    if NATIVE:
        v = codes.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    else:
        v = _decode_e4m3(codes)
    v = v * tl.load(Descale)
    r = quant.round_input(v, IS_FP16)
    if IS_FP16:  # quant.round_fp16 rounds |v|: v's sign bit back, by integer ops (a float select of -|0|
        # lost the sign of zero on the H200: -0.0 came out +0.0; rounding never changes a sign)
        sign = v.to(tl.int32, bitcast=True) & -2147483648
        r = ((r.to(tl.int32, bitcast=True) & 2147483647) | sign).to(tl.float32, bitcast=True)
    v = r
    tl.store(Out + (src[:, None] * H + h[:, None]) * D + cols[None, :], v.to(Out.dtype.element_ty), mask=mask)


# ----------------------------------------------------------------------------------------------
# launchers
# ----------------------------------------------------------------------------------------------


def _native() -> bool:
    return bool(quant.NATIVE_E4M3.value)


def _blocks(d: int) -> tuple[int, int]:
    """(BLOCK_R rows, BLOCK_D columns) of a program: a few thousand elements on a GPU; under the
    interpreter, whose cost is per operation, large tiles."""
    block_d = max(16, triton.next_power_of_2(d))
    elems = 1 << 16 if interpreting() else 4096
    return max(1, elems // block_d), block_d


def _check_rows(name: str, x: torch.Tensor) -> None:
    if x.dim() != 3:
        raise ValueError(f"{name} must be (tokens, heads, head_dim), got shape {tuple(x.shape)}")
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"{name} must be bfloat16, float16 or float32, got {x.dtype}")


def amax_many(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """max |x| of each tensor (1 to 3 of them, (T, H, D), one head_dim, any strides) in one launch:
    (n,) fp32 on their device; NaN when a tensor holds a NaN, 0 when it is empty or all zeros."""
    if not 1 <= len(tensors) <= 3:
        raise ValueError(f"amax_many takes 1 to 3 tensors, got {len(tensors)}")
    for i, x in enumerate(tensors):
        _check_rows(f"tensor {i}", x)
    d = tensors[0].shape[2]
    if any(x.shape[2] != d for x in tensors):
        raise ValueError("amax_many: the tensors must share head_dim")
    patch_interpreter()
    device = tensors[0].device
    out = torch.zeros(len(tensors), dtype=torch.int32, device=device)
    block_r, block_d = _blocks(d)
    rows = max(x.shape[0] * x.shape[1] for x in tensors)
    if rows == 0 or d == 0:
        return out.view(torch.float32)
    slots = list(tensors) + [tensors[0]] * (3 - len(tensors))  # unused slots: grid axis 1 never reaches them
    args: list[object] = []
    for x in slots:
        args += [x, x.shape[0], x.shape[1], *x.stride()]
    grid = (triton.cdiv(rows, block_r), len(tensors))
    _amax_kernel[grid](*args, d, out, BLOCK_R=block_r, BLOCK_D=block_d)
    return out.view(torch.float32)


def quantize_e4m3(
    x: torch.Tensor,
    scale: torch.Tensor,
    layout: Layout,
    cu_seqlens: torch.Tensor,
    *,
    record_amax: bool = True,
    amax_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """E4M3 codes of ``x * scale`` in ``layout`` (float8_e4m3fn, (layout.rows, H, D), pad rows zero) and,
    with ``record_amax``, max |x| as a (1,) fp32 tensor from the same pass (else None).

    x: (T, H, D) with T == layout.tokens, any strides; scale: a 1-element fp32 tensor on x's device;
    cu_seqlens: int32 (batch + 1,) of this side of the pack (read by the padded layout only).
    amax_out: a zeroed 1-element int32 tensor to reduce the amax into (its bits; several calls can share
    one zeroed buffer), else one is allocated.
    """
    _check_rows("x", x)
    if x.shape[0] != layout.tokens:
        raise ValueError(f"x has {x.shape[0]} tokens, the layout {layout.tokens}")
    patch_interpreter()
    t, h, d = x.shape
    codes = torch.empty((layout.rows, h, d), dtype=torch.float8_e4m3fn, device=x.device)
    amax = torch.zeros(1, dtype=torch.int32, device=x.device) if amax_out is None else amax_out
    if amax.dtype != torch.int32 or amax.numel() != 1:
        raise ValueError("amax_out must be a 1-element int32 tensor")
    nrows = layout.rows * h
    if nrows and d:
        block_r, block_d = _blocks(d)
        native = _native()
        _quantize_kernel[(triton.cdiv(nrows, block_r),)](
            x,
            *x.stride(),
            t,
            h,
            d,
            codes if native else codes.view(torch.uint8),
            nrows,
            layout.seq,
            cu_seqlens,
            scale,
            amax,
            PADDED=layout.padded,
            RECORD=record_amax,
            NATIVE=native,
            BLOCK_R=block_r,
            BLOCK_D=block_d,
        )
    return codes, (amax.view(torch.float32) if record_amax else None)


def dequantize_e4m3(
    codes: torch.Tensor,
    descale: torch.Tensor,
    layout: Layout,
    cu_seqlens: torch.Tensor,
    dtype: torch.dtype,
) -> torch.Tensor:
    """The packed rows (layout.tokens, H, D) of E4M3 ``codes`` (layout.rows, H, D) times ``descale``
    (a 1-element fp32 tensor), rounded to nearest even to ``dtype`` (bfloat16 or float16)."""
    if codes.dtype != torch.float8_e4m3fn or codes.dim() != 3 or codes.shape[0] != layout.rows:
        raise ValueError(f"codes must be float8_e4m3fn ({layout.rows}, H, D), got {codes.dtype} {tuple(codes.shape)}")
    if dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"dequantize to bfloat16 or float16, not {dtype}")
    patch_interpreter()
    _, h, d = codes.shape
    codes = codes.contiguous()
    out = torch.empty((layout.tokens, h, d), dtype=dtype, device=codes.device)
    nrows = layout.rows * h
    if nrows and d and layout.tokens:
        block_r, block_d = _blocks(d)
        native = _native()
        _dequantize_kernel[(triton.cdiv(nrows, block_r),)](
            codes.view(torch.uint8),  # loaded as bytes (a masked fp8 load has no zero to fill with)
            nrows,
            layout.tokens,
            h,
            d,
            layout.seq,
            cu_seqlens,
            out,
            descale,
            PADDED=layout.padded,
            IS_FP16=dtype == torch.float16,
            NATIVE=native,
            BLOCK_R=block_r,
            BLOCK_D=block_d,
        )
    return out


# ----------------------------------------------------------------------------------------------
# the twins: slow and obviously correct
# ----------------------------------------------------------------------------------------------


def amax_reference(x: torch.Tensor) -> torch.Tensor:
    """max |x| in fp32 (a 0-d tensor): NaN if any element is NaN (torch.amax propagates it), 0 when empty."""
    if x.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=x.device)
    return x.detach().to(torch.float32).abs().amax()


def quantize_e4m3_reference(
    x: torch.Tensor, scale: torch.Tensor, layout: Layout, cu_seqlens: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The twin of :func:`quantize_e4m3`: (codes (layout.rows, H, D) float8_e4m3fn, amax 0-d fp32)."""
    xf = x.detach().to(torch.float32)
    y = xf * scale.detach().to(torch.float32).reshape(())
    y = torch.where(torch.isnan(xf) | torch.isinf(xf), torch.full_like(y, float("nan")), y)
    codes = encode(y, E4M3, saturate=True)  # RNE, +-448 saturation, NaN -> 0x7F
    placed = to_layout_reference(codes, layout, cu_seqlens)  # pad rows: code 0 (+0.0)
    return placed.view(torch.float8_e4m3fn), amax_reference(x)


def dequantize_e4m3_reference(
    codes: torch.Tensor, descale: torch.Tensor, layout: Layout, cu_seqlens: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """The twin of :func:`dequantize_e4m3`."""
    values = decode(codes.view(torch.uint8), E4M3) * descale.detach().to(torch.float32).reshape(())
    return from_layout_reference(values, layout, cu_seqlens).to(dtype)
