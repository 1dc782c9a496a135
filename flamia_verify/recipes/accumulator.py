"""The GEMM accumulators a recipe may claim: fp32 (every recipe) or Hopper's E4M3 tensor cores (``fp8-mma``).

Hopper's E4M3 tensor-core MMA as the emulation (:func:`flamia_verify.kernels.emulation.mma_gemm`) models
it: the contraction runs in slices of ``MMA_SLICE`` (one instruction's K), each slice's result is added
to an fp32 sum (the kernels promote after every instruction); within a slice the products are consumed
in groups of ``MMA_GROUP``, and every product of a group is cut toward zero to a multiple of
2^(e - MMA_FRACTION_BITS), e the exponent of the group's largest |product|
(experiments/probe_fp8_mma.py fits these to the hardware; docs/kernels.md, "fp8-mma").
"""

from __future__ import annotations

__all__ = ["MMA_SLICE", "MMA_GROUP", "MMA_FRACTION_BITS", "MMA_U_SLICE"]

MMA_SLICE = 32
MMA_GROUP = 32
MMA_FRACTION_BITS = 13

#: One slice of the E4M3 MMA: every product of a group of MMA_GROUP is cut toward zero by less than
#: 2^(e - F) <= 2^-F of the group's largest |product|, so the group's sum moves by less than
#: MMA_GROUP 2^-F of its sum of |products|, and so does the slice's
MMA_U_SLICE = MMA_GROUP * 2.0**-MMA_FRACTION_BITS
