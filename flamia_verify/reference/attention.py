"""Float64 attention in the varlen convention: forward (O, LSE) and the analytic backward.

Every input is converted exactly to float64 and all arithmetic is float64. Documents are
processed one at a time, and the queries of a document in chunks of ``chunk_size`` rows, so
memory is linear in sequence length: the only quadratic object is one
(chunk, nheads, seqlen_k) float64 score block (two in the backward).

    causal, Lq = 3, Lk = 5 (offset Lk - Lq = 2)       x = visible
               k0 k1 k2 k3 k4
          q0 [ x  x  x  .  . ]
          q1 [ x  x  x  x  . ]
          q2 [ x  x  x  x  x ]

    causal, Lq = 4, Lk = 2 (offset -2): q0 and q1 see no key -> out 0, lse -inf, gradient 0
               k0 k1
          q0 [ .  . ]
          q1 [ .  . ]
          q2 [ x  . ]
          q3 [ x  x ]

Reproducibility by construction: each document's keys and values, and each chunk of its
query rows, are converted into freshly allocated float64 tensors, and chunk boundaries are
counted from the document's first query, so a document gives bitwise the same out, lse and
gradients whether it is alone or packed among others at any offset (same shapes, same
alignment, same operation sequence into the BLAS). Different chunk sizes agree to rounding
only (the BLAS kernel depends on the row count).

Causality is exact even for NaN/Inf inputs: a causal document holding one runs a query row
per chunk, so no row ever meets a key it cannot see (see :func:`_exact_causality`).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

import torch

from flamia_verify.convention import seqlens, validate_varlen_inputs
from flamia_verify.errors import InputError

__all__ = [
    "SCORE_BLOCK_BYTES",
    "visible_mask",
    "query_chunk_size",
    "attention_forward",
    "attention_backward",
    "reference_attention",
    "ReferenceAttention",
]

SCORE_BLOCK_BYTES = 256 * 2**20
"""Default budget of one (chunk, nheads, seqlen_k) float64 score block: 256 MiB.

The forward holds one such block at a time, the backward two (P and dP/dS). At 32K keys and
16 heads one query row of scores is 4 MiB, so the default chunk is 64 rows."""

_F64_BYTES = 8


def visible_mask(lq: int, lk: int, causal: bool, *, device: torch.device | str | None = None) -> torch.Tensor:
    """Boolean (lq, lk) mask: key j is visible to query i iff not causal or j <= i + (lk - lq).

    Bottom-right aligned, as in FlashAttention >= 2.1. With causal and lk < lq the first
    lq - lk rows are all False (those queries see no key).
    """
    if lq < 0 or lk < 0:
        raise InputError(f"visible_mask needs non-negative lengths, got lq={lq}, lk={lk}")
    if not causal:
        return torch.ones(lq, lk, dtype=torch.bool, device=device)
    return _causal_block(0, lq, 0, lk, lk - lq, device)


def _causal_block(r0: int, r1: int, c0: int, c1: int, offset: int, device: torch.device | str | None) -> torch.Tensor:
    """Visible mask of rows [r0, r1) x columns [c0, c1) for a causal document with the given offset."""
    rows = torch.arange(r0, r1, device=device).unsqueeze(1)
    cols = torch.arange(c0, c1, device=device).unsqueeze(0)
    return cols <= rows + offset


def query_chunk_size(nheads: int, seqlen_k: int, budget_bytes: int | None = None) -> int:
    """Query rows per chunk so that a (chunk, nheads, seqlen_k) float64 block fits the budget (>= 1).

    ``budget_bytes`` defaults to :data:`SCORE_BLOCK_BYTES`, read at call time.
    """
    if budget_bytes is None:
        budget_bytes = SCORE_BLOCK_BYTES
    row_bytes = max(1, nheads * seqlen_k * _F64_BYTES)
    return max(1, budget_bytes // row_bytes)


# ---------------------------------------------------------------------------------------------
# Argument checks beyond the calling convention
# ---------------------------------------------------------------------------------------------


def _check_scale(softmax_scale: object) -> float:
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float)):
        raise InputError(
            f"softmax_scale must be a real number (e.g. 1 / sqrt(headdim)), got {type(softmax_scale).__name__}"
        )
    if not math.isfinite(softmax_scale):
        raise InputError(f"softmax_scale must be finite, got {softmax_scale}")
    return float(softmax_scale)


def _check_causal(causal: object) -> bool:
    if not isinstance(causal, bool):
        raise InputError(f"causal must be True or False, got {causal!r}")
    return causal


def _check_chunk(chunk_size: object) -> int | None:
    if chunk_size is None:
        return None
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise InputError(f"chunk_size must be a positive int or None (automatic), got {chunk_size!r}")
    return chunk_size


def _check_like(name: str, t: object, shape: tuple[int, ...]) -> None:
    if not isinstance(t, torch.Tensor):
        raise InputError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if not t.is_floating_point():
        raise InputError(f"{name} must be a floating-point tensor, got {t.dtype}")
    if tuple(t.shape) != shape:
        raise InputError(f"{name} must have shape {shape}, got {tuple(t.shape)}")


# ---------------------------------------------------------------------------------------------
# One document
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Doc:
    """Shapes of one document and its query-chunk grid."""

    lq: int
    lk: int
    nheads: int
    nheads_k: int
    headdim: int
    causal: bool
    chunk: int

    @property
    def group(self) -> int:
        return self.nheads // self.nheads_k

    @property
    def offset(self) -> int:
        return self.lk - self.lq

    def chunks(self) -> Iterator[tuple[int, int, int]]:
        """Yield (a, b, kend): query rows [a, b) and the keys [0, kend) any of them can see."""
        for a in range(0, self.lq, self.chunk):
            b = min(a + self.chunk, self.lq)
            kend = min(self.lk, max(0, b + self.offset)) if self.causal else self.lk
            yield a, b, kend

    def mask_invisible_(self, block: torch.Tensor, a: int, b: int, kend: int, fill: float) -> None:
        """Fill the invisible entries of a (Hk, G, b - a, kend) block in place (causal only).

        Only the columns right of the chunk's first row's horizon can be invisible, so only
        that (b - a, kend - lo) corner is touched.
        """
        if not self.causal:
            return
        lo = min(kend, max(0, a + self.offset + 1))
        if lo >= kend:
            return
        vis = _causal_block(a, b, lo, kend, self.offset, block.device)
        block[..., lo:kend].masked_fill_(~vis, fill)


# Layouts. Token-major tensors of the convention are (L, H, ...). Inside a document the work is
# batched over kv heads: keys and values as (Hk, Lk, D), a chunk of c query rows as
# (Hk, G * c, ...) with row index g * c + r for query head hk * G + g and row r, so one bmm per
# GEMM serves every query head of a group. Every conversion below writes exact float64 values
# into freshly allocated memory, never a view of the caller's tensor.


def _kv_heads_first(t: torch.Tensor) -> torch.Tensor:
    """(Lk, Hk, D) any float dtype -> fresh float64 (Hk, Lk, D)."""
    out = torch.empty(t.shape[1], t.shape[0], t.shape[2], dtype=torch.float64, device=t.device)
    return out.copy_(t.permute(1, 0, 2))


def _chunk_rows(t: torch.Tensor, nheads_k: int) -> torch.Tensor:
    """(c, H, ...) any float dtype -> fresh float64 (Hk, G * c, ...)."""
    c, H, rest = t.shape[0], t.shape[1], tuple(t.shape[2:])
    G = H // nheads_k
    out = torch.empty(nheads_k, G * c, *rest, dtype=torch.float64, device=t.device)
    out.view(nheads_k, G, c, *rest).copy_(t.reshape(c, nheads_k, G, *rest).movedim(0, 2))
    return out


def _store_rows(dst: torch.Tensor, t: torch.Tensor) -> None:
    """Write (Hk, G * c, ...) into the (c, H, ...) destination, inverse of :func:`_chunk_rows`."""
    c, H = dst.shape[0], dst.shape[1]
    hk = t.shape[0]
    dst.view(c, hk, H // hk, *dst.shape[2:]).copy_(t.view(hk, H // hk, c, *t.shape[2:]).movedim(2, 0))


def _scores_(buf: torch.Tensor, qc: torch.Tensor, kh: torch.Tensor, kend: int, scale: float) -> torch.Tensor:
    """S = scale * Q_c K^T into the work buffer: (Hk, G * c, kend)."""
    hk, gc, _ = qc.shape
    s = buf[: hk * gc * kend].view(hk, gc, kend)
    torch.bmm(qc, kh[:, :kend].transpose(1, 2), out=s)
    s.mul_(scale)
    return s


def _doc_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, doc: _Doc, scale: float, out: torch.Tensor, lse: torch.Tensor
) -> None:
    """One document: q (Lq, H, D), k, v (Lk, Hk, D) in the caller's dtype.

    Writes into out (Lq, H, D) and lse (Lq, H), float64, which arrive as 0 and -inf.
    """
    Hk, G = doc.nheads_k, doc.group
    kh, vh = _kv_heads_first(k), _kv_heads_first(v)
    buf = torch.empty(Hk * G * min(doc.chunk, doc.lq) * doc.lk, dtype=torch.float64, device=out.device)
    for a, b, kend in doc.chunks():
        if kend == 0:
            continue  # no row of this chunk sees a key
        c = b - a
        s = _scores_(buf, _chunk_rows(q[a:b], Hk), kh, kend, scale)
        doc.mask_invisible_(s.view(Hk, G, c, kend), a, b, kend, -math.inf)
        m = s.amax(dim=-1, keepdim=True)
        empty = m == -math.inf  # rows that see no key
        m.masked_fill_(empty, 0.0)
        p = s.sub_(m).exp_()  # exp(S - rowmax); invisible entries exactly 0
        l = p.sum(dim=-1, keepdim=True)
        o = torch.bmm(p, vh[:, :kend]).div_(l).masked_fill_(empty, 0.0)
        _store_rows(out[a:b], o)
        _store_rows(lse[a:b], (m + torch.log(l)).squeeze(-1))


def _doc_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    doc: _Doc,
    scale: float,
    dq: torch.Tensor,
    dk: torch.Tensor,
    dv: torch.Tensor,
) -> None:
    """Analytic gradients of one document (inputs in the caller's dtypes).

    Writes dq (Lq, H, D), dk, dv (Lk, Hk, D), float64, which arrive as 0.
    """
    Hk, G = doc.nheads_k, doc.group
    kh, vh = _kv_heads_first(k), _kv_heads_first(v)
    dkh = torch.zeros_like(kh)
    dvh = torch.zeros_like(vh)
    n = Hk * G * min(doc.chunk, doc.lq) * doc.lk
    buf_p = torch.empty(n, dtype=torch.float64, device=dq.device)
    buf_ds = torch.empty(n, dtype=torch.float64, device=dq.device)
    for a, b, kend in doc.chunks():
        if kend == 0:
            continue
        c = b - a
        qc, doc_c = _chunk_rows(q[a:b], Hk), _chunk_rows(dout[a:b], Hk)
        lse_c = _chunk_rows(lse[a:b], Hk).unsqueeze(-1)  # (Hk, G * c, 1)
        # A row that saw no key has lse = -inf and must get P = 0: exp(S - (+inf)) = 0.
        lse_c.masked_fill_(lse_c == -math.inf, math.inf)
        s = _scores_(buf_p, qc, kh, kend, scale)
        doc.mask_invisible_(s.view(Hk, G, c, kend), a, b, kend, -math.inf)
        p = s.sub_(lse_c).exp_()  # P = exp(S - lse)
        dvh[:, :kend].baddbmm_(p.transpose(1, 2), doc_c)  # dV += P^T dO
        dp = buf_ds[: p.numel()].view_as(p)
        torch.bmm(doc_c, vh[:, :kend].transpose(1, 2), out=dp)  # dP = dO V^T
        delta = (doc_c * _chunk_rows(out[a:b], Hk)).sum(dim=-1, keepdim=True)  # D = rowsum(dO * O)
        ds = dp.sub_(delta).mul_(p)  # dS = P * (dP - D)
        _store_rows(dq[a:b], torch.bmm(ds, kh[:, :kend]).mul_(scale))  # dQ = scale dS K
        dkh[:, :kend].baddbmm_(ds.transpose(1, 2), qc)  # dK += dS^T Q  (scale applied once below)
    dk.copy_(dkh.mul_(scale).permute(1, 0, 2))
    dv.copy_(dvh.permute(1, 0, 2))


# ---------------------------------------------------------------------------------------------
# Public functions
# ---------------------------------------------------------------------------------------------


def _documents(
    q: torch.Tensor,
    k: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    causal: bool,
    chunk_size: int | None,
) -> Iterator[tuple[int, int, int, int, _Doc]]:
    """Yield (qs, qe, ks, ke, _Doc) for every document."""
    H, Hk, D = q.shape[1], k.shape[1], q.shape[2]
    cq = cu_seqlens_q.detach().cpu().tolist()
    ck = cu_seqlens_k.detach().cpu().tolist()
    for i, (lq, lk) in enumerate(zip(seqlens(cu_seqlens_q), seqlens(cu_seqlens_k))):
        chunk = chunk_size if chunk_size is not None else query_chunk_size(H, lk)
        yield cq[i], cq[i + 1], ck[i], ck[i + 1], _Doc(lq, lk, H, Hk, D, causal, chunk)


def _exact_causality(doc: _Doc, *tensors: torch.Tensor) -> _Doc:
    """One query row per chunk for a causal document with a non-finite entry in ``tensors``.

    Inside a chunk the GEMMs run over the keys [0, kend) of the chunk's last row, so an
    earlier row meets the keys it cannot see with a probability (or dS) of exactly 0, and
    0 * NaN = NaN. With one row per chunk kend is that row's own horizon: an invisible NaN or
    Inf never reaches it, and poisoning positions after i leaves row i bitwise unchanged (as
    long as the clean run also used chunk_size=1). Finite inputs keep their chunking.
    """
    if doc.causal and doc.chunk > 1 and not all(_all_finite(t) for t in tensors):
        return replace(doc, chunk=1)
    return doc


_ISFINITE_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _all_finite(t: torch.Tensor) -> bool:
    # torch.isfinite has no kernel for the float8 dtypes; float32 holds them exactly.
    return bool(torch.isfinite(t if t.dtype in _ISFINITE_DTYPES else t.float()).all())


def attention_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    *,
    softmax_scale: float,
    causal: bool,
    chunk_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Float64 attention forward.

    q: (total_q, nheads, headdim); k, v: (total_k, nheads_k, headdim), any float dtype
    (converted exactly). Query head h reads kv head h // (nheads // nheads_k).
    cu_seqlens_q, cu_seqlens_k: int32 (batch + 1,).

    Returns out: float64 (total_q, nheads, headdim) and lse: float64 (total_q, nheads), the
    natural log of sum_j exp(softmax_scale * q_i . k_j) over the keys row i sees. A row that
    sees no key has out = 0 and lse = -inf. ``chunk_size`` is the number of query rows per
    chunk (default: :func:`query_chunk_size`, a 256 MiB score block). A causal document whose
    v holds a NaN or Inf runs one row per chunk, so values a row cannot see never reach it.
    """
    validate_varlen_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k)
    scale, causal, chunk_size = _check_scale(softmax_scale), _check_causal(causal), _check_chunk(chunk_size)
    H, D = q.shape[1], q.shape[2]
    out = torch.zeros(q.shape[0], H, D, dtype=torch.float64, device=q.device)
    lse = torch.full((q.shape[0], H), -math.inf, dtype=torch.float64, device=q.device)
    with torch.no_grad():
        for qs, qe, ks, ke, doc in _documents(q, k, cu_seqlens_q, cu_seqlens_k, causal, chunk_size):
            if doc.lq == 0 or doc.lk == 0:
                continue  # out stays 0, lse -inf
            # Only v can carry a NaN across the mask here: invisible scores are overwritten
            # with -inf, and a query row's scores stay in that row.
            doc = _exact_causality(doc, v[ks:ke])
            _doc_forward(q[qs:qe], k[ks:ke], v[ks:ke], doc, scale, out[qs:qe], lse[qs:qe])
    return out, lse


def attention_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    *,
    softmax_scale: float,
    causal: bool,
    chunk_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Analytic float64 attention backward (not autograd).

    dout, out: (total_q, nheads, headdim); lse: (total_q, nheads), as returned by
    :func:`attention_forward`; q, k, v, cu_seqlens as there. With S = scale Q K^T:

        P = exp(S - lse)   dV = P^T dO   dP = dO V^T   D = rowsum(dO * O)
        dS = P * (dP - D)  dQ = scale dS K   dK = scale dS^T Q

    Returns dq: float64 (total_q, nheads, headdim) and dk, dv: float64
    (total_k, nheads_k, headdim), summed over the query heads that share a kv head. Rows
    that see no key get 0 gradient. A causal document with a NaN or Inf in dout, q, k, v or
    out runs one row per chunk, so nothing crosses the causal mask.
    """
    validate_varlen_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k)
    scale, causal, chunk_size = _check_scale(softmax_scale), _check_causal(causal), _check_chunk(chunk_size)
    _check_like("dout", dout, tuple(q.shape))
    _check_like("out", out, tuple(q.shape))
    _check_like("lse", lse, tuple(q.shape[:2]))
    dq = torch.zeros(q.shape, dtype=torch.float64, device=q.device)
    dk = torch.zeros(k.shape, dtype=torch.float64, device=q.device)
    dv = torch.zeros(k.shape, dtype=torch.float64, device=q.device)
    with torch.no_grad():
        for qs, qe, ks, ke, doc in _documents(q, k, cu_seqlens_q, cu_seqlens_k, causal, chunk_size):
            if doc.lq == 0 or doc.lk == 0:
                continue
            # dS is exactly 0 on invisible pairs but multiplies q, k (and is formed from dout, out, v).
            doc = _exact_causality(doc, q[qs:qe], k[ks:ke], v[ks:ke], dout[qs:qe], out[qs:qe])
            _doc_backward(
                dout[qs:qe],
                q[qs:qe],
                k[ks:ke],
                v[ks:ke],
                out[qs:qe],
                lse[qs:qe],
                doc,
                scale,
                dq[qs:qe],
                dk[ks:ke],
                dv[ks:ke],
            )
    return dq, dk, dv


class ReferenceAttention(torch.autograd.Function):
    """Forward :func:`attention_forward`, backward :func:`attention_backward`; out is float64."""

    @staticmethod
    def forward(
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cu_seqlens_q: torch.Tensor,
        cu_seqlens_k: torch.Tensor,
        softmax_scale: float,
        causal: bool,
    ) -> torch.Tensor:
        out, lse = attention_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale=softmax_scale, causal=causal)
        ctx.save_for_backward(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k)
        ctx.softmax_scale, ctx.causal = softmax_scale, causal
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, out, lse, cu_q, cu_k = ctx.saved_tensors
        dq, dk, dv = attention_backward(
            dout, q, k, v, out, lse, cu_q, cu_k, softmax_scale=ctx.softmax_scale, causal=ctx.causal
        )
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None


def reference_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    softmax_scale: float | None = None,
    causal: bool = False,
) -> torch.Tensor:
    """The float64 reference in the kernel calling convention (``softmax_scale=None``: headdim^-0.5,
    as FlashAttention's default).

    q: (total_q, nheads, headdim); k, v: (total_k, nheads_k, headdim); cu_seqlens_*: int32
    (batch + 1,). Returns out: float64 (total_q, nheads, headdim); gradients reach q, k, v in
    their own dtypes through the analytic backward. Raises InputError on a convention breach.
    """
    validate_varlen_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    if softmax_scale is None:
        softmax_scale = q.shape[-1] ** -0.5
    _check_scale(softmax_scale)
    _check_causal(causal)
    out: torch.Tensor = ReferenceAttention.apply(  # type: ignore[no-untyped-call]  # torch leaves apply untyped
        q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal
    )
    return out
