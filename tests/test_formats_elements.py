"""Element formats: bit-exact against independent oracles, exhaustive over bf16/fp16, every boundary.

Oracles, each independent of ``round_to_format``'s arithmetic:
- torch's float8_e4m3fn / float8_e5m2 / float8_e8m0fnu casts and views,
- ml_dtypes' float8_e4m3fn / float8_e5m2 / float4_e2m1fn / float8_e8m0fnu,
- ``exact_round``: a slow rational (``fractions.Fraction``) round-to-nearest-even over a grid built
  from the bit-field definition.
torch 2.13 has no conversion for float4_e2m1fn_x2 (its copy kernel is not implemented), so E2M1 is
checked against ml_dtypes, the rational reference and FORMATS.md's table of ties.

``assert_same`` is the comparison engine of every formats test (imported by the other
test_formats_* files).
"""

from __future__ import annotations

import bisect
import math
from fractions import Fraction

import ml_dtypes
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flamia_verify.formats import (
    E2M1,
    E4M3,
    E5M2,
    UE4M3,
    ElementFormat,
    decode,
    e8m0_decode,
    e8m0_exponent,
    e8m0_from_exponent,
    encode,
    round_to_format,
)
from flamia_verify.formats import (
    constants as C,
)

FORMATS = [E4M3, E5M2, E2M1, UE4M3]
ML_DTYPE = {
    "e4m3": ml_dtypes.float8_e4m3fn,
    "e5m2": ml_dtypes.float8_e5m2,
    "e2m1": ml_dtypes.float4_e2m1fn,
    "ue4m3": ml_dtypes.float8_e4m3fn,
}
TORCH_DTYPE = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
HYPOTHESIS = settings(max_examples=60, deadline=None)


# ----------------------------------------------------------------------------------------------
# Comparison engine


def _as_tensor(a) -> torch.Tensor:
    if isinstance(a, torch.Tensor):
        return a.detach().cpu()
    arr = np.asarray(a)
    if arr.dtype.kind == "V" or arr.dtype.name in {"float8_e4m3fn", "float8_e5m2", "float4_e2m1fn", "float8_e8m0fnu"}:
        arr = arr.astype(np.float32)
    return torch.from_numpy(np.ascontiguousarray(arr))


def _fmt_value(v) -> str:
    if isinstance(v, float):
        return f"{v!r} ({v.hex()})"
    return repr(v)


def assert_same(actual, expected, *, what: str, inputs=None, max_show: int = 6) -> None:
    """Bit-exact comparison with a message that says everything.

    Floats: NaN locations are compared first, then every non-NaN pair by its bit pattern (so
    -0.0 and +0.0 differ). Integers: plain equality. The message names what was compared, the
    number of mismatches, and the first indices with actual, expected and (when given) input.
    """
    a, e = _as_tensor(actual), _as_tensor(expected)
    if a.shape != e.shape:
        raise AssertionError(f"{what}: shape {tuple(a.shape)} != expected {tuple(e.shape)}")
    x = None if inputs is None else _as_tensor(inputs)
    if x is not None and x.shape != a.shape:
        x = x.expand(a.shape) if x.dim() <= a.dim() else None
    if a.dtype.is_floating_point or e.dtype.is_floating_point:
        a64, e64 = a.to(torch.float64), e.to(torch.float64)
        a_nan, e_nan = torch.isnan(a64), torch.isnan(e64)
        bad = (a_nan != e_nan) | (~a_nan & ~e_nan & (a64.view(torch.int64) != e64.view(torch.int64)))
        kind = "NaN location or bit pattern"
        to_py = float
    else:
        bad = a.to(torch.int64) != e.to(torch.int64)
        kind = "value"
        to_py = int
    n = int(bad.sum())
    if n == 0:
        return
    total = bad.numel()
    lines = [f"{what}: {n} / {total} ({100.0 * n / total:.3g}%) elements differ ({kind})"]
    if a.dtype.is_floating_point:
        nan_mismatch = int((torch.isnan(a.double()) != torch.isnan(e.double())).sum())
        if nan_mismatch:
            lines.append(f"  NaN locations differ at {nan_mismatch} element(s)")
    for idx in torch.nonzero(bad)[:max_show].tolist():
        idx = tuple(idx)
        line = f"  at {idx}: actual={_fmt_value(to_py(a[idx]))} expected={_fmt_value(to_py(e[idx]))}"
        if x is not None:
            line += f" input={_fmt_value(float(x[idx]) if x.dtype.is_floating_point else int(x[idx]))}"
        lines.append(line)
    if a.dtype.is_floating_point and not torch.isnan(a.double()[bad]).any() and not torch.isnan(e.double()[bad]).any():
        diff = (a.double() - e.double()).abs()[bad]
        lines.append(f"  max |actual - expected| among mismatches: {float(diff.max())!r}")
    raise AssertionError("\n".join(lines))


def test_assert_same_reports_location_and_values():
    with pytest.raises(AssertionError) as info:
        assert_same(
            torch.tensor([1.0, -0.0, float("nan")]),
            torch.tensor([1.0, 0.0, 2.0]),
            what="demo",
            inputs=torch.tensor([1.0, 2.0, 3.0]),
        )
    message = str(info.value)
    assert "demo: 2 / 3" in message and "at (1,)" in message and "at (2,)" in message
    assert "NaN locations differ" in message and "input=" in message
    assert_same(torch.tensor([float("nan"), -0.0]), torch.tensor([float("nan"), -0.0]), what="equal")


# ----------------------------------------------------------------------------------------------
# Slow exact reference: the grid from the bit-field definition, rounding in rationals


def grid(fmt: ElementFormat) -> list[Fraction]:
    """Non-negative finite values in code order (code == index), from the field definition."""
    values = []
    emin = 1 - fmt.bias
    for exp_field in range(1 << fmt.exp_bits):
        for man_field in range(1 << fmt.man_bits):
            if fmt.name in ("e4m3", "ue4m3") and exp_field == 15 and man_field == 7:
                continue  # S.1111.111 is NaN (OFP8)
            if fmt.name == "e5m2" and exp_field == 31:
                continue  # Inf and NaN (OFP8, IEEE-like)
            if exp_field == 0:
                values.append(Fraction(man_field, 1 << fmt.man_bits) * Fraction(2) ** emin)
            else:
                values.append((1 + Fraction(man_field, 1 << fmt.man_bits)) * Fraction(2) ** (exp_field - fmt.bias))
    assert values == sorted(values)
    return values


_GRIDS = {f.name: grid(f) for f in FORMATS}


def exact_round(v: float, fmt: ElementFormat, saturate: bool) -> float:
    """Round-to-nearest-even of the exact value v onto fmt, in rational arithmetic."""
    if math.isnan(v):
        return math.nan
    g = _GRIDS[fmt.name]
    if not fmt.signed and (v < 0 or (v == 0 and math.copysign(1, v) < 0)):
        return 0.0 if (saturate or v == 0) else math.nan
    sign = -1.0 if math.copysign(1.0, v) < 0 else 1.0
    no_specials = not (fmt.has_inf or fmt.has_nan)
    if math.isinf(v):
        if saturate or no_specials:
            return sign * float(g[-1])
        return sign * math.inf if fmt.has_inf else math.nan
    a = abs(Fraction(v))
    top = g[-1]
    if a > top:
        if saturate or no_specials:
            return sign * float(top)
        virtual = top + (top - g[-2])  # next value with an unbounded exponent: code len(g)
        mid = (top + virtual) / 2
        if a < mid or (a == mid and (len(g) - 1) % 2 == 0):
            return sign * float(top)
        return sign * math.inf if fmt.has_inf else math.nan
    i = bisect.bisect_left(g, a)
    if g[i] == a:
        return sign * float(a)
    lo, hi = g[i - 1], g[i]
    if a - lo < hi - a or (a - lo == hi - a and (i - 1) % 2 == 0):
        return sign * float(lo)
    return sign * float(hi)


def test_grid_matches_constants():
    for fmt in FORMATS:
        g = _GRIDS[fmt.name]
        assert float(g[-1]) == fmt.max_finite, fmt
        assert float(g[1]) == fmt.min_subnormal, fmt
        assert float(min(v for v in g if v >= Fraction(2) ** (1 - fmt.bias))) == fmt.min_normal, fmt
    assert [float(v) for v in _GRIDS["e2m1"]] == list(C.E2M1_MAGNITUDES)
    assert len(_GRIDS["e4m3"]) == C.E4M3_MAX_CODE + 1 and len(_GRIDS["e5m2"]) == C.E5M2_MAX_CODE + 1
    assert E4M3.emax == C.E4M3_EMAX and E5M2.emax == C.E5M2_EMAX and E2M1.emax == C.E2M1_EMAX
    assert C.NVFP4_GLOBAL_DIVISOR == 2688.0
    assert E4M3.unit_roundoff == 2.0**-4 and E5M2.unit_roundoff == 2.0**-3 and E2M1.unit_roundoff == 2.0**-2
    assert E4M3.ulp_at_one == 2.0**-3


# ----------------------------------------------------------------------------------------------
# Oracles


def oracle_ml(x: torch.Tensor, fmt: ElementFormat, saturate: bool) -> torch.Tensor:
    """ml_dtypes cast (non-saturating); clamped first when saturating; UE4M3 via E4M3 of x >= 0."""
    xs = x.double().numpy()
    if saturate:
        xs = np.clip(xs, -fmt.max_finite, fmt.max_finite)
    r = xs.astype(ML_DTYPE[fmt.name]).astype(np.float32)
    if not fmt.signed:
        neg = np.signbit(xs) & ~np.isnan(xs)
        r = np.where(neg & (xs != 0), np.float32(0.0 if saturate else np.nan), r)
        r = np.where(neg & (xs == 0), np.float32(0.0), r)
    return torch.from_numpy(r.astype(np.float32))


def oracle_torch(x: torch.Tensor, fmt: ElementFormat, saturate: bool) -> torch.Tensor:
    """torch float8 cast; clamped first when saturating (older torch casts did not saturate)."""
    xs = x.float()
    if saturate:
        xs = xs.clamp(-fmt.max_finite, fmt.max_finite)
    return xs.to(TORCH_DTYPE[fmt.name]).to(torch.float32)


def all_bf16() -> torch.Tensor:
    return torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)


def all_fp16() -> torch.Tensor:
    return torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(torch.float16)


def boundary_points(fmt: ElementFormat) -> torch.Tensor:
    """Every grid value, every midpoint between neighbours (and beyond max), and one fp32 ulp either
    side of each, with both signs: float32."""
    g = [float(v) for v in _GRIDS[fmt.name]]
    ext = g + [g[-1] + (g[-1] - g[-2])]
    mids = [(ext[i] + ext[i + 1]) / 2 for i in range(len(ext) - 1)]
    pts = np.array(g + mids + [2 * ext[-1], 1e30, fmt.min_subnormal / 4], dtype=np.float32)
    assert all(float(np.float32(m)) == m for m in mids), "midpoints must be exact in fp32"
    up = np.nextafter(pts, np.float32(np.inf))
    down = np.nextafter(pts, np.float32(-np.inf))
    allp = np.concatenate([pts, up, down])
    allp = np.concatenate([allp, -allp, np.array([np.inf, -np.inf, np.nan], dtype=np.float32)])
    return torch.from_numpy(allp.astype(np.float32))


# ----------------------------------------------------------------------------------------------
# round_to_format


@pytest.mark.parametrize("saturate", [True, False], ids=["sat", "nosat"])
@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("source", ["bf16", "fp16"])
def test_round_exhaustive_16bit_vs_ml_dtypes(fmt, saturate, source):
    x = all_bf16() if source == "bf16" else all_fp16()
    got = round_to_format(x, fmt, saturate=saturate)
    if fmt is E2M1:  # ml_dtypes maps NaN to -0 for E2M1; we keep NaN in the float32 result
        nan = torch.isnan(x)
        assert torch.isnan(got[nan]).all()
        keep = ~nan
        assert_same(
            got[keep],
            oracle_ml(x[keep], fmt, saturate),
            what=f"{fmt.name} all {source} vs ml_dtypes",
            inputs=x[keep].float(),
        )
    else:
        assert_same(got, oracle_ml(x, fmt, saturate), what=f"{fmt.name} all {source} vs ml_dtypes", inputs=x.float())


# torch 2.13's E4M3 cast saturates, so it is no oracle for E4M3 without saturation (ml_dtypes is)
@pytest.mark.parametrize(
    ("fmt", "saturate"), [(E4M3, True), (E5M2, True), (E5M2, False)], ids=["e4m3-sat", "e5m2-sat", "e5m2-nosat"]
)
def test_round_exhaustive_bf16_vs_torch_cast(fmt, saturate):
    x = all_bf16()
    got = round_to_format(x, fmt, saturate=saturate)
    assert_same(got, oracle_torch(x, fmt, saturate), what=f"{fmt.name} all bf16 vs torch cast", inputs=x.float())


@pytest.mark.parametrize("saturate", [True, False], ids=["sat", "nosat"])
@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_round_every_boundary(fmt, saturate):
    x = boundary_points(fmt)
    got = round_to_format(x, fmt, saturate=saturate)
    exact = torch.tensor([exact_round(float(v), fmt, saturate) for v in x.tolist()], dtype=torch.float32)
    assert_same(got, exact, what=f"{fmt.name} boundaries vs exact rational rounding", inputs=x)
    finite = ~torch.isnan(x) if fmt is E2M1 else torch.ones_like(x, dtype=torch.bool)
    assert_same(
        got[finite], oracle_ml(x[finite], fmt, saturate), what=f"{fmt.name} boundaries vs ml_dtypes", inputs=x[finite]
    )
    if fmt.name in TORCH_DTYPE and (saturate or fmt is E5M2):
        assert_same(got, oracle_torch(x, fmt, saturate), what=f"{fmt.name} boundaries vs torch cast", inputs=x)


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_round_random_fp32_bit_patterns(fmt):
    gen = torch.Generator().manual_seed(1234)
    bits = torch.randint(-(2**31), 2**31 - 1, (1 << 18,), generator=gen, dtype=torch.int64).to(torch.int32)
    x = bits.view(torch.float32)
    x = x[~torch.isnan(x)]
    for saturate in (True, False):
        assert_same(
            round_to_format(x, fmt, saturate=saturate),
            oracle_ml(x, fmt, saturate),
            what=f"{fmt.name} random fp32 bit patterns saturate={saturate} vs ml_dtypes",
            inputs=x,
        )


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_round_float64_is_one_rounding(fmt):
    """float64 inputs a hair off a midpoint must not be rounded to fp32 first (double rounding)."""
    g = [float(v) for v in _GRIDS[fmt.name]]
    mids = np.array([(g[i] + g[i + 1]) / 2 for i in range(len(g) - 1)], dtype=np.float64)
    tiny = np.ldexp(mids, -40)  # far below fp32 resolution, far above fp64's
    x = torch.from_numpy(np.concatenate([mids + tiny, mids - tiny, -(mids + tiny)]))
    exact = torch.tensor([exact_round(v, fmt, True) for v in x.tolist()], dtype=torch.float32)
    assert_same(round_to_format(x, fmt), exact, what=f"{fmt.name} float64 near midpoints vs exact", inputs=x)
    # the same values rounded through float32 first land on the ties and differ somewhere
    assert not torch.equal(round_to_format(x.float(), fmt), exact)


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_round_accepts_every_float_dtype(fmt):
    x = all_bf16()
    x = x[torch.isfinite(x)]
    want = round_to_format(x.float(), fmt)
    for dtype in (torch.bfloat16, torch.float32, torch.float64):
        assert_same(round_to_format(x.to(dtype), fmt), want, what=f"{fmt.name} from {dtype}", inputs=x.float())
    with pytest.raises(TypeError, match="dtype"):
        round_to_format(torch.ones(2, dtype=torch.int32), fmt)


def test_e2m1_ties_from_formats_md():
    x = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -5.0, 7.0, -100.0])
    want = torch.tensor([0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, -0.0, -4.0, 6.0, -6.0])
    assert_same(round_to_format(x, E2M1), want, what="E2M1 ties (FORMATS.md)", inputs=x)


def edge_values(fmt: ElementFormat) -> dict[str, tuple[float, float, float]]:
    """ml_dtypes-style edge values: name -> (input, rounded saturating, rounded not saturating)."""
    eps = fmt.ulp_at_one
    below_one = 1 - max(eps / 2, fmt.min_subnormal)  # E2M1: 1 is the smallest normal, 0.5 lies below
    big_nosat = math.nan if not fmt.has_inf else math.inf
    if not (fmt.has_inf or fmt.has_nan):
        big_nosat = fmt.max_finite
    return {
        "eps": (eps, eps, eps),
        "1+eps": (1 + eps, 1 + eps, 1 + eps),
        "largest below 1": (below_one, below_one, below_one),
        "1+eps/2 (tie to even 1)": (1 + eps / 2, 1.0, 1.0),
        "1+3eps/2 (tie to even 1+2eps)": (1 + 1.5 * eps, 1 + 2 * eps, 1 + 2 * eps),
        "max": (fmt.max_finite, fmt.max_finite, fmt.max_finite),
        "2*max": (2 * fmt.max_finite, fmt.max_finite, big_nosat),
        "inf": (math.inf, fmt.max_finite, big_nosat),
        "min normal": (fmt.min_normal, fmt.min_normal, fmt.min_normal),
        "min subnormal": (fmt.min_subnormal, fmt.min_subnormal, fmt.min_subnormal),
        "min subnormal/2 (tie to 0)": (fmt.min_subnormal / 2, 0.0, 0.0),
        "3/4 min subnormal": (0.75 * fmt.min_subnormal, fmt.min_subnormal, fmt.min_subnormal),
        "zero": (0.0, 0.0, 0.0),
        "nan": (math.nan, math.nan, math.nan),
    }


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_edge_values(fmt):
    edges = edge_values(fmt)
    names = list(edges)
    x = torch.tensor([edges[n][0] for n in names], dtype=torch.float32)
    for col, saturate in ((1, True), (2, False)):
        got = round_to_format(x, fmt, saturate=saturate)
        want = torch.tensor([edges[n][col] for n in names], dtype=torch.float32)
        assert_same(got, want, what=f"{fmt.name} edge values saturate={saturate} ({', '.join(names)})", inputs=x)
        if fmt.signed:
            assert_same(round_to_format(-x, fmt, saturate=saturate), -want, what=f"{fmt.name} negated edges", inputs=-x)


def test_specials_per_format():
    x = torch.tensor([464.0, 465.0, -465.0, float("inf"), float("-inf")])
    assert_same(
        round_to_format(x, E4M3, saturate=False),
        torch.tensor([448.0] + [float("nan")] * 4),
        what="E4M3 overflow without saturation (464 ties to 448, the rest NaN)",
        inputs=x,
    )
    x = torch.tensor([61439.0, 61440.0, -61440.0])
    assert_same(
        round_to_format(x, E5M2, saturate=False),
        torch.tensor([57344.0, float("inf"), float("-inf")]),
        what="E5M2 overflow without saturation (61440 ties to the even 2^16 = Inf)",
        inputs=x,
    )
    x = torch.tensor([-1.0, -0.0, -1e-30, 3.0])
    assert_same(round_to_format(x, UE4M3), torch.tensor([0.0, 0.0, 0.0, 3.0]), what="UE4M3 negatives saturate to +0")
    assert_same(
        round_to_format(x, UE4M3, saturate=False),
        torch.tensor([float("nan"), 0.0, float("nan"), 3.0]),
        what="UE4M3 negatives without saturation",
    )
    x = torch.tensor([-0.0, -1e-30])
    assert_same(round_to_format(x, E4M3), torch.tensor([-0.0, -0.0]), what="signed zeros kept")


# ----------------------------------------------------------------------------------------------
# encode / decode


@pytest.mark.parametrize("fmt", [E4M3, E5M2], ids=lambda f: f.name)
def test_decode_all_codes_vs_oracles(fmt):
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    got = decode(codes, fmt)
    assert_same(
        got, codes.view(TORCH_DTYPE[fmt.name]).to(torch.float32), what=f"{fmt.name} decode vs torch view", inputs=codes
    )
    ml = torch.from_numpy(codes.numpy().view(ML_DTYPE[fmt.name]).astype(np.float32))
    assert_same(got, ml, what=f"{fmt.name} decode vs ml_dtypes view", inputs=codes)


def test_decode_e2m1_and_ue4m3():
    codes = torch.arange(16, dtype=torch.uint8)
    ml = torch.from_numpy(codes.numpy().view(ml_dtypes.float4_e2m1fn).astype(np.float32))
    assert_same(decode(codes, E2M1), ml, what="E2M1 decode vs ml_dtypes", inputs=codes)
    assert_same(decode(codes | 0xF0, E2M1), ml, what="E2M1 decode ignores the high nibble", inputs=codes)
    # two E2M1 codes per byte, low nibble first: the layout of torch.float4_e2m1fn_x2
    packed = (codes[0::2] | (codes[1::2] << 4)).view(torch.float4_e2m1fn_x2)
    unpacked = torch.stack([packed.view(torch.uint8) & 0xF, packed.view(torch.uint8) >> 4], -1).reshape(-1)
    assert_same(decode(unpacked, E2M1), ml, what="E2M1 through float4_e2m1fn_x2 storage")
    all_codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    assert_same(decode(all_codes, UE4M3), decode(all_codes & 0x7F, E4M3), what="UE4M3 ignores bit 7")


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_encode_vs_oracle_bytes(fmt):
    x = torch.cat([all_bf16().float(), boundary_points(fmt)])
    if fmt is E2M1:
        x = x[~torch.isnan(x)]
    codes = encode(x, fmt)
    xs = np.clip(x.double().numpy(), -fmt.max_finite, fmt.max_finite)
    if not fmt.signed:
        xs = np.where(np.signbit(xs) & ~np.isnan(xs), 0.0, xs)
    want = torch.from_numpy(xs.astype(ML_DTYPE[fmt.name]).view(np.uint8).copy())
    nan = torch.isnan(x)
    assert (codes[nan] == fmt.nan_code).all() if fmt.has_nan else True
    assert_same(codes[~nan], want[~nan], what=f"{fmt.name} encode vs ml_dtypes bytes", inputs=x[~nan])
    if fmt.name in TORCH_DTYPE:
        tw = x.clamp(-fmt.max_finite, fmt.max_finite).to(TORCH_DTYPE[fmt.name]).view(torch.uint8)
        assert_same(codes[~nan], tw[~nan], what=f"{fmt.name} encode vs torch bytes", inputs=x[~nan])
    assert_same(decode(codes, fmt), round_to_format(x, fmt), what=f"{fmt.name} decode(encode(x)) == round(x)", inputs=x)


def test_encode_specials():
    x = torch.tensor([float("nan"), float("inf"), float("-inf"), 1e9])
    assert encode(x, E5M2, saturate=False).tolist() == [
        C.E5M2_NAN_CODE,
        C.E5M2_INF_CODE,
        0x80 | C.E5M2_INF_CODE,
        C.E5M2_INF_CODE,
    ]
    assert encode(x, E4M3, saturate=False).tolist() == [C.E4M3_NAN_CODE] * 4
    assert encode(x, E4M3).tolist() == [C.E4M3_NAN_CODE, C.E4M3_MAX_CODE, 0x80 | C.E4M3_MAX_CODE, C.E4M3_MAX_CODE]
    assert encode(torch.tensor([6.0, -6.0, -0.0, 0.5]), E2M1).tolist() == [0x7, 0xF, 0x8, 0x1]
    with pytest.raises(ValueError, match="no NaN"):
        encode(torch.tensor([float("nan")]), E2M1)
    with pytest.raises(TypeError, match="uint8"):
        decode(torch.tensor([1]), E4M3)


# ----------------------------------------------------------------------------------------------
# E8M0


def test_e8m0_decode_all_bytes():
    b = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    got = e8m0_decode(b)
    assert_same(
        got, b.view(torch.float8_e8m0fnu).to(torch.float32), what="E8M0 decode vs torch float8_e8m0fnu", inputs=b
    )
    ml = torch.from_numpy(b.numpy().view(ml_dtypes.float8_e8m0fnu).astype(np.float32))
    assert_same(got, ml, what="E8M0 decode vs ml_dtypes", inputs=b)
    exact = torch.tensor([math.ldexp(1.0, i - 127) for i in range(255)] + [math.nan], dtype=torch.float32)
    assert_same(got, exact, what="E8M0 decode vs 2^(b-127)", inputs=b)


def test_e8m0_byte0_is_subnormal_not_zero_and_254_is_max():
    v = e8m0_decode(torch.tensor([0, 1, 127, 254, 255], dtype=torch.uint8))
    assert float(v[0]) == C.E8M0_MIN == float.fromhex("0x1p-127") and float(v[0]) != 0.0
    assert float(v[0]) < C.FP32_MIN_NORMAL  # an fp32 subnormal
    assert float(v[1]) == C.FP32_MIN_NORMAL and float(v[2]) == 1.0 and float(v[3]) == C.E8M0_MAX
    assert math.isnan(float(v[4]))


def test_e8m0_exponent_roundtrip_and_clamp():
    e = torch.arange(-300, 301, dtype=torch.int32)
    b = e8m0_from_exponent(e)
    assert b.dtype == torch.uint8
    assert_same(b.to(torch.int32), (e + 127).clamp(0, 254), what="e8m0_from_exponent clamps to bytes 0..254", inputs=e)
    inside = (e >= -127) & (e <= 127)
    assert_same(e8m0_exponent(b)[inside], e[inside], what="e8m0_exponent(e8m0_from_exponent(e)) == e", inputs=e[inside])
    assert e8m0_exponent(b).dtype == torch.int32
    assert int(e8m0_exponent(torch.tensor([255], dtype=torch.uint8))) == 128
    with pytest.raises(TypeError):
        e8m0_from_exponent(torch.tensor([1.0]))


# ----------------------------------------------------------------------------------------------
# Properties


finite32 = st.floats(width=32, allow_nan=False, allow_infinity=False)
fmt_strategy = st.sampled_from([E4M3, E5M2, E2M1])


def half_ulp(fmt: ElementFormat, a: torch.Tensor) -> torch.Tensor:
    """Half the grid spacing at |a| (float64), for |a| <= max_finite."""
    e = torch.floor(torch.log2(a.clamp(min=fmt.min_normal))).clamp(max=fmt.emax)
    # log2 of a float64 power of two is exact; nudge values just below one with the exact check
    e = torch.where(torch.exp2(e) > a.clamp(min=fmt.min_normal), e - 1, e)
    return torch.exp2(e - fmt.man_bits - 1)


@HYPOTHESIS
@given(fmt=fmt_strategy, xs=st.lists(finite32, min_size=1, max_size=64), saturate=st.booleans())
def test_property_idempotent(fmt, xs, saturate):
    x = torch.tensor(xs, dtype=torch.float32)
    once = round_to_format(x, fmt, saturate=saturate)
    finite = torch.isfinite(once)
    assert_same(
        round_to_format(once[finite], fmt, saturate=saturate),
        once[finite],
        what=f"{fmt.name} idempotent",
        inputs=x[finite],
    )


@HYPOTHESIS
@given(fmt=fmt_strategy, xs=st.lists(finite32, min_size=2, max_size=64))
def test_property_monotone(fmt, xs):
    x = torch.tensor(sorted(xs), dtype=torch.float32)
    q = round_to_format(x, fmt)
    bad = torch.nonzero(q[1:] < q[:-1])
    assert bad.numel() == 0, f"{fmt.name} not monotone at {bad[:3].tolist()}: x={x.tolist()} q={q.tolist()}"


@HYPOTHESIS
@given(fmt=fmt_strategy, xs=st.lists(finite32, min_size=1, max_size=64))
def test_property_half_ulp_underflow_and_saturation(fmt, xs):
    x = torch.tensor(xs, dtype=torch.float32)
    q = round_to_format(x, fmt).double()
    a = x.double().abs()
    in_range = a <= fmt.max_finite
    err = (q - x.double()).abs()
    bound = half_ulp(fmt, a)
    viol = in_range & (err > bound)
    assert not viol.any(), (
        f"{fmt.name}: |q(x) - x| above half an ulp at {torch.nonzero(viol)[:3].tolist()}: "
        f"x={x[viol][:3].tolist()} q={q[viol][:3].tolist()} bound={bound[viol][:3].tolist()}"
    )
    # relative form for normal values: the unit roundoff
    normal = in_range & (a >= fmt.min_normal)
    assert (err[normal] <= fmt.unit_roundoff * a[normal]).all()
    # underflow: below half the smallest subnormal everything is a (signed) zero
    tiny = a < fmt.min_subnormal / 2
    assert (q[tiny] == 0).all() and torch.equal(torch.signbit(q[tiny]), torch.signbit(x[tiny]))
    # saturation: beyond max, exactly +-max
    big = a > fmt.max_finite
    assert torch.equal(q[big], torch.sign(x[big]).double() * fmt.max_finite)


@HYPOTHESIS
@given(xs=st.lists(st.floats(min_value=0, max_value=1e6, width=32), min_size=1, max_size=32))
def test_property_ue4m3_equals_e4m3_on_non_negatives(xs):
    x = torch.tensor(xs, dtype=torch.float32)
    assert_same(round_to_format(x, UE4M3), round_to_format(x, E4M3), what="UE4M3 == E4M3 for x >= 0", inputs=x)
