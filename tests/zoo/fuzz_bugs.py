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

The bugs are records of the known-bad registry (tags ``zoo``, ``fuzz``); ``zeros_when_empty`` is a
fixture (correct). ``STANDARD`` maps the checks that run only in the standard and full suites to a kernel that must
fail them there (the quick-suite audit in test_properties_every_check.py cannot select them).
"""

from __future__ import annotations

import torch

from flamia_verify.kernels.designs import FLAMIA_MXFP8
from flamia_verify.kernels.emulation import Quant, make_kernel
from flamia_verify.known_bad import KNOWN_BAD, Forwarding, KnownBad, patched_emulation
from flamia_verify.recipes.operands import Operand
from zoo.correct import sdpa_bf16
from zoo.targeted import packed_tiles_skip_head

_flamia = make_kernel(FLAMIA_MXFP8)
_SDPA = "zoo.correct:sdpa_bf16"


def _dkdv_leak(base):
    """A build: the base's design forward, the backward's Q and dO blocks without the diagonal fallback."""
    bwd = base.design.with_quants({Operand.K_SEQ: Quant("input")}, name="dkdv-leak", diagonal_fallback=False)
    return patched_emulation(base.design, bwd)


def _zeros_when_empty(
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, softmax_scale=None, causal=False
):
    if max_seqlen_q == 0 or max_seqlen_k == 0:
        return torch.zeros(q.shape[0], q.shape[1], v.shape[2], dtype=q.dtype, device=q.device)
    return _flamia(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale=softmax_scale, causal=causal
    )


zeros_when_empty = _zeros_when_empty  # a fixture: correct (its gradients are 0 where there is nothing)
zeros_when_empty.recipe = "mxfp8"  # type: ignore[attr-defined]
zeros_when_empty.__doc__ = "flamia-mxfp8 returning torch.zeros for an all-empty batch"


def _detached_when_gap(fn, q, k, v, cq, ck, mq, mk, scale, causal):
    out = fn(q, k, v, cq, ck, mq, mk, softmax_scale=scale, causal=causal)
    lens_k = ck[1:] - ck[:-1]
    return out.detach() if bool((lens_k == 0).any()) else out


def _attends_across_documents(fn, q, k, v, cq, ck, mq, mk, scale, causal):
    whole_q = torch.tensor([0, q.shape[0]], dtype=torch.int32, device=q.device)
    whole_k = torch.tensor([0, k.shape[0]], dtype=torch.int32, device=k.device)
    return fn(q, k, v, whole_q, whole_k, q.shape[0], k.shape[0], softmax_scale=scale, causal=causal)


def _ignores_causal(fn, q, k, v, cq, ck, mq, mk, scale, causal):
    return fn(q, k, v, cq, ck, mq, mk, softmax_scale=scale, causal=False)


#: the fuzzer's planted bugs: the check of `flamia-verify fuzz`'s report each fails (tests/test_fuzz_*.py)
RECORDS = KNOWN_BAD.register(
    KnownBad(
        "dkdv_leak",
        "causal",
        "FLAMIA MXFP8 whose backward blocks Q (in dK) and dO (in dV) across the causal diagonal; dQ and out clean",
        _dkdv_leak,
        catches=("causal.fuzz",),
        suite="fuzz",
        tags=("zoo", "fuzz"),
    ),
    KnownBad(
        "detached_when_gap",
        "interface",
        "flamia-mxfp8 returning a detached output when a document has no keys",
        Forwarding(_detached_when_gap, "detached_when_gap"),
        catches=("interface.fuzz",),
        suite="fuzz",
        tags=("zoo", "fuzz"),
    ),
    KnownBad(
        "attends_across_documents",
        "isolation",
        "torch SDPA over the whole pack as one document (cu_seqlens ignored)",
        Forwarding(_attends_across_documents, "attends_across_documents"),
        base=_SDPA,
        catches=("isolation.fuzz",),
        suite="fuzz",
        tags=("zoo", "fuzz"),
    ),
    KnownBad(
        "ignores_causal",
        "causal",
        "torch SDPA per document, never causal (the causal flag dropped)",
        Forwarding(_ignores_causal, "ignores_causal"),
        base=_SDPA,
        catches=("causal.fuzz",),
        suite="fuzz",
        tags=("zoo", "fuzz"),
    ),
    origin=__file__,
)
FUZZ_BUGS = {r.name: r.kernel(sdpa_bf16 if r.base == _SDPA else None) for r in RECORDS}
dkdv_leak = FUZZ_BUGS["dkdv_leak"]
detached_when_gap = FUZZ_BUGS["detached_when_gap"]
attends_across_documents = FUZZ_BUGS["attends_across_documents"]
ignores_causal = FUZZ_BUGS["ignores_causal"]

#: standard-suite-only check -> a planted kernel that must fail it there
STANDARD = {"isolation.fuzz": packed_tiles_skip_head}

__all__ = [
    "STANDARD",
    "FUZZ_BUGS",
    "RECORDS",
    "attends_across_documents",
    "dkdv_leak",
    "zeros_when_empty",
    "detached_when_gap",
    "ignores_causal",
]
