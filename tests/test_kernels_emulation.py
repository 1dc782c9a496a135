"""The emulated built-in kernels: coverage of the calling convention, accuracy against the float64
reference, and the FLAMIA fixes held bitwise (and shown absent in the known-bad kernels)."""

from __future__ import annotations

import pytest
import torch

from flamia_verify.kernels import builtin_kernels, load_kernel
from flamia_verify.kernels.designs import DESIGNS
from flamia_verify.kernels.emulation import (
    _aligned_cu,
    attention_weights,
    emulated_forward_with_lse,
    full_block_mask,
    pow2_block_elements,
    visible,
)
from flamia_verify.reference import attention_backward, attention_forward

KERNELS = builtin_kernels()
FIXED = ["bf16", "fp8", "flamia-mxfp8", "flamia-mxfp8-floor", "flamia-nvfp4"]
LEAKY = ["fp8-tensor", "mxfp8-naive"]


def make_case(lens_q, lens_k=None, *, heads=2, heads_k=None, dim=64, dtype=torch.bfloat16, seed=0):
    lens_k = lens_q if lens_k is None else lens_k
    heads_k = heads if heads_k is None else heads_k
    g = torch.Generator().manual_seed(seed)
    tq, tk = sum(lens_q), sum(lens_k)
    q = torch.randn(tq, heads, dim, generator=g).to(dtype)
    k = torch.randn(tk, heads_k, dim, generator=g).to(dtype)
    v = torch.randn(tk, heads_k, dim, generator=g).to(dtype)
    do = torch.randn(tq, heads, dim, generator=g).to(dtype)
    cu_q = torch.tensor([0] + list(torch.tensor(lens_q).cumsum(0).tolist()), dtype=torch.int32)
    cu_k = torch.tensor([0] + list(torch.tensor(lens_k).cumsum(0).tolist()), dtype=torch.int32)
    return q, k, v, do, cu_q, cu_k


def run(kernel, q, k, v, do, cu_q, cu_k, *, causal, scale=None):
    q, k, v = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    lens_q = (cu_q[1:] - cu_q[:-1]).tolist() or [0]
    lens_k = (cu_k[1:] - cu_k[:-1]).tolist() or [0]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    out = kernel(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), softmax_scale=scale, causal=causal)
    out.backward(do)
    return out.detach(), q.grad, k.grad, v.grad


def rel_rmse(x, ref):
    x, ref = x.double(), ref.double()
    return (torch.linalg.vector_norm(x - ref) / torch.linalg.vector_norm(ref).clamp_min(1e-300)).item()


def reference(q, k, v, do, cu_q, cu_k, *, causal):
    scale = q.shape[-1] ** -0.5
    out, lse = attention_forward(q, k, v, cu_q, cu_k, softmax_scale=scale, causal=causal)
    dq, dk, dv = attention_backward(do, q, k, v, out, lse, cu_q, cu_k, softmax_scale=scale, causal=causal)
    return out, dq, dk, dv


# ---------------------------------------------------------------------------------------------
# small pieces
# ---------------------------------------------------------------------------------------------


def test_full_block_mask_matches_brute_force():
    for lq, lk, block in [(5, 7, 2), (40, 40, 32), (33, 70, 32), (1, 1, 32), (64, 31, 16)]:
        vis = visible(lq, lk, True)
        full = full_block_mask(vis, block)
        for i in range(lq):
            for j in range(lk):
                b0 = (j // block) * block
                expect = bool(vis[i, b0 : min(b0 + block, lk)].all())
                assert bool(full[i, j]) == expect, f"row {i} col {j} block {block}: {bool(full[i, j])} != {expect}"


def test_aligned_cu_cuts_at_absolute_block_multiples():
    assert _aligned_cu(0, 70, 32, None).tolist() == [0, 32, 64, 70]
    assert _aligned_cu(5, 70, 32, None).tolist() == [0, 27, 59, 70]
    assert _aligned_cu(32, 10, 32, None).tolist() == [0, 10]
    assert _aligned_cu(30, 2, 32, None).tolist() == [0, 2]


def test_pow2_block_p_elements_do_not_depend_on_the_row_maximum():
    """Shifting every score of a row by an integer (log2 units) leaves the E4M3 elements of P unchanged:
    P's quantization depends only on the scores of its own block, never on the running maximum."""
    g = torch.Generator().manual_seed(1)
    s = torch.randn(2, 5, 96, generator=g) * 4
    e1, mb1 = pow2_block_elements(s, 32)
    e2, mb2 = pow2_block_elements(s + 7.0, 32)
    assert torch.equal(e1, e2)
    assert torch.equal(mb1 + 7.0, mb2)
    # elements of a block's maximum lie in [128, 256]; everything is on the E4M3 grid
    assert float(e1.max()) <= 256.0
    assert torch.all(e1.view(2, 5, 3, 32).amax(-1) >= 128.0)


# ---------------------------------------------------------------------------------------------
# calling convention coverage
# ---------------------------------------------------------------------------------------------

SHAPES = [
    pytest.param([40], None, 2, 2, 64, id="dense"),
    pytest.param([0, 1, 31, 32, 33], None, 2, 2, 64, id="varlen-0-1-31-32-33"),
    pytest.param([17, 50], [30, 20], 4, 2, 64, id="lq!=lk-gqa"),
    pytest.param([33], None, 4, 1, 128, id="mqa-hd128"),
]


@pytest.mark.parametrize("name", sorted(DESIGNS))
@pytest.mark.parametrize("lens_q,lens_k,heads,heads_k,dim", SHAPES)
@pytest.mark.parametrize("causal", [False, True])
def test_kernel_runs_and_tracks_reference(name, lens_q, lens_k, heads, heads_k, dim, causal):
    q, k, v, do, cu_q, cu_k = make_case(lens_q, lens_k, heads=heads, heads_k=heads_k, dim=dim)
    out, dq, dk, dv = run(KERNELS[name], q, k, v, do, cu_q, cu_k, causal=causal)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
    ref = reference(q, k, v, do, cu_q, cu_k, causal=causal)
    # query rows with no visible key output 0 and get 0 gradient (the convention), exactly
    no_key = ref[0].abs().amax(dim=-1) == 0
    assert torch.all(out[no_key] == 0) and torch.all(dq[no_key] == 0), f"{name}: a row with no visible key is not 0"
    for got, want, what in zip((out, dq, dk, dv), ref, ("out", "dq", "dk", "dv")):
        assert torch.isfinite(got).all(), f"{name}: non-finite {what}"
        err = rel_rmse(got, want)
        # a generous sanity bound (E2M1's unit roundoff 2^-2 is the coarsest operand of any kernel);
        # the ordering test below pins the accuracies down
        assert err < 0.25, f"{name} {what}: relative RMSE {err:.3g} against the float64 reference"


def test_fp16_inputs_are_supported():
    q, k, v, do, cu_q, cu_k = make_case([20, 45], dtype=torch.float16)
    for name in FIXED:
        out, dq, dk, dv = run(KERNELS[name], q, k, v, do, cu_q, cu_k, causal=True)
        assert out.dtype == torch.float16 and dq.dtype == torch.float16
        ref = reference(q, k, v, do, cu_q, cu_k, causal=True)
        assert rel_rmse(out, ref[0]) < 0.1


def test_lse_of_the_bf16_design_matches_the_reference():
    q, k, v, do, cu_q, cu_k = make_case([1, 30, 64], dtype=torch.float32)
    out, lse = emulated_forward_with_lse(DESIGNS["bf16"], q, k, v, cu_q, cu_k, softmax_scale=0.125, causal=True)
    _, lse_ref = attention_forward(q, k, v, cu_q, cu_k, softmax_scale=0.125, causal=True)
    assert torch.allclose(lse.double(), lse_ref, rtol=0, atol=1e-5), (lse.double() - lse_ref).abs().max()


# ---------------------------------------------------------------------------------------------
# accuracy ordering against the float64 reference (fixed seeds)
# ---------------------------------------------------------------------------------------------


def _errors(name, seeds=(0, 1, 2)):
    errs = {"out": 0.0, "dq": 0.0, "dk": 0.0, "dv": 0.0}
    for seed in seeds:
        q, k, v, do, cu_q, cu_k = make_case([64, 130, 62], heads=2, dim=64, seed=seed)
        got = run(KERNELS[name], q, k, v, do, cu_q, cu_k, causal=True)
        ref = reference(q, k, v, do, cu_q, cu_k, causal=True)
        for key, g, r in zip(errs, got, ref):
            errs[key] = max(errs[key], rel_rmse(g, r))
    return errs


def test_errors_order_as_the_formats_predict():
    e = {name: _errors(name) for name in ("bf16", "fp8", "flamia-mxfp8", "flamia-nvfp4")}
    for name in ("fp8", "flamia-mxfp8", "flamia-nvfp4"):
        for key in e[name]:
            assert e["bf16"][key] < e[name][key], f"bf16 {key} {e['bf16'][key]:.3g} !< {name} {e[name][key]:.3g}"
    # the NVFP4 backward is coarser than the MXFP8 one; the forwards are the same design
    assert e["flamia-nvfp4"]["out"] == e["flamia-mxfp8"]["out"]
    for key in ("dq", "dk", "dv"):
        assert e["flamia-mxfp8"][key] < e["flamia-nvfp4"][key], (key, e["flamia-mxfp8"][key], e["flamia-nvfp4"][key])
    # bf16 rounding (u = 2^-8) bounds the baseline; E4M3 (u = 2^-4) bounds the MXFP8 forward to a few u
    assert e["bf16"]["out"] < 2**-8
    assert e["flamia-mxfp8"]["out"] < 2**-4


# ---------------------------------------------------------------------------------------------
# the fixes, bitwise
# ---------------------------------------------------------------------------------------------


def _perturb_after(t, x, generator):
    """Replace positions > t with adversarial values (huge, so shared block maxima change)."""
    x = x.clone()
    x[t + 1 :] = (torch.randn(x[t + 1 :].shape, generator=generator) * 1e4).to(x.dtype)
    return x


@pytest.mark.parametrize("name", FIXED + LEAKY)
def test_causal_leakage_bitwise(name):
    """Change q, k, v, dO after position t of a single document: every output and dQ at or before t
    must be bitwise unchanged for the fixed kernels; the known-bad ones must be caught."""
    q, k, v, do, cu_q, cu_k = make_case([96], heads=2, dim=64, seed=3)
    base = run(KERNELS[name], q, k, v, do, cu_q, cu_k, causal=True)
    leaked = False
    for t in (5, 40, 63):
        g = torch.Generator().manual_seed(t)
        q2, k2, v2, do2 = (_perturb_after(t, x, g) for x in (q, k, v, do))
        new = run(KERNELS[name], q2, k2, v2, do2, cu_q, cu_k, causal=True)
        same_out = torch.equal(base[0][: t + 1], new[0][: t + 1])
        same_dq = torch.equal(base[1][: t + 1], new[1][: t + 1])
        if name in FIXED:
            assert same_out, f"{name}: out[:{t + 1}] changed when only positions > {t} changed"
            assert same_dq, f"{name}: dq[:{t + 1}] changed when only positions > {t} changed"
        leaked |= not (same_out and same_dq)
    if name in LEAKY:
        assert leaked, f"{name} is expected to leak the future through shared scales"


@pytest.mark.parametrize("name", FIXED + LEAKY)
def test_anticausal_gradient_leakage_bitwise(name):
    """dK_j and dV_j must not see queries before j: change q and dO before t only."""
    q, k, v, do, cu_q, cu_k = make_case([96], heads=2, dim=64, seed=4)
    base = run(KERNELS[name], q, k, v, do, cu_q, cu_k, causal=True)
    leaked = False
    for t in (10, 40, 70):
        g = torch.Generator().manual_seed(t)
        q2, do2 = q.clone(), do.clone()
        q2[:t] = (torch.randn(q2[:t].shape, generator=g) * 1e3).to(q.dtype)
        do2[:t] = (torch.randn(do2[:t].shape, generator=g) * 1e3).to(q.dtype)
        new = run(KERNELS[name], q2, k, v, do2, cu_q, cu_k, causal=True)
        same = torch.equal(base[2][t:], new[2][t:]) and torch.equal(base[3][t:], new[3][t:])
        if name in FIXED:
            assert same, f"{name}: dk/dv[{t}:] changed when only queries before {t} changed"
        leaked |= not same
    if name in LEAKY:
        assert leaked, f"{name} is expected to leak through sequence-blocked dO/Q scales"


def packed_among_neighbours(doc, before: int, after: int, generator):
    """(q, k, v, dO, cu_seqlens) with the tensors of one document packed after ``before`` and before
    ``after`` tokens of x300-scale neighbours (an unaligned offset when ``before`` is not a multiple
    of 32); the document is rows [before, before + len) of each."""
    parts = []
    n, heads, dim = doc[0].shape
    for x in doc:
        pre = (torch.randn(before, heads, dim, generator=generator) * 300).to(x.dtype)
        post = (torch.randn(after, heads, dim, generator=generator) * 300).to(x.dtype)
        parts.append(torch.cat([pre, x, post]))
    cu = torch.tensor([0, before, before + n, before + n + after], dtype=torch.int32)
    return parts, cu


@pytest.mark.parametrize("name", FIXED + LEAKY)
@pytest.mark.parametrize("causal", [False, True])
def test_document_isolation_bitwise(name, causal):
    """A document's outputs and gradients are bitwise the same alone, among other neighbours and at
    another offset in the pack (the fixed kernels); the known-bad ones depend on their neighbours."""
    g = torch.Generator().manual_seed(11)
    doc = [torch.randn(45, 2, 64, generator=g).to(torch.bfloat16) for _ in range(4)]  # q, k, v, do
    alone = run(
        KERNELS[name],
        *doc,
        torch.tensor([0, 45], dtype=torch.int32),
        torch.tensor([0, 45], dtype=torch.int32),
        causal=causal,
    )
    leaked = False
    for before, after in ((13, 30), (32, 7), (1, 0)):
        parts, cu = packed_among_neighbours(doc, before, after, g)
        packed = run(KERNELS[name], *parts, cu, cu, causal=causal)
        sl = slice(before, before + 45)
        same = all(torch.equal(a, p[sl]) for a, p in zip(alone, packed))
        if name in FIXED:
            assert same, f"{name}: a document packed at offset {before} differs from the document alone"
        leaked |= not same
    if name in LEAKY:
        assert leaked, f"{name} is expected to depend on its neighbours in the pack"


U_BF16 = 2.0**-8  # bf16 unit roundoff (8 significant bits)


@pytest.mark.parametrize("name", sorted(DESIGNS))
@pytest.mark.parametrize("magnitude", [1.0, 4.0])
def test_backward_rebuilds_the_forward_probabilities(name, magnitude):
    """The backward must differentiate the forward that ran: the weights it rebuilds (from the
    recomputed scores and the saved lse) must equal the weights P/l the forward multiplied V with.

    * FLAMIA designs: equal to a few fp32 ulps (exp2/log2 arithmetic on the saved lse), and the
      forward's weights sum to 1 because l sums the rounded P.
    * bf16 (FlashAttention-2 numerics): P is rounded to bf16 for P V but not for l or the backward,
      a mismatch bounded by bf16's unit roundoff u/(1-u) relative.
    * fp8-tensor and mxfp8-naive normalize E4M3-rounded P by the unrounded sum: their forward
      weights do not sum to 1 by more than anything bf16 rounding explains.
    """
    q, k, _, _, _, _ = make_case([96], heads=2, dim=64, seed=5)
    q = (q.float() * magnitude).to(q.dtype)
    fwd = attention_weights(DESIGNS[name], q, k, softmax_scale=0.125, causal=True)
    bwd = attention_weights(DESIGNS[name], q, k, softmax_scale=0.125, causal=True, backward=True)
    seen = fwd > 0
    rel = ((bwd - fwd).abs()[seen] / fwd[seen]).max().item()
    fwd_sum_dev = (fwd.sum(-1) - 1).abs().max().item()
    if name in ("fp8-tensor", "mxfp8-naive"):
        assert fwd_sum_dev > U_BF16, f"{name}: forward weights sum to 1 within {fwd_sum_dev:.3g}; expected a mismatch"
    elif name == "bf16":
        assert rel <= U_BF16 / (1 - U_BF16), f"bf16: backward/forward weights differ by {rel:.3g} relative"
    else:
        assert rel <= 16 * 2**-24, f"{name}: backward weights differ from the forward's by {rel:.3g} relative"
        assert fwd_sum_dev <= 32 * 2**-24, f"{name}: forward weights sum to 1 only within {fwd_sum_dev:.3g}"


def test_load_kernel_resolves_builtins_modules_and_files(tmp_path):
    assert load_kernel("flamia-mxfp8").recipe == "mxfp8"
    assert load_kernel("flamia_verify.reference:reference_attention").source == "module"
    f = tmp_path / "my_kernel.py"
    f.write_text("def attn(q, k, v, cu_q, cu_k, mq, mk, *, softmax_scale, causal):\n    return q\n")
    assert load_kernel(f"{f}:attn").source == "file"
    from flamia_verify.errors import KernelLoadError

    for bad in ("no-such-kernel", "no_such_module_xyz:fn", f"{f}:missing", str(tmp_path / "nope.py") + ":f"):
        with pytest.raises(KernelLoadError):
            load_kernel(bad)


# ---------------------------------------------------------------------------------------------
# the emulation on CUDA (the GPU machine): same numerics, same bitwise properties
# ---------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", sorted(DESIGNS))
def test_emulation_on_cuda_matches_cpu_and_keeps_the_fixes(name):
    """The specification runs on any device. On CUDA its GEMMs accumulate in another order, so
    outputs agree with the CPU run to fp32 accumulation level relative to the operands' rounding; the
    quantized operands themselves are bitwise equal (formats are tested bitwise CUDA vs CPU), and the
    causal and isolation fixes hold bitwise on CUDA as well."""
    from flamia_verify.kernels.emulation import make_kernel

    kernel = make_kernel(DESIGNS[name])  # the emulation itself, not the fused kernel the registry picks
    q, k, v, do, cu_q, cu_k = make_case([45, 96], heads=2, dim=64, seed=9)
    cpu = run(kernel, q, k, v, do, cu_q, cu_k, causal=True)
    gpu = run(kernel, *(x.cuda() for x in (q, k, v, do, cu_q, cu_k)), causal=True)
    for a, b, what in zip(cpu, gpu, ("out", "dq", "dk", "dv")):
        # a handful of elements may sit on a rounding boundary of an E4M3 operand that depends on an
        # accumulated value (P from S, dS from dP); compare by relative RMSE, far below the format's u
        assert rel_rmse(b.cpu(), a) < 2**-10, f"{name} {what}: CUDA vs CPU rel RMSE {rel_rmse(b.cpu(), a):.3g}"
    if name in FIXED:
        t = 60
        g = torch.Generator().manual_seed(t)
        q2, k2, v2, do2 = (_perturb_after(t, x, g) for x in (q, k, v, do))
        base = run(kernel, *(x.cuda() for x in (q, k, v, do, cu_q, cu_k)), causal=True)
        new = run(kernel, *(x.cuda() for x in (q2, k2, v2, do2, cu_q, cu_k)), causal=True)
        assert torch.equal(base[0][: t + 1], new[0][: t + 1]) and torch.equal(base[1][: t + 1], new[1][: t + 1])


def test_convention_errors_name_the_problem():
    from flamia_verify.convention import validate_varlen_inputs
    from flamia_verify.errors import InputError

    q, k, v, _, cu_q, cu_k = make_case([5, 7])
    cases = [
        ((q, k, v, cu_q.long(), cu_k), "int32"),
        ((q, k, v, torch.tensor([0, 7, 5, 12], dtype=torch.int32)[:3], cu_k), "cu_seqlens_q"),
        ((q, k, v, torch.tensor([1, 5, 12], dtype=torch.int32), cu_k), "cu_seqlens_q[0]"),
        ((q, k, v, torch.tensor([0, 7, 5], dtype=torch.int32), cu_k), "non-decreasing"),
        ((q, k[:, :1].expand(-1, 3, -1).contiguous(), v[:, :1].expand(-1, 3, -1).contiguous(), cu_q, cu_k), "multiple"),
        ((q, k, v.float(), cu_q, cu_k), "dtype"),
        ((q[0], k, v, cu_q, cu_k), "shape"),
        ((q, k, v, cu_q, torch.tensor([0, 12], dtype=torch.int32)), "same number of documents"),
        ((q, k, v, cu_q, cu_k[:2]), "cu_seqlens_k[-1]"),
    ]
    for args, needle in cases:
        with pytest.raises(InputError) as exc:
            validate_varlen_inputs(*args)
        assert needle in str(exc.value), (needle, str(exc.value))
    with pytest.raises(InputError, match="max_seqlen_q"):
        validate_varlen_inputs(q, k, v, cu_q, cu_k, 3, 7)


def testentry_point_kernels_are_found_by_name(monkeypatch):
    """A third-party package registers `name = "pkg.module:function"` in the group flamia_verify.kernels."""
    from importlib.metadata import EntryPoint

    from flamia_verify.errors import KernelLoadError
    from flamia_verify.kernels import loader

    eps = {
        "vendor-attn": EntryPoint(
            "vendor-attn", "flamia_verify.reference:reference_attention", loader.ENTRY_POINT_GROUP
        ),
        "broken-attn": EntryPoint("broken-attn", "no_such_vendor_module:attn", loader.ENTRY_POINT_GROUP),
    }
    monkeypatch.setattr(loader, "entry_point_kernels", lambda: eps)
    loaded = load_kernel("vendor-attn")
    assert loaded.source == "entry-point" and loaded.name == "vendor-attn"
    with pytest.raises(KernelLoadError, match="broken-attn"):
        load_kernel("broken-attn")
    with pytest.raises(KernelLoadError, match="vendor-attn"):  # the error lists what is registered
        load_kernel("nothing-by-this-name")
