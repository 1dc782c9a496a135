"""cudnn-fp8 without cuDNN: the fused quantization against its PyTorch twins bit for bit, the scaling
state (delayed history, calibrate-then-freeze, current), the refusals, the availability probe, and the
whole kernel glue run on a PyTorch model of cuDNN's FP8 attention (``EmulatedEngine``).

On the CPU the Triton kernels run under the interpreter (TRITON_INTERPRET=1, set here before Triton is
imported); on a GPU machine (``-m gpu``) the same twin tests run natively, and one test runs cuDNN itself
when it is available.
"""

from __future__ import annotations

import importlib.util
import math
import os
import re
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from flamia_verify.formats import E4M3, decode, encode
from flamia_verify.kernels.cudnn_fp8 import kernel as K
from flamia_verify.kernels.cudnn_fp8.engine import CudnnFp8Refused, EmulatedEngine
from flamia_verify.kernels.cudnn_fp8.layout import (
    from_layout_reference,
    make_layout,
    to_layout_reference,
)
from flamia_verify.kernels.cudnn_fp8.quantize import (
    amax_many,
    amax_reference,
    dequantize_e4m3,
    dequantize_e4m3_reference,
    quantize_e4m3,
    quantize_e4m3_reference,
)
from flamia_verify.kernels.cudnn_fp8.scaling import (
    ROLES,
    ScalingMode,
    ScalingRecipe,
    ScalingState,
    pow2_scale,
    scale_policy,
)
from flamia_verify.kernels.triton.compat import interpreting
from flamia_verify.reference.attention import reference_attention

DEVICE = "cpu" if interpreting() else "cuda"
if DEVICE == "cuda" and not torch.cuda.is_available():
    pytest.skip("no CUDA device and TRITON_INTERPRET is off", allow_module_level=True)
pytestmark = ([pytest.mark.gpu] if DEVICE == "cuda" else []) + [
    # the interpreter's tl.max over a row of NaNs warns (the amax reduction marks NaN rows itself)
    pytest.mark.filterwarnings("ignore:All-NaN slice encountered:RuntimeWarning")
]

H = float.fromhex
NAN, INF = math.nan, math.inf


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal values, NaN where NaN, and the same sign of zero."""
    a, b = a.detach().cpu().double(), b.detach().cpu().double()
    both_nan = torch.isnan(a) & torch.isnan(b)
    eq = (a == b) & (torch.signbit(a) == torch.signbit(b))
    return bool((both_nan | eq).all())


def _bytes(codes: torch.Tensor) -> torch.Tensor:
    return codes.view(torch.uint8).cpu()


def _assert_codes(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    g, w = _bytes(got), _bytes(want)
    bad = torch.nonzero(g != w)
    assert bad.numel() == 0, f"{what}: {bad.shape[0]} codes differ, first {bad[:4].tolist()}"


def _special_pack(tokens: int, heads: int, dim: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Random values over many binades plus the special ones: NaN, +-Inf, zeros of both signs, values
    that saturate at the scales used, bf16/fp16 subnormals, E4M3 subnormals and ties."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, heads, dim, generator=g) * torch.exp2(
        torch.randint(-12, 12, (tokens, heads, 1), generator=g)
    )
    flat = x.view(-1)
    specials = [
        NAN,
        INF,
        -INF,
        0.0,
        -0.0,
        448.0,
        449.0,
        464.0,
        -500.0,
        1e4,
        2.0**-9,
        2.0**-10,
        3 * 2.0**-10,
        -(2.0**-10),
    ]
    specials += [2.0**-6, H("0x1.fp-7"), 125.65, 7.93, 240.0, 248.0, 2.0**-130, -(2.0**-133), 2.0**-20]
    flat[: len(specials)] = torch.tensor(specials)
    return x.to(dtype).to(DEVICE)


CU = [0, 37, 37, 100, 141]  # 4 documents, one empty


def _cu() -> torch.Tensor:
    return torch.tensor(CU, dtype=torch.int32, device=DEVICE)


# ------------------------------------------------------------------------------------------------
# fused quantization against the twins
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("scale", [1.0, 2.0**-3, 2.0**6, 2.0**40])
def test_quantize_matches_its_twin_bit_for_bit(padded, dtype, scale):
    """Codes (RNE, +-448 saturation, Inf and NaN -> NaN 0x7F, signed zeros, subnormals) and the amax of
    the same pass, in both layouts, from a strided view."""
    x = _special_pack(CU[-1], 3, 48, dtype)
    layout = make_layout(padded, CU[-1], len(CU) - 1, 63)
    s = torch.tensor([scale], device=DEVICE)
    codes, amax = quantize_e4m3(x, s, layout, _cu())
    want, want_amax = quantize_e4m3_reference(x, s, layout, _cu())
    assert codes.shape == (layout.rows, 3, 48) and codes.dtype == torch.float8_e4m3fn
    _assert_codes(codes, want, f"quantize {layout.kind} {dtype} scale {scale}")
    assert amax is not None and _same(amax.reshape(()), want_amax)
    assert bool(torch.isnan(amax).all())  # the pack holds a NaN: the amax says so
    # a strided view (every other head, transposed twice) is read in place, without a copy
    wide = _special_pack(CU[-1], 6, 48, dtype, seed=3)
    view = wide[:, ::2]
    codes, amax = quantize_e4m3(view, s, layout, _cu())
    want, want_amax = quantize_e4m3_reference(view, s, layout, _cu())
    _assert_codes(codes, want, "strided view")
    assert amax is not None and _same(amax.reshape(()), want_amax)


def test_quantize_edge_values_give_the_chosen_codes():
    """The documented choices, code by code, at scale 1 (and in the twin)."""
    vals = [448.0, 449.0, 464.0, 500.0, 1e30, INF, -INF, NAN, 2.0**-9, 2.0**-10, 3 * 2.0**-10, -0.0, 2.0**-6, -448.0]
    want = [0x7E, 0x7E, 0x7E, 0x7E, 0x7E, 0x7F, 0x7F, 0x7F, 0x01, 0x00, 0x02, 0x80, 0x08, 0xFE]
    x = torch.tensor(vals + [0.0] * (16 - len(vals)), dtype=torch.float32, device=DEVICE).reshape(16, 1, 1)
    x = x.expand(16, 1, 16).contiguous()
    layout = make_layout(False, 16, 1, 16)
    cu = torch.tensor([0, 16], dtype=torch.int32, device=DEVICE)
    codes, amax = quantize_e4m3(x, torch.tensor([1.0], device=DEVICE), layout, cu)
    got = _bytes(codes)[: len(vals), 0, 0].tolist()
    assert got == want
    twin, _ = quantize_e4m3_reference(x, torch.tensor([1.0], device=DEVICE), layout, cu)
    _assert_codes(codes, twin, "edge values")
    assert amax is not None and math.isnan(float(amax))
    assert bool((_bytes(codes)[16:] == 0).all())  # pad rows are zeros


def test_amax_of_several_tensors_in_one_launch_keeps_nan_and_inf():
    """One launch, three tensors of different shapes and strides; a NaN found by the last program of
    many is kept, Inf is Inf, zeros and empty tensors give 0."""
    g = torch.Generator().manual_seed(1)
    big = torch.randn(9000, 2, 16, generator=g).bfloat16().to(DEVICE)  # several programs under any tiling
    big[-1, 1, 15] = NAN
    inf = torch.randn(50, 4, 16, generator=g).half().to(DEVICE)
    inf[7, 2, 3] = -INF
    zeros = torch.zeros(20, 1, 16, dtype=torch.bfloat16, device=DEVICE)
    got = amax_many([big, inf[:, 1:3], zeros])
    assert math.isnan(float(got[0])) and float(got[1]) == INF and float(got[2]) == 0.0
    for i, t in enumerate([big, inf[:, 1:3], zeros]):
        assert _same(got[i], amax_reference(t))
    clean = big.clone()
    clean[-1, 1, 15] = 3.0
    got = amax_many([clean, torch.zeros(0, 2, 16, dtype=torch.bfloat16, device=DEVICE)])
    assert float(got[0]) == float(amax_reference(clean)) and float(got[1]) == 0.0
    sub = torch.full((4, 1, 16), 2.0**-130, dtype=torch.bfloat16, device=DEVICE)  # bf16 subnormals
    assert float(amax_many([sub])[0]) == 2.0**-130


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("descale", [1.0, 2.0**-7, 2.0**12, 2.0**-130 * 2**4, 2.0**-120])
def test_dequantize_matches_its_twin_bit_for_bit(padded, dtype, descale):
    """Every E4M3 code (NaNs, signed zeros, subnormals) times power-of-two descales, into bf16 and fp16
    (fp32 subnormal products and fp16 overflow included), from both layouts."""
    tokens = CU[-1]
    codes = torch.arange(tokens * 2 * 32, dtype=torch.int64).remainder(256).to(torch.uint8).reshape(tokens, 2, 32)
    layout = make_layout(padded, tokens, len(CU) - 1, 70)
    placed = to_layout_reference(codes, layout, torch.tensor(CU, dtype=torch.int32)).to(DEVICE)
    placed = placed.view(torch.float8_e4m3fn)
    d = torch.tensor([descale], device=DEVICE)
    got = dequantize_e4m3(placed, d, layout, _cu(), dtype)
    want = dequantize_e4m3_reference(placed, d, layout, _cu(), dtype)
    assert got.shape == (tokens, 2, 32) and got.dtype == dtype
    assert _same(got.float(), want.float()), f"dequantize {layout.kind} {dtype} descale {descale}"
    nan = torch.isnan(got.float())
    bits = got.view(torch.int16)
    assert torch.equal(bits[~nan].cpu(), want.view(torch.int16)[~nan].cpu())


def test_quantize_then_dequantize_is_the_e4m3_rounding():
    x = _special_pack(CU[-1], 2, 32, torch.bfloat16, seed=5)
    layout = make_layout(True, CU[-1], len(CU) - 1, 63)
    codes, _ = quantize_e4m3(x, torch.tensor([2.0**-2], device=DEVICE), layout, _cu())
    back = dequantize_e4m3(codes, torch.tensor([4.0], device=DEVICE), layout, _cu(), torch.bfloat16)
    xf = x.float()
    want = decode(encode(xf * 0.25, E4M3, saturate=True), E4M3) * 4.0
    want = torch.where(torch.isinf(xf), NAN, want)
    assert _same(back.float(), want.to(torch.bfloat16).float())


def test_layouts_place_every_document_and_zero_the_pad_rows():
    x = torch.arange(CU[-1] * 2, dtype=torch.float32).reshape(CU[-1], 2, 1) + 1
    cu = torch.tensor(CU, dtype=torch.int32)
    for padded in (False, True):
        layout = make_layout(padded, CU[-1], len(CU) - 1, 63)
        assert layout.seq == 64 and layout.rows == (4 * 64 if padded else 192)
        placed = to_layout_reference(x, layout, cu)
        assert int((placed != 0).sum()) == x.numel()
        assert torch.equal(from_layout_reference(placed, layout, cu), x)
        if padded:
            assert torch.equal(placed[2 * 64 : 2 * 64 + 63], x[37:100])


# ------------------------------------------------------------------------------------------------
# scaling
# ------------------------------------------------------------------------------------------------


def test_pow2_scale_is_the_largest_power_of_two_that_keeps_the_amax_at_most_448():
    g = torch.Generator().manual_seed(0)
    amax = torch.exp2(torch.rand(4000, generator=g) * 260 - 140).float()  # subnormal to huge
    amax = torch.cat([amax, torch.tensor([448.0, 449.0, 1.0, 1.75, H("0x1.c00002p0"), 2.0**-149, 3e38])])
    s = pow2_scale(amax)
    k = torch.log2(s.double())
    assert bool((k == k.round()).all()) and bool((k.abs() <= 126).all())
    prod = amax.double() * s.double()
    assert bool((prod <= 448).all())
    unclamped = k < 126
    assert bool((prod[unclamped] * 2 > 448).all())  # the next power of two would exceed 448
    assert pow2_scale(torch.tensor([448.0, 449.0, 1.0, 1.75])).tolist() == [1.0, 0.5, 256.0, 256.0]
    assert pow2_scale(torch.tensor([448.0]), margin=2).tolist() == [0.25]
    assert all(math.isnan(v) for v in pow2_scale(torch.tensor([0.0, NAN, INF])).tolist())
    prev = torch.tensor([8.0, 8.0, 8.0, 8.0])
    assert scale_policy(torch.tensor([0.0, NAN, INF, 3.0]), prev).tolist() == [8.0, 8.0, 8.0, 128.0]


def test_delayed_history_is_a_window_of_past_amaxes_and_keeps_nan_visible():
    state = ScalingState(ScalingRecipe(history_len=3))
    roles = ("q", "k", "v")
    assert state.needs_measurement(roles)
    s = state.scales(roles, torch.device("cpu"), measured=torch.tensor([1.0, 2.0, 4.0]))
    assert s.tolist() == [256.0, 128.0, 64.0] and not state.needs_measurement(roles)
    state.record(roles, torch.tensor([8.0, 2.0, 4.0]))
    assert state.scales(roles, torch.device("cpu")).tolist() == [32.0, 128.0, 64.0]
    state.record(roles, torch.tensor([NAN, 0.5, 0.5]))
    s = state.scales(roles, torch.device("cpu"))
    assert s.tolist() == [32.0, 128.0, 64.0]  # NaN in q's window: the previous scale stays
    hist = state.history()
    assert hist is not None and bool(torch.isnan(hist[:, ROLES.index("q")]).any())
    for _ in range(3):  # the window moves past the NaN and the large values
        state.record(roles, torch.tensor([0.5, 0.5, 0.5]))
    assert state.scales(roles, torch.device("cpu")).tolist() == [512.0, 512.0, 512.0]
    assert state.records("q") == 6


def test_current_scaling_is_stateless():
    state = ScalingState(ScalingRecipe(mode="current"))
    assert state.mode is ScalingMode.CURRENT and not state.mode.causal_safe and ScalingMode.DELAYED.causal_safe
    for amax, want in (([1.0, 2.0, 4.0], [256.0, 128.0, 64.0]), ([0.0, NAN, 448.0], [1.0, 1.0, 1.0])):
        assert state.needs_measurement(("q", "k", "v"))
        got = state.scales(("q", "k", "v"), torch.device("cpu"), measured=torch.tensor(amax))
        assert got.tolist() == want
    state.record(("q", "k", "v"), torch.tensor([1.0, 1.0, 1.0]))
    assert state.history() is None
    with pytest.raises(ValueError, match="amaxes"):
        state.scales(("q",), torch.device("cpu"))


def test_calibrate_then_freeze_makes_every_later_call_use_the_first_calls_scales():
    state = ScalingState(ScalingRecipe(freeze_after_calibration=True))
    fwd, bwd = ("q", "k", "v"), ("dp", "dq", "dk", "dv")
    first = state.scales(fwd, torch.device("cpu"), measured=torch.tensor([3.0, 5.0, 7.0]))
    assert state.frozen("q") and state.frozen("o") and state.frozen("s") and not state.frozen("dq")
    state.record(("q", "k", "v", "o", "s"), torch.tensor([100.0] * 5))  # ignored: frozen
    assert torch.equal(state.scales(fwd, torch.device("cpu")), first)
    assert state.records("q") == 1 and state.needs_measurement(bwd)
    g = state.scales(bwd, torch.device("cpu"), measured=torch.tensor([10.0, 1.0, 1.0, 1.0]))
    assert g.tolist() == [32.0, 256.0, 256.0, 256.0]  # the largest powers of two with amax * scale <= 448
    assert state.frozen("dv")
    state.unfreeze()
    state.record(("q", "k", "v", "o", "s"), torch.tensor([100.0] * 5))
    assert state.scales(fwd, torch.device("cpu")).tolist() == [4.0, 4.0, 4.0]
    state.freeze()
    assert all(state.frozen(r) for r in ROLES)
    state.reset()
    assert state.history() is None and state.needs_measurement(fwd) and not state.frozen("q")


def test_recipe_rejects_bad_settings():
    for bad in ({"history_len": 0}, {"history_len": True}, {"margin": -1}, {"margin": 1.5}, {"mode": "blockwise"}):
        with pytest.raises(ValueError):
            ScalingRecipe(**bad)  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------------------
# probe and refusals
# ------------------------------------------------------------------------------------------------


def test_probe_says_why_cudnn_fp8_cannot_run_here():
    reason = K.unavailable()
    if importlib.util.find_spec("cudnn") is None:
        assert reason == "nvidia-cudnn-frontend is not installed (pip install 'flamia-verify[cudnn]')"
    elif not torch.cuda.is_available():
        assert reason is not None and "CUDA" in reason
    if reason is not None:
        assert "\n" not in reason


def test_probe_reasons_one_line_each(monkeypatch):
    class FakeCudnn:
        version = 91900

        def backend_version(self):
            return self.version

    fake = FakeCudnn()
    monkeypatch.setattr(K.importlib.util, "find_spec", lambda name: object())
    monkeypatch.setattr(K.importlib, "import_module", lambda name: fake)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert K.unavailable() == "needs a CUDA GPU (cuDNN's FP8 attention has no CPU kernel)"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 0))
    assert "sm_80" in (K.unavailable() or "") and "Hopper (sm_90)" in (K.unavailable() or "")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    assert K.unavailable() is None
    fake.version = 90800
    assert K.unavailable() == "needs cuDNN >= 9.14.0 for FP8 attention; found 9.8.0"

    def broken(name):
        raise OSError("libcudnn.so.9: cannot open shared object file\nmore")

    monkeypatch.setattr(K.importlib, "import_module", broken)
    assert K.unavailable() == "import cudnn failed: OSError: libcudnn.so.9: cannot open shared object file"


def _refusal(**kw):
    args = {"arch": 9, "dtype": torch.bfloat16, "head_dim": 128, "heads": 4, "heads_k": 2, "causal": False}
    args.update(kw)
    return K.refusal(**args)


def test_refusals_name_the_limit_in_one_line():
    assert _refusal() is None and _refusal(backward=True) is None
    cases = {
        "bfloat16 or float16": _refusal(dtype=torch.float32),
        "not a multiple of 3 key/value heads": _refusal(heads_k=3),
        "multiple of 16 up to 256; got 72": _refusal(head_dim=72),
        "up to 128; got 256": _refusal(arch=10, head_dim=256),
        "needs head_dim 128; got 64": _refusal(head_dim=64, backward=True),
        "document 1: Lq=3, Lk=5": _refusal(causal=True, lengths=[(4, 4), (3, 5)]),
    }
    for text, reason in cases.items():
        assert reason is not None and reason.startswith("cudnn-fp8: ") and "\n" not in reason, reason
        assert text in reason, (text, reason)
    assert _refusal(head_dim=64) is None  # the forward takes it
    assert _refusal(arch=10, head_dim=64, backward=True) is None
    assert _refusal(causal=True, lengths=[(4, 4), (3, 5)], arch=10) is None  # Blackwell: bottom-right mask
    assert _refusal(causal=True, lengths=[(0, 5)]) is None  # no query: nothing to mask
    assert "Hopper" in (_refusal(causal=True, lengths=[(2, 1)]) or "")


def test_the_package_imports_neither_cudnn_nor_triton():
    import subprocess
    import sys

    code = (
        "import sys; import flamia_verify.kernels.cudnn_fp8 as m; m.make_kernel(); "
        "print(sorted(n for n in ('cudnn', 'triton') if n in sys.modules))"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert res.stdout.strip() == "[]"


def test_the_cudnn_engine_refuses_cpu_tensors_without_importing_cudnn():
    from flamia_verify.kernels.cudnn_fp8.cudnn_graphs import CudnnEngine

    fn = K.make_kernel()
    q = torch.zeros(4, 2, 128, dtype=torch.bfloat16)
    cu = torch.tensor([0, 4], dtype=torch.int32)
    with pytest.raises(CudnnFp8Refused, match=r"^cudnn-fp8: cuDNN's FP8 attention runs on CUDA tensors; got cpu"):
        fn(q, q, q, cu, cu, 4, 4)
    assert isinstance(fn.engine, CudnnEngine)  # type: ignore[attr-defined]


# ------------------------------------------------------------------------------------------------
# the kernel on the PyTorch model of cuDNN
# ------------------------------------------------------------------------------------------------


def _pack(lens_q, lens_k, heads=4, heads_k=2, dim=32, seed=0, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    cu_q = torch.tensor([0, *torch.tensor(lens_q).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    cu_k = torch.tensor([0, *torch.tensor(lens_k).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    tq, tk = int(cu_q[-1]), int(cu_k[-1])
    q = torch.randn(tq, heads, dim, generator=g).to(dtype).to(DEVICE)
    k = torch.randn(tk, heads_k, dim, generator=g).to(dtype).to(DEVICE)
    v = torch.randn(tk, heads_k, dim, generator=g).to(dtype).to(DEVICE)
    do = torch.randn(tq, heads, dim, generator=g).to(dtype).to(DEVICE)
    return q, k, v, do, cu_q, cu_k, max(lens_q), max(lens_k)


def _run(fn, q, k, v, do, cu_q, cu_k, mq, mk, causal, grads=True):
    q, k, v = (t.detach().clone().requires_grad_(grads) for t in (q, k, v))
    out = fn(q, k, v, cu_q, cu_k, mq, mk, causal=causal)
    if not grads:
        return out, None
    return out, torch.autograd.grad(out, (q, k, v), do)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp(min=1e-300))


@pytest.mark.parametrize("mode", ["current", "delayed"])
@pytest.mark.parametrize("causal", [False, True])
def test_kernel_runs_fp8_attention_forward_and_backward(mode, causal):
    """Within E4M3's error of the float64 reference (the fp8 recipe's: a few percent), GQA, an empty
    document, on the packed layout (forward) and the padded one (a Hopper backward)."""
    q, k, v, do, cu_q, cu_k, mq, mk = _pack([20, 0, 45, 9], [20, 0, 45, 9], dim=32)
    fn = K.make_kernel(mode, engine=EmulatedEngine(arch=10), freeze_after_calibration=True)
    out, grads = _run(fn, q, k, v, do, cu_q, cu_k, mq, mk, causal)
    qd, kd, vd = (t.double().requires_grad_() for t in (q, k, v))
    ref = reference_attention(qd, kd, vd, cu_q, cu_k, mq, mk, softmax_scale=32**-0.5, causal=causal)
    ref_grads = torch.autograd.grad(ref, (qd, kd, vd), do.double())
    assert out.dtype == torch.bfloat16 and out.shape == q.shape
    assert _rel(out, ref) < 0.06
    assert grads is not None
    for name, got, want in zip(("dq", "dk", "dv"), grads, ref_grads, strict=True):
        assert got.shape == want.shape and _rel(got, want) < 0.1, (name, _rel(got, want))
    label = "delayed scaling, calibrated then frozen" if mode == "delayed" else "current scaling"
    assert fn.paths == {f"cuDNN FP8 padded ({label})": 1}  # type: ignore[attr-defined]
    assert fn.engine.calls == {"forward": 1, "backward": 2}  # type: ignore[attr-defined]  # measure, then run
    assert fn.recipe == "fp8" and fn.forward_only is False  # type: ignore[attr-defined]


def test_packed_and_padded_layouts_give_the_same_bits():
    q, k, v, do, cu_q, cu_k, mq, mk = _pack([17, 40, 3], [30, 40, 5], dim=32, seed=2)
    results = []
    for ragged in (True, False):
        fn = K.make_kernel("current", engine=EmulatedEngine(arch=10, ragged_backward=ragged))
        out, grads = _run(fn, q, k, v, do, cu_q, cu_k, mq, mk, causal=False)
        assert fn.paths == {f"cuDNN FP8 {'packed' if ragged else 'padded'} (current scaling)": 1}  # type: ignore[attr-defined]
        results.append((out, *grads))  # type: ignore[misc]
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)


def test_strided_inputs_and_grad_free_calls():
    q, k, v, do, cu_q, cu_k, mq, mk = _pack([12, 30], [12, 30], heads=4, heads_k=4, dim=32, seed=4)
    fn = K.make_kernel("current", engine=EmulatedEngine(arch=10))
    wide = torch.cat([q, q], dim=2)[:, :, :32]  # a non-contiguous view with the same values
    assert not wide.is_contiguous()
    a, _ = _run(fn, q, k, v, do, cu_q, cu_k, mq, mk, causal=True, grads=False)
    with torch.no_grad():
        b = fn(wide, k, v, cu_q, cu_k, mq, mk, causal=True)
    assert torch.equal(a, b)
    assert fn.engine.calls == {"forward": 2, "backward": 0}  # type: ignore[attr-defined]
    # the layout a backward needs, even without gradients: calls with and without them run the same graphs
    assert fn.paths == {"cuDNN FP8 padded (current scaling)": 2}  # type: ignore[attr-defined]
    c, grads = _run(fn, q, k, v, do, cu_q, cu_k, mq, mk, causal=True)
    assert torch.equal(a, c) and grads is not None


def _grads_of(ref, inputs, do):
    return torch.autograd.grad(ref, inputs, do.double())


def test_hopper_refuses_what_it_cannot_adapt_before_any_engine_call():
    engine = EmulatedEngine(arch=9)
    fn = K.make_kernel(engine=engine)
    q, k, v, do, cu_q, cu_k, mq, mk = _pack([8, 5], [8, 9], dim=32)
    with pytest.raises(CudnnFp8Refused, match="bfloat16 or float16"):
        fn(q.float(), k.float(), v.float(), cu_q, cu_k, mq, mk)
    wide = torch.zeros(q.shape[0], q.shape[1], 144, dtype=q.dtype, device=DEVICE, requires_grad=True)
    kw, vw = (torch.zeros(k.shape[0], k.shape[1], 144, dtype=k.dtype, device=DEVICE) for _ in range(2))
    out = fn(wide, kw, vw, cu_q, cu_k, mq, mk)  # head_dim 144: the forward runs, the backward is refused
    with pytest.raises(CudnnFp8Refused, match="backward on Hopper .sm_90. needs head_dim 128; got 144"):
        out.backward(torch.zeros_like(out))
    assert engine.calls == {"forward": 1, "backward": 0}


def test_hopper_runs_small_head_dims_as_128_with_zero_columns():
    """Hopper's FP8 backward takes head_dim 128 only: head_dim 32 runs on zero-padded inputs, the same
    bits as the caller padding them, within the fp8 recipe's error of float64, gradients included."""
    q, k, v, do, cu_q, cu_k, mq, mk = _pack([20, 9], [20, 9], dim=32, seed=3)
    fn = K.make_kernel("current", engine=EmulatedEngine(arch=9))
    out, grads = _run(fn, q, k, v, do, cu_q, cu_k, mq, mk, causal=True)
    pad = lambda t: torch.nn.functional.pad(t, (0, 96))  # noqa: E731
    wide = [pad(t).requires_grad_() for t in (q, k, v)]
    wide_out = fn(*wide, cu_q, cu_k, mq, mk, softmax_scale=32**-0.5, causal=True)
    wide_grads = torch.autograd.grad(wide_out, wide, pad(do))
    assert out.shape == q.shape and torch.equal(out, wide_out[..., :32])
    assert grads is not None and wide_grads is not None
    for got, wide in zip(grads, wide_grads, strict=True):
        assert got.shape[2] == 32 and torch.equal(got, wide[..., :32])
    assert fn.engine.calls == {"forward": 2, "backward": 4}  # type: ignore[attr-defined]
    qd, kd, vd = (t.double().requires_grad_() for t in (q, k, v))
    ref = reference_attention(qd, kd, vd, cu_q, cu_k, mq, mk, softmax_scale=32**-0.5, causal=True)
    assert _rel(out, ref) < 0.06
    for got, want in zip(grads, _grads_of(ref, (qd, kd, vd), do), strict=True):
        assert _rel(got, want) < 0.1


def test_hopper_runs_causal_documents_with_lq_ne_lk_as_equal_lengths():
    """Hopper's top-left mask is the convention's bottom-right one only for Lq == Lk: documents with
    Lq < Lk (zero queries in front), Lq > Lk (the first Lq - Lk queries see no key), no keys, and no
    queries, in one pack, within the fp8 recipe's error of float64; rows without keys exactly zero."""
    lens_q, lens_k = [5, 12, 3, 0, 8], [9, 7, 0, 6, 8]
    q, k, v, do, cu_q, cu_k, mq, mk = _pack(lens_q, lens_k, dim=32, seed=5)
    fn = K.make_kernel("current", engine=EmulatedEngine(arch=9))
    out, grads = _run(fn, q, k, v, do, cu_q, cu_k, mq, mk, causal=True)
    assert fn.engine.calls == {"forward": 1, "backward": 2}  # type: ignore[attr-defined]  # one pack, no loop
    qd, kd, vd = (t.double().requires_grad_() for t in (q, k, v))
    ref = reference_attention(qd, kd, vd, cu_q, cu_k, mq, mk, softmax_scale=32**-0.5, causal=True)
    assert _rel(out, ref) < 0.06
    assert grads is not None
    for got, want in zip(grads, _grads_of(ref, (qd, kd, vd), do), strict=True):
        assert _rel(got, want) < 0.1
    blind = torch.zeros(q.shape[0], dtype=torch.bool)  # queries that see no key: 5 of document 1, document 2
    blind[5:10] = True
    blind[17:20] = True
    assert not bool(out[blind].any()) and not bool(grads[0][blind].any())
    assert bool(out[~blind].abs().sum(-1).gt(0).all())
    # every document with queries has no key: output 0 without a call
    q0, k0, v0, do0, cu_q0, cu_k0, mq0, mk0 = _pack([3, 0, 4], [0, 5, 0], dim=32, seed=6)
    out0, grads0 = _run(fn, q0, k0, v0, do0, cu_q0, cu_k0, mq0, mk0, causal=True)
    assert out0.shape == q0.shape and not bool(out0.any()) and grads0 is not None and not bool(grads0[0].any())
    assert fn.engine.calls == {"forward": 1, "backward": 2}  # type: ignore[attr-defined]
    # Blackwell's bottom-right mask on the same pack: the same attention within rounding
    fn10 = K.make_kernel("current", engine=EmulatedEngine(arch=10))
    out10, _ = _run(fn10, q, k, v, do, cu_q, cu_k, mq, mk, causal=True, grads=False)
    assert _rel(out, out10) < 0.02


def test_hopper_head_dim_128_with_gqa_runs_both_passes():
    q, k, v, do, cu_q, cu_k, mq, mk = _pack([16, 24], [16, 24], heads=4, heads_k=1, dim=128, seed=7)
    fn = K.make_kernel(engine=EmulatedEngine(arch=9), freeze_after_calibration=True)
    out, grads = _run(fn, q, k, v, do, cu_q, cu_k, mq, mk, causal=True)
    qd, kd, vd = (t.double().requires_grad_() for t in (q, k, v))
    ref = reference_attention(qd, kd, vd, cu_q, cu_k, mq, mk, softmax_scale=128**-0.5, causal=True)
    assert _rel(out, ref) < 0.06
    assert grads is not None
    for got, want in zip(grads, torch.autograd.grad(ref, (qd, kd, vd), do.double()), strict=True):
        assert _rel(got, want) < 0.1


def test_empty_pack_gives_zeros_and_zero_gradients():
    fn = K.make_kernel(engine=EmulatedEngine(arch=10))
    q = torch.zeros(3, 2, 32, dtype=torch.bfloat16, device=DEVICE, requires_grad=True)
    k = torch.zeros(0, 2, 32, dtype=torch.bfloat16, device=DEVICE, requires_grad=True)
    cu_q = torch.tensor([0, 3], dtype=torch.int32, device=DEVICE)
    cu_k = torch.tensor([0, 0], dtype=torch.int32, device=DEVICE)
    out = fn(q, k, k, cu_q, cu_k, 3, 0)
    assert out.shape == q.shape and not bool(out.any())
    (gq,) = torch.autograd.grad(out.sum(), (q,))
    assert not bool(gq.any())


def _leak_case(dim=32):
    """A causal pack, and the same pack with everything after position 10 of document 1 (q, k, v, dO)
    replaced by values 50x larger."""
    q, k, v, do, cu_q, cu_k, mq, mk = _pack([14, 33, 20], [14, 33, 20], dim=dim, seed=11)
    t0 = 14 + 10
    after = slice(t0 + 1, 14 + 33)
    g = torch.Generator().manual_seed(12)
    changed = []
    for t in (q, k, v, do):
        c = t.clone()
        c[after] = (torch.randn(c[after].shape, generator=g) * 50).to(c.dtype).to(DEVICE)
        changed.append(c)
    return (q, k, v, do, cu_q, cu_k, mq, mk), (*changed, cu_q, cu_k, mq, mk), t0


@pytest.mark.parametrize("mode", ["current", "delayed"])
def test_delayed_frozen_scaling_is_causal_safe_and_current_scaling_leaks(mode):
    """Outputs and dQ up to position t, alone vs with the future changed: bitwise equal with delayed
    scaling (calibrated on the first call, then frozen), different with current scaling, whose per-tensor
    amax sees the future."""
    base, changed, t0 = _leak_case()
    fn = K.make_kernel(mode, engine=EmulatedEngine(arch=10), freeze_after_calibration=True)
    out_a, grads_a = _run(fn, *base, causal=True)
    out_b, grads_b = _run(fn, *changed, causal=True)
    assert grads_a is not None and grads_b is not None
    past = slice(0, t0 + 1)
    same = torch.equal(out_a[past], out_b[past]) and torch.equal(grads_a[0][past], grads_b[0][past])
    assert same is (mode == "delayed")
    if mode == "delayed":  # the first call ran with the scales of every later call
        out_c, grads_c = _run(fn, *base, causal=True)
        assert grads_c is not None
        assert torch.equal(out_a, out_c) and all(torch.equal(x, y) for x, y in zip(grads_a, grads_c, strict=True))


@pytest.mark.parametrize("mode", ["current", "delayed"])
def test_document_isolation_depends_on_the_scaling_mode(mode):
    """Document 1 alone, and packed among neighbours 50x larger: bitwise the same with delayed scaling
    (frozen on the document alone), different with current scaling."""
    q, k, v, do, cu_q, cu_k, mq, mk = _pack([9, 21, 6], [9, 21, 6], dim=32, seed=21)
    doc = slice(9, 30)
    one = torch.tensor([0, 21], dtype=torch.int32, device=DEVICE)
    fn = K.make_kernel(mode, engine=EmulatedEngine(arch=10), freeze_after_calibration=True)
    alone, _ = _run(fn, q[doc], k[doc], v[doc], do[doc], one, one, 21, 21, causal=False, grads=False)
    loud = [t.clone() for t in (q, k, v)]
    for t in loud:
        t[:9] *= 50
        t[30:] *= 50
    packed, _ = _run(fn, *loud, do, cu_q, cu_k, mq, mk, causal=False, grads=False)
    assert torch.equal(alone, packed[doc]) is (mode == "delayed")


def test_a_nan_input_stays_in_its_rows_with_delayed_scaling_and_the_history_shows_it():
    q, k, v, do, cu_q, cu_k, mq, mk = _pack([9, 21], [9, 21], heads=2, heads_k=2, dim=32, seed=31)
    fn = K.make_kernel(engine=EmulatedEngine(arch=10))  # delayed, learning
    _run(fn, q, k, v, do, cu_q, cu_k, mq, mk, causal=True, grads=False)  # calibrate on clean data
    bad = v.clone()
    bad[15, 1, 3] = NAN  # document 1, position 6, head 1
    out, _ = _run(fn, q, k, bad, do, cu_q, cu_k, mq, mk, causal=True, grads=False)
    nan_rows = torch.isnan(out.float()).any(dim=2)
    # the other document and the other head stay finite; every query of head 1 that sees the NaN is NaN
    # (earlier queries of its document may be NaN too: a masked key still meets P = 0 in the product, and
    # 0 * NaN is NaN, in the model as in a tensor-core kernel's diagonal tile)
    assert not bool(nan_rows[:9].any()) and not bool(nan_rows[:, 0].any())
    assert bool(nan_rows[15:, 1].all())
    badq = q.clone()
    badq[20, 0, 7] = NAN  # document 1, position 11, head 0: that query's output, and only it
    out, _ = _run(fn, badq, k, v, do, cu_q, cu_k, mq, mk, causal=True, grads=False)
    nan_rows = torch.isnan(out.float()).any(dim=2)
    assert bool(nan_rows[20, 0]) and int(nan_rows.sum()) == 1
    hist = fn.scaling.history()  # type: ignore[attr-defined]
    assert bool(torch.isnan(hist[:, ROLES.index("v")]).any())
    assert fn.scaling.records("v") == 3  # type: ignore[attr-defined]  # one record per call, calibration included


def test_learning_delayed_scales_follow_the_history():
    q, k, v, do, cu_q, cu_k, mq, mk = _pack([16], [16], heads=2, heads_k=2, dim=32, seed=41)
    fn = K.make_kernel(engine=EmulatedEngine(arch=10), history_len=2)
    state = fn.scaling  # type: ignore[attr-defined]
    _run(fn, q, k, v, do, cu_q, cu_k, mq, mk, causal=False)
    s1 = state.scales(("q", "k", "v"), torch.device(DEVICE)).tolist()
    for _ in range(2):  # q 16x larger: after the window has moved, q's scale is 16x smaller
        _run(fn, q * 16, k, v, do, cu_q, cu_k, mq, mk, causal=False)
    s2 = state.scales(("q", "k", "v"), torch.device(DEVICE)).tolist()
    assert s2[0] == s1[0] / 16 and s2[1:] == s1[1:]
    assert state.records("dq") == 3 and state.records("o") == 3


def test_the_smoke_script_says_why_it_cannot_run_here():
    path = Path(__file__).parent.parent / "benchmarks" / "cudnn_fp8_smoke.py"
    spec = importlib.util.spec_from_file_location("cudnn_fp8_smoke", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if K.unavailable() is None:
        pytest.skip("cuDNN FP8 attention is available: the smoke script runs on the GPU")
    lines: list[str] = []
    assert module.main([], out=lines.append) == 2
    assert lines == [f"cudnn-fp8 smoke: not run: {K.unavailable()}"]


@pytest.mark.gpu
@pytest.mark.skipif(K.unavailable() is not None, reason=f"cudnn-fp8 unavailable: {K.unavailable()}")
def test_cudnn_kernel_on_the_gpu_is_within_fp8_error():
    q, k, v, do, cu_q, cu_k, mq, mk = _pack([128, 256, 384], [128, 256, 384], heads=4, heads_k=2, dim=128)
    fn = K.default_kernel()
    out, grads = _run(fn, q, k, v, do, cu_q, cu_k, mq, mk, causal=True)
    qd, kd, vd = (t.double().requires_grad_() for t in (q, k, v))
    ref = reference_attention(qd, kd, vd, cu_q, cu_k, mq, mk, softmax_scale=128**-0.5, causal=True)
    assert _rel(out, ref) < 0.1
    assert grads is not None
    for got, want in zip(grads, torch.autograd.grad(ref, (qd, kd, vd), do.double()), strict=True):
        assert _rel(got, want) < 0.2


def test_a_learning_kernel_scales_each_call_from_the_history_before_it():
    """history_len 1: the call after a 16x jump in q runs with the old (saturating) scale, the next one
    with the new: bitwise the result of current scaling on the same inputs (no stale cached scalars)."""
    q, k, v, do, cu_q, cu_k, mq, mk = _pack([16, 24], [16, 24], dim=32, seed=51)
    fn = K.make_kernel(engine=EmulatedEngine(arch=10), history_len=1)
    current = K.make_kernel("current", engine=EmulatedEngine(arch=10))
    big = q * 16
    _run(fn, q, k, v, do, cu_q, cu_k, mq, mk, causal=True, grads=False)
    after_jump, _ = _run(fn, big, k, v, do, cu_q, cu_k, mq, mk, causal=True, grads=False)
    adapted, _ = _run(fn, big, k, v, do, cu_q, cu_k, mq, mk, causal=True, grads=False)
    want, _ = _run(current, big, k, v, do, cu_q, cu_k, mq, mk, causal=True, grads=False)
    assert torch.equal(adapted, want) and not torch.equal(after_jump, want)


# ------------------------------------------------------------------------------------------------
# the state: the default trains (per instance, updated every call), the former default does not
# ------------------------------------------------------------------------------------------------


def test_the_default_is_a_factory_of_delayed_states_and_the_frozen_option_is_shared():
    from flamia_verify.kernels.state import StateKind, StateSharing, declared_state, is_factory

    eng = EmulatedEngine(arch=10)
    fn = K.make_kernel(engine=eng)
    policy = declared_state(fn)
    assert (policy.kind, policy.history_len, policy.margin, policy.sharing) == (
        StateKind.DELAYED,
        K.DEFAULT_HISTORY,
        K.DEFAULT_MARGIN,
        StateSharing.PER_INSTANCE,
    )
    twin = fn.new_instance()  # type: ignore[attr-defined]
    assert twin.engine is eng and twin.scaling is not fn.scaling  # type: ignore[attr-defined]
    assert declared_state(twin) == policy
    frozen = K.make_kernel(history_len=1024, margin=0, freeze_after_calibration=True, factory=False, engine=eng)
    fp = declared_state(frozen)
    assert fp.kind is StateKind.FROZEN and fp.sharing is StateSharing.SHARED and not is_factory(frozen)
    assert declared_state(K.make_kernel("current", engine=eng)).kind is StateKind.CURRENT


def test_a_snapshot_puts_the_kernel_back_to_the_same_bits():
    q, k, v, do, cu_q, cu_k, mq, mk = _pack([16, 24], [16, 24], dim=32, seed=61)
    fn = K.make_kernel(engine=EmulatedEngine(arch=10), history_len=2)
    _run(fn, q, k, v, do, cu_q, cu_k, mq, mk, causal=True)
    snap = fn.state_snapshot()  # type: ignore[attr-defined]
    first, g1 = _run(fn, q, k, v, do, cu_q, cu_k, mq, mk, causal=True)
    _run(fn, q * 64, k, v * 64, do, cu_q, cu_k, mq, mk, causal=True)  # moves every window
    fn.state_restore(snap)  # type: ignore[attr-defined]
    again, g2 = _run(fn, q, k, v, do, cu_q, cu_k, mq, mk, causal=True)
    assert torch.equal(first, again) and all(torch.equal(a, b) for a, b in zip(g1, g2, strict=True))
    d = fn.state_describe()  # type: ignore[attr-defined]
    assert d["q"]["calibrated"] and d["q"]["records"] >= 2 and d["dq"]["scale"] is not None


def test_the_former_default_fails_the_state_family_naming_the_call_and_the_stale_scale():
    """Frozen after the first call, one state for every layer: the backward runs in reverse layer order,
    so the last layer's gradients (2^-8 of the first's) froze their scales, and the first layer's
    first backward saturates (on the PyTorch model of cuDNN, the fused quantization interpreted)."""
    from flamia_verify.properties import run_checks

    fn = K.make_kernel(
        history_len=1024, margin=0, freeze_after_calibration=True, factory=False, engine=EmulatedEngine(arch=10)
    )
    report = run_checks(fn, recipe="fp8", suite="quick", only=["state.training"], device=DEVICE)
    res = report.check("state.training")
    assert res.status == "fail" and res.verdict == "gating"
    assert "call 1 of 39 (step 0, layer 0" in res.message, res.message
    assert re.search(r"\w+'s scale 2\^-?\d+ \(from a history amax of [^)]*\) maps this call's amax", res.message)
    assert "saturates by" in res.message
    assert res.worst_case["stale_scales"][0]["ratio"] > 8


def test_the_default_passes_the_state_family_one_instance_per_layer():
    from flamia_verify.properties import run_checks

    report = run_checks(
        K.make_kernel(engine=EmulatedEngine(arch=10)),
        recipe="fp8",
        suite="quick",
        only=["state.training"],
        device=DEVICE,
    )
    res = report.check("state.training")
    assert res.status == "pass", res.message
    assert "one instance per layer" in res.message and res.metrics["state_detected"] == 1
    short = run_checks(
        K.make_kernel(engine=EmulatedEngine(arch=10), history_len=3),
        recipe="fp8",
        suite="quick",
        only=["state.history"],
        device=DEVICE,
    )
    hist = short.check("state.history")
    assert hist.status == "pass", hist.message
