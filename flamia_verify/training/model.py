"""A small decoder-only transformer whose every attention layer calls a kernel in the varlen convention.

Byte-level (vocabulary 256), pre-norm (RMSNorm), rotary position embeddings with positions that
restart at every packed document, GELU MLP (4x), tied input/output embedding. The attention kernel
is called as ``fn(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, softmax_scale=d^-0.5,
causal=True)`` with q, k, v in BF16; everything else runs under BF16 autocast with fp32 master
weights. Swapping the kernel swaps nothing else: the same seed gives the same initial weights.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["ModelConfig", "TinyLM", "AttentionProbe"]


@dataclass(frozen=True)
class ModelConfig:
    layers: int = 6
    d_model: int = 512
    heads: int = 8
    vocab: int = 256
    rope_base: float = 10000.0

    @property
    def head_dim(self) -> int:
        return self.d_model // self.heads

    def to_dict(self) -> dict:
        return asdict(self)

    def parameters(self) -> int:
        d = self.d_model
        return self.vocab * d + self.layers * (12 * d * d + 2 * d) + d


class AttentionProbe:
    """Collects, during evaluation, how far each attention call of the kernel lands from an exact one
    on the same q, k, v (relative RMSE, summed over calls)."""

    def __init__(self, exact: Callable):
        self.exact = exact
        self.err2 = 0.0
        self.ref2 = 0.0
        self.calls = 0

    def observe(self, out: torch.Tensor, q, k, v, cu, max_len: int, scale: float) -> None:
        ref = self.exact(q, k, v, cu, cu, max_len, max_len, softmax_scale=scale, causal=True)
        ref = (ref[0] if isinstance(ref, tuple) else ref).double()
        self.err2 += float(((out.double() - ref) ** 2).sum())
        self.ref2 += float((ref**2).sum())
        self.calls += 1

    @property
    def rel_rmse(self) -> float:
        return math.sqrt(self.err2 / self.ref2) if self.ref2 > 0 else 0.0


def _rope(x: torch.Tensor, pos: torch.Tensor, base: float) -> torch.Tensor:
    """Rotate (T, H, D) by the positions (T,) (pairs (i, i + D/2))."""
    d = x.shape[-1]
    inv = base ** (-torch.arange(0, d // 2, device=x.device, dtype=torch.float32) / (d // 2))
    ang = pos.float()[:, None] * inv[None, :]
    cos, sin = ang.cos()[:, None, :], ang.sin()[:, None, :]
    x1, x2 = x[..., : d // 2].float(), x[..., d // 2 :].float()
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).to(x.dtype)


class _Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        d = cfg.d_model
        self.cfg = cfg
        self.norm1 = nn.RMSNorm(d)
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.proj = nn.Linear(d, d, bias=False)
        self.norm2 = nn.RMSNorm(d)
        self.fc = nn.Linear(d, 4 * d, bias=False)
        self.out = nn.Linear(4 * d, d, bias=False)

    def forward(self, x, pos, cu, max_len, kernel, probe):
        T = x.shape[0]
        H, D = self.cfg.heads, self.cfg.head_dim
        q, k, v = self.qkv(self.norm1(x)).view(T, 3, H, D).unbind(1)
        q, k = _rope(q, pos, self.cfg.rope_base), _rope(k, pos, self.cfg.rope_base)
        q, k, v = (t.to(torch.bfloat16).contiguous() for t in (q, k, v))
        scale = D**-0.5
        o = kernel(q, k, v, cu, cu, max_len, max_len, softmax_scale=scale, causal=True)
        o = o[0] if isinstance(o, tuple) else o
        if probe is not None:
            probe.observe(o.detach(), q.detach(), k.detach(), v.detach(), cu, max_len, scale)
        x = x + self.proj(o.to(x.dtype).reshape(T, H * D))
        return x + self.out(F.gelu(self.fc(self.norm2(x))))


class TinyLM(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        if cfg.d_model % cfg.heads:
            raise ValueError(f"d_model {cfg.d_model} is not a multiple of heads {cfg.heads}")
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab, cfg.d_model)
        self.blocks = nn.ModuleList(_Block(cfg) for _ in range(cfg.layers))
        self.norm = nn.RMSNorm(cfg.d_model)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        std = 0.02
        for name, p in self.named_parameters():
            if p.dim() == 2:
                # residual projections scaled down with depth (GPT-2's rule)
                s = std / math.sqrt(2 * self.cfg.layers) if name.endswith(("proj.weight", "out.weight")) else std
                nn.init.normal_(p, 0.0, s)

    def forward(
        self,
        tokens: torch.Tensor,
        cu: torch.Tensor,
        max_len: int,
        kernel: Callable | Sequence[Callable],
        probe: AttentionProbe | None = None,
    ) -> torch.Tensor:
        """Logits (T, vocab) of a packed batch. ``kernel``: one function for every attention layer, or
        one per layer (the instances of a stateful kernel's factory: ``kernels.state.layer_kernels``)."""
        kernels = [kernel] * len(self.blocks) if callable(kernel) else list(kernel)
        if len(kernels) != len(self.blocks):
            raise ValueError(f"{len(kernels)} kernels for {len(self.blocks)} attention layers")
        lens = (cu[1:] - cu[:-1]).long()
        starts = torch.repeat_interleave(cu[:-1].long(), lens)
        pos = torch.arange(tokens.shape[0], device=tokens.device) - starts
        x = self.embed(tokens)
        for blk, fn in zip(self.blocks, kernels, strict=True):
            x = blk(x, pos, cu, max_len, fn, probe)
        return F.linear(self.norm(x), self.embed.weight)
