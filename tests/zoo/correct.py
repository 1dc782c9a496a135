"""Correct kernels from outside the project, for the no-false-alarm tests.

``sdpa_bf16`` wraps ``torch.nn.functional.scaled_dot_product_attention`` per document into the varlen
calling convention: GQA by repeating kv heads, the bottom-right causal mask as a boolean mask, and
the convention's zero output (and zero gradient) for query rows that see no key.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["sdpa_bf16"]


def sdpa_bf16(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, softmax_scale=None, causal=False):
    """torch SDPA per document (q: (total_q, H, D); k, v: (total_k, Hk, D)) -> out (total_q, H, D)."""
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    group = q.shape[1] // k.shape[1]
    outs = []
    for b in range(len(cq) - 1):
        qd = q[cq[b] : cq[b + 1]].transpose(0, 1)
        kd = k[ck[b] : ck[b + 1]].transpose(0, 1).repeat_interleave(group, dim=0)
        vd = v[ck[b] : ck[b + 1]].transpose(0, 1).repeat_interleave(group, dim=0)
        lq, lk = qd.shape[1], kd.shape[1]
        if lq == 0:
            continue
        if lk == 0:
            outs.append(torch.zeros_like(q[cq[b] : cq[b + 1]]) + 0 * q[cq[b] : cq[b + 1]])
            continue
        mask = None
        if causal:
            i = torch.arange(lq, device=q.device)[:, None]
            j = torch.arange(lk, device=q.device)[None, :]
            mask = j <= i + (lk - lq)
            seen = mask.any(-1)
            # rows that see nothing: give them key 0 (harmless), then zero their output
            mask = mask | (~seen[:, None] & (j == 0))
        o = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=mask, scale=softmax_scale)
        if causal:
            o = o * seen[None, :, None].to(o.dtype)
        outs.append(o.transpose(0, 1))
    if not outs:
        return q * 0
    return torch.cat(outs)


sdpa_bf16.recipe = "bf16"
