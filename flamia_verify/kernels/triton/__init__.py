"""Fused Triton kernels of the built-in designs (forward and backward), chosen for CUDA inputs.

Triton is imported lazily: importing this package (and ``import flamia_verify``) works without it;
the emulation (:mod:`flamia_verify.kernels.emulation`) stays the specification and the CPU path.

* :func:`with_fused_dispatch` wraps an emulated built-in kernel so that CUDA tensors run the fused
  kernels (when Triton is installed and the design has a fused implementation) and everything else
  runs the emulation.
* ``attention`` holds the kernels; ``quant`` the in-register quantizers (bit-exact twins of
  :mod:`flamia_verify.formats`). The speed table of ``flamia-verify bench`` is :mod:`flamia_verify.bench`.
"""

from __future__ import annotations

import functools
import importlib.util

from flamia_verify.kernels.metadata import kernel_design, mark_builtin

__all__ = ["triton_available", "fused_supported", "fused_applies", "with_fused_dispatch"]


@functools.cache
def triton_available() -> bool:
    """True when the ``triton`` package can be imported (it is never imported here)."""
    return importlib.util.find_spec("triton") is not None


def fused_supported(design) -> bool:
    """Whether ``design`` has a fused kernel (decided from the design alone, without Triton)."""
    from flamia_verify.kernels.triton.config import unsupported_reason

    return unsupported_reason(design) is None


def with_fused_dispatch(emulated):
    """Wrap an emulated kernel (``emulation.make_kernel``): CUDA bf16/fp16 inputs with a power-of-two
    head_dim (``fused_applies``) run the fused Triton kernels of its design, everything else the
    emulation. Returns ``emulated`` unchanged when the design has no fused implementation."""
    design = kernel_design(emulated)
    if design is None or not fused_supported(design):
        return emulated

    def kernel(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, softmax_scale=None, causal=False):
        use_fused = fused_applies(q, design)
        kernel.paths["fused Triton" if use_fused else "PyTorch emulation"] += 1  # type: ignore[attr-defined]  # function attributes
        if use_fused:
            from flamia_verify.kernels.triton.attention import fused_attention

            return fused_attention(
                design,
                q,
                k,
                v,
                cu_seqlens_q,
                cu_seqlens_k,
                max_seqlen_q,
                max_seqlen_k,
                softmax_scale=softmax_scale,
                causal=causal,
            )
        return emulated(
            q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale=softmax_scale, causal=causal
        )

    kernel.__name__ = emulated.__name__
    kernel.__qualname__ = emulated.__qualname__
    kernel.__doc__ = f"{design.name} (fused Triton on CUDA, emulation elsewhere): {design.description}"
    return mark_builtin(kernel, design, emulated=emulated)  # calls per implementation: kernels.metadata


def fused_applies(q, design=None) -> bool:
    """Whether the fused kernels take these inputs: CUDA, bf16 or fp16, head_dim a power of two from
    32 to 256, Triton installed; with ``design`` (as the dispatch passes it), also head_dim up to that
    design's ``config.head_dim_limit`` (128 for ``fp8``). Anything else runs the emulation (the same
    design, slower)."""
    from flamia_verify.kernels.triton.config import config_for, head_dim_supported

    cfg = None if design is None else config_for(design)
    return (
        bool(q.is_cuda) and q.dtype in _FUSED_DTYPES() and head_dim_supported(q.shape[-1], cfg) and triton_available()
    )


def _FUSED_DTYPES():
    import torch

    return (torch.bfloat16, torch.float16)
