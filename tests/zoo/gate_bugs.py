"""Planted bugs for the gate itself: kernels whose failure a CI job must not read as PASS.

Each kernel is the FLAMIA MXFP8 emulation with one change around it (a record of the known-bad
registry, tags ``zoo``, ``gate``, run around its base by the forwarding wrapper), follows the calling
convention and carries ``recipe``, ``catches`` (the checks that must not pass on it) and a docstring.
They double as command-line specs: ``flamia-verify check --kernel tests/zoo/gate_bugs.py:backward_raises``.

    backward_raises         the forward is right; the backward raises "CUDA error: misaligned
                            address" (a backward that cannot run is not a forward-only kernel)
    smooth_k_inplace        subtracts K's mean over the tokens from k in place before the GEMMs, as
                            SageAttention does (softmax is shift-invariant per query, so the output is
                            right); autograd rejects the write on a leaf input that requires grad
    noncausal_q_inplace     pre-scales q in place (and compensates in the softmax scale), only when
                            causal=False: the output is right, dq (taken for the unscaled q) halves
    backward_q_inplace      the forward is right; the backward writes into q in place
    long_v_inplace          copies v, then adds 1 to one element of the caller's v (output and
                            gradients are right), only on calls of more than 64 tokens
"""

from __future__ import annotations

import torch

from flamia_verify.known_bad import KNOWN_BAD, Forwarding, KnownBad

__all__ = [
    "GATE_BUGS",
    "backward_raises",
    "smooth_k_inplace",
    "noncausal_q_inplace",
    "backward_q_inplace",
    "long_v_inplace",
]


_records: list[KnownBad] = []


def _bug(body, catches: tuple[str, ...], doc: str) -> None:
    name = body.__name__.lstrip("_")
    _records.append(KnownBad(name, "interface", doc, Forwarding(body, name), catches=catches, tags=("zoo", "gate")))


class _RaisingBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, out):
        return out.view_as(out)

    @staticmethod
    def backward(ctx, g):
        raise RuntimeError("CUDA error: misaligned address")


def _backward_raises(fn, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal):
    out = fn(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale=softmax_scale, causal=causal
    )
    return _RaisingBackward.apply(out)


_bug(
    _backward_raises,
    ("interface.backward", "error.dq", "error.dk", "error.dv", "bound.grad"),
    "FLAMIA MXFP8 whose backward raises 'CUDA error: misaligned address'",
)


def _smooth_k_inplace(fn, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal):
    # no torch.no_grad(): the write is part of the graph, as in a kernel that smooths K for its own use
    k.sub_(k.float().mean(dim=0, keepdim=True).to(k.dtype))
    return fn(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale=softmax_scale, causal=causal
    )


_bug(
    _smooth_k_inplace,
    ("interface.inputs_unmodified", "interface.backward"),
    "FLAMIA MXFP8 that subtracts K's mean from k in place (SageAttention's smoothing)",
)


def _noncausal_q_inplace(fn, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal):
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else float(softmax_scale)
    if not causal:
        with torch.no_grad():
            q.mul_(2.0)  # exact in any binary format: the output is unchanged
        scale = scale / 2.0
    return fn(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale=scale, causal=causal)


_bug(
    _noncausal_q_inplace,
    ("interface.inputs_unmodified",),
    "FLAMIA MXFP8 that pre-scales q in place on non-causal calls only",
)


class _ScribbleInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q):
        ctx.save_for_backward(q)
        return q.view_as(q)

    @staticmethod
    def backward(ctx, g):
        (q,) = ctx.saved_tensors
        with torch.no_grad():
            q.mul_(0.5)  # the caller's q changes after the gradients were computed
        return g


def _backward_q_inplace(fn, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal):
    return fn(
        _ScribbleInBackward.apply(q),
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        softmax_scale=softmax_scale,
        causal=causal,
    )


_bug(_backward_q_inplace, ("interface.inputs_unmodified",), "FLAMIA MXFP8 whose backward halves q in place")


def _long_v_inplace(fn, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal):
    v_used = v.clone()  # the kernel works on its own copy (gradients flow back through the clone)...
    if q.shape[0] > 64 and v.numel():
        with torch.no_grad():  # ...and uses the caller's buffer as scratch space
            v.view(-1)[0] += 1.0
    return fn(
        q, k, v_used, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale=softmax_scale, causal=causal
    )


_bug(
    _long_v_inplace,
    ("interface.inputs_unmodified",),
    "FLAMIA MXFP8 that writes into v in place on calls of more than 64 tokens",
)

RECORDS = KNOWN_BAD.register(*_records, origin=__file__)
GATE_BUGS = {r.name: r.kernel() for r in RECORDS}
backward_raises = GATE_BUGS["backward_raises"]
smooth_k_inplace = GATE_BUGS["smooth_k_inplace"]
noncausal_q_inplace = GATE_BUGS["noncausal_q_inplace"]
backward_q_inplace = GATE_BUGS["backward_q_inplace"]
long_v_inplace = GATE_BUGS["long_v_inplace"]
