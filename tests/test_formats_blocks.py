"""Block quantizers (MX, NVFP4, scaled FP8): bit-exact against slow per-block references.

The references below loop over blocks in Python, take exponents with ``math.frexp`` and
rational arithmetic, and round elements with ml_dtypes casts, so they share no code with
``flamia_verify.formats.blocks`` (which is vectorized and rounds with ``round_to_format``).
"""

from __future__ import annotations

import math
from fractions import Fraction

import ml_dtypes
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flamia_verify.errors import InputError
from flamia_verify.formats import (
    E2M1,
    E4M3,
    E5M2,
    MXTensor,
    NVFP4Tensor,
    ScaleRule,
    block_layout,
    e8m0_decode,
    fp8_block_quantize,
    fp8_row_quantize,
    fp8_tensor_quantize,
    mx_fake_quantize,
    mx_quantize,
    mx_scale_exponent,
    nvfp4_fake_quantize,
    nvfp4_quantize,
    round_to_format,
)
from flamia_verify.formats import (
    constants as C,
)

try:
    from test_formats_elements import assert_same
except ImportError:  # tests collected as a package
    from tests.test_formats_elements import assert_same

ML_DTYPE = {"e4m3": ml_dtypes.float8_e4m3fn, "e5m2": ml_dtypes.float8_e5m2, "e2m1": ml_dtypes.float4_e2m1fn}
HYPOTHESIS = settings(max_examples=30, deadline=None)
RULES = [ScaleRule.RCEIL, ScaleRule.FLOOR]
ELEMS = [E4M3, E5M2, E2M1]


# ----------------------------------------------------------------------------------------------
# Slow references


def blocks_of(length: int, block_size: int | None, cu_seqlens: list[int] | None) -> list[tuple[int, int]]:
    """(start, end) of every block, in order: documents cut from their own start; tail = padding."""
    bounds = [0, length] if cu_seqlens is None else list(cu_seqlens)
    if bounds[-1] < length:
        bounds.append(length)
    out = []
    for s, e in zip(bounds[:-1], bounds[1:]):
        step = (e - s) if block_size is None else block_size
        for b in range(s, e, max(step, 1)):
            out.append((b, min(b + step, e)))
    return out


def exact_scale_exponent(amax: float, elem, rule: ScaleRule) -> int:
    """Unclamped MX exponent of a positive finite amax, from the definitions, in rationals."""
    if rule is ScaleRule.FLOOR:
        return math.frexp(amax)[1] - 1 - elem.emax
    # RCEIL: the smallest k with max_elem * 2^k >= amax
    a, m = Fraction(amax), Fraction(elem.max_finite)
    k = math.frexp(amax)[1] - 1 - elem.emax - 2
    while m * Fraction(2) ** k < a:
        k += 1
    return k


def mx_reference(x: torch.Tensor, *, axis, block_size, elem, rule, cu_seqlens=None):
    """Per-block Python loop; returns (data float32, scales uint8) in the layout of mx_quantize."""
    xt = np.moveaxis(x.double().numpy(), axis, -1)
    blocks = blocks_of(xt.shape[-1], block_size, None if cu_seqlens is None else cu_seqlens.tolist())
    data = np.zeros(xt.shape, np.float32)
    scales = np.zeros(xt.shape[:-1] + (len(blocks),), np.uint8)
    for row in np.ndindex(*xt.shape[:-1]):
        for b, (s, e) in enumerate(blocks):
            vals = xt[row][s:e]
            if not np.all(np.isfinite(vals)):
                scales[row][b] = 255
                data[row][s:e] = np.nan
                continue
            amax = float(np.max(np.abs(vals)))
            byte = 0 if amax == 0 else min(max(exact_scale_exponent(amax, elem, rule) + 127, 0), 254)
            scales[row][b] = byte
            scaled = vals / math.ldexp(1.0, byte - 127)  # float64: exact
            data[row][s:e] = (
                np.clip(scaled, -elem.max_finite, elem.max_finite).astype(ML_DTYPE[elem.name]).astype(np.float32)
            )
    return torch.from_numpy(np.moveaxis(data, -1, axis).copy()), torch.from_numpy(np.moveaxis(scales, -1, axis).copy())


def nvfp4_reference(x: torch.Tensor, *, axis, block_size, cu_seqlens=None, global_amax=None):
    """Per-block loop in numpy float32 scalars (IEEE fp32 ops) with ml_dtypes casts."""
    f32 = np.float32
    xt = np.moveaxis(x.float().numpy(), axis, -1)
    blocks = blocks_of(xt.shape[-1], block_size, None if cu_seqlens is None else cu_seqlens.tolist())
    if global_amax is None:
        ga = np.full(xt.shape[:-1], np.max(np.abs(xt)), np.float32)
    else:
        target = list(x.shape)
        target[axis] = 1
        ga = np.moveaxis(global_amax.float().expand(target).numpy(), axis, -1)[..., 0]
    data = np.zeros(xt.shape, np.float32)
    bscale = np.zeros(xt.shape[:-1] + (len(blocks),), np.float32)
    for row in np.ndindex(*xt.shape[:-1]):
        amax = f32(ga[row])
        s_global = f32(1.0) if amax == 0 else (f32(amax) / f32(2688.0) if np.isfinite(amax) else f32(np.nan))
        for b, (s, e) in enumerate(blocks):
            vals = xt[row][s:e]
            bamax = f32(np.max(np.abs(vals)))
            if not np.isfinite(bamax):
                bscale[row][b] = np.nan
                data[row][s:e] = np.nan
                continue
            t = (bamax / f32(6.0)) / s_global
            sb = f32(np.array(min(t, f32(448.0)), np.float32).astype(ml_dtypes.float8_e4m3fn).astype(np.float32))
            bscale[row][b] = sb
            d = f32(sb * s_global)
            if not np.isfinite(d):  # (ml_dtypes would cast the NaN quotients to E2M1 -0)
                data[row][s:e] = np.nan
            elif d == 0:
                data[row][s:e] = np.copysign(np.float32(0.0), vals)
            else:
                data[row][s:e] = np.clip(vals / d, -6.0, 6.0).astype(ml_dtypes.float4_e2m1fn).astype(np.float32)
    return (
        torch.from_numpy(np.moveaxis(data, -1, axis).copy()),
        torch.from_numpy(np.moveaxis(bscale, -1, axis).copy()),
    )


def spread_tensor(shape, seed, *, lo=-30, hi=30) -> torch.Tensor:
    """Normal values times 2^k with k varying per position: many magnitudes, some exact zeros."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.exp2(torch.randint(lo, hi, shape, generator=g).float())
    x[torch.rand(shape, generator=g) < 0.05] = 0.0
    return x


# ----------------------------------------------------------------------------------------------
# Block layout


def test_block_layout_picture_from_docstring():
    bi, nb = block_layout(14, block_size=4, cu_seqlens=torch.tensor([0, 5, 12], dtype=torch.int32))
    assert bi.tolist() == [0, 0, 0, 0, 1, 2, 2, 2, 2, 3, 3, 3, 4, 4] and nb == 5
    bi, nb = block_layout(10, block_size=4)
    assert bi.tolist() == [0, 0, 0, 0, 1, 1, 1, 1, 2, 2] and nb == 3
    bi, nb = block_layout(6, block_size=2, cu_seqlens=torch.tensor([0, 0, 1, 1, 6]))  # empty and 1-long docs
    assert bi.tolist() == [0, 1, 1, 2, 2, 3] and nb == 4
    bi, nb = block_layout(7, block_size=None, cu_seqlens=torch.tensor([0, 3, 7]))
    assert bi.tolist() == [0, 0, 0, 1, 1, 1, 1] and nb == 2


@pytest.mark.parametrize(
    ("cu", "match"),
    [
        ([1, 5], "start at 0"),
        ([0, 5, 3], "non-decreasing"),
        ([0, 20], "exceeds the length"),
        ([[0, 5]], "1-D"),
    ],
)
def test_block_layout_rejects_bad_cu_seqlens(cu, match):
    with pytest.raises(InputError, match=match):
        mx_quantize(torch.ones(10, 4), axis=0, cu_seqlens=torch.tensor(cu, dtype=torch.int32))


def test_bad_arguments():
    with pytest.raises(InputError, match="block_size"):
        mx_quantize(torch.ones(8), block_size=0)
    with pytest.raises(InputError, match="axis"):
        mx_quantize(torch.ones(8), axis=1)
    with pytest.raises(InputError, match="ScaleRule"):
        mx_quantize(torch.ones(8), rule="rceil")
    with pytest.raises(InputError, match="global_amax"):
        nvfp4_quantize(torch.ones(4, 32), global_amax=torch.ones(4, 32))


# ----------------------------------------------------------------------------------------------
# MX against the reference


@pytest.mark.parametrize("rule", RULES, ids=lambda r: r.value)
@pytest.mark.parametrize("elem", ELEMS, ids=lambda f: f.name)
def test_mx_matches_reference(elem, rule):
    x = spread_tensor((3, 5, 100), seed=7)
    x[0, 0, 3] = float("nan")
    x[1, 2, 40] = float("inf")
    x[2, 1, :32] = 0.0
    x[2, 3, :] = torch.randn(100) * 1e-41  # fp32 subnormal inputs
    x[0, 4, 64:96] = C.FP32_MAX
    cu = torch.tensor([0, 37, 37, 38, 90], dtype=torch.int32)  # empty and 1-long docs, padding tail
    for axis, cus in ((-1, None), (2, cu), (0, None)):
        got = mx_quantize(x, axis=axis, elem=elem, rule=rule, cu_seqlens=cus)
        data, scales = mx_reference(x, axis=axis % 3, block_size=32, elem=elem, rule=rule, cu_seqlens=cus)
        what = f"mx {elem.name} {rule.value} axis={axis} cu_seqlens={None if cus is None else cus.tolist()}"
        assert_same(got.scales, scales, what=what + " scales")
        assert_same(got.data, data, what=what + " data", inputs=x)


@HYPOTHESIS
@given(
    lengths=st.lists(st.integers(0, 70), min_size=1, max_size=4),
    pad=st.integers(0, 5),
    block_size=st.sampled_from([1, 3, 16, 32]),
    elem=st.sampled_from(ELEMS),
    rule=st.sampled_from(RULES),
    seed=st.integers(0, 2**16),
)
def test_property_mx_matches_reference_varlen(lengths, pad, block_size, elem, rule, seed):
    cu = torch.tensor([0] + np.cumsum(lengths).tolist(), dtype=torch.int32)
    x = spread_tensor((int(cu[-1]) + pad, 2), seed, lo=-140, hi=120)
    got = mx_quantize(x, axis=0, block_size=block_size, elem=elem, rule=rule, cu_seqlens=cu)
    data, scales = mx_reference(x, axis=0, block_size=block_size, elem=elem, rule=rule, cu_seqlens=cu)
    what = f"mx {elem.name} {rule.value} bs={block_size} cu={cu.tolist()} pad={pad} seed={seed}"
    assert_same(got.scales, scales, what=what + " scales")
    assert_same(got.data, data, what=what + " data", inputs=x)


def rceil_fp32_hardware(amax: np.ndarray, elem) -> np.ndarray:
    """NVIDIA's form: fp32 division amax / max_elem, then round up to a power of two (cvt.rp.ue8m0),
    emulated with integer bit arithmetic on the fp32 quotient (normal quotients only)."""
    q = (amax.astype(np.float32) / np.float32(elem.max_finite)).astype(np.float32)
    bits = q.view(np.int32)
    return ((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) != 0)


@pytest.mark.parametrize("elem", ELEMS, ids=lambda f: f.name)
def test_rceil_exponent_equals_fp32_division_then_round_up(elem):
    bf16 = torch.arange(1 << 15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    g = torch.Generator().manual_seed(3)
    rnd = torch.randint(0, 0x7F800000, (1 << 18,), generator=g, dtype=torch.int64).to(torch.int32).view(torch.float32)
    powers = torch.tensor([math.ldexp(elem.max_finite, k) for k in range(-120, 124)], dtype=torch.float32)
    near = torch.cat(
        [powers, torch.nextafter(powers, torch.tensor(0.0)), torch.nextafter(powers, torch.tensor(math.inf))]
    )
    amax = torch.cat([bf16, rnd, near, torch.tensor([C.FP32_MAX])])
    amax = amax[torch.isfinite(amax) & (amax / elem.max_finite >= C.FP32_MIN_NORMAL)]  # normal quotients
    got = mx_scale_exponent(amax, elem, ScaleRule.RCEIL)
    want = torch.from_numpy(rceil_fp32_hardware(amax.numpy(), elem).astype(np.int32))
    assert_same(got, want, what=f"RCEIL exponent ({elem.name}) vs fp32 division + round-up", inputs=amax)


def test_rceil_differs_from_fp32_division_only_for_subnormal_quotients():
    """Below 448 * 2^-126 the fp32 quotient is subnormal and may round down onto 2^-127; the exact
    rule (ours) then says 2^-126. Both clamp into E8M0's lowest two bytes; documented."""
    amax = np.float32(math.ldexp(448.0, -127)) + np.float32(math.ldexp(1.0, -142))
    ours = int(mx_scale_exponent(torch.tensor([amax]), E4M3, ScaleRule.RCEIL))
    assert ours == -126 == exact_scale_exponent(float(amax), E4M3, ScaleRule.RCEIL)
    assert np.float32(amax) / np.float32(448.0) == np.float32(math.ldexp(1.0, -127))  # hardware: -127


@pytest.mark.parametrize("rule", RULES, ids=lambda r: r.value)
@pytest.mark.parametrize("elem", ELEMS, ids=lambda f: f.name)
def test_scale_exponent_boundaries_vs_exact(elem, rule):
    base = [math.ldexp(elem.max_finite, k) for k in range(-130, 120)] + [math.ldexp(1.0, k) for k in range(-149, 128)]
    base = torch.tensor(base, dtype=torch.float32)
    base = base[(base > 0) & torch.isfinite(base)]
    amax = torch.cat(
        [
            base,
            torch.nextafter(base, torch.tensor(0.0)),
            torch.nextafter(base, torch.tensor(math.inf)),
            torch.tensor([C.FP32_MAX, 2.0**-149, 3 * 2.0**-149]),
        ]
    )
    amax = amax[(amax > 0) & torch.isfinite(amax)]
    got = mx_scale_exponent(amax, elem, rule)
    want = torch.tensor([exact_scale_exponent(a, elem, rule) for a in amax.tolist()], dtype=torch.int32)
    assert_same(got, want, what=f"{rule.value} exponent ({elem.name}) vs exact rational", inputs=amax)


# ----------------------------------------------------------------------------------------------
# MX special blocks (FORMATS.md)


@pytest.mark.parametrize("rule", RULES, ids=lambda r: r.value)
def test_mx_all_zero_block(rule):
    x = torch.zeros(2, 64)
    x[0, :32] = -0.0
    x[1, 32:] = torch.arange(32.0)
    q = mx_quantize(x, rule=rule)
    assert q.scales[0].tolist() == [0, 0] and int(q.scales[1, 0]) == 0
    assert_same(q.data[0], x[0], what="all-zero blocks keep signed zeros")
    assert not torch.isnan(q.dequantize()).any()
    assert_same(q.dequantize()[0], x[0], what="all-zero blocks dequantize to zeros")


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_mx_nan_or_inf_poisons_only_its_block(bad):
    x = torch.randn(96)
    clean = mx_quantize(x)
    x[40] = bad
    q = mx_quantize(x)
    assert q.scales.tolist() == [clean.scales[0].item(), 255, clean.scales[2].item()]
    assert torch.isnan(q.data[32:64]).all() and torch.isnan(q.dequantize()[32:64]).all()
    assert_same(q.data[:32], clean.data[:32], what="block before a NaN block unchanged")
    assert_same(q.data[64:], clean.data[64:], what="block after a NaN block unchanged")


def test_mx_largest_fp32_scale_bytes():
    x = torch.tensor([C.FP32_MAX, 1.0, -C.FP32_MAX])
    assert int(mx_quantize(x, rule=ScaleRule.FLOOR).scales) == 246  # 127 - 8 + 127
    assert int(mx_quantize(x, rule=ScaleRule.RCEIL).scales) == 247  # 127 - 8 + 1 + 127
    floor = mx_quantize(x, rule=ScaleRule.FLOOR)  # FP32_MAX / 2^119 = 511.99..: saturates to 448
    assert floor.data[[0, 2]].tolist() == [448.0, -448.0] and torch.isfinite(floor.dequantize()).all()
    # RCEIL: FP32_MAX / 2^120 = 255.99.. rounds up to 256, and 256 * 2^120 = 2^128 is no fp32 number:
    # the MX value is valid, its float32 dequantization overflows to +-Inf (documented)
    rceil = mx_quantize(x, rule=ScaleRule.RCEIL)
    assert rceil.data[[0, 2]].tolist() == [256.0, -256.0]
    assert rceil.dequantize()[[0, 2]].tolist() == [math.inf, -math.inf]


def test_mx_e8m0_byte0_subnormal_inputs_dequantize_exactly():
    x = torch.tensor([2.0**-130, -(2.0**-133), 2.0**-149, 0.0])
    for rule in RULES:
        q = mx_quantize(x, rule=rule)
        assert int(q.scales) == 0
        assert_same(
            q.data, torch.tensor([0.125, -(2.0**-6), 0.0, 0.0]), what=f"byte-0 block data ({rule.value})", inputs=x
        )
        assert_same(
            q.dequantize(),
            torch.tensor([2.0**-130, -(2.0**-133), 0.0, 0.0]),
            what="byte-0 block dequantizes to the subnormal inputs, not to 0",
            inputs=x,
        )


def test_mx_e8m0_byte254_from_float64_input():
    x = torch.tensor([1.8 * 2.0**134, 2.0**127, 2.0**126], dtype=torch.float64)
    q = mx_quantize(x)
    assert int(q.scales) == 254
    assert float(q.data[0]) == 224.0 and float(q.data[1]) == 1.0
    assert float(q.dequantize()[1]) == 2.0**127 and float(q.dequantize()[2]) == 2.0**126
    assert int(mx_quantize(torch.tensor([2.0**300], dtype=torch.float64)).scales) == 254  # clamped


@pytest.mark.parametrize("k", [-100, -3, 0, 5, 100])
def test_mx_amax_exactly_a_power_of_two(k):
    x = torch.tensor([2.0**k, -(2.0**k) / 3, 2.0 ** (k - 20)])
    for rule in RULES:
        q = mx_quantize(x, rule=rule)
        assert int(q.scales) - 127 == k - 8, rule
        assert float(q.data[0]) == 256.0


@pytest.mark.parametrize("k", [-100, -3, 0, 5, 100])
def test_mx_amax_just_below_and_above_448_times_power_of_two(k):
    top = torch.tensor(math.ldexp(448.0, k))
    below = torch.nextafter(top, torch.tensor(0.0))
    above = torch.nextafter(top, torch.tensor(math.inf))
    qb = mx_quantize(below.reshape(1), rule=ScaleRule.RCEIL)
    assert int(qb.scales) - 127 == k and float(qb.data) == 448.0  # rounds up onto 448, no overflow
    qt = mx_quantize(top.reshape(1), rule=ScaleRule.RCEIL)
    assert int(qt.scales) - 127 == k and float(qt.data) == 448.0
    qa = mx_quantize(above.reshape(1), rule=ScaleRule.RCEIL)
    assert int(qa.scales) - 127 == k + 1 and float(qa.data) == 224.0
    qf = mx_quantize(above.reshape(1), rule=ScaleRule.FLOOR)
    assert int(qf.scales) - 127 == k and float(qf.data) == 448.0  # saturated


def test_mx_floor_saturates_and_rceil_does_not():
    x = torch.tensor([480.0, 500.0, 1.0, -511.0])
    f = mx_quantize(x, rule=ScaleRule.FLOOR)
    assert f.data.tolist() == [448.0, 448.0, 1.0, -448.0] and int(f.scales) == 127
    r = mx_quantize(x, rule=ScaleRule.RCEIL)
    assert int(r.scales) == 128 and r.data.tolist() == [240.0, 256.0, 0.5, -256.0]


# ----------------------------------------------------------------------------------------------
# MX layout, dtypes, exactness, speed


def test_mx_axis_and_shapes():
    x = spread_tensor((40, 3, 70), seed=11)
    q = mx_quantize(x, axis=0, block_size=16)
    assert q.scales.shape == (3, 3, 70) and q.data.shape == x.shape and q.axis == 0
    assert q.block_index.tolist() == [i // 16 for i in range(40)] and q.block_index.dtype == torch.int64
    moved = mx_quantize(x.movedim(0, -1), axis=-1, block_size=16)
    assert_same(q.data, moved.data.movedim(-1, 0), what="axis=0 equals moving the axis last")
    assert_same(q.scales, moved.scales.movedim(-1, 0), what="axis=0 scales equal moving the axis last")
    q2 = mx_quantize(x, axis=-1)
    assert q2.scales.shape == (40, 3, 3) and q2.axis == 2


def test_mx_input_dtypes_agree():
    x = spread_tensor((8, 96), seed=5).bfloat16()
    want = mx_quantize(x.float())
    for dtype in (torch.bfloat16, torch.float64):
        got = mx_quantize(x.to(dtype))
        assert_same(got.data, want.data, what=f"mx data from {dtype}")
        assert_same(got.scales, want.scales, what=f"mx scales from {dtype}")
    xh = spread_tensor((8, 96), seed=5, lo=-10, hi=10).half()
    assert_same(mx_quantize(xh).data, mx_quantize(xh.float()).data, what="mx data from float16")


@pytest.mark.parametrize("elem", ELEMS, ids=lambda f: f.name)
def test_mx_dequantize_is_exact(elem):
    x = spread_tensor((6, 128), seed=2, lo=-130, hi=125)
    q = mx_quantize(x, elem=elem)
    exact = q.data.double() * torch.exp2(q.scales.double() - 127).repeat_interleave(32, dim=-1)
    assert_same(q.dequantize(), exact.float(), what=f"{elem.name} dequantize vs float64 product")
    assert torch.equal(exact.float().double(), exact), "the product must be exact in float32"
    assert_same(mx_fake_quantize(x, elem=elem), q.dequantize(), what="mx_fake_quantize == dequantize")
    assert isinstance(q, MXTensor) and q.rule is ScaleRule.RCEIL and q.elem is elem


# ----------------------------------------------------------------------------------------------
# MX properties


@HYPOTHESIS
@given(seed=st.integers(0, 2**16), elem=st.sampled_from(ELEMS), rule=st.sampled_from(RULES), lo=st.integers(-140, 100))
def test_property_mx_idempotent_bounded_monotone(seed, elem, rule, lo):
    x = spread_tensor((4, 64), seed, lo=lo, hi=lo + 24)
    q = mx_quantize(x, elem=elem, rule=rule)
    dq = q.dequantize()
    assert_same(mx_fake_quantize(dq, elem=elem, rule=rule), dq, what=f"mx {elem.name} {rule.value} idempotent")
    # error bound relative to the block scale X: half an element ulp at |x| / X, plus saturation
    X = e8m0_decode(q.scales).double().repeat_interleave(32, dim=-1)
    a = x.double().abs() / X
    e = torch.floor(torch.log2(a.clamp(min=elem.min_normal))).clamp(max=elem.emax)
    half_ulp = torch.exp2(e - elem.man_bits - 1)
    bound = (half_ulp + (a - elem.max_finite).clamp(min=0)) * X
    err = (dq.double() - x.double()).abs()
    viol = err > bound
    assert not viol.any(), f"mx error above bound at {torch.nonzero(viol)[:3].tolist()}: x={x[viol][:3].tolist()}"
    if rule is ScaleRule.RCEIL:
        assert (a <= elem.max_finite).all(), "RCEIL: nothing saturates"
    # within one block (one fixed scale) quantization is monotone
    order = torch.argsort(x, dim=-1)
    xs, ds = torch.gather(x, -1, order), torch.gather(q.data, -1, order)
    same_block = torch.gather(q.block_index.expand_as(x), -1, order)
    for r in range(x.shape[0]):
        for b in range(2):
            sel = same_block[r] == b
            assert (ds[r][sel].diff() >= 0).all(), f"not monotone in block {b} of row {r}: {xs[r][sel].tolist()}"


# ----------------------------------------------------------------------------------------------
# Document isolation (cu_seqlens)


@HYPOTHESIS
@given(
    lengths=st.lists(st.integers(0, 80), min_size=2, max_size=5),
    which=st.integers(0, 4),
    seed=st.integers(0, 2**16),
    block_size=st.sampled_from([16, 32]),
)
def test_property_document_alone_equals_document_packed(lengths, which, seed, block_size):
    which %= len(lengths)
    cu = torch.tensor([0] + np.cumsum(lengths).tolist(), dtype=torch.int32)
    s, e = int(cu[which]), int(cu[which + 1])
    x = spread_tensor((int(cu[-1]), 3, 8), seed)
    doc = x[s:e].clone()
    alone_cu = torch.tensor([0, e - s], dtype=torch.int32)
    first = int(sum(-(-n // block_size) for n in lengths[:which]))
    nb = -(-(e - s) // block_size)
    for rule in RULES:
        packed = mx_quantize(x, axis=0, block_size=block_size, rule=rule, cu_seqlens=cu)
        alone = mx_quantize(doc, axis=0, block_size=block_size, rule=rule, cu_seqlens=alone_cu)
        plain = mx_quantize(doc, axis=0, block_size=block_size, rule=rule)
        assert_same(packed.data[s:e], alone.data, what=f"mx doc {which} packed vs alone (cu={cu.tolist()})")
        assert_same(packed.scales[first : first + nb], alone.scales, what=f"mx doc {which} scales packed vs alone")
        assert_same(alone.data, plain.data, what="a single document equals no cu_seqlens")
    ga = torch.tensor(7.0)
    packed = nvfp4_quantize(x, axis=0, cu_seqlens=cu, global_amax=ga)
    alone = nvfp4_quantize(doc, axis=0, global_amax=ga)
    assert_same(packed.data[s:e], alone.data, what=f"nvfp4 doc {which} packed vs alone")
    for fn in (
        lambda t, c: fp8_block_quantize(t, axis=0, block_size=block_size, cu_seqlens=c),
        lambda t, c: fp8_row_quantize(t, axis=0, cu_seqlens=c),
    ):
        pd, ps = fn(x, cu)
        ad, as_ = fn(doc, alone_cu)
        assert_same(pd[s:e], ad, what="fp8 doc packed vs alone (data)")
        assert_same(ps[s:e], as_, what="fp8 doc packed vs alone (scale)")


def test_next_document_cannot_reach_into_a_short_last_block():
    cu = torch.tensor([0, 40, 80], dtype=torch.int32)  # doc 0's last block is [32, 40)
    x = torch.randn(80, 4)
    clean = mx_quantize(x, axis=0, cu_seqlens=cu)
    x[40:] = float("nan")
    poisoned = mx_quantize(x, axis=0, cu_seqlens=cu)
    assert_same(poisoned.data[:40], clean.data[:40], what="doc 0 unchanged when doc 1 is NaN")
    assert_same(poisoned.scales[:2], clean.scales[:2], what="doc 0 scales unchanged when doc 1 is NaN")
    x[40:] = 1e30
    assert_same(mx_quantize(x, axis=0, cu_seqlens=cu).data[:40], clean.data[:40], what="doc 0 vs huge doc 1")
    assert_same(
        mx_quantize(x, axis=0).data[32:40].isnan(),
        torch.zeros(8, 4, dtype=torch.bool),
        what="(without cu_seqlens the block [32, 64) spans both documents)",
    )


# ----------------------------------------------------------------------------------------------
# NVFP4


@pytest.mark.parametrize("case", ["tensor", "row", "varlen", "blocksize32"])
def test_nvfp4_matches_reference(case):
    x = spread_tensor((5, 4, 70), seed=21, lo=-12, hi=12)
    x[1, 1, 20] = float("nan")
    x[4, 0, :16] = 0.0
    x[3, 2, :] *= 1e-6  # block scales that round to 0 or into UE4M3's subnormals
    kwargs, ga = {}, None
    if case == "row":
        ga = x.abs().nan_to_num(0.0).amax(dim=-1, keepdim=True)
        ga[0, 0] = 0.0
        kwargs["global_amax"] = ga
    elif case == "varlen":
        kwargs["cu_seqlens"] = torch.tensor([0, 10, 11, 60], dtype=torch.int32)
    elif case == "blocksize32":
        kwargs["block_size"] = 32
    if case != "row":
        x[1, 1, 20] = 1.0  # a NaN anywhere makes the whole-tensor scale NaN (tested below)
    got = nvfp4_quantize(x, **kwargs)
    data, bscale = nvfp4_reference(
        x, axis=2, block_size=kwargs.get("block_size", 16), cu_seqlens=kwargs.get("cu_seqlens"), global_amax=ga
    )
    assert_same(got.block_scales, bscale, what=f"nvfp4 {case} block scales")
    assert_same(got.data, data, what=f"nvfp4 {case} data", inputs=x)
    assert isinstance(got, NVFP4Tensor) and got.axis == 2
    expected_dq = (
        (got.data * got.block_scales.repeat_interleave(got.block_size, -1)[..., :70]) * got.global_scale
        if case in ("tensor", "row", "blocksize32")
        else None
    )
    if expected_dq is not None:
        assert_same(got.dequantize(), expected_dq, what=f"nvfp4 {case} dequantize order")
    assert_same(nvfp4_fake_quantize(x, **kwargs), got.dequantize(), what="nvfp4_fake_quantize == dequantize")


def test_nvfp4_all_zero_tensor_has_unit_global_scale():
    q = nvfp4_quantize(torch.zeros(4, 32))
    assert float(q.global_scale) == 1.0
    assert (q.data == 0).all() and (q.block_scales == 0).all() and not torch.isnan(q.dequantize()).any()


def test_nvfp4_nan_handling():
    x = torch.randn(2, 32)
    x[0, 3] = float("nan")
    q = nvfp4_quantize(x, global_amax=torch.tensor(4.0))
    assert torch.isnan(q.data[0, :16]).all() and torch.isnan(q.block_scales[0, 0])
    assert not torch.isnan(q.data[0, 16:]).any() and not torch.isnan(q.data[1]).any()
    assert torch.isnan(nvfp4_quantize(x).dequantize()).all()  # whole-tensor amax is NaN


def test_nvfp4_block_scale_rounding_to_zero_gives_zeros():
    x = torch.zeros(32)
    x[:16] = 1000.0
    x[16:] = torch.linspace(-1e-4, 1e-4, 16)  # (1e-4 / 6) / (1000 / 2688) ~ 4.5e-5 < 2^-10: s_block = 0
    q = nvfp4_quantize(x)
    assert float(q.block_scales[1]) == 0.0
    assert (q.data[16:] == 0).all() and not torch.isnan(q.data).any()
    assert_same(torch.signbit(q.data[16:]), torch.signbit(x[16:]), what="zeros keep the sign of x")


def test_nvfp4_small_elements_vanish_below_block_amax_over_24():
    # s_global = 2688 / 2688 = 1, s_block = 6 / 6 = 1 exactly: data = round_e2m1(x)
    x = torch.zeros(16)
    x[0], x[1], x[2] = 6.0, 0.25, float(np.nextafter(np.float32(0.25), np.float32(1)))
    q = nvfp4_quantize(x, global_amax=torch.tensor(2688.0))
    assert float(q.block_scales[0]) == 1.0 and float(q.global_scale) == 1.0
    assert q.data[:3].tolist() == [6.0, 0.0, 0.5]  # block_amax / 24 = 0.25 ties to 0


@HYPOTHESIS
@given(seed=st.integers(0, 2**16), lo=st.integers(-60, 40))
def test_property_nvfp4_elements_within_half_ulp_of_scaled_input(seed, lo):
    x = spread_tensor((3, 48), seed, lo=lo, hi=lo + 8)
    q = nvfp4_quantize(x)
    d = (q.block_scales.repeat_interleave(16, -1) * q.global_scale).float()
    scaled = torch.where(d == 0, torch.zeros_like(x), x / d).double()  # the fp32 quotient the recipe rounds
    a = scaled.abs().clamp(max=6.0)
    half_ulp = torch.where(a < 1.0, torch.full_like(a, 0.25), torch.exp2(torch.floor(torch.log2(a.clamp(min=1))) - 2))
    err = (q.data.double() - scaled.clamp(-6, 6)).abs()
    assert (err <= half_ulp).all(), f"E2M1 element off by more than half an ulp (seed {seed})"
    assert (q.block_scales <= 448).all() and (q.data.abs() <= 6).all()
    assert_same(
        nvfp4_quantize(q.data, global_amax=torch.tensor(2688.0)).data,
        q.data,
        what="E2M1 data requantized with unit scales is unchanged",
    )


# ----------------------------------------------------------------------------------------------
# Scaled FP8


def test_fp8_tensor_quantize_against_torch_cast():
    x = spread_tensor((64, 48), seed=9, lo=-8, hi=8)
    data, scale = fp8_tensor_quantize(x)
    amax = x.abs().amax()
    assert float(scale) == float(amax / 448.0) and scale.dtype == torch.float32
    want = (x / scale).clamp(-448, 448).to(torch.float8_e4m3fn).to(torch.float32)
    assert_same(data, want, what="fp8_tensor_quantize data vs torch E4M3 cast", inputs=x)
    data2, scale2 = fp8_tensor_quantize(x, power_of_two=True)
    assert float(scale2) == 2.0 ** exact_scale_exponent(float(amax), E4M3, ScaleRule.RCEIL)
    assert (data2.abs() <= 448).all()
    data3, scale3 = fp8_tensor_quantize(x, elem=E5M2)
    assert float(scale3) == float(amax / 57344.0)
    assert_same(data3, (x / scale3).to(torch.float8_e5m2).float(), what="fp8 E5M2 data vs torch cast")


def test_fp8_zero_and_nan_scales():
    for pow2 in (False, True):
        data, scale = fp8_tensor_quantize(torch.zeros(8), power_of_two=pow2)
        assert float(scale) == 1.0 and (data == 0).all()
        data, scale = fp8_tensor_quantize(torch.tensor([1.0, float("nan")]), power_of_two=pow2)
        assert math.isnan(float(scale)) and torch.isnan(data).all()
    data, scale = fp8_tensor_quantize(torch.tensor([1e-44, 0.0]))  # amax / 448 underflows: clamped
    assert float(scale) == C.FP32_MIN_NORMAL and torch.isfinite(data).all()


@pytest.mark.parametrize("pow2", [True, False])
def test_fp8_row_quantize_equals_per_row_tensor_quantize(pow2):
    x = spread_tensor((6, 5, 40), seed=4, lo=-6, hi=6)
    x[2, 3] = 0.0
    data, scale = fp8_row_quantize(x, axis=-1, power_of_two=pow2)
    assert scale.shape == (6, 5, 1)
    for i in range(6):
        for j in range(5):
            d, s = fp8_tensor_quantize(x[i, j], power_of_two=pow2)
            assert_same(data[i, j], d, what=f"row ({i}, {j}) data")
            assert float(scale[i, j, 0]) == float(s)
    cu = torch.tensor([0, 4, 4, 6], dtype=torch.int32)
    data, scale = fp8_row_quantize(x, axis=0, power_of_two=pow2, cu_seqlens=cu)
    assert scale.shape == x.shape
    for s_, e_ in ((0, 4), (4, 6)):
        for j in range(5):
            for k in range(40):
                d, s = fp8_tensor_quantize(x[s_:e_, j, k], power_of_two=pow2)
                assert_same(data[s_:e_, j, k], d, what=f"doc [{s_}, {e_}) column ({j}, {k})")
                assert (scale[s_:e_, j, k] == s).all()


def test_fp8_block_quantize_equals_mx_rceil_except_zero_blocks():
    x = spread_tensor((100, 6), seed=8, lo=-140, hi=120)
    x[32:64, 2] = 0.0
    cu = torch.tensor([0, 50, 100], dtype=torch.int32)
    data, scale = fp8_block_quantize(x, axis=0, block_size=32, cu_seqlens=cu)
    mx = mx_quantize(x, axis=0, cu_seqlens=cu, rule=ScaleRule.RCEIL)
    assert_same(data, mx.data, what="fp8_block_quantize data == mx RCEIL data")
    per_block = e8m0_decode(mx.scales).clone()
    for b, (s_, e_) in enumerate(blocks_of(100, 32, cu.tolist())):
        per_block[b][(x[s_:e_] == 0).all(0)] = 1.0  # all-zero block: scale 1 (MX: byte 0)
    assert bool((per_block[1, 2] == 1.0) & (mx.scales[1, 2] == 0))
    assert_same(scale, per_block.index_select(0, mx.block_index), what="fp8_block_quantize scales vs mx scales")


def test_scale_rule_members_document_their_formula():
    assert "ceil(log2(amax / max_elem))" in ScaleRule.RCEIL.__doc__
    assert "floor(log2 amax) - emax_elem" in ScaleRule.FLOOR.__doc__
    assert ScaleRule("rceil") is ScaleRule.RCEIL and ScaleRule("floor") is ScaleRule.FLOOR


def test_results_carry_no_autograd_history():
    x = torch.randn(4, 32, requires_grad=True)
    assert not mx_fake_quantize(x).requires_grad and not nvfp4_fake_quantize(x).requires_grad
    assert not round_to_format(x, E4M3).requires_grad and not fp8_tensor_quantize(x)[0].requires_grad


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_results_equal_cpu_results_bitwise():
    x = spread_tensor((300, 4, 64), seed=13, lo=-150, hi=30)  # fp32 subnormals and E8M0 byte 0 included
    x[0, 0, 0] = float("nan")
    cu = torch.tensor([0, 100, 101, 300], dtype=torch.int32)
    for kw in ({}, {"axis": 0, "cu_seqlens": cu}, {"rule": ScaleRule.FLOOR, "elem": E2M1}, {"elem": E5M2}):
        cpu, gpu = mx_quantize(x, **kw), mx_quantize(x.cuda(), **kw)
        assert_same(gpu.scales, cpu.scales, what=f"mx scales cuda vs cpu {kw}")
        assert_same(gpu.dequantize(), cpu.dequantize(), what=f"mx dequantized cuda vs cpu {kw}")
    y = x.nan_to_num(0.0)
    cpu, gpu = nvfp4_quantize(y, axis=0, cu_seqlens=cu), nvfp4_quantize(y.cuda(), axis=0, cu_seqlens=cu)
    assert_same(gpu.block_scales, cpu.block_scales, what="nvfp4 block scales cuda vs cpu")
    assert_same(gpu.dequantize(), cpu.dequantize(), what="nvfp4 dequantized cuda vs cpu")
    for fn in (
        fp8_tensor_quantize,
        lambda t: fp8_row_quantize(t, power_of_two=False),
        lambda t: fp8_block_quantize(t, axis=0, block_size=128, cu_seqlens=cu),
    ):
        (dc, sc), (dg, sg) = fn(y), fn(y.cuda())
        assert_same(sg, sc, what="fp8 scales cuda vs cpu")
        assert_same(dg, dc, what="fp8 data cuda vs cpu")
    bf16 = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).cuda()
    assert_same(
        round_to_format(bf16, E4M3),
        bf16.float().clamp(-448, 448).to(torch.float8_e4m3fn).float(),
        what="E4M3 all bf16 vs the CUDA cast",
        inputs=bf16.float(),
    )
