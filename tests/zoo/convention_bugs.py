"""Kernels with one defect each in a part of the calling convention or an invariance that the
contiguous, scale-passing, few-document calls of the older checks never reach. Each is a record of
the known-bad registry (tags ``zoo``, ``convention``) whose body runs around its base, the emulated
flamia-mxfp8 kernel (or torch SDPA from zoo/correct.py), through the registry's forwarding wrapper and
changes one thing; the tests show that the check named in ``catches`` fails on it.

Four are the wrapper family's records (``flamia_verify/known_bad/wrapper.py``, the bugs ``flamia-verify
mutate`` runs), held here to the checks they name: ``scale_none_as_one`` is
``wrapper.defaults.scale-none-as-1``, ``assumes_contiguous`` ``wrapper.stride.storage-as-contiguous``,
``nan_to_num_output`` ``wrapper.nan.out-to-num`` and ``lse_in_log2`` ``wrapper.lse.log2``, each on its
record's own base.
"""

from __future__ import annotations

import math

import torch
from torch.autograd.function import once_differentiable

from flamia_verify.kernels.emulation import backward_pass, forward_pass
from flamia_verify.known_bad import KNOWN_BAD, Forwarding, KnownBad
from zoo.correct import sdpa_bf16

__all__ = ["CONVENTION_BUGS", "RECORDS", "differentiable_lse"]

#: the tags of this file's records
ZOO = ("zoo", "convention")
_SDPA = "zoo.correct:sdpa_bf16"
_records: list[KnownBad] = []


def _bug(catches: str, recipe: str | None = None, base: str = "flamia-mxfp8", **claims):
    """Register the decorated body (``body(base_kernel, q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale,
    causal)``, run around the base by the forwarding wrapper) as a record named after it (recipe:
    the base's, unless given)."""

    def deco(body):
        name = body.__name__.lstrip("_")
        why = " ".join((body.__doc__ or "").split())
        _records.append(
            KnownBad(
                name,
                "convention",
                why,
                Forwarding(body, name),
                base=base,
                recipe=recipe,
                catches=(catches,),
                tags=ZOO,
                **claims,
            )
        )
        return body

    return deco


@_bug("interface.arguments")
def _fp16_through_bf16(fn, q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale, causal):
    """fp16 inputs scaled by 2^-14 on the way in (a stale fp16 loss-scale folded into the cast), not back."""
    if q.dtype == torch.float16:
        q = q * 2.0**-7
        k = k * 2.0**-7
    return fn(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=softmax_scale, causal=causal)


@_bug("isolation.layout_bitwise")
def _split_by_max_seqlen(fn, q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale, causal):
    """Above max_seqlen_k = 1024 a split-KV path whose partial results are added in bf16 (a dispatch on
    the max_seqlen argument, not on the data): the output moves by about one bf16 ulp, within the
    recipe's bound and error model (isolation.layout passes it), but a document's bits depend on the
    longest neighbour and on max_seqlen (a reproducibility finding)."""
    out = fn(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=softmax_scale, causal=causal)
    if max_k > 1024:
        out = (out.float() * (1 + 2.0**-8)).to(out.dtype)
    return out


@_bug("isolation.layout")
def _split_kv_drops_the_tail(fn, q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale, causal):
    """Above max_seqlen_k = 1024 a split-KV path of 1024-key splits whose last, partial split is never
    reduced: a document longer than 1024 keys loses its keys past 1024 (a dispatch on the max_seqlen
    argument; only a pack with such a document, or a neighbour raising max_seqlen, reaches it)."""
    if max_k <= 1024:
        return fn(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=softmax_scale, causal=causal)
    ck = cu_k.tolist()
    keep = torch.cat([torch.arange(ck[b], min(ck[b + 1], ck[b] + 1024)) for b in range(len(ck) - 1)])
    lens = torch.tensor([min(ck[b + 1] - ck[b], 1024) for b in range(len(ck) - 1)])
    cu_kept = torch.cat([torch.zeros(1, dtype=torch.int32), lens.cumsum(0).to(torch.int32)])
    return fn(q, k[keep], v[keep], cu_q, cu_kept, max_q, min(max_k, 1024), softmax_scale=softmax_scale, causal=causal)


@_bug("isolation.heads_bitwise")
def _second_launch_for_upper_heads(fn, q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale, causal):
    """The query heads run in two launches split at H // 2; the second one merges its partial results in
    bf16 (about one ulp of the output away from the first launch's arithmetic): within the recipe, but a
    head's bits depend on where it sits in the head order (reproducibility)."""
    out = fn(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=softmax_scale, causal=causal)
    upper = torch.arange(out.shape[1]) >= out.shape[1] // 2
    scale = torch.where(upper, 1 + 2.0**-8, 1.0).to(torch.float32)[None, :, None]
    return (out.float() * scale).to(out.dtype)


@_bug(
    "special.degenerate",
    where="softmax_scale=0.0",
    source="Wrappers that test an optional float with `or` instead of `is None`.",
)
def _zero_scale_is_default(fn, q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale, causal):
    """softmax_scale read as ``softmax_scale or headdim**-0.5``: 0.0 is falsy, so a zero scale (uniform
    weights, an input no training run passes) gets the default scale."""
    scale = softmax_scale or q.shape[-1] ** -0.5
    return fn(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=scale, causal=causal)


@_bug("isolation.heads")
def _amax_over_heads(fn, q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale, causal):
    """q pre-rounded to E4M3 with one fp32 scale amax/448 over every head of the tensor (a per-tensor
    scale where the design has one per head)."""
    from flamia_verify.formats import E4M3, round_to_format

    s = float(q.detach().abs().max()) / 448.0
    qq = round_to_format(q.float() / s, E4M3, saturate=True) * s
    q = q + (qq.to(q.dtype) - q).detach()
    return fn(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=softmax_scale, causal=causal)


@_bug("bound.shapes")
def _gqa_modulo(fn, q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale, causal):
    """Query head h reads kv head (h // group) for groups of 1, 2 and 4, and h % heads_k otherwise (an
    index written for power-of-two groups)."""
    H, Hk = q.shape[1], k.shape[1]
    g = H // Hk
    if g in (1, 2, 4):
        return fn(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=softmax_scale, causal=causal)
    idx = torch.tensor([h % Hk for h in range(H)])
    return fn(q, k[:, idx], v[:, idx], cu_q, cu_k, max_q, max_k, softmax_scale=softmax_scale, causal=causal)


class _NoGradOfQ(torch.autograd.Function):
    """``out``'s values, and a gradient of zeros for q (the backward pass that computes dQ never ran)."""

    @staticmethod
    def forward(ctx, q, out):
        return out.clone()

    @staticmethod
    def backward(ctx, g):
        return torch.zeros((g.shape[0],) + g.shape[1:2] + g.shape[2:], dtype=g.dtype), None


@_bug("interface.arguments")
def _dq_in_the_dkdv_pass(fn, q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale, causal):
    """The backward accumulates dQ inside the dK/dV pass over key tiles (FlashAttention-2's single
    loop) and skips that pass when neither k nor v requires grad: with frozen keys and values (a
    cache of them) dQ arrives as zeros."""
    if k.requires_grad or v.requires_grad or not q.requires_grad:
        return fn(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=softmax_scale, causal=causal)
    with torch.no_grad():
        out = fn(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=softmax_scale, causal=causal)
    return _NoGradOfQ.apply(q, out)


class _InnerGraph(torch.autograd.Function):
    """The emulated flamia-mxfp8 kernel behind an autograd.Function whose backward differentiates an
    inner graph of the forward (bitwise the plain kernel's gradients), with one defect by ``bug``."""

    @staticmethod
    def forward(ctx, q, k, v, call, bug):
        with torch.enable_grad():
            leaves = [x.detach().requires_grad_() for x in (q, k, v)]
            out = call[0](*leaves, *call[1:5], softmax_scale=call[5], causal=call[6])
        ctx.inner, ctx.leaves, ctx.bug, ctx.accumulated = out, leaves, bug, None
        ctx.seed = torch.initial_seed()  # "the dropout seed", recorded for the backward
        return out.detach()

    @staticmethod
    def backward(ctx, g):
        if ctx.bug == "backward_reseeds_the_process":  # "restores the dropout RNG": later draws repeat
            torch.manual_seed(ctx.seed)
        if ctx.bug == "row_stride_from_heads":
            g = _rows_at_packed_stride(g)
        grads = list(torch.autograd.grad(ctx.inner, ctx.leaves, g, retain_graph=True))
        if ctx.bug == "grad_buffers_of_the_forward":
            if ctx.accumulated is None:
                ctx.accumulated = [x.clone() for x in grads]
            else:
                for acc, x in zip(ctx.accumulated, grads):
                    acc += x
            grads = [acc.clone() for acc in ctx.accumulated]
        return (*grads, None, None)


def _rows_at_packed_stride(g: torch.Tensor) -> torch.Tensor:
    """dO handed to a launcher whose stride arguments take 0 to mean "not given, packed rows": a dO
    broadcast over the tokens (stride 0, as ``(out * w).sum()`` gives it) is read at the packed row
    stride, past its one stored row (the memory after it, another allocation, reads as zeros here)."""
    t, h, d = g.shape
    if g.stride(0) != 0:
        return g
    row = h * g.stride(1)
    stored = g.as_strided((h * g.stride(1),), (1,), g.storage_offset())
    flat = torch.zeros(t * row, dtype=g.dtype)
    flat[: stored.numel()] = stored
    return flat.as_strided((t, h, d), (row, g.stride(1), g.stride(2)))


def _via_inner_graph(bug, fn, q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale, causal):
    if not torch.is_grad_enabled() or not any(x.requires_grad for x in (q, k, v)):
        return fn(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=softmax_scale, causal=causal)
    return _InnerGraph.apply(q, k, v, (fn, cu_q, cu_k, max_q, max_k, softmax_scale, causal), bug)


@_bug("interface.arguments")
def _grad_buffers_of_the_forward(fn, q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale, causal):
    """The gradient buffers are allocated with the forward's saved state and accumulated into by each
    backward (never cleared): a second backward through one graph (retain_graph=True) returns twice
    the gradients."""
    return _via_inner_graph("grad_buffers_of_the_forward", fn, q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale, causal)


@_bug("interface.arguments")
def _row_stride_from_heads(fn, q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale, causal):
    """The backward's launcher takes a stride of 0 for "packed": a dO broadcast over the tokens
    ((out * w).sum(), stride 0 along them) is read at the packed row stride, past its one stored row."""
    return _via_inner_graph("row_stride_from_heads", fn, q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale, causal)


class _Unguarded(torch.autograd.Function):
    """The flamia-mxfp8 emulation's forward and backward passes in an autograd.Function that leaves the
    caller's autocast on."""

    @staticmethod
    def forward(ctx, q, k, v, cu_q, cu_k, scale, causal, design):
        out, lse2 = forward_pass(design, q, k, v, cu_q, cu_k, scale, causal)
        ctx.save_for_backward(q, k, v, out, lse2, cu_q, cu_k)
        ctx.scale, ctx.causal, ctx.design = scale, causal, design
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse2, cu_q, cu_k = ctx.saved_tensors
        dq, dk, dv = backward_pass(ctx.design, q, k, v, out, lse2, dout, cu_q, cu_k, ctx.scale, ctx.causal)
        return dq, dk, dv, None, None, None, None, None


@_bug("interface.arguments_bitwise")
def _fp32_gemms_under_autocast(fn, q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale, causal):
    """A kernel written in torch ops (fp32 GEMMs on dequantized operands) that does not turn the
    caller's autocast off: inside a mixed-precision training step its fp32 GEMMs run in bf16."""
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else float(softmax_scale)
    return _Unguarded.apply(q, k, v, cu_q, cu_k, scale, bool(causal), fn.design)


@_bug("interface.process_state")
def _backward_reseeds_the_process(fn, q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale, causal):
    """The backward reseeds torch's global generator with the seed its forward recorded (to replay a
    dropout mask, also at dropout 0): out and the gradients are right; the process's random draws after
    each backward (data order, dropout, sampling) repeat."""
    return _via_inner_graph(
        "backward_reseeds_the_process", fn, q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale, causal
    )


@_bug("interface.arguments")
def _gradients_outside_the_graph(fn, q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale, causal):
    """The backward's gradients come from a first-order autograd.grad of an inner graph, not marked
    once_differentiable: under create_graph=True they are detached, and a gradient penalty on them is
    silently a constant."""
    return _via_inner_graph("none", fn, q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale, causal)


@_bug("interface.arguments_bitwise")
def _scale_as_a_default_dtype_tensor(fn, q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale, causal):
    """softmax_scale goes through torch.tensor(scale), of torch's default dtype: a model built with the
    default dtype set to bf16 rounds 128^-0.5 to bf16."""
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    s = float(torch.tensor(scale))
    return fn(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=s, causal=causal)


#: the latest forward's packing, "shared by every layer of the step", keyed by the token count
_LATEST_PACK: dict = {}


class _LatestPack(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, call):
        _LATEST_PACK[(q.shape, k.shape)] = call
        ctx.save_for_backward(q, k, v)
        return call[0](q.detach(), k.detach(), v.detach(), *call[1:5], softmax_scale=call[5], causal=call[6])

    @staticmethod
    @once_differentiable
    def backward(ctx, g):
        q, k, v = ctx.saved_tensors
        call = _LATEST_PACK[(q.shape, k.shape)]  # the latest forward's, not this call's
        with torch.enable_grad():
            leaves = [x.detach().requires_grad_() for x in (q, k, v)]
            out = call[0](*leaves, *call[1:5], softmax_scale=call[5], causal=call[6])
            return (*torch.autograd.grad(out, leaves, g), None)


@_bug("interface.arguments")
def _backward_reads_the_latest_pack(fn, q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale, causal):
    """The backward takes cu_seqlens, the scale and the causal flag from a module cache of the latest
    forward with the same shapes (one per step, as if every layer had the same packing): another call
    between a forward and its backward gives it the other call's packing."""
    if not torch.is_grad_enabled() or not any(x.requires_grad for x in (q, k, v)):
        return fn(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=softmax_scale, causal=causal)
    return _LatestPack.apply(q, k, v, (fn, cu_q, cu_k, max_q, max_k, softmax_scale, causal))


def differentiable_lse(q, k, cu_q, cu_k, scale, causal):
    """(nheads, total_q) natural-log log-sum-exp of the scaled scores in float32 torch ops (in the graph)."""
    g = q.shape[1] // k.shape[1]
    rows, cq, ck = [], cu_q.tolist(), cu_k.tolist()
    for b in range(len(cq) - 1):
        qd = q[cq[b] : cq[b + 1]].float().transpose(0, 1)
        kd = k[ck[b] : ck[b + 1]].float().transpose(0, 1).repeat_interleave(g, 0)
        s = scale * qd @ kd.transpose(1, 2)
        lq, lk = qd.shape[1], kd.shape[1]
        if causal:
            s = s.masked_fill(torch.arange(lk)[None, :] > torch.arange(lq)[:, None] + (lk - lq), -math.inf)
        rows.append(torch.logsumexp(s, dim=-1))
    return torch.cat(rows, dim=1)


class _LseWithoutGradient(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, lse):
        return lse.detach().clone()

    @staticmethod
    def backward(ctx, g):
        return None, None  # the log-sum-exp's gradient is dropped


@_bug("interface.lse", recipe="bf16", base=_SDPA)
def _lse_gradient_dropped(fn, q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale, causal):
    """Returns (out, lse) with the log-sum-exp marked as requiring grad, but its backward ignores the
    log-sum-exp's gradient (only out's reaches q, k, v): a merge of partial attention results that
    differentiates through the log-sum-exp silently loses that part of the gradient."""
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    out = fn(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=scale, causal=causal)
    with torch.no_grad():
        lse = differentiable_lse(q, k, cu_q, cu_k, scale, causal)
    return out, _LseWithoutGradient.apply(q, lse)


@_bug("interface.lse", recipe="bf16", base=_SDPA)
def _lse_padded_wrong_rows(fn, q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale, causal):
    """Returns the log-sum-exp in the padded (batch, nheads, max_seqlen_q) layout with each document's
    rows shifted by one (its first row written from the previous document's last)."""
    from flamia_verify.reference import attention_forward

    s = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    out = fn(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=s, causal=causal)
    _, lse = attention_forward(
        q.detach().double(), k.detach().double(), v.detach().double(), cu_q, cu_k, softmax_scale=s, causal=causal
    )
    lse = torch.roll(lse, 1, dims=0)
    cq = cu_q.tolist()
    padded = torch.zeros(len(cq) - 1, q.shape[1], max_q, dtype=torch.float32)
    for b in range(len(cq) - 1):
        padded[b, :, : cq[b + 1] - cq[b]] = lse[cq[b] : cq[b + 1]].T.float()
    return out, padded


RECORDS = KNOWN_BAD.register(*_records, origin=__file__)

#: the wrapper family's records this file holds to the checks they name, under the names its tests give them
_PACKAGE = {
    "scale_none_as_one": "wrapper.defaults.scale-none-as-1",
    "assumes_contiguous": "wrapper.stride.storage-as-contiguous",
    "nan_to_num_output": "wrapper.nan.out-to-num",
    "lse_in_log2": "wrapper.lse.log2",
}

#: every kernel of this file (and of its package records), by name
CONVENTION_BUGS = {r.name: r.kernel(sdpa_bf16 if r.base == _SDPA else None) for r in RECORDS}
CONVENTION_BUGS.update({name: KNOWN_BAD.kernel(record) for name, record in _PACKAGE.items()})
globals().update(CONVENTION_BUGS)  # each kernel also by its name: ``convention_bugs.split_by_max_seqlen``
