"""The library adapters (flamia_verify.kernels.adapters): found by name, honest about where they run,
and correct in the varlen convention against the float64 reference.

On the CPU: sdpa-math and sdpa-flash forward and backward, flex's eager forward (torch 2.13 has no
FlexAttention backward on the CPU), the no-fallback error of a backend without a kernel, the plumbing
of the flash-attn and sage adapters through stand-in modules, `flamia-verify list`, the exit code of an
unavailable adapter, and one quick-suite run of sdpa-math. On CUDA (``-m gpu``): every torch adapter.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch

from flamia_verify.cli import main
from flamia_verify.errors import KernelLoadError
from flamia_verify.kernels import load_kernel
from flamia_verify.kernels.adapters import ADAPTERS, BackendRefusedError
from flamia_verify.reference import reference_attention, visible_mask

CUDA = torch.cuda.is_available()

#: packs of (Lq, Lk) documents: each the convention's corner the name says
PACKS = {
    "equal": [(5, 5), (17, 17), (1, 1), (9, 9)],
    "lq<lk": [(3, 7), (1, 4), (6, 9), (2, 2)],
    "lq>lk": [(7, 3), (4, 1), (9, 6), (3, 3)],
    "empty": [(0, 0), (5, 5), (0, 3), (4, 0), (3, 6), (0, 0)],
    "mixed": [(6, 2), (0, 0), (2, 0), (4, 9), (1, 1), (0, 5), (12, 12)],
}
HEADS = [(4, 4), (4, 2), (6, 1)]  # MHA, GQA, MQA


def make_pack(docs, heads, kv_heads, dim=16, seed=0, device="cpu", dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    lq = [a for a, _ in docs]
    lk = [b for _, b in docs]
    cu_q = torch.tensor([0] + torch.tensor(lq).cumsum(0).tolist(), dtype=torch.int32)
    cu_k = torch.tensor([0] + torch.tensor(lk).cumsum(0).tolist(), dtype=torch.int32)

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(dtype).to(device)

    q, do = rnd(sum(lq), heads, dim), rnd(sum(lq), heads, dim)
    k, v = rnd(sum(lk), kv_heads, dim), rnd(sum(lk), kv_heads, dim)
    return q, k, v, do, cu_q.to(device), cu_k.to(device), max(lq), max(lk)


def seen_rows(docs, causal):
    """Per query row: whether it sees any key (bottom-right causal)."""
    rows = [visible_mask(a, b, causal).any(-1) if a else torch.zeros(0, dtype=torch.bool) for a, b in docs]
    return torch.cat(rows)


def run(fn, q, k, v, do, cu_q, cu_k, mq, mk, *, causal, scale, grad=True):
    q, k, v = (x.detach().requires_grad_(grad) for x in (q, k, v))
    out = fn(q, k, v, cu_q, cu_k, mq, mk, softmax_scale=scale, causal=causal)
    out = out[0] if isinstance(out, tuple) else out
    if not grad:
        return (out.detach(),)
    grads = torch.autograd.grad(out, (q, k, v), do.to(out.dtype), allow_unused=True)
    return (out.detach(), *grads)


def assert_close(got, ref, what):
    """BF16 tolerance: every element within 2^-6 of the reference's largest magnitude (one BF16
    rounding of an output is 2^-9 relative; the backward rounds P and dS once more)."""
    assert got.shape == ref.shape, f"{what}: shape {tuple(got.shape)} vs {tuple(ref.shape)}"
    assert got is not None and torch.isfinite(got).all(), f"{what}: non-finite values"
    err = (got.double() - ref.double()).abs().max().item() if ref.numel() else 0.0
    scale = ref.double().abs().max().item() if ref.numel() else 0.0
    assert err <= 2**-6 * max(scale, 1e-6), f"{what}: max error {err:.3g} against max |ref| {scale:.3g}"


def check_against_reference(fn, docs, heads, kv_heads, *, causal, scale, device="cpu", grad=True, name=""):
    q, k, v, do, cu_q, cu_k, mq, mk = make_pack(docs, heads, kv_heads, device=device)
    before = [x.clone() for x in (q, k, v, do, cu_q, cu_k)]
    got = run(fn, q, k, v, do, cu_q, cu_k, mq, mk, causal=causal, scale=scale, grad=grad)
    ref = run(reference_attention, q, k, v, do, cu_q, cu_k, mq, mk, causal=causal, scale=scale, grad=grad)
    for x, y in zip((q, k, v, do, cu_q, cu_k), before):
        assert torch.equal(x, y) and x.dtype == y.dtype, f"{name}: an input was modified"
    assert got[0].dtype == q.dtype, f"{name}: output dtype {got[0].dtype}"
    for g, r, what in zip(got, ref, ("out", "dq", "dk", "dv")):
        assert g is not None, f"{name} {what}: no gradient"
        assert_close(g.cpu(), r.cpu(), f"{name} {what}")
    blind = ~seen_rows(docs, causal)
    assert (got[0].cpu()[blind] == 0).all(), f"{name}: a row that sees no key has a non-zero output"
    if grad:
        assert (got[1].cpu()[blind] == 0).all(), f"{name}: a row that sees no key has a non-zero dq"


# ------------------------------------------------------------------------------------------------
# the CPU adapters
# ------------------------------------------------------------------------------------------------

CPU_ADAPTERS = ["sdpa-math", "sdpa-flash"]


@pytest.mark.parametrize("name", CPU_ADAPTERS)
@pytest.mark.parametrize("pack", sorted(PACKS))
@pytest.mark.parametrize("causal", [False, True])
def test_cpu_adapters_match_the_reference_with_gradients(name, pack, causal):
    kernel = load_kernel(name)
    assert kernel.source == "adapter" and kernel.recipe == "bf16"
    for i, (heads, kv_heads) in enumerate(HEADS):
        scale = None if i == 0 else 0.3
        check_against_reference(
            kernel, PACKS[pack], heads, kv_heads, causal=causal, scale=scale, name=f"{name} {pack} H{heads}/{kv_heads}"
        )


@pytest.mark.parametrize("name", CPU_ADAPTERS)
def test_cpu_adapters_handle_a_pack_without_queries_or_keys(name):
    kernel = load_kernel(name)
    for docs in ([(0, 0)], [(0, 4), (0, 0)], [(3, 0), (2, 0)]):
        for causal in (False, True):
            check_against_reference(kernel, docs, 4, 2, causal=causal, scale=0.5, name=f"{name} {docs}")


@pytest.mark.parametrize("name", ["flex", "flex-packed"])
@pytest.mark.parametrize("pack", sorted(PACKS))
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_flex_forward_runs_eagerly_on_the_cpu_and_matches_the_reference(name, pack, causal):
    """flex is not offered on the CPU (no backward there in torch 2.13), but its mask_mod, the
    placement of documents and the fix-up of rows without keys are the same code on every device:
    check its forward here."""
    fn = ADAPTERS[name].build()
    for heads, kv_heads in HEADS:
        check_against_reference(
            fn, PACKS[pack], heads, kv_heads, causal=causal, scale=0.3, grad=False, name=f"{name} {pack} H{heads}"
        )


def test_aligned_flex_starts_every_document_on_a_block_boundary():
    """The aligned wiring puts no two documents in one 128-token block; the packed one keeps them
    where they are."""
    from flamia_verify.kernels.adapters import _document_of, _places

    cu = torch.tensor([0, 5, 5, 200, 329])
    place, n = _places(cu, _document_of(cu, 329), True)
    assert n == 128 + 256 + 256
    assert place[:5].tolist() == [0, 1, 2, 3, 4] and place[5].item() == 128 and place[200].item() == 384
    blocks = (place // 128).tolist()
    doc = torch.repeat_interleave(torch.arange(4), cu[1:] - cu[:-1]).tolist()
    assert all(len({d for d, b in zip(doc, blocks) if b == blk}) == 1 for blk in set(blocks))
    packed, n_packed = _places(cu, _document_of(cu, 329), False)
    assert n_packed == 329 and packed.tolist() == list(range(329))


def test_deterministic_mode_is_scoped_to_the_call_and_its_backward():
    """The deterministic SDPA adapters switch torch's deterministic mode on for their call and the
    backward they own, and leave the caller's setting as it was (on or off, warn-only or not)."""
    from flamia_verify.kernels.adapters import _DeterministicCall

    seen = []

    def run(q, k, v):
        seen.append(torch.are_deterministic_algorithms_enabled())
        return (q * k * v).sum(-1, keepdim=True) * q

    q, k, v = (torch.randn(3, 2, 4, dtype=torch.float64, requires_grad=True) for _ in range(3))
    for before, warn_only in ((False, False), (True, True)):
        torch.use_deterministic_algorithms(before, warn_only=warn_only)
        try:
            out = _DeterministicCall.apply(run, q, k, v)
            grads = torch.autograd.grad(out.sum(), (q, k, v), retain_graph=True)
            again = torch.autograd.grad(out.sum(), (q, k, v))  # a retained graph differentiates again
            want = torch.autograd.grad(run(q, k, v).sum(), (q, k, v))
            assert all(torch.equal(a, b) and torch.equal(b, c) for a, b, c in zip(grads, again, want))
            assert torch.are_deterministic_algorithms_enabled() == before
            assert torch.is_deterministic_algorithms_warn_only_enabled() == warn_only
        finally:
            torch.use_deterministic_algorithms(False)
    assert seen[0] is True


def test_a_backend_without_a_kernel_raises_and_never_falls_back():
    """The memory-efficient backend has no CPU kernel: the adapter (built past its probe) says so,
    naming itself and the document, instead of running another backend."""
    fn = ADAPTERS["sdpa-efficient"].build()
    q, k, v, do, cu_q, cu_k, mq, mk = make_pack(PACKS["lq<lk"], 4, 2)
    with pytest.raises(BackendRefusedError, match=r"sdpa-efficient: .*memory-efficient backend has no kernel"):
        fn(q, k, v, cu_q, cu_k, mq, mk, softmax_scale=0.3, causal=True)


# ------------------------------------------------------------------------------------------------
# names, probes, declarations
# ------------------------------------------------------------------------------------------------


def test_every_adapter_declares_its_recipe_forward_only_and_limits():
    assert set(ADAPTERS) == {
        "sdpa-math",
        "sdpa-flash",
        "sdpa-efficient",
        "sdpa-cudnn",
        "flex",
        "flex-packed",
        "flash-attn",
        "sage",
        "cudnn-fp8",
        "cudnn-fp8-frozen",
        "cudnn-fp8-current",
        "fa4",
        "fa4-fp8",
        "fa4-fp8-current",
        "fa4-fp8-doc",
        "te-fp8",
    }
    fa4_fp8 = ("fa4-fp8", "fa4-fp8-current", "fa4-fp8-doc")  # tests/test_fa4.py tests them
    recipes = {
        "te-fp8": "fp8",
        "cudnn-fp8": "fp8-mma",
        "cudnn-fp8-frozen": "fp8-mma",
        "cudnn-fp8-current": "fp8-mma",
    } | dict.fromkeys(fa4_fp8, "fp8-mma")
    for name, a in ADAPTERS.items():
        assert a.name == name and a.limits and a.wraps and a.runs_on
        assert a.recipe == recipes.get(name, "bf16")
        assert a.forward_only == (name == "sage" or name in fa4_fp8)
        reason = a.unavailable()
        assert reason is None or (reason and "\n" not in reason)


def test_builtin_names_keep_precedence(monkeypatch):
    import flamia_verify.kernels.adapters as adapters

    monkeypatch.setitem(adapters.ADAPTERS, "bf16", adapters.ADAPTERS["te-fp8"])
    assert load_kernel("bf16").source == "builtin"


@pytest.mark.skipif(CUDA, reason="the CUDA-only adapters are available here")
@pytest.mark.parametrize("name", ["sdpa-efficient", "sdpa-cudnn", "flex", "flex-packed"])
def test_a_cuda_adapter_without_cuda_is_a_load_error_with_the_reason(name):
    reason = ADAPTERS[name].unavailable()
    assert reason is not None and reason.startswith("needs CUDA")
    with pytest.raises(KernelLoadError, match=rf"adapter '{name}' is not available: needs CUDA"):
        load_kernel(name)


def test_te_fp8_is_never_offered_and_says_why():
    reason = ADAPTERS["te-fp8"].unavailable()
    assert reason is not None and reason.startswith("not built") and "transformer_engine" in reason
    with pytest.raises(KernelLoadError, match="not built"):
        load_kernel("te-fp8")


@pytest.mark.parametrize(("name", "module"), [("flash-attn", "flash_attn"), ("sage", "sageattention")])
def test_a_missing_library_is_a_load_error_naming_it(name, module, monkeypatch):
    monkeypatch.setitem(sys.modules, module, None)  # importing it now fails, installed or not
    reason = ADAPTERS[name].unavailable()
    assert reason == f"{module} is not installed"
    with pytest.raises(KernelLoadError, match=f"{module} is not installed"):
        load_kernel(name)


def test_cli_exits_3_with_the_reason_for_an_unavailable_adapter(capsys):
    assert main(["check", "--kernel", "te-fp8", "--device", "cpu"]) == 3
    err = capsys.readouterr().err
    assert "te-fp8" in err and "not built" in err and len(err.strip().splitlines()) == 1


def test_list_shows_each_adapter_with_its_recipe_and_availability(capsys):
    assert main(["list"]) == 0
    text = capsys.readouterr().out
    assert "adapters" in text
    lines = text.splitlines()
    for a in ADAPTERS.values():
        line = next(x for x in lines if x.split() and x.split()[0] == a.name)
        assert a.recipe in line.split()
        assert (a.unavailable() or "available") in line


# ------------------------------------------------------------------------------------------------
# flash-attn and sage through stand-in modules (neither library is installed on our machines)
# ------------------------------------------------------------------------------------------------


def _stand_in(monkeypatch, module, attr, record, returns_tuple):
    def fn(q, k, v, cu_q, cu_k, mq, mk, **kwargs):
        record.append(kwargs)
        scale = kwargs.get("softmax_scale", kwargs.get("sm_scale"))
        causal = kwargs.get("causal", kwargs.get("is_causal"))
        out = reference_attention(q, k, v, cu_q, cu_k, mq, mk, softmax_scale=scale, causal=causal).to(q.dtype)
        return (out, "lse") if returns_tuple else out

    monkeypatch.setitem(sys.modules, module, types.SimpleNamespace(**{attr: fn}))


def test_flash_attn_adapter_passes_the_call_through(monkeypatch):
    calls: list[dict] = []
    _stand_in(monkeypatch, "flash_attn", "flash_attn_varlen_func", calls, returns_tuple=False)
    fn = ADAPTERS["flash-attn"].build()
    check_against_reference(fn, PACKS["mixed"], 4, 2, causal=True, scale=0.3, name="flash-attn (stand-in)")
    assert calls[0] == {"softmax_scale": 0.3, "causal": True}


def test_sage_adapter_passes_the_call_through_and_returns_out(monkeypatch):
    calls: list[dict] = []
    _stand_in(monkeypatch, "sageattention", "sageattn_varlen", calls, returns_tuple=True)
    fn = ADAPTERS["sage"].build()
    check_against_reference(fn, PACKS["lq>lk"], 4, 2, causal=True, scale=0.25, grad=False, name="sage (stand-in)")
    assert calls[0] == {"sm_scale": 0.25, "is_causal": True}


# ------------------------------------------------------------------------------------------------
# the whole quick suite, once
# ------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_sdpa_math_passes_the_quick_suite_on_the_cpu():
    from flamia_verify.api import check

    report = check("sdpa-math", suite="quick", device="cpu")
    bad = [(c.name, c.status) for c in report.checks if c.status in ("fail", "error")]
    assert not bad, f"sdpa-math quick suite: {bad}"


# ------------------------------------------------------------------------------------------------
# CUDA
# ------------------------------------------------------------------------------------------------

GPU_ADAPTERS = ["sdpa-math", "sdpa-flash", "sdpa-efficient", "sdpa-cudnn", "flex", "flex-packed"]


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("name", GPU_ADAPTERS)
@pytest.mark.parametrize("pack", sorted(PACKS))
@pytest.mark.parametrize("causal", [False, True])
def test_cuda_adapters_match_the_reference_with_gradients(name, pack, causal):
    kernel = load_kernel(name)
    docs = PACKS[pack]  # sdpa-cudnn: a document with one key runs as two copies of it
    for heads, kv_heads in HEADS:
        check_against_reference(
            kernel, docs, heads, kv_heads, causal=causal, scale=0.3, device="cuda", name=f"{name} {pack} H{heads}"
        )


@pytest.mark.parametrize("causal", [False, True])
def test_one_key_as_two_copies_gives_the_one_key_attention(causal):
    """sdpa-cudnn runs a document with one key as two copies of it (cuDNN has no key length 1). The
    same wiring on the CPU's math backend: O and every gradient match the reference of the one key."""
    from flamia_verify.kernels.adapters import _make_sdpa

    kernel = _make_sdpa("sdpa-cudnn", "MATH", "math")
    docs = [(1, 1), (3, 1), (5, 5), (2, 1)] if causal else [(1, 1), (4, 1), (5, 7)]
    for heads, kv_heads in HEADS:
        check_against_reference(kernel, docs, heads, kv_heads, causal=causal, scale=0.3, name=f"one key H{heads}")


def test_a_report_names_the_versions_of_the_libraries_an_adapter_wraps():
    from flamia_verify.properties.engine import environment

    assert "kernel_libraries" not in environment("cpu", load_kernel("sdpa-math").fn)
    versions = ADAPTERS["sage"].library_versions()
    assert set(versions) == {"sageattention"}
    fn = lambda *a, **k: None  # noqa: E731
    fn.libraries = {"sageattention": "1.0.6"}
    assert environment("cpu", fn)["kernel_libraries"] == {"sageattention": "1.0.6"}
    assert set(ADAPTERS["cudnn-fp8"].library_versions()) == {"nvidia-cudnn-frontend", "cudnn-runtime"}
