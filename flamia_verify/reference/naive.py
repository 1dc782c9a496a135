"""The slow, obviously-correct twin of the reference: dense per document, differentiated by autograd.

Memory is quadratic in the document length (the whole (nheads, Lq, Lk) score matrix), so it
is for tests and small cases only. It shares no code with :mod:`.attention` beyond the
calling-convention validation.
"""

from __future__ import annotations

import math

import torch

from flamia_verify.convention import validate_varlen_inputs

__all__ = ["naive_attention"]


def naive_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    *,
    softmax_scale: float,
    causal: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense float64 attention, differentiable by autograd.

    q: (total_q, nheads, headdim); k, v: (total_k, nheads_k, headdim). Returns out: float64
    (total_q, nheads, headdim) and lse: float64 (total_q, nheads), with out = 0 and
    lse = -inf on rows that see no key, like :func:`attention_forward`.
    """
    validate_varlen_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k)
    group = q.shape[1] // k.shape[1]
    cq = cu_seqlens_q.tolist()
    ck = cu_seqlens_k.tolist()
    outs, lses = [], []
    for i in range(len(cq) - 1):
        qd = q[cq[i] : cq[i + 1]].double()
        kd = k[ck[i] : ck[i + 1]].double().repeat_interleave(group, dim=1)  # query head h -> kv head h // group
        vd = v[ck[i] : ck[i + 1]].double().repeat_interleave(group, dim=1)
        lq, lk = qd.shape[0], kd.shape[0]
        rows = torch.arange(lq, device=q.device).unsqueeze(1)
        cols = torch.arange(lk, device=q.device).unsqueeze(0)
        visible = (cols <= rows + (lk - lq)) if causal else torch.ones(lq, lk, dtype=torch.bool, device=q.device)
        seen = visible.any(dim=1)  # (lq,) rows that see at least one key
        s = softmax_scale * torch.einsum("qhd,khd->hqk", qd, kd)
        s = s.masked_fill(~visible, -math.inf)
        s_safe = torch.where(seen.unsqueeze(1), s, torch.zeros_like(s))  # keep softmax finite on empty rows
        p = torch.where(seen.unsqueeze(1), torch.softmax(s_safe, dim=-1), torch.zeros_like(s))
        outs.append(torch.einsum("hqk,khd->qhd", p, vd))
        lses.append(torch.logsumexp(s, dim=-1).transpose(0, 1))
    out = torch.cat(outs) if outs else q.new_zeros(q.shape, dtype=torch.float64)
    lse = torch.cat(lses) if lses else q.new_zeros(q.shape[:2], dtype=torch.float64)
    return out, lse
