"""Planted bugs for the fuzzer and the standard suite's fuzz pass (``isolation.fuzz``).

    dkdv_leak           FLAMIA MXFP8 with a clean forward and dQ; the backward's Q blocks in
                        dK = dS^T Q and dO blocks in dV = P^T dO straddle the causal diagonal (K in
                        dQ = dS K is kept in BF16, so dQ does not leak): only dK and dV of later keys
                        change when earlier queries change
    zeros_when_empty    correct (flamia-mxfp8), but a batch whose documents are all empty gets
                        ``torch.zeros``: an output without grad_fn where there is nothing to
                        differentiate (not a bug: the gradients are 0)
    detached_when_gap   flamia-mxfp8, but any document without keys makes the kernel return a detached
                        output: every gradient of the batch is lost
    attends_across_documents  torch SDPA (bf16) over the whole pack as one document: cu_seqlens are
                        ignored, every query attends to the keys of every document (a cross-document leak)
    ignores_causal      torch SDPA (bf16) per document, always without the causal mask (the causal flag
                        is dropped on the way in)

``STANDARD`` maps the checks that run only in the standard and full suites to a kernel that must
fail them there (the quick-suite audit in test_properties_every_check.py cannot select them).
"""

from __future__ import annotations

import torch

from flamia_verify.kernels.designs import FLAMIA_MXFP8
from flamia_verify.kernels.emulation import Quant, make_kernel
from flamia_verify.recipes.operands import Operand
from zoo.correct import sdpa_bf16
from zoo.kernels import _split_kernel
from zoo.targeted import packed_tiles_skip_head

_flamia = make_kernel(FLAMIA_MXFP8)


def _tag(fn, recipe: str, doc: str):
    fn.recipe = recipe
    fn.__doc__ = doc
    return fn


dkdv_leak = _tag(
    _split_kernel(
        FLAMIA_MXFP8,
        FLAMIA_MXFP8.with_quants({Operand.K_SEQ: Quant("input")}, name="dkdv-leak", diagonal_fallback=False),
    ),
    "mxfp8",
    "FLAMIA MXFP8 whose backward blocks Q (in dK) and dO (in dV) across the causal diagonal; dQ and out clean",
)


def _zeros_when_empty(
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, softmax_scale=None, causal=False
):
    if max_seqlen_q == 0 or max_seqlen_k == 0:
        return torch.zeros(q.shape[0], q.shape[1], v.shape[2], dtype=q.dtype, device=q.device)
    return _flamia(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale=softmax_scale, causal=causal
    )


zeros_when_empty = _tag(_zeros_when_empty, "mxfp8", "flamia-mxfp8 returning torch.zeros for an all-empty batch")


def _detached_when_gap(
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, softmax_scale=None, causal=False
):
    out = _flamia(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale=softmax_scale, causal=causal
    )
    lens_k = cu_seqlens_k[1:] - cu_seqlens_k[:-1]
    return out.detach() if bool((lens_k == 0).any()) else out


detached_when_gap = _tag(
    _detached_when_gap, "mxfp8", "flamia-mxfp8 returning a detached output when a document has no keys"
)


def _attends_across_documents(
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, softmax_scale=None, causal=False
):
    whole_q = torch.tensor([0, q.shape[0]], dtype=torch.int32, device=q.device)
    whole_k = torch.tensor([0, k.shape[0]], dtype=torch.int32, device=k.device)
    return sdpa_bf16(q, k, v, whole_q, whole_k, q.shape[0], k.shape[0], softmax_scale=softmax_scale, causal=causal)


attends_across_documents = _tag(
    _attends_across_documents, "bf16", "torch SDPA over the whole pack as one document (cu_seqlens ignored)"
)


def _ignores_causal(
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, softmax_scale=None, causal=False
):
    return sdpa_bf16(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale=softmax_scale, causal=False
    )


ignores_causal = _tag(_ignores_causal, "bf16", "torch SDPA per document, never causal (the causal flag dropped)")

#: standard-suite-only check -> a planted kernel that must fail it there
STANDARD = {"isolation.fuzz": packed_tiles_skip_head}

__all__ = [
    "STANDARD",
    "attends_across_documents",
    "dkdv_leak",
    "zeros_when_empty",
    "detached_when_gap",
    "ignores_causal",
]
