"""Compatibility shims for running the fused kernels under Triton's interpreter (CPU tests).

Triton 3.6's interpreter turns a scalar used as a loop bound (``range(0, n)`` with a run-time
``n``) into a Python int with ``int(array)``, but it keeps scalars as 1-element arrays, and
NumPy >= 2.4 refuses ``int()`` of an array that is not 0-dimensional ("only 0-dimensional arrays
can be converted to Python scalars"). The shim re-patches ``tensor.__index__`` inside the
interpreter's own patch scope (so it is undone with the rest after each launch) to read the single
element instead. Nothing changes on a GPU, where the interpreter is not used.
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
    interpreter._flamia_verify_index_fix = True
