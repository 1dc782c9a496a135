"""Float64 attention reference: forward (O, LSE) and analytic backward; varlen, causal, GQA; chunked.

``reference_attention`` follows the kernel calling convention (see
:mod:`flamia_verify.convention`); ``attention_forward`` and ``attention_backward``
are the two halves it is built from; ``naive_attention`` is the slow, obviously-correct
twin (dense per document, autograd) that the tests hold the fast path to.
"""

from __future__ import annotations

from flamia_verify.reference.attention import (
    SCORE_BLOCK_BYTES,
    ReferenceAttention,
    attention_backward,
    attention_forward,
    query_chunk_size,
    reference_attention,
    visible_mask,
)
from flamia_verify.reference.naive import naive_attention

__all__ = [
    "SCORE_BLOCK_BYTES",
    "ReferenceAttention",
    "attention_backward",
    "attention_forward",
    "naive_attention",
    "query_chunk_size",
    "reference_attention",
    "visible_mask",
]
