"""The derived tolerances the default thresholds are built from (docs/checks.md gives each derivation):

* the first-order RMS error model :func:`predicted_rel_rmse` (each rounded GEMM operand contributes a
  relative error of RMS u/sqrt(3), independent of the others) and the factor the error thresholds
  allow over it (:data:`ERROR_MODEL_FACTOR`);
* the worst-case normalization mismatch of the BF16 baseline (P rounded to the input dtype while the
  row sum is fp32: |sum_j A_ij - 1| <= u_in): :func:`conservation_tolerance`;
* the z-score of the bias statistics' null distribution (:data:`BIAS_Z`).

The check modules read them here; :mod:`flamia_verify.properties.thresholds` (above the catalog of
checks) assembles every check's defaults and validates a user's overrides.
"""

from __future__ import annotations

import math

import torch

from flamia_verify.recipes import Recipe
from flamia_verify.recipes.operands import OPERANDS_REACHING

__all__ = ["ERROR_MODEL_FACTOR", "BIAS_Z", "input_unit_roundoff", "predicted_rel_rmse", "conservation_tolerance"]

#: The error thresholds allow twice the first-order RMS model. The model ignores the amplification
#: of score errors by the softmax (e^dS - 1 > dS) and correlations between rounding errors; the
#: measured errors of the correct built-in kernels sit at 0.45-0.95 of the model (docs/checks.md).
ERROR_MODEL_FACTOR = 2.0

#: Bias statistics are z-scores under the null hypothesis of unbiased rounding; 6 standard
#: deviations: a false alarm probability below 2e-9 per statistic for a Gaussian null.
BIAS_Z = 6.0


def input_unit_roundoff(dtype: torch.dtype) -> float:
    return {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11, torch.float32: 2.0**-24}.get(dtype, 2.0**-53)


def predicted_rel_rmse(recipe: Recipe, dtype: torch.dtype, tensor: str) -> float:
    """First-order RMS relative error of ``tensor`` (out, dq, dk, dv): sqrt(sum_x u_x^2 / 3)."""
    model = recipe.bound_model(dtype)
    total = sum(model[op].u ** 2 for op in OPERANDS_REACHING[tensor])
    return math.sqrt(total / 3.0)


def conservation_tolerance(dtype: torch.dtype) -> float:
    """|sum_j A_ij - 1| <= u_in for the BF16 baseline (P rounded, fp32 row sum), plus the rounding of
    the output to the input dtype: 2 u_in + u_in^2."""
    u = input_unit_roundoff(dtype)
    return 2 * u + u * u
