"""Compatibility shims for running the fused kernels under Triton's interpreter (CPU tests).

``patch_interpreter`` installs two fixes, once per process; nothing changes on a GPU, where the
interpreter is not used.

1. Triton 3.6's interpreter turns a scalar used as a loop bound (``range(0, n)`` with a run-time
``n``) into a Python int with ``int(array)``, but it keeps scalars as 1-element arrays, and
NumPy >= 2.4 refuses ``int()`` of an array that is not 0-dimensional ("only 0-dimensional arrays
can be converted to Python scalars"). The shim re-patches ``tensor.__index__`` inside the
interpreter's own patch scope (so it is undone with the rest after each launch) to read the single
element instead.
2. Its bf16 -> fp32 conversion renormalizes subnormal inputs and then clamps the exponent, so a
bf16 value below 2^-126 loaded by a kernel comes out wrong (2^-130 reads as 0), and fp32 -> bf16
mishandles subnormals too (and truncates). The shim converts bf16 to fp32 exactly (the bf16 bits
are the top half of the fp32) and fp32 to bf16 with round-to-nearest-even on the bit pattern.
"""

from __future__ import annotations

import os

__all__ = ["interpreting", "patch_interpreter"]


def interpreting() -> bool:
    """True when Triton runs kernels through its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def patch_interpreter() -> None:
    """Install the ``__index__`` fix once (a no-op when not interpreting or already installed)."""
    if not interpreting():
        return
    import numpy as np
    from triton.runtime import interpreter

    if getattr(interpreter, "_flamia_verify_index_fix", False):
        return
    original = interpreter._patch_lang_tensor

    def _patch_lang_tensor(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))

    interpreter._patch_lang_tensor = _patch_lang_tensor

    # 2. bf16 <-> fp32 on the bit patterns (exact upcast; RNE downcast), subnormals included
    import triton.language as tl

    convert = interpreter._convert_float

    def _convert_float(input, input_dtype, output_dtype, rounding_mode):
        if input_dtype == tl.bfloat16 and output_dtype == tl.float32:
            bits = np.frombuffer(input.tobytes(), dtype=np.uint16).astype(np.uint32) << 16
            return bits.reshape(input.shape)
        if input_dtype == tl.float32 and output_dtype == tl.bfloat16:
            # round to nearest even on the bit pattern (subnormals included; NaN stays NaN)
            bits = np.frombuffer(input.tobytes(), dtype=np.uint32).astype(np.uint64)
            nan = (bits & 0x7FFFFFFF) > 0x7F800000
            rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
            rounded = np.where(nan, ((bits >> 16) | 0x40).astype(np.uint16), rounded)
            return rounded.reshape(input.shape)
        return convert(input, input_dtype, output_dtype, rounding_mode)

    interpreter._convert_float = _convert_float
    interpreter._flamia_verify_index_fix = True
