"""The kernel calling convention (FlashAttention varlen) and its input validation.

    out = fn(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
             softmax_scale=s, causal=c)

q: (total_q, nheads, headdim); k, v: (total_k, nheads_k, headdim) with nheads % nheads_k == 0.
cu_seqlens_*: int32 (batch + 1,), starting at 0, non-decreasing; documents may be empty.
causal is bottom-right aligned: key j of a document is visible to query i iff
j <= i + (Lk - Lq). A query row with no visible key outputs 0 and gets 0 gradient.

    causal, Lq = 3, Lk = 5 (offset Lk - Lq = 2)       x = visible
               k0 k1 k2 k3 k4
          q0 [ x  x  x  .  . ]
          q1 [ x  x  x  x  . ]
          q2 [ x  x  x  x  x ]
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

from flamia_verify.errors import InputError

__all__ = [
    "AttentionKernel",
    "VarlenInputs",
    "validate_varlen_inputs",
    "first_output",
    "seqlens",
    "zeros_in_graph",
    "no_attention",
]


class AttentionKernel(Protocol):
    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cu_seqlens_q: torch.Tensor,
        cu_seqlens_k: torch.Tensor,
        max_seqlen_q: int,
        max_seqlen_k: int,
        *,
        softmax_scale: float,
        causal: bool,
    ) -> torch.Tensor | tuple[Any, ...]: ...


@dataclass(frozen=True)
class VarlenInputs:
    """Validated shape facts of one call."""

    total_q: int
    total_k: int
    nheads: int
    nheads_k: int
    headdim: int
    batch: int


def _check_cu(name: str, cu: torch.Tensor, total: int) -> None:
    if not isinstance(cu, torch.Tensor):
        raise InputError(f"{name} must be a torch.Tensor of int32, got {type(cu).__name__}")
    if cu.dtype != torch.int32:
        raise InputError(f"{name} must have dtype torch.int32, got {cu.dtype}")
    if cu.dim() != 1 or cu.numel() < 1:
        raise InputError(f"{name} must be 1-D with batch + 1 >= 1 entries, got shape {tuple(cu.shape)}")
    vals = cu.detach().cpu().tolist()
    if vals[0] != 0:
        raise InputError(f"{name}[0] must be 0, got {vals[0]}")
    for i in range(1, len(vals)):
        if vals[i] < vals[i - 1]:
            raise InputError(
                f"{name} must be non-decreasing: {name}[{i}] = {vals[i]} < {name}[{i - 1}] = {vals[i - 1]}"
            )
    if vals[-1] != total:
        raise InputError(f"{name}[-1] = {vals[-1]} must equal the number of tokens ({total})")


def validate_varlen_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
) -> VarlenInputs:
    """Check the calling convention; raise :class:`InputError` naming the first problem."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise InputError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 3:
            raise InputError(f"{name} must have shape (tokens, heads, headdim), got {tuple(t.shape)}")
        if not t.is_floating_point():
            raise InputError(f"{name} must be a floating-point tensor, got {t.dtype}")
    if k.shape != v.shape:
        raise InputError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    if q.shape[2] != k.shape[2]:
        raise InputError(f"q and k must have the same headdim, got {q.shape[2]} and {k.shape[2]}")
    if q.device != k.device or q.device != v.device:
        raise InputError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if q.dtype != k.dtype or q.dtype != v.dtype:
        raise InputError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if k.shape[1] == 0 or q.shape[1] % k.shape[1] != 0:
        raise InputError(f"nheads ({q.shape[1]}) must be a multiple of nheads_k ({k.shape[1]})")
    _check_cu("cu_seqlens_q", cu_seqlens_q, q.shape[0])
    _check_cu("cu_seqlens_k", cu_seqlens_k, k.shape[0])
    if cu_seqlens_q.numel() != cu_seqlens_k.numel():
        raise InputError(
            f"cu_seqlens_q and cu_seqlens_k must describe the same number of documents, "
            f"got {cu_seqlens_q.numel() - 1} and {cu_seqlens_k.numel() - 1}"
        )
    lq, lk = seqlens(cu_seqlens_q), seqlens(cu_seqlens_k)
    if max_seqlen_q is not None and lq and max(lq) > max_seqlen_q:
        raise InputError(f"max_seqlen_q = {max_seqlen_q} is smaller than the longest query document ({max(lq)})")
    if max_seqlen_k is not None and lk and max(lk) > max_seqlen_k:
        raise InputError(f"max_seqlen_k = {max_seqlen_k} is smaller than the longest key document ({max(lk)})")
    return VarlenInputs(q.shape[0], k.shape[0], q.shape[1], k.shape[1], q.shape[2], cu_seqlens_q.numel() - 1)


def seqlens(cu: torch.Tensor) -> list[int]:
    """Document lengths from cumulative offsets."""
    vals = cu.detach().cpu().tolist()
    return [b - a for a, b in zip(vals[:-1], vals[1:])]


def zeros_in_graph(x: torch.Tensor) -> torch.Tensor:
    """Zeros shaped like ``x`` that stay in its autograd graph with a zero gradient, whatever ``x``
    holds (``0 * x`` would turn an Inf or NaN input into NaN)."""
    return torch.where(torch.zeros((), dtype=torch.bool, device=x.device), x, x.new_zeros(()))


def no_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The output of a pack in which no query sees a key: zeros shaped like ``q``, in the autograd
    graph of q, k and v with zero gradients (so a backward returns zeros, not None)."""
    return zeros_in_graph(q) + (zeros_in_graph(k).sum() + zeros_in_graph(v).sum())


def first_output(result: object) -> torch.Tensor:
    """A kernel may return out or a tuple whose first item is out."""
    if isinstance(result, (tuple, list)):
        if not result:
            raise InputError("kernel returned an empty tuple; expected out or (out, ...)")
        result = result[0]
    if not isinstance(result, torch.Tensor):
        raise InputError(f"kernel returned {type(result).__name__}; expected a tensor or a tuple starting with one")
    return result
