"""cuDNN's FP8 attention (``sdpa_fp8`` / ``sdpa_fp8_backward``) in the varlen calling convention, with
fused Triton quantization around it and per-tensor scaling that can be checked.

* :mod:`.scaling`: the scaling modes (``current``, ``delayed``), the per-role amax/scale state (its
  snapshots and its description for the reports), the calibrate-then-freeze option, and which mode is
  causal-safe.
* :mod:`.quantize`: the fused Triton kernels (amax, E4M3 quantization with its amax, dequantization)
  and their PyTorch twins.
* :mod:`.layout`: packed (THD, ragged offsets) and padded (BSHD) buffers.
* :mod:`.kernel`: the kernel function, its autograd Function, the availability probe and the
  refusals; :mod:`.cudnn_graphs`: cuDNN's graphs; :mod:`.engine`: the interface between the two and a
  PyTorch model of cuDNN's FP8 attention (CPU tests).

Importing this package imports neither cuDNN's frontend (``import cudnn``) nor Triton:
:func:`unavailable` says whether the kernel can run here.
"""

from __future__ import annotations

from flamia_verify.kernels.cudnn_fp8.engine import CudnnFp8Refused, EmulatedEngine
from flamia_verify.kernels.cudnn_fp8.kernel import (
    current_kernel,
    default_kernel,
    frozen_kernel,
    make_kernel,
    unavailable,
)
from flamia_verify.kernels.cudnn_fp8.scaling import ScalingMode, ScalingRecipe, ScalingState

__all__ = [
    "CudnnFp8Refused",
    "EmulatedEngine",
    "ScalingMode",
    "ScalingRecipe",
    "ScalingState",
    "current_kernel",
    "default_kernel",
    "frozen_kernel",
    "make_kernel",
    "unavailable",
]
