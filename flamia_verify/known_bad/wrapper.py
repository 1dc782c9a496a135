"""The wrapper family: bugs of a kernel's *wrapper*, not of its arithmetic.

The source-edit family (:mod:`flamia_verify.known_bad.table`) edits the emulation's own steps. The
bugs that reach users mostly live one layer out: in the code that turns FlashAttention's varlen
calling convention into a kernel launch (argument defaults, head and document index arithmetic,
dispatch by size, input strides and dtypes, NaN guards, the returned tuple). A wrapper bug is a
known-bad record whose ``build`` is the forwarding wrapper (:class:`~flamia_verify.known_bad.forwarding.Forwarding`)
with one such thing wrong in its body: built on a correct kernel in the convention (by default the
built-in emulation of ``flamia-mxfp8`` or ``bf16``, or any other base a test chooses), it returns a
kernel in the same convention; the correct kernel inside runs unchanged.

Most leave the correct kernel's numbers untouched, bit for bit, until their dimension is exercised
(tag ``plain``): a contiguous bf16 call with the scale passed, two equal documents, GQA 2:1,
head_dim 64 goes straight through. :func:`distinguishes` shows each one observable on probe calls of
this module's own (strided and fused-QKV inputs, ``softmax_scale=None``, max_seqlen above the true
maximum, GQA 3:1, 5:1, 6:2, 7:1, head_dim 80/96/192/256, fp16, a 600-token document, empty documents
at the start, middle and end, a NaN in one element, eleven documents).

Names are ``wrapper.<dimension>.<what>``; the family is ``wrapper.<dimension>``, so the kill table of
``flamia-verify mutate`` shows one row per dimension, and ``--family wrapper`` selects them all. Every
record is registered in :data:`~flamia_verify.known_bad.KNOWN_BAD`, tagged ``mutant`` and ``wrapper``.
Some are also the zoo's convention bugs: the test suite builds the same record on the base its test
needs (``record.kernel(base=...)``) and holds it to the checks it names (``catches``, ``quiet``).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import torch

from flamia_verify.formats import E4M3, round_to_format
from flamia_verify.formats.constants import E4M3_MAX
from flamia_verify.known_bad.forwarding import Body, EditGrad, Forwarding, around, run, scale_of
from flamia_verify.known_bad.record import KNOWN_BAD, Kernel, KnownBad, base_kernel

__all__ = [
    "KIND",
    "WRAPPER_MUTANTS",
    "WRAPPER_BUGS",
    "WRAPPER_CORRECT",
    "WRAPPER_FAMILIES",
    "Probe",
    "PROBES",
    "PLAIN",
    "probe_call",
    "distinguishes",
    "plain_matches",
]

KIND = "wrapper"


# ----------------------------------------------------------------------------------------------
# small pieces the wrappers share
# ----------------------------------------------------------------------------------------------

_run = run
_EditGrad = EditGrad


def _lens(cu: torch.Tensor) -> list[int]:
    vals = cu.detach().cpu().tolist()
    return [b - a for a, b in zip(vals[:-1], vals[1:])]


def _cu(lens: list[int], like: torch.Tensor) -> torch.Tensor:
    vals = [0]
    for n in lens:
        vals.append(vals[-1] + n)
    return torch.tensor(vals, dtype=torch.int32, device=like.device)


class _OwnBackward(torch.autograd.Function):
    """Forward ``fwd(q, k, v)``; backward ``bwd(q, k, v, dout) -> (dq, dk, dv)``: a wrapper that
    launches its own backward (and may launch it differently from the forward)."""

    @staticmethod
    def forward(ctx, fwd, bwd, q, k, v):
        ctx.bwd = bwd
        ctx.save_for_backward(q, k, v)
        return fwd(q, k, v)

    @staticmethod
    def backward(ctx, dout):
        q, k, v = ctx.saved_tensors
        dq, dk, dv = ctx.bwd(q, k, v, dout)
        return None, None, dq, dk, dv


def _grads(call, q, k, v, dout):
    """Gradients of ``call(q, k, v)`` against ``dout`` (the correct kernel's own backward)."""
    with torch.enable_grad():
        qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
        out = call(qq, kk, vv)
        return torch.autograd.grad(out, (qq, kk, vv), dout, allow_unused=True)


def _fp8_per_tensor(x: torch.Tensor) -> torch.Tensor:
    """x rounded to E4M3 with one fp32 scale amax/448 over the whole tensor (straight-through gradient)."""
    s = x.detach().abs().amax().float().clamp(min=1e-30) / E4M3_MAX
    y = (round_to_format(x.detach().float() / s, E4M3, saturate=True) * s).to(x.dtype)
    return x + (y - x).detach()


def _lse(fn, q, k, v, cq, ck, scale, causal) -> torch.Tensor:
    """The correct kernel's log-sum-exp in the convention's layout: (nheads, total_q), natural log: the
    emulation's own of an emulated base (its ``design``), the float64 reference's of any other."""
    from flamia_verify.kernels.metadata import kernel_design

    design = kernel_design(fn)
    scale = scale_of(q, scale)
    with torch.no_grad():
        if design is None:
            from flamia_verify.reference import attention_forward

            _, ref = attention_forward(
                q.detach().double(),
                k.detach().double(),
                v.detach().double(),
                cq,
                ck,
                softmax_scale=scale,
                causal=causal,
            )
            return ref.T.float().contiguous()
        from flamia_verify.kernels.emulation import emulated_forward_with_lse

        _, lse = emulated_forward_with_lse(
            design, q.detach(), k.detach(), v.detach(), cq, ck, softmax_scale=scale, causal=bool(causal)
        )
    return lse.transpose(0, 1).contiguous()


# ----------------------------------------------------------------------------------------------
# argument defaults: softmax_scale and causal
# ----------------------------------------------------------------------------------------------


def _scale_none_as_one(fn, q, k, v, cq, ck, mq, mk, scale, causal):
    return fn(q, k, v, cq, ck, mq, mk, softmax_scale=1.0 if scale is None else scale, causal=causal)


def _scale_none_as_inv_d(fn, q, k, v, cq, ck, mq, mk, scale, causal):
    s = 1.0 / q.shape[-1] if scale is None else scale
    return fn(q, k, v, cq, ck, mq, mk, softmax_scale=s, causal=causal)


def _scale_none_from_hidden(fn, q, k, v, cq, ck, mq, mk, scale, causal):
    s = (q.shape[1] * q.shape[2]) ** -0.5 if scale is None else scale
    return fn(q, k, v, cq, ck, mq, mk, softmax_scale=s, causal=causal)


def _scale_ignored(fn, q, k, v, cq, ck, mq, mk, scale, causal):
    return fn(q, k, v, cq, ck, mq, mk, softmax_scale=q.shape[-1] ** -0.5, causal=causal)


def _causal_self_only(fn, q, k, v, cq, ck, mq, mk, scale, causal):
    self_attention = cq is ck or (cq.shape == ck.shape and torch.equal(cq, ck))
    return fn(q, k, v, cq, ck, mq, mk, softmax_scale=scale, causal=causal and self_attention)


def _causal_not_saved(fn, q, k, v, cq, ck, mq, mk, scale, causal):
    def fwd(q, k, v):
        return _run(fn, q, k, v, cq, ck, mq, mk, scale, causal)

    def bwd(q, k, v, dout):  # the flag was not kept for the backward launch: its default is used
        return _grads(lambda a, b, c: _run(fn, a, b, c, cq, ck, mq, mk, scale, False), q, k, v, dout)

    return _OwnBackward.apply(fwd, bwd, q, k, v)


# ----------------------------------------------------------------------------------------------
# GQA index arithmetic
# ----------------------------------------------------------------------------------------------


def _with_kv_heads(fn, q, k, v, cq, ck, mq, mk, scale, causal, kv_of):
    """Run ``fn`` with query head h reading kv head ``kv_of(h, H, Hk)`` (clamped into range)."""
    nh, nk = q.shape[1], k.shape[1]
    group = nh // nk
    idx = [min(max(kv_of(h, nh, nk), 0), nk - 1) for h in range(nh)]
    if idx == [h // group for h in range(nh)]:  # the same launch as the correct arithmetic
        return fn(q, k, v, cq, ck, mq, mk, softmax_scale=scale, causal=causal)
    if all(idx.count(j) == group for j in range(nk)):  # a permutation of the query heads
        order = sorted(range(nh), key=lambda h: (idx[h], h))
        inverse = torch.argsort(torch.tensor(order)).to(q.device)
        out = _run(fn, q[:, order], k, v, cq, ck, mq, mk, scale, causal)
        return out.index_select(1, inverse)
    sel = torch.tensor(idx, device=q.device)
    return fn(q, k.index_select(1, sel), v.index_select(1, sel), cq, ck, mq, mk, softmax_scale=scale, causal=causal)


def _gqa_modulo(fn, q, k, v, cq, ck, mq, mk, scale, causal):
    return _with_kv_heads(fn, q, k, v, cq, ck, mq, mk, scale, causal, lambda h, nh, nk: h % nk)


def _gqa_shift(fn, q, k, v, cq, ck, mq, mk, scale, causal):
    return _with_kv_heads(fn, q, k, v, cq, ck, mq, mk, scale, causal, lambda h, nh, nk: h >> int(math.log2(nh // nk)))


def _gqa_divisor_swapped(fn, q, k, v, cq, ck, mq, mk, scale, causal):
    return _with_kv_heads(fn, q, k, v, cq, ck, mq, mk, scale, causal, lambda h, nh, nk: h // nk)


def _gqa_dkdv_first_head(fn, q, k, v, cq, ck, mq, mk, scale, causal):
    group = q.shape[1] // k.shape[1]
    if group == 1:
        return fn(q, k, v, cq, ck, mq, mk, softmax_scale=scale, causal=causal)

    def fwd(q, k, v):
        return _run(fn, q, k, v, cq, ck, mq, mk, scale, causal)

    def bwd(q, k, v, dout):  # K/V expanded per query head; the group's gradients never summed
        kx, vx = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        dq, dkx, dvx = _grads(lambda a, b, c: _run(fn, a, b, c, cq, ck, mq, mk, scale, causal), q, kx, vx, dout)
        return dq, dkx[:, ::group].contiguous(), dvx[:, ::group].contiguous()

    return _OwnBackward.apply(fwd, bwd, q, k, v)


def _gqa_expanded(fn, q, k, v, cq, ck, mq, mk, scale, causal):
    group = q.shape[1] // k.shape[1]
    kx, vx = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    return fn(q, kx, vx, cq, ck, mq, mk, softmax_scale=scale, causal=causal)


# ----------------------------------------------------------------------------------------------
# cu_seqlens arithmetic
# ----------------------------------------------------------------------------------------------


def _cu_last_dropped(fn, q, k, v, cq, ck, mq, mk, scale, causal):
    out = _run(fn, q, k, v, cq, ck, mq, mk, scale, causal)
    start = int(cq[-2]) if cq.numel() > 1 else 0  # the launch covers documents 0 .. batch - 2
    rows = torch.arange(q.shape[0], device=q.device)[:, None, None] < start
    return torch.where(rows, out, out.new_zeros(()))


def _cu_empty_by_q(fn, q, k, v, cq, ck, mq, mk, scale, causal):
    lq, lk = _lens(cq), _lens(ck)
    keep = [i for i, n in enumerate(lq) if n > 0]
    if len(keep) == len(lq) or not keep:
        return fn(q, k, v, cq, ck, mq, mk, softmax_scale=scale, causal=causal)
    # documents without queries are dropped from both offset lists: their keys stay in the tensor
    # and shift every later document's keys
    nq, nk = [lq[i] for i in keep], [lk[i] for i in keep]
    tk = sum(nk)
    return fn(q, k[:tk], v[:tk], _cu(nq, cq), _cu(nk, ck), mq, mk, softmax_scale=scale, causal=causal)


def _cu_empty_takes_a_row(fn, q, k, v, cq, ck, mq, mk, scale, causal):
    lq, lk = _lens(cq), _lens(ck)
    if all(lq) and all(lk):
        return fn(q, k, v, cq, ck, mq, mk, softmax_scale=scale, causal=causal)

    def offsets(lens, total, like):
        vals, at = [0], 0
        for n in lens:  # an empty document is given one row
            at = min(at + max(n, 1), total)
            vals.append(at)
        vals[-1] = total
        return torch.tensor(vals, dtype=torch.int32, device=like.device)

    cq2, ck2 = offsets(lq, q.shape[0], cq), offsets(lk, k.shape[0], ck)
    mq2, mk2 = max([mq] + _lens(cq2)), max([mk] + _lens(ck2))
    return fn(q, k, v, cq2, ck2, mq2, mk2, softmax_scale=scale, causal=causal)


def _cu_k_start_minus_one(fn, q, k, v, cq, ck, mq, mk, scale, causal):
    from flamia_verify.known_bad.operators import shift_cu

    ck2 = shift_cu(ck, -1)  # every document's keys start one early
    return fn(q, k, v, cq, ck2, mq, max([mk] + _lens(ck2)), softmax_scale=scale, causal=causal)


def _cu_k_from_q(fn, q, k, v, cq, ck, mq, mk, scale, causal):
    # keys read at the query offsets; reads past the keys' end come back as zeros (masked loads)
    tq, tk = q.shape[0], k.shape[0]
    if tq <= tk:
        k, v = k[:tq], v[:tq]
    else:
        k, v = (torch.cat([t, t.new_zeros(tq - tk, *t.shape[1:])]) for t in (k, v))
    return fn(q, k, v, cq, cq, mq, mq, softmax_scale=scale, causal=causal)


# ----------------------------------------------------------------------------------------------
# dispatch by size
# ----------------------------------------------------------------------------------------------

LONG = 512  # the "long sequence" path of the dispatching wrappers
MANY_DOCS = 8  # the "many documents" path


def _dispatch_long_noncausal(fn, q, k, v, cq, ck, mq, mk, scale, causal):
    long_path = max(mq, mk) > LONG  # the long-sequence path has no causal variant
    return fn(q, k, v, cq, ck, mq, mk, softmax_scale=scale, causal=causal and not long_path)


def _dispatch_dense_when_max_is_total(fn, q, k, v, cq, ck, mq, mk, scale, causal):
    if cq.numel() > 2 and mq >= q.shape[0]:  # "max_seqlen covers everything: one sequence"
        one_q, one_k = _cu([q.shape[0]], cq), _cu([k.shape[0]], ck)
        return fn(q, k, v, one_q, one_k, q.shape[0], k.shape[0], softmax_scale=scale, causal=causal)
    return fn(q, k, v, cq, ck, mq, mk, softmax_scale=scale, causal=causal)


def _dispatch_headdim_scale_dropped(fn, q, k, v, cq, ck, mq, mk, scale, causal):
    if q.shape[-1] in (64, 128):
        return fn(q, k, v, cq, ck, mq, mk, softmax_scale=scale, causal=causal)
    return fn(q, k, v, cq, ck, mq, mk, softmax_scale=None, causal=causal)  # the generic path's own default


def _dispatch_headdim_padded(fn, q, k, v, cq, ck, mq, mk, scale, causal):
    d = q.shape[-1]
    if d in (64, 128):
        return fn(q, k, v, cq, ck, mq, mk, softmax_scale=scale, causal=causal)
    padded = 128 if d < 128 else 256
    pad = [0, padded - d]
    qp, kp, vp = (torch.nn.functional.pad(t, pad) for t in (q, k, v))
    s = padded**-0.5 if scale is None else scale  # the default taken from the padded head_dim
    return _run(fn, qp, kp, vp, cq, ck, mq, mk, s, causal)[..., :d]


def _dispatch_many_docs_padded(fn, q, k, v, cq, ck, mq, mk, scale, causal):
    lk = _lens(ck)
    if len(lk) <= MANY_DOCS:
        return fn(q, k, v, cq, ck, mq, mk, softmax_scale=scale, causal=causal)
    # the batched path pads every document's keys to max_seqlen_k and forgets the padding mask
    starts = _cu(lk, ck).tolist()
    parts_k, parts_v = [], []
    for b, n in enumerate(lk):
        zeros = k.new_zeros(mk - n, *k.shape[1:])
        parts_k += [k[starts[b] : starts[b] + n], zeros]
        parts_v += [v[starts[b] : starts[b] + n], zeros]
    ck2 = _cu([mk] * len(lk), ck)
    return fn(q, torch.cat(parts_k), torch.cat(parts_v), cq, ck2, mq, mk, softmax_scale=scale, causal=causal)


# ----------------------------------------------------------------------------------------------
# reductions over heads and over the packed batch
# ----------------------------------------------------------------------------------------------


def _reduce_v_fp8_per_tensor(fn, q, k, v, cq, ck, mq, mk, scale, causal):
    return fn(q, k, _fp8_per_tensor(v), cq, ck, mq, mk, softmax_scale=scale, causal=causal)


def _reduce_out_fp8_per_tensor(fn, q, k, v, cq, ck, mq, mk, scale, causal):
    return _fp8_per_tensor(_run(fn, q, k, v, cq, ck, mq, mk, scale, causal))


def _reduce_q_descale_head0(fn, q, k, v, cq, ck, mq, mk, scale, causal):
    # Q pre-scaled per head by a power of two, descaled with head 0's factor for every head
    amax = q.detach().float().abs().amax(dim=(0, 2)).clamp(min=2.0**-100)
    s = torch.exp2(torch.ceil(torch.log2(amax / E4M3_MAX)))
    s = torch.where(torch.isfinite(s), s, torch.ones_like(s))
    qs = q / s.to(q.dtype)[None, :, None]
    s0 = float(s[0])
    return fn(qs, k, v, cq, ck, mq, mk, softmax_scale=scale_of(q, scale) * s0, causal=causal)


# ----------------------------------------------------------------------------------------------
# NaN handling
# ----------------------------------------------------------------------------------------------


def _nan_out_to_num(fn, q, k, v, cq, ck, mq, mk, scale, causal):
    return torch.nan_to_num(_run(fn, q, k, v, cq, ck, mq, mk, scale, causal))


def _nan_grads_to_num(fn, q, k, v, cq, ck, mq, mk, scale, causal):
    q, k, v = (_EditGrad.apply(t, torch.nan_to_num) for t in (q, k, v))
    return fn(q, k, v, cq, ck, mq, mk, softmax_scale=scale, causal=causal)


def _nan_inputs_masked(fn, q, k, v, cq, ck, mq, mk, scale, causal):
    q, k, v = (torch.where(torch.isnan(t), torch.zeros_like(t), t) for t in (q, k, v))
    return fn(q, k, v, cq, ck, mq, mk, softmax_scale=scale, causal=causal)


# ----------------------------------------------------------------------------------------------
# the returned tuple: (out, lse)
# ----------------------------------------------------------------------------------------------


def _lse_correct(fn, q, k, v, cq, ck, mq, mk, scale, causal):
    return _run(fn, q, k, v, cq, ck, mq, mk, scale, causal), _lse(fn, q, k, v, cq, ck, scale, causal)


def _lse_log2(fn, q, k, v, cq, ck, mq, mk, scale, causal):
    lse = _lse(fn, q, k, v, cq, ck, scale, causal) / math.log(2.0)  # the kernel's internal unit leaks out
    return _run(fn, q, k, v, cq, ck, mq, mk, scale, causal), lse


def _lse_transposed(fn, q, k, v, cq, ck, mq, mk, scale, causal):
    lse = _lse(fn, q, k, v, cq, ck, scale, causal).transpose(0, 1).contiguous()  # (total_q, nheads)
    return _run(fn, q, k, v, cq, ck, mq, mk, scale, causal), lse


def _lse_unscaled(fn, q, k, v, cq, ck, mq, mk, scale, causal):
    lse = _lse(fn, q, k, v, cq, ck, 1.0, causal)  # of q.k, not of softmax_scale * q.k
    return _run(fn, q, k, v, cq, ck, mq, mk, scale, causal), lse


def _lse_padded(fn, q, k, v, cq, ck, mq, mk, scale, causal):
    lse = _lse(fn, q, k, v, cq, ck, scale, causal)
    lq = _lens(cq)
    padded = lse.new_full((len(lq), q.shape[1], mq), float("inf"))  # (batch, nheads, max_seqlen_q)
    start = 0
    for b, n in enumerate(lq):
        padded[b, :, :n] = lse[:, start : start + n]
        start += n
    return _run(fn, q, k, v, cq, ck, mq, mk, scale, causal), padded


# ----------------------------------------------------------------------------------------------
# strides, dtypes
# ----------------------------------------------------------------------------------------------


def _as_packed(x: torch.Tensor) -> torch.Tensor:
    """x's storage read from x's first element as if x were contiguous."""
    strides, acc = [], 1
    for n in reversed(x.shape):
        strides.append(acc)
        acc *= n
    return x.as_strided(x.shape, tuple(reversed(strides)), x.storage_offset())


def _stride_storage_as_contiguous(fn, q, k, v, cq, ck, mq, mk, scale, causal):
    q, k, v = (t if t.is_contiguous() else _as_packed(t) for t in (q, k, v))
    return fn(q, k, v, cq, ck, mq, mk, softmax_scale=scale, causal=causal)


def _stride_last_dim_only(fn, q, k, v, cq, ck, mq, mk, scale, causal):
    def fix(t):  # the wrapper checks only the innermost stride; the kernel assumes packed rows
        if t.stride(-1) != 1:
            return t.contiguous()
        return t if t.is_contiguous() else _as_packed(t)

    return fn(fix(q), fix(k), fix(v), cq, ck, mq, mk, softmax_scale=scale, causal=causal)


def _dtype_fp16_via_bf16(fn, q, k, v, cq, ck, mq, mk, scale, causal):
    if q.dtype != torch.float16:
        return fn(q, k, v, cq, ck, mq, mk, softmax_scale=scale, causal=causal)
    bq, bk, bv = (t.to(torch.bfloat16) for t in (q, k, v))
    return _run(fn, bq, bk, bv, cq, ck, mq, mk, scale, causal).to(torch.float16)


def _dtype_out_bf16(fn, q, k, v, cq, ck, mq, mk, scale, causal):
    return _run(fn, q, k, v, cq, ck, mq, mk, scale, causal).to(torch.bfloat16)


# ----------------------------------------------------------------------------------------------
# determinism, heads, positions
# ----------------------------------------------------------------------------------------------

_ATOMICS = random.Random()  # seeded from the OS: another order on every call, as atomics give


def _determinism_group_atomics(fn, q, k, v, cq, ck, mq, mk, scale, causal):
    group = q.shape[1] // k.shape[1]
    if group == 1 or k.shape[0] <= LONG:
        return fn(q, k, v, cq, ck, mq, mk, softmax_scale=scale, causal=causal)

    def fwd(q, k, v):
        return _run(fn, q, k, v, cq, ck, mq, mk, scale, causal)

    def bwd(q, k, v, dout):  # long inputs: each query head adds its dK, dV into the kv head atomically
        kx, vx = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        dq, dkx, dvx = _grads(lambda a, b, c: _run(fn, a, b, c, cq, ck, mq, mk, scale, causal), q, kx, vx, dout)

        def atomics(g):
            parts = list(g.unflatten(1, (k.shape[1], group)).unbind(2))
            _ATOMICS.shuffle(parts)
            acc = parts[0].clone()
            for p in parts[1:]:
                acc += p  # in the gradient's dtype, one rounding per arrival
            return acc

        return dq, atomics(dkx), atomics(dvx)

    return _OwnBackward.apply(fwd, bwd, q, k, v)


def _head_odd_last_dropped(fn, q, k, v, cq, ck, mq, mk, scale, causal):
    out = _run(fn, q, k, v, cq, ck, mq, mk, scale, causal)
    nh = q.shape[1]
    if nh % 2 == 0:
        return out
    heads = torch.arange(nh, device=q.device)[None, :, None] < nh // 2 * 2  # grid of head pairs
    return torch.where(heads, out, out.new_zeros(()))


def _head_odd_kv_backward(fn, q, k, v, cq, ck, mq, mk, scale, causal):
    nk = k.shape[1]
    if nk == 1 or nk % 2 == 0:
        return fn(q, k, v, cq, ck, mq, mk, softmax_scale=scale, causal=causal)

    def last_head_lost(g):  # the backward grid covers kv heads in pairs
        g = g.clone()
        g[:, -1] = 0
        return g

    k, v = _EditGrad.apply(k, last_head_lost), _EditGrad.apply(v, last_head_lost)
    return fn(q, k, v, cq, ck, mq, mk, softmax_scale=scale, causal=causal)


def _position_tail_unwritten(fn, q, k, v, cq, ck, mq, mk, scale, causal):
    out = _run(fn, q, k, v, cq, ck, mq, mk, scale, causal)
    whole = q.shape[0] // 16 * 16  # the store of the pack's last partial 16-row tile is missing
    if whole == q.shape[0]:
        return out
    rows = torch.arange(q.shape[0], device=q.device)[:, None, None] < whole
    return torch.where(rows, out, out.new_zeros(()))


def _position_keys_past_512(fn, q, k, v, cq, ck, mq, mk, scale, causal):
    out = _run(fn, q, k, v, cq, ck, mq, mk, scale, causal)
    lq, lk = _lens(cq), _lens(ck)
    sq, sk = _cu(lq, cq).tolist(), _cu(lk, ck).tolist()
    rows: list[int] = []
    keys: list[int] = []
    lens_q: list[int] = []
    for b in range(len(lq)):
        if lk[b] <= LONG:
            continue
        off = lk[b] - lq[b]
        mine = [i for i in range(lq[b]) if not causal or i + off >= LONG]  # rows that see key 512 or later
        if mine:
            rows += [sq[b] + i for i in mine]
            keys += list(range(sk[b], sk[b] + LONG))
            lens_q.append(len(mine))
    if not rows:
        return out
    # the key loop stops after 512 keys: those rows attend to the first 512 keys only
    r = torch.tensor(rows, device=q.device)
    kk = torch.tensor(keys, device=q.device)
    cq2, ck2 = _cu(lens_q, cq), _cu([LONG] * len(lens_q), ck)
    part = _run(
        fn,
        q.index_select(0, r),
        k.index_select(0, kk),
        v.index_select(0, kk),
        cq2,
        ck2,
        max(lens_q),
        LONG,
        scale,
        False,
    )
    return out.index_copy(0, r, part)


# ----------------------------------------------------------------------------------------------
# the table
# ----------------------------------------------------------------------------------------------


def _m(
    dimension: str,
    what: str,
    why: str,
    body: Body,
    *,
    base: str = "flamia-mxfp8",
    plain: bool = True,
    correct: bool = False,
    **claims,
) -> KnownBad:
    """A wrapper bug (or, ``correct``, a correct wrapper) as a known-bad record. ``claims``: the
    checks a test holds it to on the base it builds it on (``catches``, ``quiet``), ``where``."""
    name = f"{KIND}.{dimension}.{what}"
    tags = ("mutant", KIND) + (("plain",) if plain else ())
    return KnownBad(
        name, f"{KIND}.{dimension}", why, Forwarding(body, name), base=base, tags=tags, correct=correct, **claims
    )


WRAPPER_MUTANTS: tuple[KnownBad, ...] = (
    # argument defaults
    _m(
        "defaults",
        "scale-none-as-1",
        "softmax_scale=None taken as 1.0",
        _scale_none_as_one,
        base="bf16",
        catches=("interface.arguments",),
        where="softmax_scale=None",
    ),
    _m("defaults", "scale-none-as-inv-d", "softmax_scale=None taken as 1/headdim", _scale_none_as_inv_d),
    _m(
        "defaults",
        "scale-none-from-hidden",
        "softmax_scale=None taken as (nheads*headdim)^-0.5",
        _scale_none_from_hidden,
    ),
    _m(
        "defaults",
        "scale-ignored",
        "softmax_scale passed is ignored: always headdim^-0.5",
        _scale_ignored,
        # a base packing passes softmax_scale 0.0883 and two special.magnitudes cases 0.5 and 2 times the
        # default; bound.out fails too (on random q, k its score-error slack is above a 0.71x scale change
        # only in part of the cases)
        catches=("error.out", "error.dq", "error.dk", "error.dv", "special.magnitudes", "bound.out", "bound.grad"),
        quiet=("causal", "isolation"),
        where="a softmax_scale other than headdim^-0.5",
    ),
    _m("defaults", "causal-self-only", "causal honoured only when cu_seqlens_q equals cu_seqlens_k", _causal_self_only),
    _m(
        "defaults",
        "causal-not-saved",
        "causal not kept for the backward: gradients of the non-causal attention",
        _causal_not_saved,
        plain=False,
    ),
    # GQA index arithmetic
    _m(
        "gqa",
        "modulo",
        "query head h reads kv head h % Hk instead of h // (H/Hk)",
        _gqa_modulo,
        base="bf16",
        where="GQA with nheads_k > 1 and a group > 1",
        source="GQA expansion reports where repeat and repeat_interleave were confused.",
    ),
    _m("gqa", "pow2-shift", "kv head h >> int(log2(group)): right for power-of-two groups only", _gqa_shift),
    _m("gqa", "divisor-swapped", "kv head h // Hk instead of h // (H/Hk) (clamped into range)", _gqa_divisor_swapped),
    _m(
        "gqa",
        "dkdv-first-head",
        "dK, dV of a kv head taken from the first query head of its group, not summed over it",
        _gqa_dkdv_first_head,
        plain=False,
    ),
    _m(
        "gqa",
        "expanded",
        "K, V expanded with repeat_interleave, MHA launch (correct)",
        _gqa_expanded,
        correct=True,
        plain=False,
    ),
    # cu_seqlens arithmetic
    _m(
        "cu",
        "last-dropped",
        "the launch covers batch - 1 documents: the last is never written",
        _cu_last_dropped,
        base="bf16",
        plain=False,
    ),
    _m(
        "cu",
        "empty-by-q-lengths",
        "documents without queries dropped from both offset lists: later documents' keys shift",
        _cu_empty_by_q,
    ),
    _m(
        "cu",
        "empty-takes-a-row",
        "an empty document is given one row: later documents shift by one",
        _cu_empty_takes_a_row,
    ),
    _m(
        "cu",
        "k-start-minus-one",
        "each document's keys start one early (cu_seqlens_k[b] - 1): sees the previous document's last key",
        _cu_k_start_minus_one,
        plain=False,
    ),
    _m("cu", "k-from-q", "cu_seqlens_q and max_seqlen_q used for the keys too (self-attention assumed)", _cu_k_from_q),
    # dispatch by size
    _m(
        "dispatch",
        "long-noncausal",
        f"max_seqlen above {LONG}: a path without the causal mask",
        _dispatch_long_noncausal,
    ),
    _m(
        "dispatch",
        "dense-when-max-is-total",
        "max_seqlen_q >= total_q taken as one sequence: cu_seqlens ignored",
        _dispatch_dense_when_max_is_total,
    ),
    _m(
        "dispatch",
        "headdim-scale-dropped",
        "head_dim not in {64, 128}: the generic path drops softmax_scale (uses headdim^-0.5)",
        _dispatch_headdim_scale_dropped,
    ),
    _m(
        "dispatch",
        "headdim-padded-default",
        "head_dim not in {64, 128} zero-padded to 128/256; softmax_scale=None from the padded size",
        _dispatch_headdim_padded,
    ),
    _m(
        "dispatch",
        "many-docs-unmasked-padding",
        f"more than {MANY_DOCS} documents: keys padded to max_seqlen_k with zeros, padding not masked",
        _dispatch_many_docs_padded,
    ),
    # reductions
    _m(
        "reduce",
        "v-fp8-per-tensor",
        "V rounded to E4M3 with one scale over all heads and documents",
        _reduce_v_fp8_per_tensor,
        plain=False,
    ),
    _m(
        "reduce",
        "out-fp8-per-tensor",
        "out rounded to E4M3 with one scale over all heads and documents",
        _reduce_out_fp8_per_tensor,
        plain=False,
    ),
    _m(
        "reduce",
        "q-descale-head0",
        "Q pre-scaled per head by a power of two, descaled with head 0's factor for all heads",
        _reduce_q_descale_head0,
        plain=False,
    ),
    # NaN handling
    _m(
        "nan",
        "out-to-num",
        "nan_to_num on the output",
        _nan_out_to_num,
        base="bf16",
        # hiding a NaN already in the inputs is a robustness finding; it spreads to no other document
        catches=("special.nonfinite",),
        quiet=("isolation.nonfinite",),
        where="NaN or inf in the inputs",
        source="Reports of wrappers masking NaNs after attention and hiding upstream divergence.",
    ),
    _m("nan", "grads-to-num", "nan_to_num on dQ, dK, dV", _nan_grads_to_num),
    _m("nan", "inputs-masked", "NaN elements of q, k, v masked to 0 with where()", _nan_inputs_masked),
    # the returned tuple
    _m("lse", "correct", "returns (out, lse), lse (nheads, total_q) natural log (correct)", _lse_correct, correct=True),
    _m(
        "lse",
        "log2",
        "returns (out, lse) with lse in log2 units",
        _lse_log2,
        base="bf16",
        catches=("interface.lse",),
        where="the returned lse",
    ),
    _m("lse", "transposed", "returns (out, lse) with lse laid out (total_q, nheads)", _lse_transposed),
    _m("lse", "unscaled", "returns (out, lse) with the lse of q.k without softmax_scale", _lse_unscaled),
    _m(
        "lse",
        "padded",
        "returns (out, lse) with lse padded (batch, nheads, max_seqlen_q), FlashAttention's older varlen layout (correct)",
        _lse_padded,
        correct=True,
    ),
    # strides
    _m(
        "stride",
        "storage-as-contiguous",
        "a non-contiguous q, k or v read from its storage as if it were contiguous",
        _stride_storage_as_contiguous,
        catches=("interface.arguments",),
        where="non-contiguous inputs (fused qkv slices, transposed storage)",
        source="Reports of flash-attention ports returning wrong output for non-contiguous q/k/v sliced from a "
        "fused projection or transposed.",
    ),
    _m(
        "stride",
        "last-dim-only",
        "only the innermost stride checked: fused-QKV slices and head-major views read as packed rows",
        _stride_last_dim_only,
    ),
    # dtypes
    _m(
        "dtype",
        "fp16-via-bf16",
        "fp16 inputs cast to bf16 for the kernel, out cast back",
        _dtype_fp16_via_bf16,
        base="bf16",
        where="fp16 inputs",
        source="Wrapper reports where an fp16 call was silently routed through a bf16-only kernel.",
    ),
    _m("dtype", "out-bf16", "out returned in bf16 whatever the input dtype", _dtype_out_bf16),
    # determinism
    _m(
        "determinism",
        "group-atomics",
        f"more than {LONG} keys with GQA: dK, dV summed over the group in arrival order, in bf16",
        _determinism_group_atomics,
    ),
    # heads
    _m(
        "heads",
        "odd-last-dropped",
        "grid over head pairs: with an odd nheads the last head is never written",
        _head_odd_last_dropped,
    ),
    _m(
        "heads",
        "odd-kv-backward",
        "backward grid over kv-head pairs: with an odd nheads_k > 1 the last kv head gets no dK, dV",
        _head_odd_kv_backward,
    ),
    # positions
    _m(
        "position",
        "tail-unwritten",
        "rows past the last multiple of 16 of the pack are never written",
        _position_tail_unwritten,
    ),
    _m(
        "position",
        "keys-past-512",
        f"the key loop stops after {LONG} keys of a document",
        _position_keys_past_512,
    ),
)
KNOWN_BAD.register(*WRAPPER_MUTANTS, origin=__name__)
WRAPPER_BUGS = tuple(m for m in WRAPPER_MUTANTS if not m.correct)
WRAPPER_CORRECT = tuple(m for m in WRAPPER_MUTANTS if m.correct)
WRAPPER_FAMILIES = tuple(dict.fromkeys(m.family for m in WRAPPER_MUTANTS))


# ----------------------------------------------------------------------------------------------
# probes: does a mutant differ from the correct kernel at all?
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Probe:
    """One call in the convention. layout: ``packed`` (contiguous), ``fused`` (q, k, v slices of one
    (T, H + 2Hk, D) tensor), ``head-major`` (views of (H, T, D) tensors), ``channels-last`` (views of
    (T, D, H) tensors: unit stride on heads). scale: a number, or None (passed as None).
    extra_max: added to the true max_seqlen_*; max_is_total: max_seqlen_* passed as the totals (an
    upper bound callers often pass); nan: (tensor, token, head, channel) set to NaN."""

    name: str
    lens_q: tuple[int, ...]
    lens_k: tuple[int, ...] | None = None
    heads: int = 2
    heads_k: int = 1
    headdim: int = 64
    causal: bool = True
    dtype: torch.dtype = torch.bfloat16
    scale: float | None = 0.125
    layout: str = "packed"
    extra_max: int = 0
    max_is_total: bool = False
    nan: tuple[str, int, int, int] | None = None
    seed: int = 0


#: contiguous bf16, scale passed (= headdim^-0.5), two equal documents, GQA 2:1, head_dim 64
PLAIN = Probe("plain", (64, 64), heads=2, heads_k=1, headdim=64, scale=64**-0.5)

PROBES: tuple[Probe, ...] = (
    PLAIN,
    Probe("scale None, 6:2, d96", (33, 70, 5), heads=6, heads_k=2, headdim=96, scale=None, seed=1),
    Probe("scale 0.3, 3:1, d80, Lq != Lk", (45, 64), (60, 30), heads=3, heads_k=1, headdim=80, scale=0.3, seed=2),
    Probe(
        "5:1, d192, empty first/last, not causal",
        (0, 40, 17, 0),
        (0, 40, 17, 0),
        heads=5,
        heads_k=1,
        headdim=192,
        causal=False,
        scale=None,
        seed=3,
    ),
    Probe(
        "7:1, d256, empty middle queries, max_seqlen +100",
        (20, 0, 35),
        (25, 12, 35),
        heads=7,
        heads_k=1,
        headdim=256,
        extra_max=100,
        seed=4,
    ),
    Probe("600 tokens, 4:2", (600, 30), heads=4, heads_k=2, headdim=64, seed=5),
    Probe(
        "11 documents, max_seqlen = total",
        (5, 17, 1, 30, 9, 12, 3, 20, 8, 14, 6),
        heads=4,
        heads_k=4,
        headdim=128,
        max_is_total=True,
        seed=6,
    ),
    Probe("fp16, 9:3", (50, 30), heads=9, heads_k=3, headdim=64, dtype=torch.float16, seed=7),
    Probe("fused QKV, 4:2", (40, 24), heads=4, heads_k=2, headdim=64, layout="fused", seed=8),
    Probe("head-major views", (28, 36), heads=2, heads_k=2, headdim=64, layout="head-major", seed=9),
    Probe("channels-last views", (28, 36), heads=2, heads_k=2, headdim=64, layout="channels-last", seed=10),
    Probe("NaN in one key", (30, 40), heads=2, heads_k=1, headdim=64, nan=("k", 35, 0, 3), seed=11),
    Probe(
        "NaN in one query, not causal",
        (30, 40),
        heads=3,
        heads_k=1,
        headdim=80,
        causal=False,
        nan=("q", 5, 2, 0),
        seed=12,
    ),
)


def _tensors(p: Probe, device: str):
    """Leaves (what gradients are taken against) and the q, k, v views handed to the kernel."""
    g = torch.Generator().manual_seed(p.seed)
    lk = p.lens_k if p.lens_k is not None else p.lens_q
    tq, tk, d = sum(p.lens_q), sum(lk), p.headdim

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(p.dtype).to(device)

    leaves: tuple[torch.Tensor, ...]
    if p.layout == "fused":
        if tq != tk:
            raise ValueError("a fused QKV probe needs total_q == total_k")
        qkv = rnd(tq, p.heads + 2 * p.heads_k, d).requires_grad_()
        leaves = (qkv,)

        def views():
            return qkv[:, : p.heads], qkv[:, p.heads : p.heads + p.heads_k], qkv[:, p.heads + p.heads_k :]

    elif p.layout in ("head-major", "channels-last"):
        perm = (1, 0, 2) if p.layout == "head-major" else (0, 2, 1)
        shapes = ((tq, p.heads, d), (tk, p.heads_k, d), (tk, p.heads_k, d))
        leaves = tuple(rnd(*[s[i] for i in perm]).requires_grad_() for s in shapes)

        def views():
            return tuple(x.permute(*perm) for x in leaves)

    else:
        leaves = (
            rnd(tq, p.heads, d).requires_grad_(),
            rnd(tk, p.heads_k, d).requires_grad_(),
            rnd(tk, p.heads_k, d).requires_grad_(),
        )

        def views():
            return leaves

    if p.nan is not None:
        which, t, h, c = p.nan
        with torch.no_grad():
            q, k, v = views()
            {"q": q, "k": k, "v": v}[which][t, h, c] = float("nan")
    dout = rnd(tq, p.heads, d)
    return leaves, views, dout


def probe_call(kernel: Kernel, p: Probe, device: str = "cpu"):
    """Run one probe: (out, lse or None, gradients of the leaves, whether an input was modified)."""
    leaves, views, dout = _tensors(p, device)
    before = [x.detach().clone() for x in leaves]
    q, k, v = views()
    lk = p.lens_k if p.lens_k is not None else p.lens_q
    cq = _cu(list(p.lens_q), torch.empty(0, device=device))
    ck = _cu(list(lk), torch.empty(0, device=device))
    mq = sum(p.lens_q) if p.max_is_total else max(p.lens_q) + p.extra_max
    mk = sum(lk) if p.max_is_total else max(lk) + p.extra_max
    res = kernel(q, k, v, cq, ck, mq, mk, softmax_scale=p.scale, causal=p.causal)
    out, lse = (res[0], res[1] if len(res) > 1 else None) if isinstance(res, (tuple, list)) else (res, None)
    grads = torch.autograd.grad(out, leaves, dout.to(out.dtype), allow_unused=True)
    changed = any(not _same(a, b.detach()) for a, b in zip(before, leaves))
    return out.detach(), (None if lse is None else lse.detach()), [g for g in grads], changed


def _same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    """Bitwise equal, NaN equal to NaN, shapes and dtypes included."""
    if a is None or b is None:
        return a is None and b is None
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    both_nan = torch.isnan(a) & torch.isnan(b)
    return bool(((a == b) | both_nan).all())


def distinguishes(mutant: KnownBad, device: str = "cpu", probes: tuple[Probe, ...] = PROBES) -> str | None:
    """How the mutant shows on the probes (one line), or None when it never differs from the correct
    kernel. Compared: out, the gradients, the lse of a returned tuple (against the correct lse),
    the inputs after the call, and two runs of the mutant."""
    correct = base_kernel(mutant.base)
    kernel = mutant.kernel(base_kernel(mutant.base))
    reference = around(correct, _lse_correct, name="reference")
    for p in probes:
        try:
            out, lse, grads, changed = probe_call(kernel, p, device)
        except Exception as exc:  # a crash is a visible difference
            return f"raises {type(exc).__name__} on {p.name}"
        if changed:
            return f"modifies its inputs on {p.name}"
        ref_out, ref_lse, ref_grads, _ = probe_call(reference, p, device)
        if not _same(out, ref_out):
            return f"out differs on {p.name}"
        for i, (a, b) in enumerate(zip(grads, ref_grads)):
            if not _same(a, b):
                names = ("dqkv",) if len(grads) == 1 else ("dq", "dk", "dv")
                return f"{names[i]} differs on {p.name}"
        if lse is not None and not _same(lse, ref_lse):
            return f"lse differs on {p.name}"
        again = probe_call(kernel, p, device)
        if not (_same(out, again[0]) and all(_same(a, b) for a, b in zip(grads, again[2]))):
            return f"two runs differ on {p.name}"
    return None


def plain_matches(mutant: KnownBad, device: str = "cpu") -> bool:
    """On :data:`PLAIN`, out and the gradients are bitwise the correct kernel's."""
    out, _, grads, changed = probe_call(mutant.kernel(), PLAIN, device)
    ref_out, _, ref_grads, _ = probe_call(base_kernel(mutant.base), PLAIN, device)
    return not changed and _same(out, ref_out) and all(_same(a, b) for a, b in zip(grads, ref_grads))
