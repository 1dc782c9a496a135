"""The fused kernels' in-register quantizers against flamia_verify.formats, bit for bit.

Each quantizer is the same ``@triton.jit`` helper that the attention kernels call; a one-program
test kernel (``quant.quantize_tile`` / ``quant.round_tile``) applies it to a tile and writes the
result back. Comparisons are exact (``rtol=0, atol=0``, NaN where NaN). On CPU the kernels run
under Triton's interpreter (TRITON_INTERPRET=1, set here before Triton is imported); on a GPU
machine the same tests run on CUDA.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

triton = pytest.importorskip("triton")

from flamia_verify.formats import (  # noqa: E402
    E2M1,
    E4M3,
    UE4M3,
    ScaleRule,
    mx_fake_quantize,
    nvfp4_fake_quantize,
    round_to_format,
)
from flamia_verify.kernels.triton.compat import interpreting  # noqa: E402
from flamia_verify.kernels.triton.config import KIND_INPUT, KIND_MX, KIND_NVFP4  # noqa: E402

DEVICE = "cpu" if interpreting() else "cuda"
if DEVICE == "cuda" and not torch.cuda.is_available():
    pytest.skip("no CUDA device and TRITON_INTERPRET is off", allow_module_level=True)
pytestmark = ([pytest.mark.gpu] if DEVICE == "cuda" else []) + [  # selected by `-m gpu` on a GPU machine
    # the special tile's Inf times a block scale overflows in NumPy (the interpreter), as intended
    pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
]

from flamia_verify.kernels.triton.quant import quantize_tile, round_tile  # noqa: E402

H = float.fromhex


def assert_bitwise(got: torch.Tensor, want: torch.Tensor, what: str, inputs: torch.Tensor | None = None):
    """Exact equality (NaN matches NaN) with a message naming the first mismatches."""
    got, want = got.cpu(), want.cpu()
    same = (got == want) | (torch.isnan(got) & torch.isnan(want))
    if bool(same.all()):
        return
    bad = torch.nonzero(~same)
    lines = [f"{what}: {bad.shape[0]} / {got.numel()} elements differ; first ones (index: input -> kernel, formats):"]
    for idx in bad[:8].tolist():
        i = tuple(idx)
        x = f"{float(inputs.cpu()[i])!r} -> " if inputs is not None else ""
        lines.append(f"  {i}: {x}{float(got[i])!r}, {float(want[i])!r}")
    raise AssertionError("\n".join(lines))


# edge values of each element format (ml_dtypes-style sweep), both signs
E4M3_EDGES = [
    0.0,
    H("0x1p-9"),
    H("0x1p-10"),
    H("0x1.8p-10"),
    H("0x1.8p-9"),
    H("0x1p-6"),
    H("0x1.fp-7"),
    1.0,
    1.0 + 2**-4,
    1.0 + 2**-3,
    1.0 + 3 * 2**-4,
    7.93,
    125.65,
    240.0,
    248.0,
    256.0,
    272.0,
    440.0,
    448.0,
    456.0,
    464.0,
    480.0,
    1e4,
    float("inf"),
    float("nan"),
]
E2M1_EDGES = [0.0, 0.25, 0.2500001, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 5.9, 6.0, 7.0, 100.0, float("inf"), float("nan")]


def _sweep(edges: list[float], n: int = 1024, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    vals = torch.tensor(edges + [-e for e in edges], dtype=torch.float32)
    rand = torch.randn(n - vals.numel(), generator=g) * torch.exp2(
        torch.randint(-14, 10, (n - vals.numel(),), generator=g).float()
    )
    return torch.cat([vals, rand]).to(DEVICE)


@pytest.mark.parametrize("fmt,elem,saturate", [("e4m3", E4M3, True), ("e2m1", E2M1, True), ("ue4m3", UE4M3, True)])
def test_element_rounding_matches_formats(fmt, elem, saturate):
    x = _sweep(E2M1_EDGES if fmt == "e2m1" else E4M3_EDGES)
    if fmt == "e4m3":  # the values the interpreter's float8 cast mis-rounds (DESIGN.md, known traps)
        assert float(round_tile(torch.tensor([125.65, 7.93] + [0.0] * 6, device=DEVICE), fmt)[0]) == 128.0
    assert_bitwise(round_tile(x, fmt), round_to_format(x, elem, saturate=saturate), f"round to {fmt}", x)


@pytest.mark.parametrize("fmt,dtype", [("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_input_dtype_rounding_matches_torch_casts(fmt, dtype):
    """fp32 -> bf16/fp16 round-to-nearest-even in fp32 arithmetic (the interpreter's cast truncates)."""
    x = _sweep(
        [
            0.0,
            1.0 + 2**-9,
            1.0 + 3 * 2**-9,
            65504.0,
            65520.0,
            70000.0,
            H("0x1p-24"),
            H("0x1p-25"),
            H("0x1.8p-25"),
            H("0x1p-133"),
            3.3e38,
            3.4e38,
        ]
    )
    assert_bitwise(round_tile(x, fmt), x.to(dtype).to(torch.float32), f"round to {fmt}", x)


def _special_tile(rows: int, cols: int, seed: int = 1) -> torch.Tensor:
    """Random magnitudes over many binades, with special rows: zeros, a power-of-two amax, an amax
    just below 448 * 2^k, subnormal-range values, values near bf16's largest, a NaN and an Inf."""
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(rows, cols, generator=g) * torch.exp2(torch.randint(-12, 12, (rows, 1), generator=g).float())
    t[0] = 0.0
    t[1, :] = 0.5
    t[1, 3] = 4.0
    t[2, :] = torch.linspace(-447.99, 447.99, cols) * 2.0**-5
    t[3, :] = torch.randn(cols, generator=g) * 2.0**-130
    t[4, :] = torch.randn(cols, generator=g) * 1e38
    t[5, :] = 0.0
    t[5, 7] = -H("0x1p-133")
    # a NaN makes its whole block NaN (GPUs' tl.max drops NaN; the kernels reduce with a NaN-keeping
    # maximum), an Inf too (its block's amax is not finite)
    t[6, 5] = float("nan")
    t[7, 40] = float("inf")
    if rows > 40:
        t[40, 9] = float("nan")  # in a column block, away from the NaN rows' blocks
    return t.bfloat16().float().to(DEVICE)


@pytest.mark.parametrize("rule", [ScaleRule.RCEIL, ScaleRule.FLOOR])
@pytest.mark.parametrize("axis,block", [(1, 32), (1, 128), (0, 32), (0, 128), (1, 0)])
def test_mx_tile_quantization_matches_formats(axis, block, rule):
    """MXFP8 (E4M3, E8M0) fake quantization along either axis of a tile: blocks of 32 (MX), 128
    (the fp8 design's sequence tiles) or a whole row (block 0: the fp8 design's per-row scale)."""
    t = _special_tile(128, 128)
    size = block or t.shape[axis]
    got = quantize_tile(t, kind=KIND_MX, block=size, axis=axis, rceil=rule is ScaleRule.RCEIL)
    want = mx_fake_quantize(t, axis=axis, block_size=size, rule=rule)
    assert_bitwise(got, want, f"MX axis={axis} block={size} {rule.name}", t)


def test_nvfp4_tile_quantization_matches_formats():
    """NVFP4 along the last axis with a per-row fp32 global scale (the flamia-nvfp4 left operands)."""
    t = _special_tile(64, 128)
    t[4] = t[4] * 1e-30  # keep the row amax finite after the division by 2688
    got = quantize_tile(t, kind=KIND_NVFP4, block=16, axis=1)
    want = nvfp4_fake_quantize(t, axis=1, block_size=16, global_amax=t.abs().amax(dim=1, keepdim=True))
    assert_bitwise(got, want, "NVFP4 16-blocks, row scale", t)
    # a finite row scale over a row that holds a NaN: only the NaN's 16-block turns NaN (its block amax)
    finite = torch.nan_to_num(t, nan=0.0, posinf=0.0).abs().amax(dim=1, keepdim=True)
    got = quantize_tile(t, kind=KIND_NVFP4, block=16, axis=1, row_amax=finite[:, 0])
    want = nvfp4_fake_quantize(t, axis=1, block_size=16, global_amax=finite)
    assert bool(torch.isnan(want[6]).any()) and not bool(torch.isnan(want[6]).all())
    assert_bitwise(got, want, "NVFP4 16-blocks, finite row scale over a NaN block", t)


def test_nvfp4_rows_of_a_few_subnormal_ulps_stay_finite_and_match_formats():
    """A row amax of a few fp32 subnormal ulps made amax / 2688 underflow to 0 and the row NaN (found by
    train-parity: the dS^T row of a key no query attends to). The global scale's floor of 2^-126 keeps
    every such row finite, in the fused quantizer and in formats alike, bit for bit."""
    g = torch.Generator().manual_seed(0)
    t = torch.randn(32, 128, generator=g)
    for i in range(32):
        t[i] = t[i] * 2.0 ** (-120 - i)  # row amax from ~2^-118 down to a few ulps of 2^-149
    t = t.to(DEVICE)
    got = quantize_tile(t, kind=KIND_NVFP4, block=16, axis=1)
    want = nvfp4_fake_quantize(t, axis=1, block_size=16, global_amax=t.abs().amax(dim=1, keepdim=True))
    assert bool(torch.isfinite(want).all()) and bool(torch.isfinite(got).all())
    assert bool(((want - t).abs() <= 2 * 2688.0 * 2.0**-126 + t.abs()).all())
    assert_bitwise(got, want, "NVFP4 rows of tiny amax", t)


@pytest.mark.parametrize("is_fp16", [False, True])
def test_input_kind_rounds_like_a_cast(is_fp16):
    t = _special_tile(64, 64)
    got = quantize_tile(t, kind=KIND_INPUT, block=0, axis=1, is_fp16=is_fp16)
    dtype = torch.float16 if is_fp16 else torch.bfloat16
    assert_bitwise(got, t.to(dtype).float(), f"input rounding to {dtype}", t)


@pytest.mark.skipif(DEVICE != "cuda", reason="the GPU's E4M3 conversion exists only on a GPU")
def test_software_e4m3_rounding_matches_formats_bit_for_bit_on_gpu():
    """On a GPU the quantizers round to E4M3 with the hardware conversion (the default, which every
    other GPU test here runs); FLAMIA_VERIFY_NATIVE_E4M3=0 selects the fp32/int32 twin that the
    interpreter runs. This module's tests and the fused kernels' exact-input tests, rerun on the GPU
    in a process with the twin selected."""
    import subprocess
    import sys

    env = dict(os.environ, FLAMIA_VERIFY_NATIVE_E4M3="0")
    here = os.path.dirname(__file__)
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-x",
        "-n",
        "8",
        "-p",
        "no:cacheprovider",
        "-m",
        "gpu",
        "-k",
        "not software_e4m3",
        os.path.join(here, "test_triton_quant.py"),
        os.path.join(here, "test_triton_attention.py"),
    ]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-2000:]


def test_hardware_e4m3_only_where_every_gpu_has_the_fp8_type(monkeypatch):
    """The hardware conversion needs compute capability 8.9 (float8e4nv); older GPUs, a GPU that cannot
    be queried, the interpreter and FLAMIA_VERIFY_NATIVE_E4M3=0/false/off keep the arithmetic rounding."""
    from flamia_verify.kernels.triton import quant

    monkeypatch.setattr(quant, "interpreting", lambda: False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    caps = {0: (9, 0), 1: (9, 0)}
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i: caps[i])
    monkeypatch.delenv("FLAMIA_VERIFY_NATIVE_E4M3", raising=False)
    assert quant._native_e4m3_default()
    for off in ("0", "false", "OFF", " no "):
        monkeypatch.setenv("FLAMIA_VERIFY_NATIVE_E4M3", off)
        assert not quant._native_e4m3_default(), off
    monkeypatch.setenv("FLAMIA_VERIFY_NATIVE_E4M3", "1")
    caps[1] = (8, 0)  # an A100 beside an H200
    assert not quant._native_e4m3_default()

    def broken(i):
        raise RuntimeError("CUDA driver mismatch")

    monkeypatch.setattr(torch.cuda, "get_device_capability", broken)
    assert not quant._native_e4m3_default()
    monkeypatch.setattr(quant, "interpreting", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i: (9, 0))
    assert not quant._native_e4m3_default()
