"""PyTorch references of the E4M3 codes that the fused fp8-mma kernels' pre-pass writes (test-only).

``round_operand_codes`` (:mod:`flamia_verify.kernels.triton.attention`) rounds an operand and writes
it, in one Triton pass, as E4M3 codes and power-of-two scales for the E4M3 tensor cores. The
functions here compute the same codes, in the same layouts and storage dtype, from the rounded
operand, with plain tensor operations: tests/test_fp8_mma.py holds the pre-pass to them bit for bit
and checks that codes times scales give back the operand exactly. Triton is imported only when one
of them is called (the storage dtype and the documents' first blocks are the pre-pass's own).
"""

from __future__ import annotations

import torch

from flamia_verify.formats.constants import E4M3_MAX

__all__ = ["e4m3_block_codes_reference", "e4m3_row_codes_reference"]


def _pow2_scale(amax: torch.Tensor) -> torch.Tensor:
    """A power of two t per amax with amax / t <= 448: 2^(floor(log2 amax) - 8), doubled where that
    leaves amax / t above 448 (1 where amax is 0). For an operand of E4M3 values times a
    power-of-two scale s (RCEIL: amax <= 448 s), t <= s, so x / t = (x / s) 2^j, j >= 0, is again an
    E4M3 value: the codes below are exact."""
    _, ex = torch.frexp(amax)  # amax = m 2^ex, m in [0.5, 1): floor(log2 amax) = ex - 1
    t = torch.ldexp(torch.ones_like(amax), ex - 9)
    t = torch.where(amax > E4M3_MAX * t, t * 2, t)
    return torch.where(amax > 0, t, torch.ones_like(t))


def e4m3_row_codes_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A head_dim-rounded operand (total, heads, head_dim) of E4M3 values times a row scale, as
    (codes with x's layout, scales (heads, total) fp32) with codes * scale == x exactly."""
    from flamia_verify.kernels.triton.prepass import _code_dtype

    xf = x.float()
    t = _pow2_scale(xf.abs().amax(-1))
    return (xf / t[..., None]).to(_code_dtype()), t.T.contiguous()


def e4m3_block_codes_reference(x: torch.Tensor, cu: torch.Tensor, block: int):
    """A sequence-rounded operand (total, heads, head_dim) of E4M3 values times a scale per block of
    ``block`` tokens (restarting at each document of ``cu``) and channel, as (codes transposed to
    (heads, head_dim, total) so that they are the K-major B operand of P V, scales (blocks, heads,
    head_dim) fp32, each document's first block (batch,) int32)."""
    from flamia_verify.kernels.triton.prepass import _code_dtype, _first_blocks

    total, heads, dim = x.shape
    cu64 = cu.to(torch.int64)
    first, bound = _first_blocks(cu, block, total)
    tok = torch.arange(total, device=x.device)
    doc = torch.searchsorted(cu64[1:].contiguous(), tok, right=True).clamp_max(max(cu.numel() - 2, 0))
    ids = first[doc] + (tok - cu64[doc]) // block
    xf = x.float()
    amax = torch.zeros((bound, heads, dim), dtype=torch.float32, device=x.device)
    amax.scatter_reduce_(0, ids[:, None, None].expand(total, heads, dim), xf.abs(), "amax")
    t = _pow2_scale(amax)
    codes = (xf / t[ids]).to(_code_dtype())
    return codes.permute(1, 2, 0).contiguous(), t, first.to(torch.int32)
