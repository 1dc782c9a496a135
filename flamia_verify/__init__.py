"""flamia-verify: may we train with this low-precision attention kernel?

Runs a candidate attention kernel (FlashAttention varlen calling convention) beside a float64
reference and checks the properties low precision breaks: causal and cross-document leakage,
forward/backward consistency, error bounds, special values, determinism.
"""

from __future__ import annotations

from flamia_verify._version import __version__

__all__ = ["__version__", "check", "fuzz", "load_kernel", "Report"]


def __getattr__(name: str):
    # Lazy: `import flamia_verify` stays cheap and never imports Triton.
    if name == "Report":
        from flamia_verify.results import Report

        return Report
    if name == "load_kernel":
        from flamia_verify.kernels.loader import load_kernel

        return load_kernel
    if name == "check":
        from flamia_verify.api import check

        return check
    if name == "fuzz":
        from flamia_verify.api import fuzz

        return fuzz
    raise AttributeError(f"module 'flamia_verify' has no attribute {name!r}")
