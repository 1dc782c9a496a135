"""Recipes: which precision a kernel claims for each GEMM of attention.

A recipe names the number format of every GEMM operand (:class:`~flamia_verify.recipes.operands.Operand`
lists them with their GEMM and contraction axis); it carries the error-bound model of those formats
(:meth:`Recipe.bound_model`), which the checks derive their bounds and default thresholds from.
Built-in kernels carry their own recipe; a user's kernel names one with ``--recipe``.

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

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

from flamia_verify.errors import ConfigError
from flamia_verify.formats import ScaleRule
from flamia_verify.formats.constants import FP32_MIN_NORMAL
from flamia_verify.recipes.accumulator import MMA_SLICE, MMA_U_SLICE
from flamia_verify.recipes.bounds import (
    ALPHA_BF16,
    ALPHA_E8M0,
    E2M1_ETA,
    E4M3_ETA,
    E4M3_UNSCALED_ETA,
    EXACT,
    NVFP4_ALPHA,
    NVFP4_GLOBAL_ETA,
    U_BF16,
    U_E2M1,
    U_E4M3,
    U_E4M3_FLOOR,
    Admission,
    OperandModel,
    RecipeBoundModel,
    fp16_probabilities,
    input_rounding,
    output_rounding,
)
from flamia_verify.recipes.operands import Operand

__all__ = ["Recipe", "RECIPES", "get_recipe"]


@dataclass(frozen=True)
class Recipe:
    """A precision recipe: its name, a description for people, and the rounding model of each GEMM
    operand under its formats (``operand_models(dtype)``: {Operand: OperandModel} for inputs of
    ``dtype``)."""

    name: str
    description: str
    operand_models: Callable[[torch.dtype], Mapping[Operand, OperandModel]] = field(repr=False, compare=False)

    #: the GEMMs' accumulator (:class:`~flamia_verify.recipes.bounds.RecipeBoundModel`): 0 for fp32,
    #: else the slice length and the relative error of one slice's sum
    acc_slice: int = 0
    u_slice: float = 0.0
    #: second formats the recipe admits for some operands, for inputs of a dtype (already part of
    #: ``operand_models``; :class:`~flamia_verify.recipes.bounds.Admission`)
    admissions: Callable[[torch.dtype], tuple[Admission, ...]] = field(
        default=lambda dtype: (), repr=False, compare=False
    )
    #: the E8M0 scale rule of the recipe's MXFP8 operands (those whose rounding it fixes completely:
    #: ``OperandModel.mx_block``)
    scale_rule: ScaleRule = ScaleRule.RCEIL

    def bound_model(self, dtype: torch.dtype) -> RecipeBoundModel:
        """The rounding model of every GEMM operand and of the outputs, for inputs of ``dtype``."""
        u_out, alpha_out = output_rounding(dtype)
        return RecipeBoundModel(
            self.name,
            self.operand_models(dtype),
            u_out=u_out,
            alpha_out=alpha_out,
            acc_slice=self.acc_slice,
            u_slice=self.u_slice,
            admissions=self.admissions(dtype),
            ftz=FP32_MIN_NORMAL,
        )


def _bf16_nominal(dtype: torch.dtype) -> tuple[OperandModel, OperandModel]:
    """(inputs, computed) of BF16 GEMMs: on BF16/FP16 inputs only the computed operands (P, P^T, dS,
    dS^T) are rounded (to the input dtype); on fp32 inputs every operand is rounded to BF16."""
    if dtype in (torch.bfloat16, torch.float16):
        return EXACT, input_rounding(dtype)
    bf16 = OperandModel(U_BF16, alpha=ALPHA_BF16)
    return bf16, bf16


def _bf16(dtype: torch.dtype) -> dict[Operand, OperandModel]:
    """BF16 GEMMs (:func:`_bf16_nominal`), with the probabilities P and P^T in BF16 or FP16
    (:func:`~flamia_verify.recipes.bounds.fp16_probabilities`)."""
    inputs, computed = _bf16_nominal(dtype)
    probs, _ = fp16_probabilities(computed)
    return {op: (probs if op in (Operand.P, Operand.PT) else computed) if op.computed else inputs for op in Operand}


def _bf16_admissions(dtype: torch.dtype) -> tuple[Admission, ...]:
    _, admission = fp16_probabilities(_bf16_nominal(dtype)[1])
    return (admission,) if admission else ()


def _fp8(dtype: torch.dtype) -> dict[Operand, OperandModel]:
    """E4M3 with scales of any granularity: a scale may cover the whole tensor, and P (P^T) may be
    cast without a scale."""
    scaled = OperandModel(U_E4M3, 0.0, E4M3_ETA, alpha=ALPHA_E8M0)
    p = OperandModel(U_E4M3, E4M3_ETA, E4M3_UNSCALED_ETA, alpha=ALPHA_E8M0)
    return {op: p if op in (Operand.P, Operand.PT) else scaled for op in Operand}


def _mx(floor: bool) -> tuple[OperandModel, OperandModel]:
    """(inputs, computed) MXFP8 operand models: E4M3 32-blocks with an E8M0 scale by RCEIL, or by
    FLOOR (whose saturation doubles u); q, k, v and dO on the E4M3 grid near their line maximum stay
    exact (significands up to 1.875, 1.75 under FLOOR)."""
    u = U_E4M3_FLOOR if floor else U_E4M3
    computed = OperandModel(u, E4M3_ETA, alpha=ALPHA_E8M0, mx_block=True)
    inputs = OperandModel(u, E4M3_ETA, 0.0, 1.75 if floor else 1.875, alpha=ALPHA_E8M0, mx_block=True)
    return inputs, computed


def _mxfp8(floor: bool):
    def models(dtype: torch.dtype) -> dict[Operand, OperandModel]:
        inputs, computed = _mx(floor)
        return {op: computed if op.computed else inputs for op in Operand}

    return models


def _nvfp4(dtype: torch.dtype) -> dict[Operand, OperandModel]:
    """MXFP8 everywhere but P^T, dS and dS^T (the left operands of dV, dQ, dK): NVFP4 with its
    row-local fp32 scale."""
    inputs, computed = _mx(False)
    nv = OperandModel(U_E2M1, E2M1_ETA, NVFP4_GLOBAL_ETA, alpha=NVFP4_ALPHA)
    return {op: inputs if not op.computed else computed if op is Operand.P else nv for op in Operand}


RECIPES: dict[str, Recipe] = {
    "bf16": Recipe(
        "bf16",
        "all GEMM operands BF16 (P and P^T may be FP16), fp32 accumulation (the FlashAttention baseline)",
        _bf16,
        admissions=_bf16_admissions,
    ),
    "fp8": Recipe(
        "fp8",
        "E4M3 operands with power-of-two or fp32 scales of any granularity (per tensor, row or tile)",
        _fp8,
    ),
    "fp8-mma": Recipe(
        "fp8-mma",
        "E4M3 operands as in fp8; any GEMM may run on Hopper's E4M3 tensor cores: 32-long slices whose "
        "sums keep 13 bits below each slice's largest product, added in fp32",
        _fp8,
        acc_slice=MMA_SLICE,
        u_slice=MMA_U_SLICE,
    ),
    "mxfp8": Recipe(
        "mxfp8",
        "MXFP8 on every GEMM: E4M3 elements, 32-blocks along each contraction axis, E8M0 scale by RCEIL",
        _mxfp8(floor=False),
    ),
    "mxfp8-floor": Recipe(
        "mxfp8-floor",
        "MXFP8 with the OCP FLOOR scale rule (the largest elements of a block saturate)",
        _mxfp8(floor=True),
        scale_rule=ScaleRule.FLOOR,
    ),
    "nvfp4": Recipe(
        "nvfp4",
        "mixed NVFP4/FP8: MXFP8 forward, S recompute and dP; NVFP4 for the P^T, dS and dS^T operands of "
        "dV, dQ, dK (their sequence-blocked partners stay MXFP8)",
        _nvfp4,
    ),
}


def get_recipe(name: str | Recipe) -> Recipe:
    """The recipe of a name (``--recipe``, a kernel's ``recipe`` attribute, a reproducer's); a
    :class:`Recipe` passes through. Raises ConfigError for an unknown name."""
    if isinstance(name, Recipe):
        return name
    try:
        return RECIPES[name]
    except KeyError:
        raise ConfigError(f"unknown recipe {name!r}; choose one of: {', '.join(RECIPES)}") from None
