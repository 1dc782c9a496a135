"""Statistics of attention inputs, recorded (a capture's calls) or generated (a case's tensors): what
the realistic value distributions of :mod:`flamia_verify.properties.cases` are calibrated against.

Every function takes the varlen tensors of one call, q: (total_q, nheads, headdim); k, v:
(total_k, nheads_k, headdim); dO like q; cu_seqlens: int32 (batch + 1,), and works in float64 on the
CPU.

    channel_norm_ratio   per head, the largest channel RMS over the median channel RMS (outlier
                         channels: 1.2-1.5 for N(0, 1) over a few hundred tokens, ~100 for an LLM's
                         outlier channels); the largest over heads
    kurtosis             Pearson kurtosis of the entries of each head (3 for a Gaussian), mean over heads
    token_norm_ratio     per head, the largest token's L2 norm over the median token's (massive
                         activations: a few tokens far above the rest); the largest over heads
    token_norm_kurtosis  Pearson kurtosis of the tokens' L2 norms, per head, mean over heads
    effective_rank       exp(entropy of the normalized singular values) of each head's (tokens, headdim)
                         matrix (Roy and Vetterli 2007), mean over heads: headdim-ish for white noise,
                         about r for rank r
    low_frequency_share  the share of the squared norm in the quarter of rotary pairs (i, i + D/2) with the
                         lowest frequencies (the last quarter of pair indices), over every head: 0.25
                         for white noise; rotary-trained q and k put most of their norm there
    sink_weight          the attention weight the first key of a document takes, mean over the causal
                         rows that see at least ``min_keys`` keys; with the mean 1/n of uniform
                         attention over the same rows beside it
    relative_position_r2 the share of the variance of the scores q_i . k_j (causal, within
                         documents) explained by the distance i - j alone (a mean per distance): ~0
                         for unstructured q and k, larger when rotary structure makes scores a function
                         of relative position

:func:`call_statistics` gathers them for one call in a flat dict (the columns of
``benchmarks/realistic_stats.py``).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import torch

__all__ = [
    "call_statistics",
    "channel_norm_ratio",
    "effective_rank",
    "frequency_shares",
    "token_norm_quantiles",
    "kurtosis",
    "low_frequency_share",
    "relative_position_r2",
    "sink_weight",
    "token_norm_kurtosis",
    "token_norm_ratio",
]

#: the share of rotary pairs that :func:`low_frequency_share` counts as low-frequency (a quarter)
LOW_FREQUENCY_FRACTION = 0.25
#: rows that see fewer keys than this are left out of :func:`sink_weight` (a row of two keys gives its
#: first key half its weight under any scores)
SINK_MIN_KEYS = 32


def _heads(x: torch.Tensor) -> torch.Tensor:
    """(heads, tokens, dim) float64."""
    return x.detach().double().cpu().transpose(0, 1)


def _pearson_kurtosis(x: torch.Tensor) -> float:
    x = x.flatten()
    if x.numel() < 2:
        return float("nan")
    c = x - x.mean()
    var = (c**2).mean()
    return float((c**4).mean() / var**2) if var > 0 else float("nan")


def channel_norm_ratio(x: torch.Tensor) -> float:
    """max over heads of (largest channel RMS / median channel RMS), the RMS of a channel over tokens."""
    rms = _heads(x).pow(2).mean(dim=1).sqrt()  # (heads, dim)
    med = rms.median(dim=-1).values
    return float((rms.amax(dim=-1) / med.clamp_min(1e-300)).max())


def kurtosis(x: torch.Tensor) -> float:
    """Pearson kurtosis of each head's entries (3 for a Gaussian), mean over heads."""
    h = _heads(x)
    return sum(_pearson_kurtosis(h[i]) for i in range(h.shape[0])) / h.shape[0]


def _token_norms(x: torch.Tensor) -> torch.Tensor:
    return _heads(x).pow(2).sum(dim=-1).sqrt()  # (heads, tokens)


def token_norm_ratio(x: torch.Tensor) -> float:
    """max over heads of (largest token L2 norm / median token L2 norm)."""
    n = _token_norms(x)
    return float((n.amax(dim=-1) / n.median(dim=-1).values.clamp_min(1e-300)).max())


def token_norm_kurtosis(x: torch.Tensor) -> float:
    """Pearson kurtosis of the tokens' L2 norms, per head, mean over heads."""
    n = _token_norms(x)
    return sum(_pearson_kurtosis(n[i]) for i in range(n.shape[0])) / n.shape[0]


def effective_rank(x: torch.Tensor) -> float:
    """exp(entropy of s / sum(s)) of each head's singular values s, mean over heads."""
    h = _heads(x)
    ranks = []
    for i in range(h.shape[0]):
        s = torch.linalg.svdvals(h[i])
        p = s / s.sum().clamp_min(1e-300)
        p = p[p > 0]
        ranks.append(math.exp(float(-(p * p.log()).sum())))
    return sum(ranks) / len(ranks)


def frequency_shares(x: torch.Tensor, bins: int = 4) -> tuple[float, ...]:
    """The share of sum(x^2) in each of ``bins`` equal groups of rotary pairs (i, i + D/2), from the
    highest frequencies (i = 0) to the lowest; white noise gives 1 / bins each."""
    h = _heads(x)
    half = h.shape[-1] // 2
    pair = (h[..., :half].pow(2) + h[..., half : 2 * half].pow(2)).sum(dim=(0, 1))  # (D/2,)
    total = float(pair.sum())
    edges = [round(i * half / bins) for i in range(bins + 1)]
    return tuple(float(pair[a:b].sum()) / total if total > 0 else float("nan") for a, b in zip(edges, edges[1:]))


def token_norm_quantiles(x: torch.Tensor, qs: tuple[float, ...] = (0.9, 0.99, 1.0)) -> tuple[float, ...]:
    """Quantiles of the tokens' L2 norms over their median, per head, mean over heads."""
    n = _token_norms(x)
    rel = n / n.median(dim=-1, keepdim=True).values.clamp_min(1e-300)
    return tuple(float(torch.quantile(rel, q, dim=-1).mean()) for q in qs)


def low_frequency_share(x: torch.Tensor) -> float:
    """The share of sum(x^2) held by the lowest-frequency quarter of rotary pairs (i, i + D/2): pair
    indices i in [3/4 D/2, D/2) (frequency base^(-i / (D/2)) falls with i)."""
    h = _heads(x)
    d = h.shape[-1]
    half = d // 2
    pair = h[..., :half].pow(2) + h[..., half : 2 * half].pow(2)  # (heads, tokens, D/2)
    lo = half - max(1, round(half * LOW_FREQUENCY_FRACTION))
    total = float(pair.sum())
    return float(pair[..., lo:].sum()) / total if total > 0 else float("nan")


def _expand(k: torch.Tensor, heads: int) -> torch.Tensor:
    return k.repeat_interleave(heads // k.shape[1], dim=1)


def _documents(cu_q: torch.Tensor, cu_k: torch.Tensor) -> Iterator[tuple[int, int, int, int]]:
    cq, ck = cu_q.tolist(), cu_k.tolist()
    for i in range(len(cq) - 1):
        yield cq[i], cq[i + 1], ck[i], ck[i + 1]


def _scores(
    q: torch.Tensor, k: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor, scale: float
) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(scores (heads, lq, lk), visible (lq, lk), distance i - j (lq, lk)) of every document with queries
    and keys."""
    k = _expand(k, q.shape[1])
    for a, b, c, e in _documents(cu_q, cu_k):
        lq, lk = b - a, e - c
        if lq == 0 or lk == 0:
            continue
        s = torch.einsum("qhd,khd->hqk", q[a:b].double(), k[c:e].double()) * scale
        i = torch.arange(lq)[:, None]
        j = torch.arange(lk)[None, :]
        yield s, j <= i + (lk - lq), i - j + (lk - lq)


def sink_weight(
    q: torch.Tensor,
    k: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    softmax_scale: float,
    *,
    min_keys: int = SINK_MIN_KEYS,
) -> tuple[float, float]:
    """(mean causal attention weight of each document's first key, mean 1/n of uniform attention) over
    the rows (every head) that see at least ``min_keys`` keys; (nan, nan) when no row does."""
    total, uniform, rows = 0.0, 0.0, 0
    for s, vis, _ in _scores(q, k, cu_seqlens_q, cu_seqlens_k, softmax_scale):
        n = vis.sum(dim=-1)  # visible keys per row
        keep = n >= min_keys
        if not keep.any():
            continue
        p = torch.softmax(s.masked_fill(~vis, -math.inf), dim=-1)
        total += float(p[:, keep, 0].sum())
        uniform += float((1.0 / n[keep].double()).sum()) * s.shape[0]
        rows += int(keep.sum()) * s.shape[0]
    return (total / rows, uniform / rows) if rows else (float("nan"), float("nan"))


def relative_position_r2(
    q: torch.Tensor, k: torch.Tensor, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, softmax_scale: float
) -> float:
    """1 - (residual variance of the visible scores about their mean per distance i - j) / (their variance),
    pooled over documents and heads."""
    vals, dist = [], []
    for s, vis, d in _scores(q, k, cu_seqlens_q, cu_seqlens_k, softmax_scale):
        vals.append(s[:, vis].flatten())
        dist.append(d[vis].expand(s.shape[0], -1).flatten())
    if not vals:
        return float("nan")
    x, dd = torch.cat(vals), torch.cat(dist).long()
    total = float(((x - x.mean()) ** 2).sum())
    if total <= 0:
        return float("nan")
    sums = torch.zeros(int(dd.max()) + 1, dtype=torch.float64).index_add_(0, dd, x)
    counts = torch.zeros_like(sums).index_add_(0, dd, torch.ones_like(x))
    means = sums / counts.clamp_min(1)
    return 1.0 - float(((x - means[dd]) ** 2).sum()) / total


def call_statistics(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dout: torch.Tensor | None,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    softmax_scale: float | None = None,
) -> dict[str, Any]:
    """Every statistic of this module for one call, flat (``chan_q``, ``kurt_v``, ``sink``, ...)."""
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else float(softmax_scale)
    out: dict[str, Any] = {}
    for name, x in (("q", q), ("k", k), ("v", v)):
        out[f"chan_{name}"] = channel_norm_ratio(x)
        out[f"kurt_{name}"] = kurtosis(x)
    for name, x in (("k", k), ("v", v)):
        out[f"tok_{name}"] = token_norm_ratio(x)
        out[f"tokkurt_{name}"] = token_norm_kurtosis(x)
    out["kurt_do"] = kurtosis(dout) if dout is not None else float("nan")
    out["tok_do"] = token_norm_ratio(dout) if dout is not None else float("nan")
    out["rank_q"] = effective_rank(q)
    out["rank_k"] = effective_rank(k)
    out["lowfreq_q"] = low_frequency_share(q)
    out["lowfreq_k"] = low_frequency_share(k)
    for name, x in (("q", q), ("k", k)):
        for i, share in enumerate(frequency_shares(x)):
            out[f"freq{i}_{name}"] = share
    if dout is not None:
        out["do_p90"], out["do_p99"], out["do_max"] = token_norm_quantiles(dout)
    out["sink"], out["sink_uniform"] = sink_weight(q, k, cu_seqlens_q, cu_seqlens_k, scale)
    out["relpos_r2"] = relative_position_r2(q, k, cu_seqlens_q, cu_seqlens_k, scale)
    return out
