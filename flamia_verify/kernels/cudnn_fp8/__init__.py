"""cuDNN's FP8 attention (``sdpa_fp8`` / ``sdpa_fp8_backward``) in the varlen calling convention, with
fused Triton quantization around it and per-tensor scaling that can be checked.

* :mod:`.scaling`: the scaling modes (``current``, ``delayed``), the per-role amax/scale state, the
  calibrate-then-freeze rule of a check run, and which mode is causal-safe.
* :mod:`.quantize`: the fused Triton kernels (amax, E4M3 quantization with its amax, dequantization)
  and their PyTorch twins.
* :mod:`.layout`: packed (THD, ragged offsets) and padded (BSHD) buffers.
* :mod:`.kernel`: the kernel function, its autograd Function, the cuDNN graphs, the availability probe
  and the refusals; :mod:`.engines`: the cuDNN engine and a PyTorch model of it (CPU tests).

Nothing here imports cuDNN's frontend (``import cudnn``) or Triton when the package is imported:
:func:`unavailable` says whether the kernel can run here.
"""

from __future__ import annotations

from flamia_verify.kernels.cudnn_fp8.scaling import ScalingMode, ScalingRecipe, ScalingState

__all__ = ["ScalingMode", "ScalingRecipe", "ScalingState"]
