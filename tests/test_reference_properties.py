"""Properties of the float64 reference: masks, gradients, packing, chunking, GQA, SDPA agreement.

Two kinds of comparison appear here:

* bitwise (torch.equal) where the computation is the same sequence of float64 operations on
  the same shapes: a document alone vs packed among others, default chunking vs the same
  chunk size passed explicitly, low-precision inputs vs their exact float64 copies;
* `assert_same_math` where two float64 evaluations of one formula differ only in summation
  order. Its tolerance is the standard rounding bound for an accumulation of n terms,
  gamma_n ~ n u with u = 2^-53, applied to the largest magnitude of the result:
  |got - want| <= n u max|want|, with n the total length of the nested sums that produce the
  value (headdim for the scores, seqlen_k for the softmax sums and P V, seqlen_q * group for
  dK and dV). On these well-scaled inputs the measured differences are below 12 u max|want|
  (chunked vs unchunked, see docs/reference.md), against n >= 30 here; an indexing or
  masking bug moves results by O(1) relative.
"""

from __future__ import annotations

import math

import pytest
import torch

import flamia_verify.reference.attention as attention_module
from flamia_verify.reference import (
    attention_backward,
    attention_forward,
    naive_attention,
    query_chunk_size,
    reference_attention,
    visible_mask,
)

U = 2.0**-53  # float64 unit roundoff


def cu_seqlens(lengths) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(list(lengths), dtype=torch.int64).cumsum(0).tolist()], dtype=torch.int32)


def make_inputs(docs, nheads, nheads_k, headdim, *, seed=0, dtype=torch.float64):
    """Random q, k, v, dout ~ N(0, 1) for documents [(seqlen_q, seqlen_k), ...]."""
    g = torch.Generator().manual_seed(seed)
    cq, ck = cu_seqlens(d[0] for d in docs), cu_seqlens(d[1] for d in docs)
    tq, tk = int(cq[-1]), int(ck[-1])
    q = torch.randn(tq, nheads, headdim, generator=g, dtype=torch.float64).to(dtype)
    k = torch.randn(tk, nheads_k, headdim, generator=g, dtype=torch.float64).to(dtype)
    v = torch.randn(tk, nheads_k, headdim, generator=g, dtype=torch.float64).to(dtype)
    dout = torch.randn(tq, nheads, headdim, generator=g, dtype=torch.float64)
    return q, k, v, dout, cq, ck


def forward_backward(q, k, v, dout, cq, ck, *, causal, chunk_size=None, scale=None):
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    out, lse = attention_forward(q, k, v, cq, ck, softmax_scale=scale, causal=causal, chunk_size=chunk_size)
    grads = attention_backward(
        dout, q, k, v, out, lse, cq, ck, softmax_scale=scale, causal=causal, chunk_size=chunk_size
    )
    return (out, lse, *grads)


NAMES = ("out", "lse", "dq", "dk", "dv")


def assert_same_math(name: str, got: torch.Tensor, want: torch.Tensor, n_terms: int) -> None:
    """|got - want| <= n_terms * u * max|want| entrywise; -inf entries must match exactly."""
    assert got.shape == want.shape, f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    assert got.dtype == want.dtype, f"{name}: dtype {got.dtype} != {want.dtype}"
    got_inf, want_inf = torch.isinf(got), torch.isinf(want)
    if not torch.equal(got_inf, want_inf):
        idx = torch.nonzero(got_inf != want_inf)[:5].tolist()
        raise AssertionError(f"{name}: infinite entries differ at {idx} (first 5)")
    assert torch.equal(got[got_inf], want[want_inf]), f"{name}: signs of infinite entries differ"
    assert not torch.isnan(got).any() and not torch.isnan(want).any(), f"{name}: NaN present"
    g, w = got[~got_inf], want[~want_inf]
    if w.numel() == 0:
        return
    tol = n_terms * U * w.abs().max().item()
    diff = (g - w).abs()
    bad = diff > tol
    if bad.any():
        full_idx = torch.nonzero(~want_inf)[bad.nonzero().squeeze(1)][:3].tolist()
        worst = diff.argmax().item()
        raise AssertionError(
            f"{name}: mismatched elements {int(bad.sum())} / {w.numel()} beyond tol {tol:.3e} "
            f"(= {n_terms} u max|want|); first at {full_idx}; max abs diff {diff.max().item():.3e} "
            f"(got {g[worst].item()!r}, want {w[worst].item()!r})"
        )


def assert_bitwise(name: str, got: torch.Tensor, want: torch.Tensor, context: str) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype, f"{context}: {name} shape/dtype differ"
    if not torch.equal(got, want):
        diff = got != want
        idx = torch.nonzero(diff)[:3].tolist()
        first = tuple(idx[0])
        raise AssertionError(
            f"{context}: {name} not bitwise equal, {int(diff.sum())} / {got.numel()} entries differ; "
            f"first at {idx}: {got[first].item()!r} vs {want[first].item()!r}"
        )


# ---------------------------------------------------------------------------------------------
# Masks
# ---------------------------------------------------------------------------------------------


def _picture(rows: str) -> torch.Tensor:
    return torch.tensor([[c == "x" for c in r.split()] for r in rows.strip().splitlines()])


def test_visible_mask_is_bottom_right_aligned() -> None:
    assert torch.equal(
        visible_mask(3, 5, True),
        _picture("""
            x x x . .
            x x x x .
            x x x x x
        """),
    )
    assert torch.equal(
        visible_mask(4, 2, True),
        _picture("""
            . .
            . .
            x .
            x x
        """),
    )
    assert torch.equal(visible_mask(3, 3, True), torch.ones(3, 3, dtype=torch.bool).tril())
    assert torch.equal(visible_mask(2, 4, False), torch.ones(2, 4, dtype=torch.bool))
    assert visible_mask(0, 4, True).shape == (0, 4) and visible_mask(3, 0, True).shape == (3, 0)
    assert visible_mask(2, 2, True).dtype == torch.bool


def test_rows_without_keys_get_zero_output_and_gradient() -> None:
    # Document 0: causal 5 queries over 2 keys (q0..q2 see nothing); document 1: no keys at all.
    q, k, v, dout, cq, ck = make_inputs([(5, 2), (3, 0)], 2, 2, 4, seed=1)
    out, lse, dq, dk, dv = forward_backward(q, k, v, dout, cq, ck, causal=True)
    blind = torch.tensor([1, 1, 1, 0, 0, 1, 1, 1], dtype=torch.bool)
    assert torch.equal(out[blind], torch.zeros_like(out[blind]))
    assert torch.equal(lse[blind], torch.full_like(lse[blind], -math.inf))
    assert torch.equal(dq[blind], torch.zeros_like(dq[blind]))
    assert torch.isfinite(lse[~blind]).all()
    # q3 sees one key: its softmax is the constant 1, so its dq is exactly 0 as well; q4 sees two.
    assert torch.equal(dq[3], torch.zeros_like(dq[3])) and (dq[4] != 0).all()


# ---------------------------------------------------------------------------------------------
# Gradients
# ---------------------------------------------------------------------------------------------

GRAD_DOCS = [(2, 3), (0, 1), (1, 1), (3, 2), (2, 0)]  # includes empty docs and rows that see no key


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_gradcheck_reference_attention(causal: bool) -> None:
    """Finite differences of reference_attention agree with its analytic backward."""
    q, k, v, _, cq, ck = make_inputs(GRAD_DOCS, 2, 1, 3, seed=2)
    q, k, v = (t.requires_grad_() for t in (q, k, v))

    def f(q, k, v):
        return reference_attention(q, k, v, cq, ck, 3, 3, softmax_scale=0.7, causal=causal)

    assert torch.autograd.gradcheck(f, (q, k, v), eps=1e-6, atol=1e-8, rtol=1e-6)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_gradcheck_naive_twin(causal: bool) -> None:
    """The dense twin's autograd gradients are right (so it can judge the analytic backward)."""
    q, k, v, _, cq, ck = make_inputs(GRAD_DOCS, 2, 1, 3, seed=2)
    q, k, v = (t.requires_grad_() for t in (q, k, v))

    def f(q, k, v):
        out, lse = naive_attention(q, k, v, cq, ck, softmax_scale=0.7, causal=causal)
        return out, torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)

    assert torch.autograd.gradcheck(f, (q, k, v), eps=1e-6, atol=1e-8, rtol=1e-6)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_analytic_backward_matches_autograd_of_naive_twin(causal: bool) -> None:
    docs = [(9, 9), (0, 4), (1, 1), (7, 11), (12, 5), (3, 0)]
    H, Hk, D = 4, 2, 8
    q, k, v, dout, cq, ck = make_inputs(docs, H, Hk, D, seed=3)
    got = forward_backward(q, k, v, dout, cq, ck, causal=causal, chunk_size=4)
    qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
    out, lse = naive_attention(qq, kk, vv, cq, ck, softmax_scale=D**-0.5, causal=causal)
    out.backward(dout)
    want = (out.detach(), lse.detach(), qq.grad, kk.grad, vv.grad)
    n = D + max(d[1] for d in docs) + (H // Hk) * max(d[0] for d in docs)
    for name, g, w in zip(NAMES, got, want):
        assert_same_math(name, g, w, n)


# ---------------------------------------------------------------------------------------------
# Packing and chunking
# ---------------------------------------------------------------------------------------------

DOC = (23, 29)
PACKINGS = {
    "alone": ([], []),
    "between": ([(5, 7)], [(0, 3), (4, 4)]),
    "last": ([(1, 0), (12, 12), (3, 1)], []),
    "odd_offsets": ([(7, 3), (1, 5)], [(2, 9)]),
}


def _pack(doc_tensors, before, after, seed):
    """Place one document's (q, k, v, dout) among random neighbours; return packed tensors and its slices."""
    q0, k0, v0, do0 = doc_tensors
    H, Hk, D = q0.shape[1], k0.shape[1], q0.shape[2]
    parts_b = make_inputs(before or [(0, 0)], H, Hk, D, seed=seed, dtype=q0.dtype)
    parts_a = make_inputs(after or [(0, 0)], H, Hk, D, seed=seed + 1, dtype=q0.dtype)
    q = torch.cat([parts_b[0], q0, parts_a[0]])
    k = torch.cat([parts_b[1], k0, parts_a[1]])
    v = torch.cat([parts_b[2], v0, parts_a[2]])
    dout = torch.cat([parts_b[3], do0, parts_a[3]])
    docs = [*before, (q0.shape[0], k0.shape[0]), *after]
    sq = slice(parts_b[0].shape[0], parts_b[0].shape[0] + q0.shape[0])
    sk = slice(parts_b[1].shape[0], parts_b[1].shape[0] + k0.shape[0])
    return q, k, v, dout, cu_seqlens(d[0] for d in docs), cu_seqlens(d[1] for d in docs), sq, sk


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16], ids=["f64", "bf16"])
@pytest.mark.parametrize("chunk_size", [None, 5], ids=["auto", "chunk5"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_packed_document_is_bitwise_equal_to_alone(causal, chunk_size, dtype) -> None:
    q0, k0, v0, do0, _, _ = make_inputs([DOC], 4, 2, 16, seed=11, dtype=dtype)
    results = {}
    for i, (label, (before, after)) in enumerate(PACKINGS.items()):
        q, k, v, dout, cq, ck, sq, sk = _pack((q0, k0, v0, do0), before, after, seed=100 + 10 * i)
        r = forward_backward(q, k, v, dout, cq, ck, causal=causal, chunk_size=chunk_size)
        results[label] = (r[0][sq], r[1][sq], r[2][sq], r[3][sk], r[4][sk])
    for label, r in results.items():
        for name, got, want in zip(NAMES, r, results["alone"]):
            assert_bitwise(name, got, want, f"packing {label!r} vs alone (causal={causal}, chunk={chunk_size})")


def test_packed_document_is_bitwise_equal_through_autograd() -> None:
    """Same through reference_attention with bf16 inputs: out float64, gradients in bf16."""
    q0, k0, v0, do0, _, _ = make_inputs([DOC], 4, 1, 8, seed=12, dtype=torch.bfloat16)
    results = []
    for i, (before, after) in enumerate(PACKINGS.values()):
        q, k, v, dout, cq, ck, sq, sk = _pack((q0, k0, v0, do0), before, after, seed=200 + 10 * i)
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        out = reference_attention(q, k, v, cq, ck, 32, 32, softmax_scale=0.25, causal=True)
        assert out.dtype == torch.float64
        out.backward(dout)
        assert q.grad.dtype == k.grad.dtype == v.grad.dtype == torch.bfloat16
        results.append((out.detach()[sq], q.grad[sq], k.grad[sk], v.grad[sk]))
    for r in results[1:]:
        for name, got, want in zip(("out", "dq", "dk", "dv"), r, results[0]):
            assert_bitwise(name, got, want, "reference_attention packed vs alone")


@pytest.mark.parametrize("chunk_size", [1, 3, 1000], ids=["chunk1", "chunk3", "chunk_large"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", [(40, 40), (25, 47), (47, 19)], ids=["lq=lk", "lq<lk", "lq>lk"])
def test_chunked_matches_unchunked(shape, causal, chunk_size) -> None:
    """Chunking changes only summation order, never the math.

    Not bitwise: MKL's dgemm picks its kernel by the row count (measured: a 1000-row product
    computed in blocks of 1, 3 or 257 rows differs in the last bits from the whole product,
    blocks of 64 do not), and dK, dV accumulate chunk by chunk. Hence `assert_same_math`.
    The unchunked run is one chunk holding the whole document.
    """
    H, Hk, D = 4, 2, 16
    docs = [shape, (3, 4)]
    q, k, v, dout, cq, ck = make_inputs(docs, H, Hk, D, seed=5)
    whole = forward_backward(q, k, v, dout, cq, ck, causal=causal, chunk_size=10**6)
    chunked = forward_backward(q, k, v, dout, cq, ck, causal=causal, chunk_size=chunk_size)
    n = D + shape[1] + (H // Hk) * shape[0]
    for name, got, want in zip(NAMES, chunked, whole):
        assert_same_math(f"{name} (chunk={chunk_size})", got, want, n)


def test_default_chunk_follows_budget(monkeypatch) -> None:
    assert query_chunk_size(16, 32768) == 64  # 256 MiB / (16 heads * 32768 keys * 8 bytes)
    assert query_chunk_size(16, 0) >= 1 and query_chunk_size(10**6, 10**6) == 1
    # A budget of 5 query rows for this shape: the default grid is then exactly chunk_size=5.
    H, Hk, D, lk = 4, 2, 8, 31
    monkeypatch.setattr(attention_module, "SCORE_BLOCK_BYTES", 5 * H * lk * 8 + 7)
    assert query_chunk_size(H, lk) == 5
    q, k, v, dout, cq, ck = make_inputs([(26, lk)], H, Hk, D, seed=6)
    auto = forward_backward(q, k, v, dout, cq, ck, causal=True)
    explicit = forward_backward(q, k, v, dout, cq, ck, causal=True, chunk_size=5)
    for name, got, want in zip(NAMES, auto, explicit):
        assert_bitwise(name, got, want, "default chunking vs chunk_size=5")


# ---------------------------------------------------------------------------------------------
# GQA, SDPA, dtypes
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("group", [2, 4])
def test_gqa_equals_mha_with_repeated_kv_heads(group: int, causal: bool) -> None:
    Hk, D = 2, 8
    H = Hk * group
    docs = [(13, 17), (1, 1), (9, 4)]
    q, k, v, dout, cq, ck = make_inputs(docs, H, Hk, D, seed=7)
    gqa = forward_backward(q, k, v, dout, cq, ck, causal=causal, chunk_size=4)
    k_rep, v_rep = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # head h -> kv head h // group
    mha = forward_backward(q, k_rep, v_rep, dout, cq, ck, causal=causal, chunk_size=4)
    dk_sum = mha[3].view(-1, Hk, group, D).sum(2)
    dv_sum = mha[4].view(-1, Hk, group, D).sum(2)
    n = D + 17 + group * 13
    for name, got, want in zip(NAMES, gqa, (*mha[:3], dk_sum, dv_sum)):
        assert_same_math(name, got, want, n)


SDPA_SHAPES = [(33, 33, False), (33, 33, True), (20, 45, False), (20, 45, True), (45, 45, True)]


@pytest.mark.parametrize("lq,lk,causal", SDPA_SHAPES)
def test_dense_matches_torch_sdpa(lq: int, lk: int, causal: bool) -> None:
    """One document equals torch's scaled_dot_product_attention in float64, gradients included.

    SDPA's is_causal is top-left aligned, so it is used only for lq == lk; otherwise the
    bottom-right mask from visible_mask is passed as attn_mask.
    """
    H, Hk, D = 4, 2, 16
    q, k, v, dout, cq, ck = make_inputs([(lq, lk)], H, Hk, D, seed=8)
    scale = 0.2
    ours = forward_backward(q, k, v, dout, cq, ck, causal=causal, scale=scale)
    qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
    # SDPA layout (batch, heads, seq, dim), kv heads repeated for GQA.
    qb = qq.transpose(0, 1).unsqueeze(0)
    kb = kk.repeat_interleave(H // Hk, dim=1).transpose(0, 1).unsqueeze(0)
    vb = vv.repeat_interleave(H // Hk, dim=1).transpose(0, 1).unsqueeze(0)
    kwargs = {"is_causal": True} if causal and lq == lk else {"attn_mask": visible_mask(lq, lk, causal)}
    out = torch.nn.functional.scaled_dot_product_attention(qb, kb, vb, scale=scale, **kwargs)
    out = out.squeeze(0).transpose(0, 1)
    out.backward(dout)
    n = D + lk + (H // Hk) * lq
    for name, got, want in zip(
        ("out", "dq", "dk", "dv"), (ours[0], *ours[2:]), (out.detach(), qq.grad, kk.grad, vv.grad)
    ):
        assert_same_math(f"{name} vs SDPA", got, want, n)


LOW_PRECISION = [torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn]


@pytest.mark.parametrize("dtype", LOW_PRECISION, ids=str)
def test_low_precision_inputs_are_converted_exactly(dtype) -> None:
    q, k, v, dout, cq, ck = make_inputs([(6, 9), (4, 4)], 2, 1, 8, seed=9, dtype=dtype)
    low = forward_backward(q, k, v, dout, cq, ck, causal=True)
    exact = forward_backward(q.double(), k.double(), v.double(), dout, cq, ck, causal=True)
    for name, got, want in zip(NAMES, low, exact):
        assert got.dtype == torch.float64
        assert_bitwise(name, got, want, f"{dtype} inputs vs their float64 values")


def test_inputs_are_left_unmodified() -> None:
    q, k, v, dout, cq, ck = make_inputs([(6, 9), (0, 2), (4, 4)], 4, 2, 8, seed=10)
    before = [t.clone() for t in (q, k, v, dout, cq, ck)]
    out, lse, *_ = forward_backward(q, k, v, dout, cq, ck, causal=True, chunk_size=2)
    out_before, lse_before = out.clone(), lse.clone()
    attention_backward(dout, q, k, v, out, lse, cq, ck, softmax_scale=0.3, causal=True)
    for t, b in zip((q, k, v, dout, cq, ck, out, lse), (*before, out_before, lse_before)):
        assert torch.equal(t, b)


def test_empty_batch_and_empty_documents() -> None:
    for docs in ([], [(0, 0)], [(0, 3), (0, 0)]):
        q, k, v, dout, cq, ck = make_inputs(docs or [(0, 0)], 2, 1, 4)
        if not docs:
            cq = ck = torch.zeros(1, dtype=torch.int32)
        out, lse, dq, dk, dv = forward_backward(q, k, v, dout, cq, ck, causal=True)
        assert out.shape == q.shape and lse.shape == q.shape[:2]
        assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
        assert not dk.any() and not dv.any()


def test_huge_scores_stay_finite() -> None:
    """Scores of magnitude ~1e6: the row-max shift keeps out a convex combination of v rows."""
    q, k, v, dout, cq, ck = make_inputs([(16, 16)], 2, 2, 8, seed=13)
    out, lse, dq, dk, dv = forward_backward(q * 1e3, k * 1e3, v, dout, cq, ck, causal=True)
    for name, t in zip(NAMES, (out, lse, dq, dk, dv)):
        assert torch.isfinite(t).all(), f"{name} has non-finite entries"
    vmax, vmin = v.amax(0), v.amin(0)  # per (head, channel) over keys
    assert (out <= vmax + 1e-12).all() and (out >= vmin - 1e-12).all()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_cpu() -> None:
    docs = [(70, 70), (0, 3), (33, 90), (90, 33)]
    H, Hk, D = 4, 2, 32
    q, k, v, dout, cq, ck = make_inputs(docs, H, Hk, D, seed=14)
    cpu = forward_backward(q, k, v, dout, cq, ck, causal=True, chunk_size=16)
    gpu = forward_backward(*(t.cuda() for t in (q, k, v, dout, cq, ck)), causal=True, chunk_size=16)
    n = D + 90 + (H // Hk) * 90
    for name, got, want in zip(NAMES, gpu, cpu):
        assert got.device.type == "cuda"
        assert_same_math(f"{name} cuda vs cpu", got.cpu(), want, n)


@pytest.mark.parametrize("poison", [math.nan, math.inf], ids=["nan", "inf"])
@pytest.mark.parametrize("where", ["q", "k", "v", "dout"])
def test_poisoned_future_positions_do_not_cross_the_causal_mask(where: str, poison: float) -> None:
    """NaN/Inf at positions after t leaves rows <= t bitwise unchanged: out, lse and dq.

    A poisoned causal document runs one row per chunk by itself when the poison could cross
    the mask through a 0 * NaN inside a GEMM (v in the forward; any input of the backward).
    The clean run it is compared with uses the same chunking: chunk_size=1 where the
    poisoned run falls back to it, the default otherwise. The other document is untouched.
    """
    H, Hk, D, L, t = 4, 2, 8, 24, 13
    scale = D**-0.5
    q, k, v, dout, cq, ck = make_inputs([(L, L), (5, 5)], H, Hk, D, seed=15)
    fwd_chunk = 1 if where == "v" else None
    clean_out, clean_lse = attention_forward(q, k, v, cq, ck, softmax_scale=scale, causal=True, chunk_size=fwd_chunk)
    clean_grads = attention_backward(
        dout, q, k, v, clean_out, clean_lse, cq, ck, softmax_scale=scale, causal=True, chunk_size=1
    )
    bad = {"q": q.clone(), "k": k.clone(), "v": v.clone(), "dout": dout.clone()}
    bad[where][t + 1 : L, 1, ::3] = poison  # positions after t of document 0, one head
    out, lse = attention_forward(bad["q"], bad["k"], bad["v"], cq, ck, softmax_scale=scale, causal=True)
    grads = attention_backward(
        bad["dout"], bad["q"], bad["k"], bad["v"], out, lse, cq, ck, softmax_scale=scale, causal=True
    )
    context = f"{where} = {poison} after position {t}"
    for name, got, want in zip(("out", "lse", "dq"), (out, lse, grads[0]), (clean_out, clean_lse, clean_grads[0])):
        assert_bitwise(name, got[: t + 1], want[: t + 1], context)
    # The clean second document keeps the default chunking in the poisoned run.
    default = forward_backward(q, k, v, dout, cq, ck, causal=True)
    for name, got, want in zip(NAMES, (out, lse, *grads), default):
        assert_bitwise(name, got[L:], want[L:], context + ", other document")
    if where != "dout":
        assert not torch.isfinite(out[t + 1 : L]).all(), "the poison should reach the rows that see it"


def test_repeated_runs_are_bitwise_identical() -> None:
    q, k, v, dout, cq, ck = make_inputs([(30, 41), (0, 2), (17, 9)], 4, 2, 16, seed=16)
    first = forward_backward(q, k, v, dout, cq, ck, causal=True, chunk_size=7)
    again = forward_backward(q, k, v, dout, cq, ck, causal=True, chunk_size=7)
    for name, got, want in zip(NAMES, again, first):
        assert_bitwise(name, got, want, "second run vs first")
