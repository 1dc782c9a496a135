"""The float64 reference against the exact definition evaluated by mpmath at 50 digits.

Tiny cases (a few tokens, 1-2 heads, headdim <= 4) that cover every shape rule: causal
bottom-right alignment, seqlen_q != seqlen_k, GQA, empty and length-1 documents, rows that
see no key. The mpmath twin shares nothing with the reference except the definition:

    s_j = scale * q . k_j over the visible keys j;  p_j = exp(s_j - lse),  lse = log sum_j exp(s_j)
    out = sum_j p_j v_j;  dv_j += p_j dout;  dp_j = dout . v_j;  D = sum_j p_j dp_j
    ds_j = p_j (dp_j - D);  dq = scale sum_j ds_j k_j;  dk_j += scale ds_j q

(D = sum_j p_j dp_j equals rowsum(dout * out) exactly, which is the form the reference uses.)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import mpmath
import pytest
import torch

from flamia_verify.reference import attention_backward, attention_forward, reference_attention

MP_DIGITS = 50
# Required agreement with the exact values, from the reference's specification. Float64
# evaluation of these tiny cases is good to a few units of 2^-53 ~ 1.1e-16; 1e-12 leaves three
# orders of magnitude for the cases whose scores reach the hundreds (see `large_scores`).
REL_TOL = 1e-12


@dataclass(frozen=True)
class Case:
    name: str
    docs: tuple[tuple[int, int], ...]  # (seqlen_q, seqlen_k) per document
    nheads: int
    nheads_k: int
    headdim: int
    magnitude: float = 1.0  # inputs ~ N(0, magnitude^2)
    score_offset: float = 0.0  # add this to every score of a row (through channel 0), see `large_offset`


CASES = [
    Case("square", ((4, 4),), 1, 1, 3),
    Case("more_keys", ((3, 5),), 2, 2, 4),
    Case("more_queries", ((5, 3),), 1, 1, 4),  # causal: q0, q1 see no key
    Case("gqa", ((3, 4),), 2, 1, 2),
    Case("packed_edge_docs", ((2, 0), (0, 2), (1, 1), (0, 0), (3, 4), (1, 3)), 2, 1, 4),
    Case("single_token", ((1, 1),), 2, 2, 1),
    # Every score near 800 (exp(800) overflows float64) with an O(1) spread: only the row-max
    # shift keeps the forward finite, and the softmax stays far from one-hot.
    Case("large_offset", ((3, 3), (2, 4)), 2, 2, 4, score_offset=800.0),
]

# Scores spread over hundreds: every row's softmax is one-hot to ~1e-8 (see test_saturated_rows).
SATURATED = Case("saturated", ((3, 3), (2, 4)), 2, 2, 4, magnitude=12.0)


def _cu(lens):
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)


def _inputs(case: Case, seed: int):
    g = torch.Generator().manual_seed(seed)
    cq, ck = _cu([d[0] for d in case.docs]), _cu([d[1] for d in case.docs])
    tq, tk = int(cq[-1]), int(ck[-1])

    def rnd(*shape):
        return case.magnitude * torch.randn(*shape, generator=g, dtype=torch.float64)

    q, k, v = (
        rnd(tq, case.nheads, case.headdim),
        rnd(tk, case.nheads_k, case.headdim),
        rnd(tk, case.nheads_k, case.headdim),
    )
    if case.score_offset:
        # q . k = sqrt(offset / scale)^2 * scale on channel 0, plus an O(1) part from the others.
        c = math.sqrt(case.score_offset * math.sqrt(case.headdim))
        q[:, :, 0], k[:, :, 0] = c, c
    dout = torch.randn(tq, case.nheads, case.headdim, generator=g, dtype=torch.float64)
    return q, k, v, dout, cq, ck


def _mp_attention(q, k, v, dout, cq, ck, scale: float, causal: bool, *, with_ds: bool = False):
    """Exact (50-digit) out, lse, dq, dk, dv as nested lists of mpf (lse -inf as None).

    with_ds: also return max over rows and heads of sum_j |ds_j|.
    """
    mp = mpmath.mp
    tq, H, D = q.shape
    tk, Hk, _ = k.shape
    G = H // Hk
    Q, K, V, DO = (t.tolist() for t in (q, k, v, dout))  # float64 -> Python floats, exact
    sc = mp.mpf(scale)
    zero = mp.mpf(0)
    out = [[[zero] * D for _ in range(H)] for _ in range(tq)]
    lse = [[None] * H for _ in range(tq)]
    dq = [[[zero] * D for _ in range(H)] for _ in range(tq)]
    dk = [[[zero] * D for _ in range(Hk)] for _ in range(tk)]
    dv = [[[zero] * D for _ in range(Hk)] for _ in range(tk)]
    ds_row_max = zero
    cq, ck = cq.tolist(), ck.tolist()
    for b in range(len(cq) - 1):
        q0, lq, k0, lk = cq[b], cq[b + 1] - cq[b], ck[b], ck[b + 1] - ck[b]
        for i in range(lq):
            keys = [j for j in range(lk) if not causal or j <= i + (lk - lq)]
            if not keys:
                continue  # out 0, lse -inf, gradient 0
            for h in range(H):
                hk = h // G
                qi, doi = Q[q0 + i][h], DO[q0 + i][h]
                s = {j: sc * mp.fsum(mp.mpf(a) * mp.mpf(c) for a, c in zip(qi, K[k0 + j][hk])) for j in keys}
                m = max(s.values())
                lse_ih = m + mp.log(mp.fsum(mp.exp(s[j] - m) for j in keys))
                p = {j: mp.exp(s[j] - lse_ih) for j in keys}
                lse[q0 + i][h] = lse_ih
                out[q0 + i][h] = [mp.fsum(p[j] * V[k0 + j][hk][d] for j in keys) for d in range(D)]
                dp = {j: mp.fsum(mp.mpf(a) * mp.mpf(c) for a, c in zip(doi, V[k0 + j][hk])) for j in keys}
                delta = mp.fsum(p[j] * dp[j] for j in keys)
                ds = {j: p[j] * (dp[j] - delta) for j in keys}
                ds_row_max = max(ds_row_max, mp.fsum(abs(x) for x in ds.values()))
                dq[q0 + i][h] = [sc * mp.fsum(ds[j] * K[k0 + j][hk][d] for j in keys) for d in range(D)]
                for j in keys:
                    row_k, row_v = dk[k0 + j][hk], dv[k0 + j][hk]
                    for d in range(D):
                        row_k[d] += sc * ds[j] * qi[d]
                        row_v[d] += p[j] * doi[d]
    if with_ds:
        return out, lse, dq, dk, dv, ds_row_max
    return out, lse, dq, dk, dv


def _assert_close_to_exact(name: str, got: torch.Tensor, exact, case: Case) -> None:
    """Max-norm relative error max|got - exact| / max|exact| <= REL_TOL; exact zeros and -inf kept.

    Relative to the largest exact entry, not entry by entry: gradient entries can cancel to
    nearly 0, where an entrywise relative error measures the cancellation, not the reference.
    """
    flat_got = got.reshape(-1).tolist()
    flat_exact = torch.tensor(0).new_empty(0).tolist()
    stack = [exact]
    while stack:  # flatten nested lists in order
        x = stack.pop()
        if isinstance(x, list):
            stack.extend(reversed(x))
        else:
            flat_exact.append(x)
    assert len(flat_got) == len(flat_exact), f"{name}: {len(flat_got)} values, exact has {len(flat_exact)}"
    finite = [e for e in flat_exact if e is not None]
    scale = max((abs(e) for e in finite), default=mpmath.mpf(0))
    worst, worst_at = mpmath.mpf(0), None
    for idx, (g, e) in enumerate(zip(flat_got, flat_exact)):
        if e is None:
            assert g == -math.inf, f"{case.name}: {name}[{idx}] should be -inf (row sees no key), got {g}"
            continue
        if e == 0:
            assert g == 0.0, f"{case.name}: {name}[{idx}] should be exactly 0 (no visible key), got {g}"
            continue
        err = abs(mpmath.mpf(g) - e)
        if err > worst:
            worst, worst_at = err, idx
    if scale == 0:
        return
    rel = worst / scale
    assert rel <= REL_TOL, (
        f"{case.name}: {name} max-norm relative error {float(rel):.3e} > {REL_TOL:g} at flat index {worst_at}: "
        f"got {flat_got[worst_at]!r}, exact {mpmath.nstr(flat_exact[worst_at], 20)} (scale {mpmath.nstr(scale, 6)})"
    )


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_matches_mpmath(case: Case, causal: bool) -> None:
    q, k, v, dout, cq, ck = _inputs(case, seed=len(case.name))
    scale = 1.0 / math.sqrt(case.headdim)
    out, lse = attention_forward(q, k, v, cq, ck, softmax_scale=scale, causal=causal)
    dq, dk, dv = attention_backward(dout, q, k, v, out, lse, cq, ck, softmax_scale=scale, causal=causal)
    with mpmath.workdps(MP_DIGITS):
        exact = _mp_attention(q, k, v, dout, cq, ck, scale, causal)
        for name, got, ex in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, dq, dk, dv), exact):
            _assert_close_to_exact(name, got, ex, case)


def test_autograd_wrapper_matches_mpmath() -> None:
    """reference_attention's gradients (through autograd) are the exact ones too."""
    case = CASES[4]  # packed edge documents, GQA
    q, k, v, dout, cq, ck = _inputs(case, seed=7)
    scale = 0.5
    qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
    out = reference_attention(qq, kk, vv, cq, ck, 3, 4, softmax_scale=scale, causal=True)
    out.backward(dout)
    with mpmath.workdps(MP_DIGITS):
        ex_out, _, ex_dq, ex_dk, ex_dv = _mp_attention(q, k, v, dout, cq, ck, scale, True)
        for name, got, ex in (
            ("out", out.detach(), ex_out),
            ("dq", qq.grad, ex_dq),
            ("dk", kk.grad, ex_dk),
            ("dv", vv.grad, ex_dv),
        ):
            _assert_close_to_exact(name, got, ex, case)


def test_saturated_rows() -> None:
    """One-hot softmax rows: out, lse, dv exact to REL_TOL; dq, dk within the formula's own bound.

    The analytic backward forms dS = P * (dP - D) with D = rowsum(dO * O). When a row is
    one-hot to 1 - eps, the true dS of its dominant key is O(eps) but is computed as the
    difference of two O(M) numbers, M = max_i |dO_i|_1 max|V| (a bound on |dP| and |D|), so its
    absolute error is a few units of u * M however small dS is (every FlashAttention-style
    backward shares this). Relative to the tiny true gradient that is ~1e-8 here; relative to
    the terms it is a few ulps. First-order bound, u = 2^-53:

        |d(dS_ij)| <= P_ij * 2 (D + Lk) u M  +  delta_P * |dS_ij|
            (rounding of dP and of D, each a D-term dot product after O's Lk-term sums;
             delta_P = (D + 2) u sigma + 2u is P's relative error for scores bounded by sigma)
        |d(dQ_i)|  <= scale max|K| (2 (D + Lk) u M + (delta_P + 2 Lk u) sum_j |dS_ij|)
        |d(dK_j)|  <= scale max|Q| (Lq G) (2 (D + Lk) u M + (delta_P + 2 Lq G u) max_i sum_j |dS_ij|)
    """
    case = SATURATED
    q, k, v, dout, cq, ck = _inputs(case, seed=3)
    scale = 1.0 / math.sqrt(case.headdim)
    out, lse = attention_forward(q, k, v, cq, ck, softmax_scale=scale, causal=False)
    dq, dk, dv = attention_backward(dout, q, k, v, out, lse, cq, ck, softmax_scale=scale, causal=False)
    with mpmath.workdps(MP_DIGITS):
        ex_out, ex_lse, ex_dq, ex_dk, ex_dv, ds_row = _mp_attention(q, k, v, dout, cq, ck, scale, False, with_ds=True)
        for name, got, ex in (("out", out, ex_out), ("lse", lse, ex_lse), ("dv", dv, ex_dv)):
            _assert_close_to_exact(name, got, ex, case)
        ex_dq_t = torch.tensor([[[float(x) for x in h] for h in r] for r in ex_dq], dtype=torch.float64)
        ex_dk_t = torch.tensor([[[float(x) for x in h] for h in r] for r in ex_dk], dtype=torch.float64)
        ds_row = float(ds_row)

    u = 2.0**-53
    D, G = case.headdim, case.nheads // case.nheads_k
    lk, lq = max(d[1] for d in case.docs), max(d[0] for d in case.docs)
    M = dout.abs().sum(-1).max().item() * v.abs().max().item()
    sigma = scale * D * (q.abs().max() * k.abs().max()).item()
    delta_p = (D + 2) * u * sigma + 2 * u
    bound_dq = scale * k.abs().max().item() * (2 * (D + lk) * u * M + (delta_p + 2 * lk * u) * ds_row)
    bound_dk = scale * q.abs().max().item() * lq * G * (2 * (D + lk) * u * M + (delta_p + 2 * lq * G * u) * ds_row)
    # float(exact) adds at most half an ulp of each entry, negligible against these bounds.
    err_dq = (dq - ex_dq_t).abs().max().item()
    err_dk = (dk - ex_dk_t).abs().max().item()
    assert err_dq <= bound_dq, f"saturated: |dq - exact| = {err_dq:.3e} exceeds the rounding bound {bound_dq:.3e}"
    assert err_dk <= bound_dk, f"saturated: |dk - exact| = {err_dk:.3e} exceeds the rounding bound {bound_dk:.3e}"
    # The case really is saturated: the true gradient is tiny next to the terms it comes from,
    # and the 1e-12 relative criterion of the other cases would not hold.
    assert ex_dq_t.abs().max().item() < 1e-4 * scale * M * k.abs().max().item()
