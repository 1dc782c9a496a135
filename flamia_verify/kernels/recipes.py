"""Recipes: which precision a kernel claims for each GEMM of attention.

A recipe names the number format of every GEMM operand; it selects the error-bound model and the
default thresholds of the checks. Built-in kernels carry their own recipe; a user's kernel names one
with ``--recipe``.

The six GEMMs and the axis each operand is blocked along (its contraction axis):

    forward    S  = Q K^T      Q, K along head_dim
               O  = P V        P along keys,     V along keys (sequence)
    backward   S  = Q K^T      recompute, same operands as the forward
               dP = dO V^T     dO, V along head_dim
               dV = P^T dO     P^T along queries, dO along queries (sequence)
               dQ = dS K       dS along keys,     K along keys (sequence)
               dK = dS^T Q     dS^T along queries, Q along queries (sequence)

The operands blocked along the sequence on the right of a GEMM (V, dO, K, Q in the last four) are
where causal and cross-document leakage come from: one shared scale covers several positions.
"""

from __future__ import annotations

from dataclasses import dataclass

from flamia_verify.errors import ConfigError

__all__ = ["Recipe", "RECIPES", "get_recipe", "GEMMS"]

GEMMS = ("qk", "pv", "qk_recompute", "dp", "dv", "dq", "dk")


@dataclass(frozen=True)
class Recipe:
    name: str
    description: str
    # format of each GEMM's operands, for people and for the bound model
    gemm_formats: dict
    # unit roundoff of the element format used by the forward's GEMM operands (2^-(mantissa bits + 1))
    forward_unit_roundoff: float
    # unit roundoff of the coarsest element format used by any backward GEMM operand
    backward_unit_roundoff: float


_BF16 = "bf16 (fp32 accumulation)"
_MX = "MXFP8 E4M3, 32-blocks, E8M0 scale"
_NV = "NVFP4 E2M1, 16-blocks, UE4M3 scale, fp32 row scale"

# unit roundoffs: bf16 has 7 stored mantissa bits (u = 2^-8), E4M3 has 3 (u = 2^-4), E2M1 has 1 (u = 2^-2)
U_BF16 = 2.0**-8
U_FP16 = 2.0**-11
U_E4M3 = 2.0**-4
U_E2M1 = 2.0**-2

RECIPES: dict[str, Recipe] = {
    "bf16": Recipe(
        "bf16",
        "all GEMM operands BF16, fp32 accumulation (the FlashAttention baseline)",
        {g: _BF16 for g in GEMMS},
        U_BF16,
        U_BF16,
    ),
    "fp8": Recipe(
        "fp8",
        "E4M3 operands with power-of-two or fp32 scales of any granularity (per tensor, row or tile)",
        {g: "E4M3 with scales" for g in GEMMS},
        U_E4M3,
        U_E4M3,
    ),
    "mxfp8": Recipe(
        "mxfp8",
        "MXFP8 on every GEMM: E4M3 elements, 32-blocks along each contraction axis, E8M0 scale by RCEIL",
        {g: _MX for g in GEMMS},
        U_E4M3,
        U_E4M3,
    ),
    "mxfp8-floor": Recipe(
        "mxfp8-floor",
        "MXFP8 with the OCP FLOOR scale rule (the largest elements of a block saturate)",
        {g: _MX + " (FLOOR)" for g in GEMMS},
        U_E4M3,
        U_E4M3,
    ),
    "nvfp4": Recipe(
        "nvfp4",
        "mixed NVFP4/FP8: MXFP8 forward, S recompute and dP; NVFP4 for the P^T, dS and dS^T operands of "
        "dV, dQ, dK (their sequence-blocked partners stay MXFP8)",
        {
            "qk": _MX,
            "pv": _MX,
            "qk_recompute": _MX,
            "dp": _MX,
            "dv": f"P^T {_NV}; dO {_MX}",
            "dq": f"dS {_NV}; K {_MX}",
            "dk": f"dS^T {_NV}; Q {_MX}",
        },
        U_E4M3,
        U_E2M1,
    ),
}


def get_recipe(name: str) -> Recipe:
    try:
        return RECIPES[name]
    except KeyError:
        raise ConfigError(f"unknown recipe {name!r}; choose one of: {', '.join(RECIPES)}") from None
