"""Correct kernels of the kinds teams train with, whose results are not bitwise reproducible under a
structural change, and their twins with a real bug on the same structural path.

``online_tiles_by_max_seqlen``: FlashAttention-2's forward structure in PyTorch: an online softmax over
key tiles whose size the kernel picks from ``max_seqlen_k`` (64 keys up to 1024, 256 past it, as a
launch heuristic does), P of each tile rounded to the input dtype against the running row maximum
before P V, the accumulator rescaled when the maximum grows; the backward by autograd through it.
Another tile size rounds P against other running maxima, so max_seqlen above the true maximum (or a
long neighbour document) changes many last bits of out, within the bf16 recipe. A pad-to-max design
differs from the plain call in the same way.

``fp8_p_past_1024``: the same kernel whose long-row path (max_seqlen_k past 1024) rounds P to E4M3
instead of the input dtype: a real precision bug that only a structural change reaches. It must fail
the gating verdict (interface.arguments), not only the reproducibility one (a record of the known-bad
registry, tags ``zoo``, ``common-kinds``).

``nan_to_zero``: a correct kernel whose output goes through ``torch.nan_to_num``: correct on every
input a training step produces, but it hides a NaN already in q (a robustness finding). The wrapper
family's ``wrapper.nan.out-to-num`` (the BF16 emulation inside).

``refuses_degenerate``: torch SDPA per document that raises ValueError on softmax_scale <= 0 and on a
pack without queries: refusing an input no training run produces is allowed.

``zero_scale_is_default``: a correct kernel called with ``softmax_scale or headdim**-0.5``, so
softmax_scale = 0 gives the default scale: a wrong answer on an input no training run produces (a
robustness finding, a failure only when robustness is required). The record of
``zoo/convention_bugs.py`` (the emulated flamia-mxfp8 inside).

``fp8_row_scaled``: FP8 attention with current scaling per row (one token of one head): Q, K and V
rounded to E4M3 under an fp32 scale amax/448 of their own row (the fp8 recipe admits fp32 scales of any
granularity), P rounded to E4M3 under the fixed scale 2^8 and normalized by the sum of the rounded P,
fp32 accumulation; the backward by autograd through the dequantized values (straight-through). A V whose
channels differ in magnitude is not on the E4M3 grid under such a scale: a check that feeds a constant
V must not read its rounding as lost probability.

The correct kinds (``online_tiles_by_max_seqlen``, ``refuses_degenerate``, ``pads_to_max_seqlen``,
``fp8_row_scaled``) are test fixtures, not known-bad records.
"""

from __future__ import annotations

import math

import torch

import zoo.convention_bugs  # noqa: F401  (registers zero_scale_is_default)
from flamia_verify.known_bad import KNOWN_BAD, KnownBad
from zoo.correct import _doc_scores, _documents, sdpa_bf16

__all__ = [
    "fp8_p_past_1024",
    "fp8_row_scaled",
    "pads_to_max_seqlen",
    "nan_to_zero",
    "online_tiles_by_max_seqlen",
    "refuses_degenerate",
    "zero_scale_is_default",
]

#: the key-tile sizes of the online-softmax kernel: small rows, and rows past LONG_ROWS keys
SHORT_TILE, LONG_TILE, LONG_ROWS = 64, 256, 1024


def _online_softmax(q, k, v, cu_q, cu_k, scale: float, causal: bool, tile: int, p_dtype: torch.dtype):
    group = q.shape[1] // k.shape[1]
    out = []
    cq, ck = cu_q.tolist(), cu_k.tolist()
    for b in range(len(cq) - 1):
        q0, q1, k0, k1 = cq[b], cq[b + 1], ck[b], ck[b + 1]
        lq, lk = q1 - q0, k1 - k0
        if lq == 0:
            continue
        Q = q[q0:q1].float().transpose(0, 1)  # (H, lq, D)
        K = k[k0:k1].float().transpose(0, 1).repeat_interleave(group, 0)
        V = v[k0:k1].float().transpose(0, 1).repeat_interleave(group, 0)
        m = torch.full((Q.shape[0], lq, 1), -math.inf)
        l = torch.zeros((Q.shape[0], lq, 1))
        acc = torch.zeros_like(Q[..., :1].expand(-1, -1, V.shape[-1]))
        rows = torch.arange(lq)[:, None]
        for j0 in range(0, lk, tile):
            j1 = min(lk, j0 + tile)
            S = (Q @ K[:, j0:j1].transpose(1, 2)) * scale
            if causal:
                vis = torch.arange(j0, j1)[None, :] <= rows + (lk - lq)
                S = torch.where(vis, S, torch.full((), -math.inf))
            m_new = torch.maximum(m, S.amax(-1, keepdim=True))
            safe = torch.where(m_new == -math.inf, torch.zeros_like(m_new), m_new)
            p = torch.exp(S - safe)
            alpha = torch.exp(torch.where(m == -math.inf, torch.full_like(m, -math.inf), m - safe))
            l = l * alpha + p.sum(-1, keepdim=True)
            acc = acc * alpha + p.to(p_dtype).float() @ V[:, j0:j1]
            m = m_new
        seen = l > 0
        o = torch.where(seen, acc / torch.where(seen, l, torch.ones_like(l)), torch.zeros(()))
        out.append(o.transpose(0, 1))
    if not out:
        return q * 0
    return torch.cat(out).to(q.dtype)


def _tiled_kernel(long_p_dtype: torch.dtype | None, name: str):
    def kernel(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, softmax_scale=None, causal=False):
        scale = q.shape[-1] ** -0.5 if softmax_scale is None else float(softmax_scale)
        long_rows = int(max_seqlen_k) > LONG_ROWS
        tile = LONG_TILE if long_rows else SHORT_TILE
        p_dtype = long_p_dtype if long_rows and long_p_dtype is not None else q.dtype
        with torch.autocast(device_type=q.device.type, enabled=False):  # its fp32 arithmetic stays fp32
            return _online_softmax(q, k, v, cu_seqlens_q, cu_seqlens_k, scale, causal, tile, p_dtype)

    kernel.__name__ = name
    kernel.recipe = "bf16"  # type: ignore[attr-defined]
    return kernel


online_tiles_by_max_seqlen = _tiled_kernel(None, "online_tiles_by_max_seqlen")


class _LongRowsInFp8:
    """A build: the base's tiled kernel (this file's) with P of its long-row path rounded to E4M3."""

    def __call__(self, base):
        return _tiled_kernel(torch.float8_e4m3fn, "fp8_p_past_1024")


RECORDS = KNOWN_BAD.register(
    KnownBad(
        "fp8_p_past_1024",
        "dispatch",
        "online_tiles_by_max_seqlen whose long-row path (max_seqlen_k past 1024) rounds P to E4M3 instead of "
        "the input dtype",
        _LongRowsInFp8(),
        base="zoo.common_kinds:online_tiles_by_max_seqlen",
        recipe="bf16",
        catches=("isolation.layout",),
        where="max_seqlen_k above 1024",
        tags=("zoo", "common-kinds"),
    ),
    origin=__file__,
)
fp8_p_past_1024 = RECORDS[0].kernel(online_tiles_by_max_seqlen)
nan_to_zero = KNOWN_BAD.kernel("wrapper.nan.out-to-num")
zero_scale_is_default = KNOWN_BAD.kernel("zero_scale_is_default")


def refuses_degenerate(
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, softmax_scale=None, causal=False
):
    if q.shape[0] == 0:
        raise ValueError("refuses_degenerate: a pack without queries")
    if softmax_scale is not None and softmax_scale <= 0:
        raise ValueError("refuses_degenerate: softmax_scale must be positive")
    return sdpa_bf16(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale=softmax_scale, causal=causal
    )


refuses_degenerate.recipe = "bf16"  # type: ignore[attr-defined]


def pads_to_max_seqlen(
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, softmax_scale=None, causal=False
):
    """torch SDPA per document behind a pad-to-max buffer budget: a (batch, heads, max_seqlen_q,
    max_seqlen_k) score buffer past 2^29 elements cannot be allocated (as a pad-to-max design runs out
    of memory when the caller passes max_seqlen far above the true maxima)."""
    batch = cu_seqlens_q.numel() - 1
    if batch * q.shape[1] * int(max_seqlen_q) * int(max_seqlen_k) > 2**29:
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory for the padded score buffer")
    return sdpa_bf16(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale=softmax_scale, causal=causal
    )


pads_to_max_seqlen.recipe = "bf16"  # type: ignore[attr-defined]


def _e4m3_rows(x: torch.Tensor) -> torch.Tensor:
    """x rounded to E4M3 under an fp32 scale amax/448 per row (the last axis), straight-through."""
    amax = x.detach().abs().amax(-1, keepdim=True)
    scale = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax))
    rounded = (x.detach() / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).float() * scale
    return x + (rounded - x.detach())


def _e4m3_p(p: torch.Tensor) -> torch.Tensor:
    """Probabilities rounded to E4M3 under the fixed scale 2^8 (1 maps to 256), straight-through."""
    rounded = (p.detach() * 256.0).to(torch.float8_e4m3fn).float() / 256.0
    return p + (rounded - p.detach())


def fp8_row_scaled(
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, softmax_scale=None, causal=False
):
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else float(softmax_scale)
    group = q.shape[1] // k.shape[1]
    with torch.autocast(device_type=q.device.type, enabled=False):  # its fp32 arithmetic stays fp32
        qf, kf, vf = (_e4m3_rows(t.float()) for t in (q, k, v))
        out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        for q0, q1, k0, k1 in _documents(cu_seqlens_q, cu_seqlens_k):
            S, _, _, vis = _doc_scores(qf, kf, q0, q1, k0, k1, scale, causal)
            V = vf[k0:k1].transpose(0, 1).repeat_interleave(group, 0)
            m = S.amax(-1, keepdim=True)
            m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
            p = _e4m3_p(torch.where(vis, torch.exp(S - m), torch.zeros((), device=q.device)))
            total = p.sum(-1, keepdim=True)  # the sum of the rounded P that multiplies V
            out[q0:q1] = ((p @ V) / torch.where(total > 0, total, torch.ones_like(total))).transpose(0, 1)
    return out.to(q.dtype)


fp8_row_scaled.recipe = "fp8"  # type: ignore[attr-defined]
