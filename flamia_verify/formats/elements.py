"""Element formats (E4M3, E5M2, E2M1, UE4M3) and the E8M0 scale: rounding, encoding, decoding.

Everything here is computed with explicit float32/float64 arithmetic, never with torch's float8
casts, so that those casts (and ml_dtypes) stay independent oracles for the tests.

How `round_to_format` rounds, and why it is exact
-------------------------------------------------
For an input of magnitude ``a`` the format's grid spacing ("quantum") at ``a`` is
``q = 2^(max(floor(log2 a), emin) - man_bits)``. ``x / q`` divides by a power of two, which is
exact in binary floating point; ``torch.round`` rounds it to the nearest integer with ties to
even; multiplying back by ``q`` is exact again. So the only rounding that happens is the one we
want, done once, on the exact input value: there is no double rounding. Inputs of 32 bits or fewer
(bf16, fp16, fp32) are computed in float32, float64 inputs in float64. ``2^floor(log2 a)`` is the
input's own exponent field (a bit mask); inputs below the format's smallest normal, fp32
subnormals included, use ``2^emin``.

Overflow
--------
``saturate=True`` (the default; CUDA ``cvt.rn.satfinite``): magnitudes are clamped to
``max_finite`` before rounding, so finite overflow and +-Inf give +-max_finite; NaN stays NaN.
``saturate=False`` (ml_dtypes / IEEE): the value is rounded as if the exponent range were
unbounded; a result above ``max_finite`` becomes NaN for formats without Inf (E4M3: 464 -> 448
because the tie goes to the even mantissa, anything above 464 -> NaN) and +-Inf for E5M2
(61440 -> Inf, the tie goes to the even 2^16). E2M1 has neither Inf nor NaN and always saturates.
Results carry no autograd history (inputs are detached): rounding has no useful derivative, and a
silent zero gradient would hide a missing straight-through estimator. A NaN input gives a NaN
output for every format (the float32 result can hold it even where the
format cannot; `encode` refuses to encode NaN as E2M1).

Unsigned formats (UE4M3)
------------------------
The sign bit is unused: ``-0.0`` becomes ``+0.0``; a negative input becomes ``+0.0`` when
saturating (0 is the nearest representable value) and NaN otherwise.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import cast

import torch

from flamia_verify.formats import constants as C

__all__ = [
    "ElementFormat",
    "E4M3",
    "E5M2",
    "E2M1",
    "UE4M3",
    "ELEMENT_FORMATS",
    "round_to_format",
    "encode",
    "decode",
    "e8m0_decode",
    "e8m0_from_exponent",
    "e8m0_exponent",
]


@dataclass(frozen=True)
class ElementFormat:
    """A small binary floating-point format: its layout and its limits.

    Values are ``(-1)^s * 2^(E - bias) * 1.M`` for exponent field E >= 1 and
    ``(-1)^s * 2^(1 - bias) * 0.M`` (subnormals) for E = 0, with the format's own special codes.
    """

    name: str
    exp_bits: int
    man_bits: int
    bias: int
    max_finite: float
    min_normal: float
    min_subnormal: float
    has_inf: bool
    has_nan: bool
    signed: bool = True
    #: code written for NaN by `encode` (sign bit clear), or None when the format has no NaN
    nan_code: int | None = None
    #: code of +Inf (sign bit clear), or None when the format has no Inf
    inf_code: int | None = None

    @property
    def emin(self) -> int:
        """Exponent of the smallest normal value: 1 - bias."""
        return 1 - self.bias

    @property
    def emax(self) -> int:
        """Exponent of the largest finite value: floor(log2 max_finite) (OCP's emax_elem)."""
        return math.frexp(self.max_finite)[1] - 1

    @property
    def ulp_at_one(self) -> float:
        """Spacing of the grid in [1, 2): 2^-man_bits (machine epsilon)."""
        return math.ldexp(1.0, -self.man_bits)

    @property
    def unit_roundoff(self) -> float:
        """Largest relative rounding error for normal values, round to nearest: 2^-(man_bits+1)."""
        return math.ldexp(1.0, -(self.man_bits + 1))

    @property
    def code_bits(self) -> int:
        """Width of a code: sign (when signed) + exponent + mantissa bits."""
        return int(self.signed) + self.exp_bits + self.man_bits

    def __repr__(self) -> str:
        return f"ElementFormat({self.name})"


E4M3 = ElementFormat(
    name="e4m3",
    exp_bits=C.E4M3_EXP_BITS,
    man_bits=C.E4M3_MAN_BITS,
    bias=C.E4M3_BIAS,
    max_finite=C.E4M3_MAX,
    min_normal=C.E4M3_MIN_NORMAL,
    min_subnormal=C.E4M3_MIN_SUBNORMAL,
    has_inf=False,
    has_nan=True,
    signed=True,
    nan_code=C.E4M3_NAN_CODE,
)
E5M2 = ElementFormat(
    name="e5m2",
    exp_bits=C.E5M2_EXP_BITS,
    man_bits=C.E5M2_MAN_BITS,
    bias=C.E5M2_BIAS,
    max_finite=C.E5M2_MAX,
    min_normal=C.E5M2_MIN_NORMAL,
    min_subnormal=C.E5M2_MIN_SUBNORMAL,
    has_inf=True,
    has_nan=True,
    signed=True,
    nan_code=C.E5M2_NAN_CODE,
    inf_code=C.E5M2_INF_CODE,
)
E2M1 = ElementFormat(
    name="e2m1",
    exp_bits=C.E2M1_EXP_BITS,
    man_bits=C.E2M1_MAN_BITS,
    bias=C.E2M1_BIAS,
    max_finite=C.E2M1_MAX,
    min_normal=C.E2M1_MIN_NORMAL,
    min_subnormal=C.E2M1_MIN_SUBNORMAL,
    has_inf=False,
    has_nan=False,
    signed=True,
)
UE4M3 = ElementFormat(
    name="ue4m3",
    exp_bits=C.E4M3_EXP_BITS,
    man_bits=C.E4M3_MAN_BITS,
    bias=C.E4M3_BIAS,
    max_finite=C.UE4M3_MAX,
    min_normal=C.E4M3_MIN_NORMAL,
    min_subnormal=C.UE4M3_MIN_SUBNORMAL,
    has_inf=False,
    has_nan=True,
    signed=False,
    nan_code=C.E4M3_NAN_CODE,
)

#: every element format by name
ELEMENT_FORMATS: dict[str, ElementFormat] = {f.name: f for f in (E4M3, E5M2, E2M1, UE4M3)}


def _check_float(x: torch.Tensor, what: str) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in (torch.float64, torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(
            f"{what} must have dtype float64, float32, float16 or bfloat16, got {x.dtype}; "
            "convert it first (float8 tensors: .to(torch.float32) is exact)"
        )


def _work_dtype(x: torch.Tensor) -> torch.dtype:
    """float64 for float64 input, float32 otherwise (bf16 and fp16 convert to float32 exactly)."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def pow2(k: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """2^k, exact, built from its bit pattern; k must lie in the dtype's normal exponent range."""
    if dtype == torch.float64:
        return ((k.to(torch.int64) + 1023) << 52).view(torch.float64)
    if dtype == torch.float32:
        return ((k.to(torch.int32) + 127) << 23).view(torch.float32)
    raise TypeError(f"pow2 builds float32 or float64, not {dtype}")


def floor_log2(a: torch.Tensor) -> torch.Tensor:
    """floor(log2 a) as int32 for positive finite a (normal or subnormal), exact via frexp."""
    return torch.frexp(a)[1] - 1


# bit masks of the exponent field: (bits & mask) is 2^floor(log2 |x|) for normal x, 0 for
# subnormal x and zero, Inf for Inf and NaN (the sign bit is masked off)
_EXPONENT_MASK = {torch.float32: (torch.int32, 0x7F800000), torch.float64: (torch.int64, 0x7FF0000000000000)}


def binade(x: torch.Tensor) -> torch.Tensor:
    """2^floor(log2 |x|) for normal float32/float64 x (0 for subnormals and zeros), exact."""
    int_dtype, mask = _EXPONENT_MASK[x.dtype]
    return (x.view(int_dtype) & mask).view(x.dtype)


def round_to_format(x: torch.Tensor, fmt: ElementFormat, *, saturate: bool = True) -> torch.Tensor:
    """Round ``x`` to the nearest value of ``fmt`` (ties to even); float32 result, same shape.

    x: any shape, float64 / float32 / float16 / bfloat16. Every input is rounded once, exactly
    (see the module docstring). Overflow: see the module docstring (``saturate``).
    """
    _check_float(x, "x")
    xw = x.detach().to(_work_dtype(x))
    saturating = saturate or not (fmt.has_inf or fmt.has_nan)
    if saturating:
        xw = xw.clamp(-fmt.max_finite, fmt.max_finite)  # NaN passes through clamp unchanged
    # quantum q = 2^(max(floor(log2 |x|), emin) - man_bits); x / q and r * q are exact
    q = binade(xw).clamp_(min=math.ldexp(1.0, fmt.emin)).mul_(math.ldexp(1.0, -fmt.man_bits))
    r = (xw / q).round_().mul_(q)  # torch.round (in place): ties to even; the sign of zero is kept
    if not saturating:
        r = torch.where(torch.isinf(xw), xw, r)  # Inf / Inf gave NaN above
        overflow_value = math.inf if fmt.has_inf else math.nan
        r = torch.where(r.abs() > fmt.max_finite, torch.copysign(torch.full_like(r, overflow_value), xw), r)
    if not fmt.signed:
        r = torch.where(xw < 0, 0.0 if saturate else math.nan, r)
        r = r + 0.0  # -0.0 + 0.0 = +0.0: no sign bit
    return r.to(torch.float32)


def encode(x: torch.Tensor, fmt: ElementFormat, *, saturate: bool = True) -> torch.Tensor:
    """Round ``x`` to ``fmt`` and return its codes as uint8 (same shape).

    Layout: sign | exponent | mantissa, right-aligned: E4M3/E5M2 use all 8 bits, E2M1 the low 4
    bits (sign = bit 3), UE4M3 the low 7 bits (bit 7 = 0). NaN is written as ``fmt.nan_code``
    (sign bit clear; E4M3 0x7F, E5M2 0x7F), Inf as ``fmt.inf_code`` with its sign. E2M1 has no
    NaN: a NaN input raises ValueError.
    """
    r = round_to_format(x, fmt, saturate=saturate)
    nan = torch.isnan(r)
    if not fmt.has_nan and bool(nan.any()):
        raise ValueError(
            f"{int(nan.sum())} NaN value(s) cannot be encoded as {fmt.name}, which has no NaN; "
            "keep the float32 values from round_to_format instead"
        )
    a = r.abs()
    sub = a < fmt.min_normal
    e = floor_log2(torch.where(sub, torch.ones_like(a), a)).clamp_(min=fmt.emin, max=fmt.emax + 1)
    exp_field = torch.where(sub, torch.zeros_like(e), e + fmt.bias)
    frac = torch.where(sub, a / fmt.min_subnormal, (a / pow2(e) - 1.0) * (1 << fmt.man_bits))
    man_field = torch.nan_to_num(frac, nan=0.0, posinf=0.0).to(torch.int32)
    code = (exp_field << fmt.man_bits) | man_field
    if fmt.signed:
        code = code | (torch.signbit(r).to(torch.int32) << (fmt.exp_bits + fmt.man_bits))
    if fmt.has_inf:
        inf_code = cast(int, fmt.inf_code) | (torch.signbit(r).to(torch.int32) << 7)
        code = torch.where(torch.isinf(r), inf_code, code)
    if fmt.has_nan:
        code = torch.where(nan, torch.full_like(code, cast(int, fmt.nan_code)), code)
    return code.to(torch.uint8)


@functools.cache
def _decode_table(fmt: ElementFormat) -> tuple[float, ...]:
    """Value of every code 0 .. 2^code_bits - 1, computed from the fields with exact math.ldexp."""
    values = []
    sign_shift = fmt.exp_bits + fmt.man_bits
    for code in range(1 << fmt.code_bits):
        sign = -1.0 if (fmt.signed and code >> sign_shift & 1) else 1.0
        exp_field = (code >> fmt.man_bits) & ((1 << fmt.exp_bits) - 1)
        man_field = code & ((1 << fmt.man_bits) - 1)
        magnitude_code = code & ((1 << sign_shift) - 1)
        if fmt.has_nan and magnitude_code == fmt.nan_code:
            values.append(math.nan)
        elif fmt.has_inf and magnitude_code == fmt.inf_code:
            values.append(sign * math.inf)
        elif fmt.has_inf and fmt.has_nan and exp_field == (1 << fmt.exp_bits) - 1:
            values.append(math.nan)  # IEEE-like: the all-ones exponent with a nonzero mantissa
        elif exp_field == 0:
            values.append(sign * math.ldexp(man_field, fmt.emin - fmt.man_bits))
        else:
            values.append(sign * math.ldexp((1 << fmt.man_bits) + man_field, exp_field - fmt.bias - fmt.man_bits))
    return tuple(values)


def decode(codes: torch.Tensor, fmt: ElementFormat) -> torch.Tensor:
    """Values (float32) of uint8 ``codes`` of ``fmt``: a lookup into a table built from the fields.

    Bits above the format's code width are ignored (E2M1: the high nibble; UE4M3: bit 7).
    """
    if not isinstance(codes, torch.Tensor) or codes.dtype != torch.uint8:
        raise TypeError(f"codes must be a uint8 tensor, got {getattr(codes, 'dtype', type(codes).__name__)}")
    index = (codes & ((1 << fmt.code_bits) - 1)).to(torch.int64)
    return _decode_table_tensor(fmt, codes.device)[index]


@functools.cache
def _decode_table_tensor(fmt: ElementFormat, device: torch.device) -> torch.Tensor:
    """``_decode_table(fmt)`` as a float32 tensor on ``device``, built once per format and device.
    Shared by every call: it is only ever indexed (the result is a new tensor), never handed out."""
    return torch.tensor(_decode_table(fmt), dtype=torch.float32, device=device)


@functools.cache
def _e8m0_table() -> tuple[float, ...]:
    # byte b -> 2^(b - 127) for b in 0..254 (byte 0 is 2^-127, an fp32 subnormal); 0xFF -> NaN
    return tuple(math.ldexp(1.0, b - C.E8M0_BIAS) for b in range(C.E8M0_MAX_BYTE + 1)) + (math.nan,)


def e8m0_decode(b: torch.Tensor) -> torch.Tensor:
    """E8M0 bytes (uint8, any shape) -> float32 scales 2^(b - 127); 0xFF -> NaN.

    Byte 0 is 2^-127 = 0x1p-127, an fp32 subnormal, and comes out as such (never 0).
    """
    if not isinstance(b, torch.Tensor) or b.dtype != torch.uint8:
        raise TypeError(f"E8M0 bytes must be a uint8 tensor, got {getattr(b, 'dtype', type(b).__name__)}")
    return _e8m0_table_tensor(b.device)[b.to(torch.int64)]


@functools.cache
def _e8m0_table_tensor(device: torch.device) -> torch.Tensor:
    """``_e8m0_table()`` as a float32 tensor on ``device``, built once per device. Shared by every
    call: it is only ever indexed (the result is a new tensor), never handed out."""
    return torch.tensor(_e8m0_table(), dtype=torch.float32, device=device)


def e8m0_from_exponent(e: torch.Tensor) -> torch.Tensor:
    """Unbiased exponents (integer tensor) -> E8M0 bytes (uint8), clamped to bytes 0..254.

    Exponents below -127 give byte 0 (2^-127), above 127 give byte 254 (2^127); never 0xFF.
    """
    if e.dtype.is_floating_point or e.dtype == torch.bool:
        raise TypeError(f"exponents must be an integer tensor, got {e.dtype}")
    biased = e.to(torch.int64) + C.E8M0_BIAS
    return biased.clamp(C.E8M0_MIN_BYTE, C.E8M0_MAX_BYTE).to(torch.uint8)


def e8m0_exponent(b: torch.Tensor) -> torch.Tensor:
    """E8M0 bytes (uint8) -> unbiased exponents b - 127 (int32). The NaN byte 0xFF gives 128."""
    if not isinstance(b, torch.Tensor) or b.dtype != torch.uint8:
        raise TypeError(f"E8M0 bytes must be a uint8 tensor, got {getattr(b, 'dtype', type(b).__name__)}")
    return b.to(torch.int32) - C.E8M0_BIAS
