"""The FlashAttention-4 adapters (flamia_verify/kernels/fa4.py): fa4 (BF16/FP16, forward and backward)
and fa4-fp8 with its scaling policies (delayed, current per tensor, current per document and kv head).

Neither machine of CI has FA4 or a GPU it runs on, so the glue is tested through a stand-in of
``flash_attn.cute.interface``: a ``flash_attn_varlen_func`` with the real one's first eight positional
parameters (q, k, v, qv, cu_seqlens_q, ...), its checks on cu_seqlens, dtypes and FP8 descales, and the
float64 reference as its arithmetic (FP8 codes times their descales, out in BF16, as FA4 writes it).
On it: the argument mapping (qv never positional, cu_seqlens, max_seqlen, softmax_scale, causal, GQA,
the returned lse), the availability reasons, the FP8 scales each policy computes, and which policy lets
a later token or another document change an output (the property each policy is offered for). Where
flash-attn-4 is installed, the stand-in's signature is held to the real one's, and the real interface
takes the adapters' calls up to its own check for CUDA.
"""

from __future__ import annotations

import inspect
import math
import sys
import types
from typing import Any, NamedTuple

import pytest
import torch
from test_adapters import PACKS, check_against_reference, make_pack

from flamia_verify.errors import KernelLoadError
from flamia_verify.kernels import fa4, load_kernel
from flamia_verify.kernels.adapters import ADAPTERS
from flamia_verify.kernels.cudnn_fp8.scaling import pow2_scale
from flamia_verify.reference import reference_attention
from flamia_verify.reference.attention import attention_forward

FA4_NAMES = ("fa4", "fa4-fp8", "fa4-fp8-current", "fa4-fp8-doc")
FP8_NAMES = FA4_NAMES[1:]
POLICIES = {"fa4-fp8": "delayed", "fa4-fp8-current": "current", "fa4-fp8-doc": "document"}
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


# ------------------------------------------------------------------------------------------------
# the stand-in interface
# ------------------------------------------------------------------------------------------------


class StandInScales(NamedTuple):
    q: torch.Tensor | None = None
    k: torch.Tensor | None = None
    v: torch.Tensor | None = None


def _per_row(descale: torch.Tensor | None, cu: torch.Tensor, heads: int) -> torch.Tensor | float:
    """A (batch, heads_kv) descale as (total, heads, 1) rows (a query head reads its kv head's)."""
    if descale is None:
        return 1.0
    lengths = (cu[1:] - cu[:-1]).long()
    rows = torch.repeat_interleave(descale.double(), lengths, dim=0)  # (total, heads_kv)
    return rows.repeat_interleave(heads // descale.shape[1], dim=1)[..., None]


class StandIn:
    """``flash_attn.cute.interface`` as the adapters use it, recording every call."""

    TensorwiseScales = StandInScales

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []

    def flash_attn_varlen_func(
        self,
        q,
        k,
        v,
        qv=None,
        cu_seqlens_q=None,
        cu_seqlens_k=None,
        max_seqlen_q=None,
        max_seqlen_k=None,
        **kwargs,
    ):
        call = {"q": q, "k": k, "v": v, "qv": qv, "cu_seqlens_q": cu_seqlens_q, "cu_seqlens_k": cu_seqlens_k}
        call.update(max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, **kwargs)
        self.calls.append(call)
        assert qv is None, "qv given: cu_seqlens_q went in as the fourth positional argument"
        for cu in (cu_seqlens_q, cu_seqlens_k):  # FA4's own checks
            assert cu is not None and cu.dtype == torch.int32 and cu.stride(0) == 1
        assert v.dtype in (torch.float16, torch.bfloat16, *FP8_DTYPES)
        assert q.dtype == k.dtype == v.dtype and q.shape[1] % k.shape[1] == 0
        scale = kwargs.get("softmax_scale")
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        causal = kwargs.get("causal", False)
        fp8 = v.dtype in FP8_DTYPES
        if fp8:
            if any(t.requires_grad for t in (q, k, v)):
                raise NotImplementedError("FA4 CuTe FP8 backward is not supported yet (forward-only).")
            d = kwargs.get("scales") or StandInScales()
            batch, heads_kv = cu_seqlens_q.numel() - 1, k.shape[1]
            for t in d:
                assert t is None or (t.shape == (batch, heads_kv) and t.dtype == torch.float32)
            q = q.double() * _per_row(d.q, cu_seqlens_q, q.shape[1])
            k = k.double() * _per_row(d.k, cu_seqlens_k, k.shape[1])
            v = v.double() * _per_row(d.v, cu_seqlens_k, v.shape[1])
        args = (q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
        out = reference_attention(*args, softmax_scale=scale, causal=causal)
        out = out.to(torch.bfloat16 if fp8 else q.dtype)
        lse = None
        if kwargs.get("return_lse"):
            with torch.no_grad():
                lse = attention_forward(*args[:5], softmax_scale=scale, causal=causal)[1].T.float().contiguous()
        return out, lse


@pytest.fixture
def standin(monkeypatch):
    fake = StandIn()
    module = types.ModuleType(fa4.INTERFACE)
    module.flash_attn_varlen_func = fake.flash_attn_varlen_func  # type: ignore[attr-defined]
    module.TensorwiseScales = StandInScales  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, fa4.INTERFACE, module)
    return fake


def _call(fn, q, k, v, cu_q, cu_k, mq, mk, **kw):
    out = fn(q, k, v, cu_q, cu_k, mq, mk, **kw)
    return out[0] if isinstance(out, tuple) else out


# ------------------------------------------------------------------------------------------------
# fa4: the mapping onto the convention
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("pack", ["mixed", "lq<lk", "lq>lk"])
def test_fa4_matches_the_reference_through_the_stand_in(standin, pack, causal):
    """Out and every gradient as the reference's (the stand-in computes the reference: what is tested is
    that the adapter hands it the call the convention describes), GQA, bottom-right causal."""
    fn = ADAPTERS["fa4"].build()
    check_against_reference(fn, PACKS[pack], 4, 2, causal=causal, scale=0.3, name=f"fa4 {pack}")
    assert len(standin.calls) == 1


def test_fa4_passes_qv_by_keyword_and_maps_every_argument(standin):
    fn = ADAPTERS["fa4"].build()
    q, k, v, _, cu_q, cu_k, mq, mk = make_pack(PACKS["mixed"], 6, 2)
    result = fn(q, k, v, cu_q, cu_k, mq + 3, mk, softmax_scale=0.25, causal=1)
    call = standin.calls[-1]
    assert call["q"] is q and call["k"] is k and call["v"] is v and call["qv"] is None
    assert torch.equal(call["cu_seqlens_q"], cu_q) and torch.equal(call["cu_seqlens_k"], cu_k)
    assert (call["max_seqlen_q"], call["max_seqlen_k"]) == (mq + 3, mk)  # an upper bound, passed on
    assert type(call["max_seqlen_q"]) is int and type(call["softmax_scale"]) is float
    assert call["softmax_scale"] == 0.25 and call["causal"] is True
    assert call["return_lse"] is True and call["deterministic"] is False
    assert "scales" not in call
    out, lse = result
    assert out.shape == q.shape and out.dtype == q.dtype
    assert lse.shape == (q.shape[1], q.shape[0]) and lse.dtype == torch.float32  # (nheads, total_q)
    _, want = attention_forward(q, k, v, cu_q, cu_k, softmax_scale=0.25, causal=True)
    assert torch.equal(lse, want.T.float())


def test_fa4_softmax_scale_none_is_fa4s_default_and_lse_is_optional(standin):
    fn = fa4.make_kernel(return_lse=False, deterministic=True)
    q, k, v, _, cu_q, cu_k, mq, mk = make_pack(PACKS["equal"], 4, 4)
    out = fn(q, k, v, cu_q, cu_k, mq, mk, causal=False)
    assert isinstance(out, torch.Tensor) and out.shape == q.shape
    call = standin.calls[-1]
    assert call["softmax_scale"] is None and call["return_lse"] is False and call["deterministic"] is True
    assert fn.paths == {"FA4 varlen, deterministic backward": 1}  # type: ignore[attr-defined]


def test_fa4_hands_strided_cu_seqlens_over_as_contiguous_copies(standin):
    """FA4 asserts stride 1 on cu_seqlens; the convention allows views (interface.arguments passes them)."""
    fn = ADAPTERS["fa4"].build()
    q, k, v, _, cu_q, cu_k, mq, mk = make_pack(PACKS["lq<lk"], 4, 2)
    strided_q = torch.stack([cu_q, cu_q], dim=1)[:, 0]
    strided_k = torch.stack([cu_k, -cu_k], dim=1)[:, 0]
    assert strided_q.stride(0) == 2
    got = _call(fn, q, k, v, strided_q, strided_k, mq, mk, softmax_scale=0.3, causal=True)
    want = _call(fn, q, k, v, cu_q, cu_k, mq, mk, softmax_scale=0.3, causal=True)
    assert torch.equal(got, want)
    assert torch.equal(standin.calls[0]["cu_seqlens_q"], cu_q) and standin.calls[0]["cu_seqlens_q"].stride(0) == 1
    assert strided_q.stride(0) == 2 and torch.equal(strided_k, cu_k)  # the caller's views untouched


def test_fa4_fp16_keeps_its_dtype(standin):
    fn = ADAPTERS["fa4"].build()
    q, k, v, do, cu_q, cu_k, mq, mk = make_pack(PACKS["equal"], 4, 1, dtype=torch.float16)
    q.requires_grad_()
    out = _call(fn, q, k, v, cu_q, cu_k, mq, mk, softmax_scale=0.3, causal=True)
    assert out.dtype == torch.float16
    (dq,) = torch.autograd.grad(out, (q,), do)
    assert dq.dtype == torch.float16


# ------------------------------------------------------------------------------------------------
# availability: one line, the first reason
# ------------------------------------------------------------------------------------------------


def _machine(monkeypatch, *, missing: str | None = None, cuda: bool = True, arch: tuple[int, int] = (9, 0)):
    monkeypatch.setattr(fa4, "_found", lambda module: module != missing)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: arch)


@pytest.mark.parametrize("name", FA4_NAMES)
def test_without_flash_attn_4_every_fa4_adapter_names_the_package(name):
    """On this CPU machine (flash-attn-4 is not installed here): one line, the package and the extra."""
    if fa4._found("flash_attn.cute"):
        pytest.skip("flash-attn-4 is installed here")
    reason = ADAPTERS[name].unavailable()
    assert reason == "flash-attn-4 is not installed (no module flash_attn.cute; pip install 'flamia-verify[fa4]')"
    with pytest.raises(KernelLoadError, match=rf"adapter '{name}' is not available: flash-attn-4 is not installed"):
        load_kernel(name)


@pytest.mark.parametrize(
    ("module", "dist"),
    [("cutlass", "nvidia-cutlass-dsl"), ("quack", "quack-kernels"), ("tvm_ffi", "apache-tvm-ffi")],
)
def test_a_missing_dependency_is_named_with_its_distribution(monkeypatch, module, dist):
    _machine(monkeypatch, missing=module)
    for name in FA4_NAMES:
        reason = ADAPTERS[name].unavailable()
        assert reason == f"flash-attn-4 needs {dist} (module {module}), which is not installed " + (
            "(pip install 'flamia-verify[fa4]')"
        )


def test_without_cuda_the_reason_is_the_gpu(monkeypatch):
    _machine(monkeypatch, cuda=False)
    for name in FA4_NAMES:
        assert ADAPTERS[name].unavailable() == "needs a CUDA GPU (FlashAttention-4 has only CUDA kernels)"


@pytest.mark.parametrize(
    ("arch", "bf16", "fp8"),
    [
        ((8, 0), False, False),
        ((9, 0), True, False),
        ((10, 0), True, True),
        ((10, 3), True, True),
        ((12, 0), True, False),
    ],
)
def test_the_gpu_generation_decides_bf16_and_fp8(monkeypatch, arch, bf16, fp8):
    """FA4 on Hopper and Blackwell; its FP8 forward on compute capability 10.x only (its interface asserts
    it), so on the H100/H200 fa4 runs and fa4-fp8 says why not."""
    _machine(monkeypatch, arch=arch)
    sm = f"sm_{arch[0]}{arch[1]}"
    reason = ADAPTERS["fa4"].unavailable()
    assert (reason is None) is bf16
    if not bf16:
        assert reason == f"FlashAttention-4 runs on Hopper (sm_90) and Blackwell (sm_100 and later); this GPU is {sm}"
    for name in FP8_NAMES:
        reason = ADAPTERS[name].unavailable()
        assert (reason is None) is fp8
        if not fp8:
            assert reason is not None and reason.startswith("FlashAttention-4's FP8 forward runs on Blackwell")
            assert reason.endswith(f"this GPU is {sm}") and "\n" not in reason


@pytest.fixture
def namespace_flash_attn(tmp_path, monkeypatch):
    """flash_attn as flash-attn-4 alone installs it: a namespace package holding only flash_attn.cute."""
    (tmp_path / "flash_attn" / "cute").mkdir(parents=True)
    (tmp_path / "flash_attn" / "cute" / "__init__.py").write_text("")
    before = {name for name in sys.modules if name.split(".")[0] == "flash_attn"}
    for name in before:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield
    for name in [n for n in sys.modules if n.split(".")[0] == "flash_attn" and n not in before]:
        del sys.modules[name]


def test_flash_attn_4_alone_is_not_flash_attn_2(namespace_flash_attn, monkeypatch):
    """The flash-attn adapter (FlashAttention-2's flash_attn package) is not offered on a machine with
    only flash-attn-4, whose flash_attn is a namespace package; the fa4 adapters find their module."""
    reason = ADAPTERS["flash-attn"].unavailable()
    assert reason == "flash_attn is not installed (only flash_attn.cute, FlashAttention-4: see the fa4 adapter)"
    assert fa4._found("flash_attn.cute")
    assert ADAPTERS["fa4"].unavailable() != "flash-attn-4 is not installed (no module flash_attn.cute; " + (
        "pip install 'flamia-verify[fa4]')"
    )


# ------------------------------------------------------------------------------------------------
# declarations
# ------------------------------------------------------------------------------------------------


def test_the_adapters_declare_their_recipes_forward_only_and_libraries():
    assert ADAPTERS["fa4"].recipe == "bf16" and not ADAPTERS["fa4"].forward_only
    for name in FP8_NAMES:
        a = ADAPTERS[name]
        assert a.recipe == "fp8-mma" and a.forward_only and a.runs_on == "CUDA"
        assert "Blackwell only" in a.limits
    for name in FA4_NAMES:
        assert ADAPTERS[name].libraries == fa4.LIBRARIES
        assert set(ADAPTERS[name].library_versions()) == set(fa4.LIBRARIES)
    assert "causal-safe" in ADAPTERS["fa4-fp8"].wraps and "not causal-safe" in ADAPTERS["fa4-fp8-doc"].wraps


def test_load_gives_the_kernel_its_declarations(standin, monkeypatch):
    _machine(monkeypatch, arch=(10, 0))
    for name in FA4_NAMES:
        loaded = load_kernel(name)
        assert loaded.source == "adapter" and loaded.recipe == ADAPTERS[name].recipe
        assert loaded.fn.forward_only is ADAPTERS[name].forward_only
    fn = ADAPTERS["fa4-fp8-doc"].build()
    assert fn.policy == "document" and fn.scaling is None  # type: ignore[attr-defined]
    assert ADAPTERS["fa4-fp8"].build().scaling.recipe.freeze_after_calibration  # type: ignore[attr-defined]


def test_the_survey_lists_the_fa4_adapters_unavailable_here_with_one_reason():
    from flamia_verify.sweep.survey import availability, default_kernels

    kernels = default_kernels()
    assert all(name in kernels for name in FA4_NAMES)
    if fa4._found("flash_attn.cute"):
        pytest.skip("flash-attn-4 is installed here")
    for name in FA4_NAMES:
        reason, recipe = availability(name, "cpu")
        assert reason is not None and reason.startswith("flash-attn-4 is not installed") and "\n" not in reason
        assert recipe == ADAPTERS[name].recipe


# ------------------------------------------------------------------------------------------------
# FP8: the scales of each policy
# ------------------------------------------------------------------------------------------------


def test_tensor_amax():
    x = torch.tensor([[-3.0, 2.0], [0.5, -7.5]], dtype=torch.bfloat16)
    assert fa4.tensor_amax(x).tolist() == [7.5] and fa4.tensor_amax(x).dtype == torch.float32
    assert fa4.tensor_amax(x[:0]).tolist() == [0.0]
    x[0, 0] = math.nan
    assert math.isnan(fa4.tensor_amax(x).item())


def test_document_head_amax_is_per_document_and_kv_head_with_q_heads_grouped():
    q, k, _, _, cu_q, cu_k, _, _ = make_pack(PACKS["empty"], 6, 2)
    for x, cu in ((q, cu_q), (k, cu_k)):
        got = fa4.document_head_amax(x, cu, 2)
        group = x.shape[1] // 2
        assert got.shape == (cu.numel() - 1, 2) and got.dtype == torch.float32
        for b in range(cu.numel() - 1):
            rows = x[int(cu[b]) : int(cu[b + 1])].float()
            for h in range(2):
                want = rows[:, h * group : (h + 1) * group].abs().amax().item() if rows.numel() else 0.0
                assert got[b, h].item() == want
    bad = q.clone()
    bad[int(cu_q[1]) + 1, 3, 0] = math.nan  # document 1, query head 3 (kv head 1)
    got = fa4.document_head_amax(bad, cu_q, 2)
    assert math.isnan(got[1, 1].item()) and int(torch.isnan(got).sum()) == 1


def test_quantize_e4m3_per_tensor_and_per_document():
    q, _, _, _, cu_q, _, _, _ = make_pack(PACKS["mixed"], 4, 2)
    amax = fa4.tensor_amax(q)
    scale = pow2_scale(amax)
    codes = fa4.quantize_e4m3(q, scale)
    assert codes.dtype == torch.float8_e4m3fn and codes.shape == q.shape
    assert torch.equal(codes, (q.float() * scale).to(torch.float8_e4m3fn))
    assert 224 < codes.float().abs().max().item() <= 448  # the amax lands in (224, 448]
    per_doc = pow2_scale(fa4.document_head_amax(q, cu_q, 2))  # (batch, 2); empty documents: NaN, unused
    codes = fa4.quantize_e4m3(q, per_doc, cu_q)
    for b in range(cu_q.numel() - 1):
        for h in range(4):
            rows = slice(int(cu_q[b]), int(cu_q[b + 1]))
            want = (q[rows, h].float() * per_doc[b, h // 2]).to(torch.float8_e4m3fn)
            assert torch.equal(codes[rows, h], want)
    loud = torch.full((2, 1, 4), 1e4, dtype=torch.bfloat16)
    loud[0, 0, 0] = math.nan
    out = fa4.quantize_e4m3(loud, torch.ones(1)).float()
    assert math.isnan(out[0, 0, 0].item()) and out[1].eq(448).all()  # saturated, NaN kept


def test_descales_are_exact_reciprocals_in_fa4s_shape():
    s = torch.tensor([2.0**-3])
    d = fa4.fp8_descales(s, 3, 2)
    assert d.shape == (3, 2) and d.is_contiguous() and d.eq(8.0).all() and d.dtype == torch.float32
    s2 = torch.tensor([[2.0, 4.0], [0.5, 1.0]])
    assert fa4.fp8_descales(s2, 2, 2).tolist() == [[0.5, 0.25], [2.0, 1.0]]


def _fp8_run(fn, q, k, v, cu_q, cu_k, mq, mk, causal=True, scale=0.3):
    return _call(fn, q, k, v, cu_q, cu_k, mq, mk, softmax_scale=scale, causal=causal)


@pytest.mark.parametrize("name", FP8_NAMES)
def test_fp8_kernels_hand_e4m3_codes_and_their_descales_to_fa4(standin, monkeypatch, name):
    _machine(monkeypatch, arch=(10, 0))
    fn = load_kernel(name).fn
    q, k, v, _, cu_q, cu_k, mq, mk = make_pack(PACKS["mixed"], 4, 2, dtype=torch.float16)
    out, lse = fn(q, k, v, cu_q, cu_k, mq, mk, softmax_scale=0.3, causal=True)
    call = standin.calls[-1]
    assert call["qv"] is None and call["return_lse"] is True and call["softmax_scale"] == 0.3
    assert all(call[t].dtype == torch.float8_e4m3fn for t in ("q", "k", "v"))
    d = call["scales"]
    assert isinstance(d, StandInScales) and all(t.shape == (7, 2) for t in d)
    if POLICIES[name] == "document":
        want = [1.0 / pow2_scale(fa4.document_head_amax(x, cu, 2)) for x, cu in ((q, cu_q), (k, cu_k), (v, cu_k))]
        for got, w, cu in zip(d, want, (cu_q, cu_k, cu_k), strict=True):
            empty = (cu[1:] - cu[:-1]) == 0
            assert torch.equal(got[~empty], w[~empty]) and got[empty].eq(1.0).all()  # no data: scale 1
    else:  # one scale per tensor, the same for every (document, kv head)
        for got, x in zip(d, (q, k, v), strict=True):
            assert got.eq(1.0 / pow2_scale(fa4.tensor_amax(x))).all()
    assert out.dtype == torch.float16 and out.shape == q.shape and out.grad_fn is None
    assert lse.shape == (4, q.shape[0])
    ref = reference_attention(q, k, v, cu_q, cu_k, mq, mk, softmax_scale=0.3, causal=True)
    err = (out.double() - ref).norm() / ref.norm()
    assert err < 0.1, f"{name}: relative error {err:.3g} (E4M3 operands: a few percent)"


def test_fp8_is_forward_only_with_inputs_that_require_grad(standin, monkeypatch):
    """The harness finds a forward-only kernel by its output without grad_fn; FA4 itself refuses an
    FP8 input that requires grad, which the quantized copies never do."""
    fn = fa4.make_fp8_kernel("current")
    q, k, v, _, cu_q, cu_k, mq, mk = make_pack(PACKS["equal"], 4, 2)
    q.requires_grad_()
    out = _fp8_run(fn, q, k, v, cu_q, cu_k, mq, mk)
    assert out.grad_fn is None and not standin.calls[-1]["q"].requires_grad


def test_delayed_scaling_calibrates_on_the_first_call_and_then_stays(standin):
    fn = fa4.make_fp8_kernel("delayed")  # frozen after calibration: what the check runs
    q, k, v, _, cu_q, cu_k, mq, mk = make_pack(PACKS["equal"], 4, 2)
    _fp8_run(fn, q, k, v, cu_q, cu_k, mq, mk)
    first = [t.clone() for t in standin.calls[-1]["scales"]]
    _fp8_run(fn, q * 16, k, v * 0.25, cu_q, cu_k, mq, mk)
    assert all(torch.equal(a, b) for a, b in zip(first, standin.calls[-1]["scales"], strict=True))
    assert standin.calls[-1]["q"].float().abs().max().item() == 448  # q 16x larger saturates
    assert first[0][0, 0].item() == 1.0 / pow2_scale(fa4.tensor_amax(q)).item()


def test_learning_delayed_scales_follow_the_history(standin):
    fn = fa4.make_fp8_kernel("delayed", freeze_after_calibration=False, history_len=2)
    q, k, v, _, cu_q, cu_k, mq, mk = make_pack(PACKS["equal"], 4, 2)
    _fp8_run(fn, q, k, v, cu_q, cu_k, mq, mk)
    d1 = standin.calls[-1]["scales"].q[0, 0].item()
    for _ in range(3):  # the window (2 calls) moves past the first amax
        _fp8_run(fn, q * 16, k, v, cu_q, cu_k, mq, mk)
    assert standin.calls[-1]["scales"].q[0, 0].item() == d1 * 16
    assert fn.scaling.records("q") == 4  # type: ignore[attr-defined]


def test_margin_divides_every_policys_scales(standin):
    q, k, v, _, cu_q, cu_k, mq, mk = make_pack(PACKS["equal"], 4, 2)
    for policy in ("delayed", "current", "document"):
        got = []
        for margin in (0, 2):
            _fp8_run(fa4.make_fp8_kernel(policy, margin=margin), q, k, v, cu_q, cu_k, mq, mk)
            got.append(standin.calls[-1]["scales"].k)
        assert torch.equal(got[1], got[0] * 4), policy


# ------------------------------------------------------------------------------------------------
# FP8: which policy leaks
# ------------------------------------------------------------------------------------------------


def _future_changed():
    """A causal pack, and the same pack with every token after position 10 of document 1 replaced by
    values 50x larger."""
    docs = [(14, 14), (33, 33), (20, 20)]
    q, k, v, _, cu_q, cu_k, mq, mk = make_pack(docs, 4, 2, dim=32, seed=11)
    t0 = 14 + 10
    after = slice(t0 + 1, 14 + 33)
    g = torch.Generator().manual_seed(12)
    changed = []
    for t in (q, k, v):
        c = t.clone()
        c[after] = (torch.randn(c[after].shape, generator=g) * 50).to(c.dtype)
        changed.append(c)
    return (q, k, v, cu_q, cu_k, mq, mk), (*changed, cu_q, cu_k, mq, mk), t0


@pytest.mark.parametrize("policy", ["delayed", "current", "document"])
def test_which_policies_let_a_later_token_change_an_earlier_output(standin, policy):
    """Outputs up to position t of document 1, and every output of the other documents, with the tokens
    after t changed: bitwise the same with delayed scaling; the same in the other documents only with
    per-document scaling; changed everywhere with one amax over the pack."""
    base, changed, t0 = _future_changed()
    fn = fa4.make_fp8_kernel(policy)
    a = _fp8_run(fn, *base)
    b = _fp8_run(fn, *changed)
    past = slice(14, t0 + 1)
    others = torch.cat([torch.arange(14), torch.arange(47, 67)])
    assert torch.equal(a[past], b[past]) is fa4.Fp8Scaling(policy).causal_safe
    assert torch.equal(a[others], b[others]) is fa4.Fp8Scaling(policy).document_safe


@pytest.mark.parametrize("policy", ["delayed", "current", "document"])
def test_which_policies_let_the_neighbours_change_a_document(standin, policy):
    """Document 1 alone, and packed among neighbours 50x larger: bitwise the same unless one amax spans
    the pack."""
    docs = [(9, 9), (21, 21), (6, 6)]
    q, k, v, _, cu_q, cu_k, mq, mk = make_pack(docs, 4, 2, dim=32, seed=21)
    doc = slice(9, 30)
    one = torch.tensor([0, 21], dtype=torch.int32)
    fn = fa4.make_fp8_kernel(policy)
    alone = _fp8_run(fn, q[doc], k[doc], v[doc], one, one, 21, 21, causal=False)
    loud = [t.clone() for t in (q, k, v)]
    for t in loud:
        t[:9] *= 50
        t[30:] *= 50
    packed = _fp8_run(fn, *loud, cu_q, cu_k, mq, mk, causal=False)
    assert torch.equal(alone, packed[doc]) is fa4.Fp8Scaling(policy).document_safe


@pytest.mark.parametrize("policy", ["delayed", "current", "document"])
def test_the_checks_say_which_policy_leaks(standin, policy):
    """The causal and isolation families on each policy (FA4's arithmetic stood in by the reference on
    the dequantized codes): delayed passes both; current fails causal and isolation (one amax spans the
    pack); document fails causal only, and isolation.heads (a q descale is one per kv head: the query
    heads of a GQA group share their amax), never across documents."""
    from flamia_verify.api import check

    report = check(fa4.make_fp8_kernel(policy), recipe="fp8-mma", forward_only=True, only=["causal", "isolation"])
    failed = {c.name for c in report.checks if c.status in ("fail", "error")}
    safe = fa4.Fp8Scaling(policy)
    assert {c.name for c in report.checks if c.status == "error"} == set()
    assert bool({n for n in failed if n.startswith("causal.")}) is not safe.causal_safe, failed
    across = {n for n in failed if n.startswith("isolation.") and n != "isolation.heads"}
    assert bool(across) is not safe.document_safe, failed
    assert ("isolation.heads" in failed) is (policy != "delayed"), failed
    if policy == "document":
        assert {"causal.forward", "causal.nan"} <= failed


# ------------------------------------------------------------------------------------------------
# the real interface, where flash-attn-4 is installed (not on CI's machines)
# ------------------------------------------------------------------------------------------------

needs_fa4 = pytest.mark.skipif(not fa4._found("flash_attn.cute"), reason="flash-attn-4 is not installed")


@needs_fa4
def test_the_stand_in_has_the_real_interfaces_signature():
    real = pytest.importorskip(fa4.INTERFACE)
    params = list(inspect.signature(real.flash_attn_varlen_func).parameters)
    assert params[:8] == list(inspect.signature(StandIn.flash_attn_varlen_func).parameters)[1:9]
    for name in ("softmax_scale", "causal", "deterministic", "return_lse", "scales"):
        assert name in params
    assert real.TensorwiseScales._fields == ("q", "k", "v")


@needs_fa4
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU refusal")
def test_the_real_interface_takes_the_calls_up_to_its_cuda_check():
    """cu_seqlens, max_seqlen, dtypes, shapes and (FP8) the descales pass the interface's own asserts;
    the first one that fails is the one for CUDA."""
    q, k, v, _, cu_q, cu_k, mq, mk = make_pack(PACKS["mixed"], 4, 2, dim=64)
    for fn in (fa4.make_kernel(), fa4.make_fp8_kernel("document"), fa4.make_fp8_kernel("current")):
        with pytest.raises(AssertionError, match="CUDA"):
            fn(q, k, v, cu_q, cu_k, mq, mk, softmax_scale=0.3, causal=True)


# ------------------------------------------------------------------------------------------------
# CUDA, where FA4 runs (-m gpu; benchmarks/fa4_gpu.sh smoke)
# ------------------------------------------------------------------------------------------------


def _runs_here(fp8: bool) -> str | None:
    return fa4.unavailable(fp8=fp8)


def _cuda_against_the_reference(docs, heads, kv_heads, dim, dtype, causal, name):
    """FA4 on CUDA: out, dQ, dK, dV within BF16's tolerance of the reference (rows that see no key
    therefore 0), and its lse (nheads, total_q) close to the reference's where a row sees a key."""
    fn = load_kernel("fa4")
    q, k, v, do, cu_q, cu_k, mq, mk = make_pack(docs, heads, kv_heads, dim=dim, device="cuda", dtype=dtype)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    out, lse = fn(q, k, v, cu_q, cu_k, mq, mk, softmax_scale=0.3, causal=causal)
    grads = torch.autograd.grad(out, (q, k, v), do)
    ref = reference_attention(q, k, v, cu_q, cu_k, mq, mk, softmax_scale=0.3, causal=causal)
    want = torch.autograd.grad(ref, (q, k, v), do.double())
    for what, got, w in zip(("out", "dq", "dk", "dv"), (out, *grads), (ref, *want), strict=True):
        assert got.dtype == dtype, f"{name} {what}: {got.dtype}"
        err = (got.double() - w.double()).abs().max().item() if w.numel() else 0.0
        top = w.double().abs().max().item() if w.numel() else 0.0
        assert err <= 2**-6 * max(top, 1e-6), f"{name} {what}: max error {err:.3g} against max |ref| {top:.3g}"
    _, ref_lse = attention_forward(q, k, v, cu_q, cu_k, softmax_scale=0.3, causal=causal)
    seen = torch.isfinite(ref_lse.T)
    assert lse.shape == (heads, q.shape[0]), f"{name}: lse {tuple(lse.shape)}"
    assert torch.allclose(lse[seen].double(), ref_lse.T[seen], atol=1e-2), f"{name}: lse"
    assert not torch.isfinite(lse[~seen]).any(), f"{name}: a row without keys has a finite lse"


needs_fa4_gpu = pytest.mark.skipif(_runs_here(False) is not None, reason=f"fa4: {_runs_here(False)}")


@pytest.mark.gpu
@needs_fa4_gpu
@pytest.mark.parametrize("pack", sorted(PACKS))
@pytest.mark.parametrize("causal", [False, True])
def test_cuda_fa4_matches_the_reference_with_gradients(pack, causal):
    """Every pack of tests/test_adapters.py (empty documents, Lq < Lk, Lq > Lk: bottom-right causal),
    GQA 4/2, head_dim 128, bf16: one compiled configuration per mask."""
    _cuda_against_the_reference(PACKS[pack], 4, 2, 128, torch.bfloat16, causal, f"fa4 {pack}")


@pytest.mark.gpu
@needs_fa4_gpu
@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim", "dtype"),
    [(4, 4, 128, torch.bfloat16), (6, 1, 128, torch.bfloat16), (4, 2, 64, torch.bfloat16), (4, 2, 128, torch.float16)],
)
def test_cuda_fa4_heads_head_dims_and_fp16(heads, kv_heads, dim, dtype):
    _cuda_against_the_reference(PACKS["mixed"], heads, kv_heads, dim, dtype, True, f"fa4 H{heads}/{kv_heads} D{dim}")


@pytest.mark.gpu
@pytest.mark.skipif(_runs_here(True) is not None, reason=f"fa4-fp8: {_runs_here(True)}")
@pytest.mark.parametrize("name", FP8_NAMES)
def test_cuda_fa4_fp8_is_within_e4m3s_error_of_the_reference(name):
    fn = load_kernel(name)
    q, k, v, _, cu_q, cu_k, mq, mk = make_pack(PACKS["mixed"], 4, 2, dim=128, device="cuda")
    out, _ = fn(q, k, v, cu_q, cu_k, mq, mk, softmax_scale=0.3, causal=True)
    ref = reference_attention(q, k, v, cu_q, cu_k, mq, mk, softmax_scale=0.3, causal=True)
    assert out.dtype == q.dtype and ((out.double() - ref).norm() / ref.norm()).item() < 0.1
