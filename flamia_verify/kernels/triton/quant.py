"""In-register rounding and block quantization for the fused attention kernels.

Every function here is a ``@triton.jit`` helper that works on a tile held in registers and
reproduces one quantizer of :mod:`flamia_verify.formats` bit for bit (``quantize_tile`` below runs
each of them in a one-program kernel so that tests can hold them against the formats with
``rtol=0, atol=0``).

All rounding is done with explicit fp32 / int32 arithmetic and never through a float cast:

* ``x.to(tl.float8e4nv)`` is mis-rounded by Triton's interpreter near binade edges, and the
  interpreter's fp32 -> bf16 cast truncates instead of rounding to nearest even. Rounding first to
  the target grid in fp32 makes every later cast exact, so the interpreter and the GPU agree.
* Round to nearest even onto a grid of quantum ``q`` (a power of two) is ``(a + c) - c`` with
  ``c = q * 2^23``: the sum lies in ``[c, 2c)`` whose fp32 spacing is exactly ``q``, so IEEE
  addition performs the RNE rounding and the subtraction is exact (Sterbenz).

Scale exponents come from the fp32 bit pattern of the block amax (no floating log2), exactly as
``formats.blocks.mx_scale_exponent`` derives them with ``frexp``:
RCEIL ``e = floor(log2 amax) - 8 + (mantissa > 1.75)``, FLOOR ``e = floor(log2 amax) - 8``,
clamped to E8M0's ``[-127, 127]``; amax == 0 gives -127 (byte 0) and all-zero data.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from flamia_verify.formats import constants
from flamia_verify.kernels.triton import config
from flamia_verify.kernels.triton.compat import interpreting

__all__ = [
    "KIND_INPUT",
    "KIND_MX",
    "KIND_NVFP4",
    "quantize_tile",
    "round_tile",
]

# operand kinds (constexpr switches of the kernels); see config.py and emulation.Quant
KIND_INPUT = tl.constexpr(config.KIND_INPUT)  # round to the input dtype (bf16 / fp16)
KIND_MX = tl.constexpr(config.KIND_MX)  # E4M3 elements, power-of-two (E8M0) scale per BLOCK elements
KIND_NVFP4 = tl.constexpr(config.KIND_NVFP4)  # E2M1 elements, 16-blocks, UE4M3 block scale, fp32 row scale

E4M3_MAX = tl.constexpr(constants.E4M3_MAX)  # 448 = 0x1.cp8
E2M1_MAX = tl.constexpr(constants.E2M1_MAX)  # 6 = 0x1.8p2
NVFP4_GLOBAL_DIVISOR = tl.constexpr(2688.0)  # 448 * 6


def _native_e4m3_default() -> bool:
    """The hardware E4M3 conversion: on unless FLAMIA_VERIFY_NATIVE_E4M3 is 0/false/no/off, never under
    the interpreter, and only when every visible GPU has it (float8e4nv needs compute capability 8.9:
    Ada, Hopper and later; older GPUs keep the arithmetic rounding)."""
    if os.environ.get("FLAMIA_VERIFY_NATIVE_E4M3", "1").strip().lower() in ("0", "false", "no", "off"):
        return False
    if interpreting() or not torch.cuda.is_available():
        return False
    try:
        return all(torch.cuda.get_device_capability(i) >= (8, 9) for i in range(torch.cuda.device_count()))
    except RuntimeError:  # a GPU that cannot be queried: the arithmetic rounding runs anywhere
        return False


#: On a GPU, round to E4M3 with the hardware conversion (fp32 -> float8e4nv, which Triton lowers to
#: ``cvt.rn.satfinite.e4m3x2.f32`` on Hopper: RNE, +-448 saturation, NaN kept); under the interpreter
#: (whose float8 cast mis-rounds), on GPUs before compute capability 8.9 and with
#: ``FLAMIA_VERIFY_NATIVE_E4M3=0`` set before importing this module, with the fp32/int32 arithmetic of
#: ``round_grid``. Both are held against the formats bit for bit on a GPU (tests/test_triton_quant.py);
#: the hardware conversion is the faster one (benchmarks/RESULTS.md).
NATIVE_E4M3 = tl.constexpr(_native_e4m3_default())


@triton.jit
def max_keep_nan(a, b):
    """Elementwise maximum that propagates NaN (running amaxes across tiles; ``amax``'s combine)."""
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


#: GPUs: one reduction with a NaN-keeping maximum. The interpreter runs ``tl.reduce`` with a Python
#: combine function element by element (slow), and its ``tl.max`` drops NaN as a GPU's does: there a
#: second reduction marks the blocks that hold a NaN.
_NAN_REDUCE = tl.constexpr(not interpreting())


@triton.jit
def amax(x, AXIS: tl.constexpr):
    """max |x| along AXIS, NaN if any element is NaN (as ``torch.amax`` in the formats: a NaN makes its
    whole block NaN). ``tl.max`` alone drops NaN, on GPUs and in the interpreter."""
    if _NAN_REDUCE:
        return tl.reduce(tl.abs(x), AXIS, max_keep_nan)
    else:
        m = tl.max(tl.abs(x), axis=AXIS)
        return tl.where(tl.max((x != x).to(tl.int32), axis=AXIS) > 0, float("nan"), m)


@triton.jit
def exp2i(e):
    """2^e as fp32 for an int32 tensor e, exactly: normal for e >= -126, subnormal down to 2^-149,
    0 below (the values of ``torch.ldexp(1, e)``)."""
    normal = ((tl.minimum(tl.maximum(e, -126), 127) + 127) << 23).to(tl.float32, bitcast=True)
    shift = tl.minimum(tl.maximum(e + 149, 0), 22)
    sub = ((e * 0 + 1) << shift).to(tl.float32, bitcast=True)
    sub = tl.where(e < -149, 0.0, sub)
    return tl.where(e >= -126, normal, sub)


@triton.jit
def biased_exponent(a):
    """The 8-bit biased exponent field of fp32 ``a`` (0 for zero and subnormals, 255 for Inf/NaN)."""
    return (a.to(tl.int32, bitcast=True) >> 23) & 0xFF


@triton.jit
def round_grid(a, EMIN: tl.constexpr, MAN_BITS: tl.constexpr, MAX: tl.constexpr):
    """Round a >= 0 (fp32) to nearest even on a float grid with MAN_BITS stored mantissa bits and
    minimum normal exponent EMIN, saturating at MAX (NaN passes through)."""
    a = tl.where(a > MAX, MAX, a)
    e = tl.maximum(biased_exponent(a) - 127, EMIN)
    c = exp2i(e - MAN_BITS + 23)
    return (a + c) - c


@triton.jit
def round_e4m3(x):
    """``round_to_format(x, E4M3, saturate=True)``: RNE onto the E4M3 grid, saturating at +-448."""
    if NATIVE_E4M3:
        return x.to(tl.float8e4nv).to(tl.float32)
    else:
        r = round_grid(tl.abs(x), -6, 3, E4M3_MAX)
        return tl.where(x < 0, -r, r)


@triton.jit
def round_e2m1(x):
    """``round_to_format(x, E2M1)``: RNE onto {0, 0.5, 1, 1.5, 2, 3, 4, 6}, saturating at +-6."""
    r = round_grid(tl.abs(x), 0, 1, E2M1_MAX)
    return tl.where(x < 0, -r, r)


@triton.jit
def round_bf16(x):
    """fp32 -> nearest-even bf16 value, kept in fp32 (overflow to +-Inf, NaN kept)."""
    bits = x.to(tl.int32, bitcast=True)
    r = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536  # -65536 == 0xFFFF0000
    return tl.where(x != x, x, r.to(tl.float32, bitcast=True))


@triton.jit
def round_fp16(x):
    """fp32 -> nearest-even fp16 value, kept in fp32 (subnormals below 2^-14, overflow to +-Inf)."""
    a = tl.abs(x)
    e = tl.maximum(biased_exponent(a) - 127, -14)
    c = exp2i(tl.minimum(e, 15) - 10 + 23)
    r = (a + c) - c
    r = tl.where(r > 65504.0, float("inf"), r)
    return tl.where(x < 0, -r, r)


@triton.jit
def round_input(x, IS_FP16: tl.constexpr):
    """Round fp32 values to the kernel's input dtype (values stay fp32)."""
    if IS_FP16:
        return round_fp16(x)
    else:
        return round_bf16(x)


@triton.jit
def mx_exponent(amax, RCEIL: tl.constexpr):
    """E8M0 scale exponent of an E4M3 block from its fp32 amax (>= 0), clamped to [-127, 127]."""
    bits = amax.to(tl.int32, bitcast=True)
    be = (bits >> 23) & 0xFF
    e = be - 127 - 8
    if RCEIL:
        e += ((bits & 0x7FFFFF) > 0x600000).to(tl.int32)  # mantissa > 1.75
    e = tl.where(be == 0, -127, e)  # zero and subnormal amax: below E8M0's range
    return tl.minimum(tl.maximum(e, -127), 127)


@triton.jit
def _mx_apply(x, amax, RCEIL: tl.constexpr, AXIS: tl.constexpr):
    """Fake-quantize ``x`` whose blocks run along AXIS, given each block's amax (``x`` reduced over
    AXIS): a 2-d tile one block wide, or a 3-d view of several blocks."""
    e = mx_exponent(amax, RCEIL)
    data = round_e4m3(x * tl.expand_dims(exp2i(-e), AXIS))
    # a NaN or infinite amax poisons its block through the block's scale: data * NaN is NaN for every
    # element (zeros included), so one select per block replaces one per element (the same bits)
    scale = tl.where(amax < float("inf"), exp2i(e), float("nan"))
    return data * tl.expand_dims(scale, AXIS)


@triton.jit
def mx_last(x, R: tl.constexpr, C: tl.constexpr, BLOCK: tl.constexpr, RCEIL: tl.constexpr):
    """``mx_fake_quantize(x, axis=-1, block_size=BLOCK)`` of an (R, C) fp32 tile (C % BLOCK == 0).
    A tile one block wide is reduced in place; wider tiles go through a 3-d view (a layout change)."""
    tl.static_assert(C % BLOCK == 0)
    if C == BLOCK:
        return _mx_apply(x, amax(x, 1), RCEIL, 1)
    else:
        x3 = tl.reshape(x, (R, C // BLOCK, BLOCK))
        return tl.reshape(_mx_apply(x3, amax(x3, 2), RCEIL, 2), (R, C))


@triton.jit
def mx_first(x, R: tl.constexpr, C: tl.constexpr, BLOCK: tl.constexpr, RCEIL: tl.constexpr):
    """``mx_fake_quantize(x, axis=0, block_size=BLOCK)`` of an (R, C) fp32 tile (R % BLOCK == 0)."""
    tl.static_assert(R % BLOCK == 0)
    if R == BLOCK:
        return _mx_apply(x, amax(x, 0), RCEIL, 0)
    else:
        x3 = tl.reshape(x, (R // BLOCK, BLOCK, C))
        return tl.reshape(_mx_apply(x3, amax(x3, 1), RCEIL, 1), (R, C))


@triton.jit
def nvfp4_row_scale(row_amax):
    """NVFP4's fp32 global scale of each row: max(amax / 2688, 2^-126) (IEEE division), 1 for an all-zero
    row (formats.blocks, NVFP4 step 2: the floor keeps a tiny row's scale from underflowing to 0)."""
    q = tl.math.div_rn(row_amax, tl.full(row_amax.shape, NVFP4_GLOBAL_DIVISOR, tl.float32))
    s_global = tl.where(row_amax == 0, 1.0, tl.maximum(q, 1.1754943508222875e-38))
    return tl.where(row_amax < float("inf"), s_global, float("nan"))


@triton.jit
def nvfp4_blocks(x, row_amax, R: tl.constexpr, C: tl.constexpr, BLOCK: tl.constexpr):
    """NVFP4 of an (R, C) tile along its last axis, without the row scale: ``e2m1 * s_block``.

    row_amax: (R,) fp32, the amax of each whole row (over every tile of the contraction axis). The
    full value is ``nvfp4_blocks(...) * nvfp4_row_scale(row_amax)[:, None]``, in
    the order of ``formats.blocks.nvfp4_quantize``. ``e2m1 * s_block`` has at most 6 significant
    bits, so it is exact in bf16; the fp32 row scale is not, and the kernels apply it to the
    accumulated result of the dot instead (it is the same for every product of an output row).
    """
    tl.static_assert(C % BLOCK == 0)
    sg = nvfp4_row_scale(row_amax)[:, None]
    x3 = tl.reshape(x, (R, C // BLOCK, BLOCK))
    bamax = amax(x3, 2)
    per_elem = tl.math.div_rn(bamax, tl.full(bamax.shape, E2M1_MAX, tl.float32))
    s_block = round_grid(tl.math.div_rn(per_elem, tl.broadcast_to(sg, bamax.shape)), -6, 3, E4M3_MAX)
    s_block = tl.where(bamax < float("inf"), s_block, float("nan"))
    denom = tl.broadcast_to((s_block * sg)[:, :, None], x3.shape)
    data = round_e2m1(tl.math.div_rn(x3, tl.where(denom == 0, 1.0, denom)))
    data = tl.where(denom == 0, 0.0, data)
    return tl.reshape(data * s_block[:, :, None], (R, C))


@triton.jit
def quantize_last(
    x,
    row_amax,
    R: tl.constexpr,
    C: tl.constexpr,
    KIND: tl.constexpr,
    BLOCK: tl.constexpr,
    RCEIL: tl.constexpr,
    IS_FP16: tl.constexpr,
):
    """Round an (R, C) fp32 tile as an operand blocked along its last axis (fp32 values out).

    KIND_INPUT returns x unchanged: the kernels' dot (``attention._mma``) rounds its operands to
    the input dtype, so rounding here too would only cost instructions. KIND_NVFP4 returns the
    operand without its fp32 row scale (``nvfp4_blocks``); the caller multiplies the result rows."""
    if KIND == KIND_MX:
        return mx_last(x, R, C, BLOCK, RCEIL)
    elif KIND == KIND_NVFP4:
        return nvfp4_blocks(x, row_amax, R, C, BLOCK)
    else:
        return x


@triton.jit
def quantize_first(
    x,
    R: tl.constexpr,
    C: tl.constexpr,
    KIND: tl.constexpr,
    BLOCK: tl.constexpr,
    RCEIL: tl.constexpr,
    IS_FP16: tl.constexpr,
):
    """Round an (R, C) fp32 tile as an operand blocked along its first axis (fp32 values out;
    KIND_INPUT: unchanged, see ``quantize_last``)."""
    if KIND == KIND_MX:
        return mx_first(x, R, C, BLOCK, RCEIL)
    else:
        return x


# ----------------------------------------------------------------------------------------------
# test kernels: one program rounds or quantizes one tile and writes it back
# ----------------------------------------------------------------------------------------------

_ROUNDERS = {"e4m3": 0, "e2m1": 1, "bf16": 2, "fp16": 3, "ue4m3": 4}


@triton.jit
def _round_kernel(X, Y, N: tl.constexpr, WHICH: tl.constexpr):
    offs = tl.arange(0, N)
    x = tl.load(X + offs)
    if WHICH == 0:
        y = round_e4m3(x)
    elif WHICH == 1:
        y = round_e2m1(x)
    elif WHICH == 2:
        y = round_bf16(x)
    elif WHICH == 3:
        y = round_fp16(x)
    else:
        y = tl.where(x < 0, 0.0, round_grid(tl.abs(x), -6, 3, E4M3_MAX))
    tl.store(Y + offs, y)


def round_tile(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """Round a 1-d fp32 tensor (length a power of two) in-kernel onto ``fmt``'s grid."""
    x = x.contiguous().to(torch.float32)
    y = torch.empty_like(x)
    _round_kernel[(1,)](x, y, x.numel(), _ROUNDERS[fmt])
    return y


@triton.jit
def _quantize_kernel(
    X,
    Y,
    RowAmax,
    R: tl.constexpr,
    C: tl.constexpr,
    KIND: tl.constexpr,
    BLOCK: tl.constexpr,
    AXIS: tl.constexpr,
    RCEIL: tl.constexpr,
    IS_FP16: tl.constexpr,
):
    rows = tl.arange(0, R)
    cols = tl.arange(0, C)
    x = tl.load(X + rows[:, None] * C + cols[None, :])
    if AXIS == 1:
        amax = tl.load(RowAmax + rows)
        y = quantize_last(x, amax, R, C, KIND, BLOCK, RCEIL, IS_FP16)
        if KIND == KIND_NVFP4:
            y = y * nvfp4_row_scale(amax)[:, None]
    else:
        y = quantize_first(x, R, C, KIND, BLOCK, RCEIL, IS_FP16)
    if KIND == KIND_INPUT:  # what the kernels' dot does to an input-precision operand
        y = round_input(y, IS_FP16)
    tl.store(Y + rows[:, None] * C + cols[None, :], y)


def quantize_tile(
    x: torch.Tensor,
    *,
    kind: int,
    block: int,
    axis: int,
    rceil: bool = True,
    is_fp16: bool = False,
    row_amax: torch.Tensor | None = None,
) -> torch.Tensor:
    """Fake-quantize an (R, C) tile in one Triton program, blocks along ``axis`` (0 or 1).

    kind: KIND_INPUT, KIND_MX or KIND_NVFP4 (NVFP4 along axis 1 only, with the row amax of x as
    its per-row global amax, or ``row_amax``). Returns fp32 (R, C) values, for comparison with the formats.
    """
    x = x.contiguous().to(torch.float32)
    y = torch.empty_like(x)
    row_amax = (x.abs().amax(dim=1) if row_amax is None else row_amax.to(x.device, torch.float32)).contiguous()
    _quantize_kernel[(1,)](x, y, row_amax, x.shape[0], x.shape[1], int(kind), block, axis, rceil, is_fp16)
    return y
