"""Known-bad kernels for ``train-parity``: what a kernel that breaks causality does to training.

``future_leak``: the FLAMIA MXFP8 emulation with the causal diagonal moved one key to the right in
the forward and the backward (query i also sees key i + 1, the byte it must predict). Built from the
mutation table's edits (``mask.forward+1`` and ``mask.backward+1``), so the emulation itself stays
unpatched. Use it as ``--kernel flamia_verify.training.demo_kernels:future_leak``.
"""

from __future__ import annotations

import functools

__all__ = ["future_leak"]


@functools.lru_cache(maxsize=1)
def _future_leak_kernel():
    from flamia_verify.mutation.build import Mutant, mutant_kernel
    from flamia_verify.mutation.table import by_name

    edits = by_name("mask.forward+1").edits + by_name("mask.backward+1").edits
    return mutant_kernel(Mutant("demo.future-leak", "mask", "forward and backward see one key past the diagonal",
                                edits))


def future_leak(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, softmax_scale=None, causal=False):
    """FLAMIA MXFP8 (emulation, any device) whose causal mask lets query i see key i + 1."""
    return _future_leak_kernel()(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                 softmax_scale=softmax_scale, causal=causal)


future_leak.recipe = "mxfp8"
