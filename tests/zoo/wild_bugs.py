"""A held-out zoo of realistic buggy attention kernels, written without knowledge of the verifier's checks.

Every kernel follows the FlashAttention varlen calling convention::

    out = fn(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale=s, causal=c)

``WILD`` maps a name to a buggy kernel. Each bug is modelled on a kind of defect that public bug reports of
FlashAttention-style and FP8 attention kernels (and their Python wrappers) describe; each is correct on the
most ordinary inputs (contiguous bf16, scale passed, equal-length short documents, 2 query heads, head_dim
64) and wrong only in its own part of the input space or of the contract. Each carries ``recipe``,
``description``, ``source`` and ``dimension`` attributes.

Each is a record of the known-bad registry (tags ``zoo``, ``wild``; judged by the quick suite's gate,
``tests/test_wild_zoo.py``) built on this file's fp32 attention (``fp32_attention``), or one of the
registry's records that had been written twice: ``gqa_repeat_not_interleave`` is ``wrapper.gqa.modulo``,
``assumes_contiguous_layout`` ``wrapper.stride.storage-as-contiguous``, ``fp16_computed_in_bf16``
``wrapper.dtype.fp16-via-bf16``, ``nan_to_num_output`` ``wrapper.nan.out-to-num`` and
``scale_zero_means_default`` the convention zoo's ``zero_scale_is_default``, each built on
``fp32_attention`` as they were written here; ``causal_top_left`` is the targeted zoo's
``top_left_causal`` (the emulated flamia-mxfp8) and ``causal_offset_from_max_seqlen`` the causal zoo's
``offset_from_max_seqlens`` (torch SDPA per document).

``CORRECT_WILD`` maps a name to a correct kernel of varied implementation that a verifier must not flag.

``demonstrate(name)`` builds one concrete CPU input on which bug ``name`` differs from a float64 reference
(or from itself, for the non-determinism bug) and returns a one-line description of the difference.
"""

from __future__ import annotations

import functools
import math
import random
from collections.abc import Callable

import torch
import torch.nn.functional as F

from flamia_verify.formats import E4M3, ScaleRule, fp8_row_quantize, fp8_tensor_quantize, mx_fake_quantize
from flamia_verify.kernels.designs import DESIGNS
from flamia_verify.kernels.emulation import Quant, emulated_forward_with_lse, make_kernel
from flamia_verify.known_bad import KNOWN_BAD, KnownBad
from flamia_verify.recipes.operands import Operand

__all__ = ["CORRECT_WILD", "WILD", "demonstrate", "reference", "ordinary_case", "make_case", "run_case"]

LN2 = math.log(2.0)
_INF = math.inf


# ----------------------------------------------------------------------------------------------
# shared helpers
# ----------------------------------------------------------------------------------------------


def _documents(cu_q, cu_k):
    cq = [int(x) for x in cu_q.tolist()]
    ck = [int(x) for x in cu_k.tolist()]
    return [(cq[b], cq[b + 1], ck[b], ck[b + 1]) for b in range(len(cq) - 1)]


def _visible(lq: int, lk: int, causal: bool, offset: int | None = None, device=None) -> torch.Tensor:
    """(lq, lk) bool: key j visible to query i; causal is bottom-right aligned unless offset is given."""
    if not causal:
        return torch.ones(lq, lk, dtype=torch.bool, device=device)
    off = lk - lq if offset is None else offset
    i = torch.arange(lq, device=device)[:, None]
    j = torch.arange(lk, device=device)[None, :]
    return j <= i + off


def _kv_divide(h: int, hk: int) -> torch.Tensor:
    return torch.arange(h) // (h // hk)


class _GradEdit(torch.autograd.Function):
    """Identity forward; the backward passes the incoming gradient through ``edit``."""

    @staticmethod
    def forward(ctx, x, edit):
        ctx.edit = edit
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return ctx.edit(g.clone()), None


def _ste(x: torch.Tensor, rounded: torch.Tensor) -> torch.Tensor:
    """Value of ``rounded``, gradient of ``x`` (a straight-through rounding)."""
    return x + (rounded.to(x.dtype) - x).detach()


def _fwd_of(value: torch.Tensor, graph: torch.Tensor) -> torch.Tensor:
    """The value of ``value`` with the gradient of ``graph`` (for backward-only defects)."""
    return value.detach() + (graph - graph.detach())


def _pv(p: torch.Tensor, vd: torch.Tensor, vis: torch.Tensor, plain: bool) -> torch.Tensor:
    """(H, Lq, Lk) weights times (Lk, H, D) values -> (H, Lq, D); masked keys never touch the output
    unless ``plain`` (then a masked key's inf/NaN value leaks through 0 * inf)."""
    if plain:
        return torch.einsum("hqk,khd->hqd", p, vd)
    finite = torch.isfinite(vd)
    o = torch.einsum("hqk,khd->hqd", p, torch.where(finite, vd, torch.zeros((), dtype=vd.dtype)))
    if bool(finite.all()):
        return o
    bad = torch.where(finite, torch.zeros((), dtype=vd.dtype), vd).permute(1, 0, 2)  # (H, Lk, D)
    h, lq, lk = p.shape
    rows = max(1, (1 << 22) // max(1, h * lk * vd.shape[-1]))
    extra = []
    for r0 in range(0, lq, rows):
        pr = p[:, r0 : r0 + rows, :, None]
        vr = vis[r0 : r0 + rows, :, None][None]
        extra.append(torch.where(vr, pr * bad[:, None], torch.zeros((), dtype=vd.dtype)).sum(2))
    return o + torch.cat(extra, dim=1)


def _doc_attention(
    qd,
    kd,
    vd,
    scale,
    vis,
    *,
    mask_value=-_INF,
    rowmax_heads=False,
    no_max=False,
    raw_score_fn=None,
    p_round=None,
    plain_pv=False,
):
    """One document: qd (Lq, H, D), kd/vd (Lk, H, D) (kv already expanded to H heads), vis (Lq, Lk).

    Returns o (Lq, H, D) and the natural-log lse (H, Lq) of the scaled scores, in the input's float dtype.
    """
    s = torch.einsum("qhd,khd->hqk", qd, kd)
    if raw_score_fn is not None:
        s = raw_score_fn(s)
    s = s * scale
    s = s.masked_fill(~vis[None], mask_value)
    if no_max:
        m = torch.zeros(s.shape[:-1] + (1,), dtype=s.dtype, device=s.device)
        p = torch.exp(s.clamp(max=80.0))
    else:
        if rowmax_heads:
            m = s.detach().amax(dim=(0, 2), keepdim=True).expand(s.shape[0], -1, 1)
        else:
            m = s.detach().amax(dim=-1, keepdim=True)
        m = torch.where(torch.isfinite(m), m, torch.zeros((), dtype=m.dtype))
        p = torch.exp(s - m)
    lsum = p.sum(-1)
    p_used = p if p_round is None else p_round(p)
    o = _pv(p_used, vd, vis, plain_pv)
    ok = lsum != 0
    o = o / torch.where(ok, lsum, torch.ones((), dtype=lsum.dtype))[..., None]
    o = torch.where(ok[..., None], o, torch.zeros((), dtype=o.dtype))
    lse = (m[..., 0] + torch.log(lsum)).detach()
    return o.transpose(0, 1), lse


def _attend(
    q,
    k,
    v,
    cu_q,
    cu_k,
    scale,
    causal,
    *,
    work=torch.float32,
    max_q=None,
    max_k=None,
    kv_map: Callable | None = None,
    expand: Callable | None = None,
    offset_fn: Callable | None = None,
    doc_filter: Callable | None = None,
    key_range: Callable | None = None,
    empty_k="zero",
    pad_keys_to=None,
    tile_overread=None,
    doc_fn: Callable | None = None,
    **doc_kwargs,
):
    """Per-document attention over a packed batch: out (total_q, H, D) and lse (H, total_q), both in ``work``.

    The keyword hooks let a kernel change one step (the kv head map, the causal offset, which documents
    run, the key range of a document, ...); with none given this is a correct float32 (or float64) kernel.
    """
    total_q, h, d = q.shape
    total_k, hk = k.shape[0], k.shape[1]
    dev = q.device
    out = torch.zeros(total_q, h, d, dtype=work, device=dev)
    lse = torch.full((h, total_q), -_INF, dtype=work, device=dev)
    kv_idx = (kv_map or _kv_divide)(h, hk).to(dev)
    for b, (q0, q1, k0, k1) in enumerate(_documents(cu_q, cu_k)):
        lq, lk = q1 - q0, k1 - k0
        if lq <= 0:
            continue
        if doc_filter is not None and not doc_filter(b):
            continue
        if key_range is not None:
            k0, k1 = key_range(k0, k1, total_k)
            lk = k1 - k0
        if lk <= 0:
            if empty_k == "nan":
                out[q0:q1] = math.nan
            continue
        qd = q[q0:q1].to(work)
        vis = _visible(lq, lk, causal, None if offset_fn is None else offset_fn(lq, lk), device=dev)
        read1 = k1
        if tile_overread is not None:
            read1 = min(k0 + -(-lk // tile_overread) * tile_overread, total_k)
        kd = k[k0:read1].to(work)
        vd = v[k0:read1].to(work)
        if read1 > k1:
            vis = torch.cat([vis, torch.zeros(lq, read1 - k1, dtype=torch.bool, device=dev)], dim=1)
        if expand is not None:
            kd, vd = expand(kd, h), expand(vd, h)
        else:
            kd, vd = kd[:, kv_idx], vd[:, kv_idx]
        if pad_keys_to is not None and not causal and pad_keys_to > lk:
            pad = pad_keys_to - lk
            kd = torch.cat([kd, kd.new_zeros(pad, h, d)])
            vd = torch.cat([vd, vd.new_zeros(pad, h, d)])
            vis = torch.ones(lq, pad_keys_to, dtype=torch.bool, device=dev)
        fn = doc_fn or _doc_attention
        o, ls = fn(qd, kd, vd, scale, vis, **doc_kwargs)
        out[q0:q1] = o
        lse[:, q0:q1] = ls
    return out, lse


def _scale_of(q, softmax_scale):
    return q.shape[-1] ** -0.5 if softmax_scale is None else float(softmax_scale)


def _base(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=None, causal=False, **hooks):
    out, _ = _attend(q, k, v, cu_q, cu_k, _scale_of(q, softmax_scale), causal, max_q=max_q, max_k=max_k, **hooks)
    return out.to(q.dtype)


def _base_lse(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=None, causal=False, **hooks):
    out, lse = _attend(q, k, v, cu_q, cu_k, _scale_of(q, softmax_scale), causal, max_q=max_q, max_k=max_k, **hooks)
    return out.to(q.dtype), lse.float()


def fp32_attention(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=None, causal=False):
    """This file's correct kernel: fp32 attention per document (the base its bugs are built on)."""
    return _base(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=softmax_scale, causal=causal)


fp32_attention.recipe = "bf16"  # type: ignore[attr-defined]
_FP32 = "zoo.wild_bugs:fp32_attention"


def reference(q, k, v, cu_q, cu_k, softmax_scale=None, causal=False):
    """float64 (out, lse) of the convention, differentiable (q, k, v may be float64 leaves)."""
    q64, k64, v64 = q.double(), k.double(), v.double()
    return _attend(q64, k64, v64, cu_q, cu_k, _scale_of(q, softmax_scale), causal, work=torch.float64)


def _as_if_contiguous(x: torch.Tensor) -> torch.Tensor:
    """Read x's storage from its offset as if x were contiguous (what raw pointer arithmetic does)."""
    if x.is_contiguous():
        return x
    strides = torch.empty(x.shape, dtype=torch.int8, device="meta").stride()
    size = x.untyped_storage().nbytes() // x.element_size()
    if x.storage_offset() + x.numel() > size:
        return x.contiguous()
    return x.as_strided(x.shape, strides, x.storage_offset())


def _describe(recipe: str, description: str, source: str = "", dimension: str = ""):
    def mark(fn):
        fn.recipe = recipe
        fn.description = description
        if source:
            fn.source = source
        if dimension:
            fn.dimension = dimension
        return fn

    return mark


# ----------------------------------------------------------------------------------------------
# tiled, split-kv and manual-backward building blocks
# ----------------------------------------------------------------------------------------------


def _doc_tiled(qd, kd, vd, scale, vis, *, tile=128, rescale_acc=True, acc_round=None):
    """Online softmax over key tiles of ``tile`` (FlashAttention's forward loop); ``acc_round`` rounds the
    unnormalised output accumulator after every tile (a narrower accumulator)."""
    h, lq, d = qd.shape[1], qd.shape[0], qd.shape[2]
    lk = kd.shape[0]
    m = torch.full((h, lq, 1), -_INF, dtype=qd.dtype, device=qd.device)
    lsum = torch.zeros(h, lq, 1, dtype=qd.dtype, device=qd.device)
    acc = torch.zeros(h, lq, d, dtype=qd.dtype, device=qd.device)
    for t0 in range(0, lk, tile):
        t1 = min(t0 + tile, lk)
        s = torch.einsum("qhd,khd->hqk", qd, kd[t0:t1]) * scale
        s = s.masked_fill(~vis[None, :, t0:t1], -_INF)
        m_new = torch.maximum(m, s.detach().amax(-1, keepdim=True))
        m_safe = torch.where(torch.isfinite(m_new), m_new, torch.zeros((), dtype=m_new.dtype))
        alpha = torch.exp(m - m_safe)
        p = torch.exp(s - m_safe)
        lsum = lsum * alpha + p.sum(-1, keepdim=True)
        pv = _pv(p, vd[t0:t1], vis[:, t0:t1], plain=False)
        acc = (acc * alpha if rescale_acc else acc) + pv
        if acc_round is not None:
            acc = acc_round(acc)
        m = m_new
    ok = lsum != 0
    o = torch.where(ok, acc / torch.where(ok, lsum, torch.ones((), dtype=lsum.dtype)), torch.zeros((), dtype=acc.dtype))
    m_safe = torch.where(torch.isfinite(m), m, torch.zeros((), dtype=m.dtype))
    return o.transpose(0, 1), (m_safe + torch.log(lsum))[..., 0].detach()


def _doc_splitkv(qd, kd, vd, scale, vis, *, n_keys, split=256, empty_lse_zero=True):
    """Split-kv forward: each split of ``split`` keys over [0, n_keys) normalizes on its own, then the
    splits are merged by their lse."""
    lk = kd.shape[0]
    outs, lses = [], []
    for a in range(0, max(n_keys, lk), split):
        b = min(a + split, lk)
        if a >= lk:
            # a split past the document's end does no work; its lse slot keeps its initial value
            fill = 0.0 if empty_lse_zero else -_INF
            outs.append(torch.zeros_like(qd).transpose(0, 1))
            lses.append(torch.full((qd.shape[1], qd.shape[0]), fill, dtype=qd.dtype, device=qd.device))
            continue
        o, ls = _doc_attention(qd, kd[a:b], vd[a:b], scale, vis[:, a:b])
        outs.append(o.transpose(0, 1))
        lses.append(ls)
    lse_all = torch.stack(lses)  # (S, H, Lq)
    mx = lse_all.amax(0)
    mx = torch.where(torch.isfinite(mx), mx, torch.zeros((), dtype=mx.dtype))
    w = torch.exp(lse_all - mx)  # (S, H, Lq)
    den = w.sum(0)
    num = sum(w[i][..., None] * outs[i] for i in range(len(outs)))
    ok = den != 0
    o = torch.where(ok[..., None], num / torch.where(ok, den, torch.ones((), dtype=den.dtype))[..., None], 0.0)
    return o.transpose(0, 1), (mx + torch.log(den)).detach()


class _ManualDoc(torch.autograd.Function):
    """One document with a hand-written FlashAttention-2 style backward; dQ is accumulated over key tiles
    of 32 (in a random order when ``shuffle``, like fp32 atomic adds from concurrent thread blocks)."""

    @staticmethod
    def forward(ctx, qd, kd, vd, scale, vis, shuffle):
        s = torch.einsum("qhd,khd->hqk", qd, kd) * scale
        s = s.masked_fill(~vis[None], -_INF)
        m = s.amax(-1, keepdim=True)
        m = torch.where(torch.isfinite(m), m, torch.zeros((), dtype=m.dtype))
        p = torch.exp(s - m)
        lsum = p.sum(-1, keepdim=True)
        a = p / torch.where(lsum != 0, lsum, torch.ones((), dtype=lsum.dtype))
        o = _pv(a, vd, vis, plain=False).transpose(0, 1)
        ctx.save_for_backward(qd, kd, vd, a, o)
        ctx.scale, ctx.shuffle = scale, shuffle
        return o

    @staticmethod
    def backward(ctx, do):
        qd, kd, vd, a, o = ctx.saved_tensors
        do = do.to(qd.dtype)
        dv = torch.einsum("hqk,qhd->khd", a, do)
        dp = torch.einsum("qhd,khd->hqk", do, vd)
        di = (do * o).sum(-1).transpose(0, 1)[..., None]  # (H, Lq, 1)
        ds = a * (dp - di)
        dk = torch.einsum("hqk,qhd->khd", ds, qd) * ctx.scale
        lk = kd.shape[0]
        tiles = list(range(0, lk, 32))
        if ctx.shuffle:
            random.SystemRandom().shuffle(tiles)
        dq = torch.zeros_like(qd)
        for t0 in tiles:
            dq = dq + torch.einsum("hqk,khd->qhd", ds[:, :, t0 : t0 + 32], kd[t0 : t0 + 32]) * ctx.scale
        return dq, dk, dv, None, None, None


def _doc_manual(qd, kd, vd, scale, vis, *, shuffle_from=None):
    shuffle = shuffle_from is not None and kd.shape[0] >= shuffle_from
    o = _ManualDoc.apply(qd, kd, vd, scale, vis, shuffle)
    return o, torch.zeros(qd.shape[1], qd.shape[0], dtype=qd.dtype, device=qd.device)


class _ExpandPairs(torch.autograd.Function):
    """kv heads repeated to the query heads; the backward sums each group's gradients two heads at a
    time (an unrolled reduction that assumes an even group)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.repeat_interleave(group, dim=1)

    @staticmethod
    def backward(ctx, g):
        group = ctx.group
        if group == 1:
            return g, None
        t, h, d = g.shape
        g = g.reshape(t, h // group, group, d)
        acc = torch.zeros_like(g[:, :, 0])
        for j in range(0, group - 1, 2):
            acc = acc + g[:, :, j] + g[:, :, j + 1]
        return acc, None


class _DoutAsContiguous(torch.autograd.Function):
    """Identity; the backward only checks that the output gradient's last stride is 1 and then reads it
    as if it were contiguous."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        if g.stride(-1) == 1:
            return _as_if_contiguous(g)
        return g.contiguous()


# ----------------------------------------------------------------------------------------------
# the buggy kernels
# ----------------------------------------------------------------------------------------------

WILD: dict[str, Callable] = {}
_records: list[KnownBad] = []


class _Hooked:
    """A build: the kernel ``fn`` (the base, this file's fp32 attention, run with one of its hooks set)."""

    def __init__(self, fn):
        self.fn = fn

    def __call__(self, base):
        return self.fn


def _bug(name, recipe, description, source, dimension):
    def register(fn):
        fn.__name__ = name
        _records.append(
            KnownBad(
                name,
                "wild",
                description,
                _Hooked(fn),
                base=_FP32,
                recipe=recipe,
                where=dimension,
                source=source,
                tags=("zoo", "wild"),
                attrs=(("description", description), ("dimension", dimension)),
            )
        )
        return fn

    return register


@_bug(
    "scale_default_from_nheads",
    "bf16",
    "With softmax_scale=None the default scale is taken from q.shape[-2] (the number of heads) instead of "
    "the head dimension q.shape[-1].",
    "Wrapper reports where the default softmax scale was computed from the wrong tensor dimension.",
    "softmax_scale=None (argument defaults)",
)
def _scale_default_from_nheads(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=None, causal=False):
    scale = softmax_scale if softmax_scale is not None else q.shape[-2] ** -0.5
    return _base(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=scale, causal=causal)


@_bug(
    "bwd_scale_none_is_one",
    "bf16",
    "The forward fills in the default scale, but the autograd context stores the raw softmax_scale argument "
    "and the backward falls back to 1.0 when it is None.",
    "Reports of gradients that disagree with the forward because the backward received a different softmax "
    "scale than the forward.",
    "softmax_scale=None, backward only",
)
def _bwd_scale_none_is_one(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=None, causal=False):
    fwd = _base(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=softmax_scale, causal=causal)
    bwd_scale = 1.0 if softmax_scale is None else softmax_scale
    graph = _base(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=bwd_scale, causal=causal)
    return _fwd_of(fwd, graph)


@_bug(
    "bwd_causal_top_left",
    "bf16",
    "The forward uses the bottom-right causal mask but the backward kernel recomputes P with a top-left mask.",
    "Reports of a backward kernel whose mask template disagreed with the forward's for unequal lengths.",
    "causal with seqlen_q != seqlen_k, backward only",
)
def _bwd_causal_top_left(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=None, causal=False):
    fwd = _base(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=softmax_scale, causal=causal)
    graph = _base(
        q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=softmax_scale, causal=causal, offset_fn=lambda lq, lk: 0
    )
    return _fwd_of(fwd, graph)


@_bug(
    "finite_mask_value",
    "bf16",
    "Masked scores are filled with -10000 instead of -inf, so a query row that sees no key gets a uniform "
    "average over all the document's keys instead of zero output.",
    "Reports of attention wrappers using a large finite negative mask value and leaking weight into fully masked rows.",
    "causal with seqlen_q > seqlen_k (rows without visible keys)",
)
def _finite_mask_value(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=None, causal=False):
    return _base(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=softmax_scale, causal=causal, mask_value=-1e4)


@_bug(
    "pad_without_key_mask",
    "bf16",
    "The non-causal path pads every document's keys to max_seqlen_k with zeros and forgets the key padding "
    "mask, so the padding keys (score 0, value 0) dilute the softmax.",
    "Pad/unpad wrapper reports where the key padding mask was dropped on one code path.",
    "non-causal with documents shorter than max_seqlen_k",
)
def _pad_without_key_mask(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=None, causal=False):
    return _base(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=softmax_scale, causal=causal, pad_keys_to=int(max_k))


@_bug(
    "splitkv_empty_split_lse",
    "bf16",
    "Above max_seqlen_k 512 the split-kv path splits [0, max_seqlen_k) into 256-key splits; a split past a "
    "document's end leaves its lse slot at the zero it was allocated with, so the merge gives it weight.",
    "Split-KV / flash-decoding combine reports where splits without work were not written as -inf.",
    "max_seqlen_k > 512 with documents shorter than max_seqlen_k",
)
def _splitkv_empty_split_lse(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=None, causal=False):
    if int(max_k) <= 512:
        return _base(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=softmax_scale, causal=causal)
    return _base(
        q,
        k,
        v,
        cu_q,
        cu_k,
        max_q,
        max_k,
        softmax_scale=softmax_scale,
        causal=causal,
        doc_fn=_doc_splitkv,
        n_keys=int(max_k),
    )


@_bug(
    "lse_log2_hdim128",
    "bf16",
    "The head_dim >= 128 kernel instantiation returns its internal base-2 log-sum-exp instead of converting "
    "it to natural log.",
    "softmax_lse reports where one kernel variant returned the log2-domain statistic.",
    "returned lse, head_dim >= 128",
)
def _lse_log2_hdim128(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=None, causal=False):
    out, lse = _base_lse(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=softmax_scale, causal=causal)
    if q.shape[-1] >= 128:
        lse = lse / LN2
    return out, lse


@_bug(
    "lse_padded_layout",
    "bf16",
    "The lse is written in the padded (batch, nheads, max_seqlen_q) layout and then returned as its first "
    "total_q columns, as if it were already the packed (nheads, total_q) layout.",
    "Reports on the varlen softmax_lse layout change from padded (B, H, max_seqlen_q) to packed (H, total_q).",
    "returned lse with unequal query lengths",
)
def _lse_padded_layout(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=None, causal=False):
    out, lse = _base_lse(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=softmax_scale, causal=causal)
    h, total_q = lse.shape
    docs = _documents(cu_q, cu_k)
    buf = torch.zeros(h, max(1, len(docs)) * int(max_q), dtype=lse.dtype, device=lse.device)
    for b, (q0, q1, _, _) in enumerate(docs):
        buf[:, b * int(max_q) : b * int(max_q) + q1 - q0] = lse[:, q0:q1]
    if buf.shape[1] < total_q:
        buf = torch.cat([buf, torch.zeros(h, total_q - buf.shape[1], dtype=lse.dtype, device=lse.device)], dim=1)
    return out, buf[:, :total_q]


@_bug(
    "v_head_stride_assumed",
    "bf16",
    "V is read honoring its row stride but assuming a head stride of head_dim, which holds for row-major "
    "and fused-qkv layouts but not for head-major (transposed) storage.",
    "Reports of TMA/descriptor setup that took one stride from the tensor and hard-coded the other.",
    "V in head-major (transposed) storage",
)
def _v_head_stride_assumed(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=None, causal=False):
    d = v.shape[-1]
    if v.stride(-1) == 1 and v.stride(1) != d:
        size = v.untyped_storage().nbytes() // v.element_size()
        last = v.storage_offset() + (v.shape[0] - 1) * v.stride(0) + (v.shape[1] - 1) * d + d - 1
        if last < size:
            v = v.as_strided(v.shape, (v.stride(0), d, 1), v.storage_offset())
    return _base(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=softmax_scale, causal=causal)


@_bug(
    "bwd_dout_stride_check",
    "bf16",
    "The backward only checks that the output gradient's last stride is 1 and then reads it as contiguous, "
    "so a dout that is a slice of a larger gradient (e.g. after torch.cat) is read from the wrong places.",
    "Reports of incorrect backward for non-contiguous output gradients (dout from cat or split).",
    "non-contiguous output gradient, backward only",
)
def _bwd_dout_stride_check(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=None, causal=False):
    out = _base(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=softmax_scale, causal=causal)
    return _DoutAsContiguous.apply(out)


@_bug(
    "gqa_group_shift",
    "bf16",
    "The kv head index is computed as h >> int(log2(group)) (wrapped to nheads_k), which is right only for "
    "power-of-two group sizes.",
    "GQA index arithmetic reports where the group size was assumed to be a power of two.",
    "GQA with a non-power-of-two group size (3, 5, 6, ...)",
)
def _gqa_group_shift(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=None, causal=False):
    def kv_map(h, hk):
        shift = int(math.log2(h // hk))
        return (torch.arange(h) >> shift) % hk

    return _base(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=softmax_scale, causal=causal, kv_map=kv_map)


@_bug(
    "bwd_gqa_odd_group",
    "bf16",
    "The dK/dV reduction over the query heads of a GQA group is unrolled two heads at a time and drops the "
    "last head when the group size is odd.",
    "Reports of wrong dK/dV for some GQA ratios in backward kernels that unroll the head-group reduction.",
    "GQA with an odd group size > 1, backward only (dK, dV)",
)
def _bwd_gqa_odd_group(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=None, causal=False):
    group = q.shape[1] // k.shape[1]
    return _base(
        q,
        k,
        v,
        cu_q,
        cu_k,
        max_q,
        max_k,
        softmax_scale=softmax_scale,
        causal=causal,
        expand=lambda x, h: _ExpandPairs.apply(x, group),
    )


@_bug(
    "empty_key_doc_nan",
    "bf16",
    "A document with queries but zero keys divides 0 by 0 and outputs NaN instead of zeros.",
    "Reports of zero-length KV sequences in varlen batches producing NaN or hangs.",
    "documents with seqlen_k == 0",
)
def _empty_key_doc_nan(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=None, causal=False):
    return _base(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=softmax_scale, causal=causal, empty_k="nan")


@_bug(
    "empty_doc_drops_last",
    "bf16",
    "The wrapper launches one program per non-empty document but indexes documents 0..n-1 of cu_seqlens, so "
    "an empty document before the end pushes the last document out of the launch (its output stays zero).",
    "Reports of empty sequences in the middle of a varlen batch corrupting later sequences.",
    "empty documents at the start or in the middle of the batch",
)
def _empty_doc_drops_last(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=None, causal=False):
    nonempty = int(((cu_q[1:] - cu_q[:-1]) > 0).sum())
    return _base(
        q,
        k,
        v,
        cu_q,
        cu_k,
        max_q,
        max_k,
        softmax_scale=softmax_scale,
        causal=causal,
        doc_filter=lambda b: b < nonempty,
    )


@_bug(
    "decode_inclusive_key_end",
    "bf16",
    "The single-token-query (max_seqlen_q == 1, decode) path treats cu_seqlens_k[b+1] as an inclusive end "
    "and attends to one extra key, the first key of the next document.",
    "Decode-path varlen reports with off-by-one key ranges between paged and packed layouts.",
    "max_seqlen_q == 1 (decode) batches",
)
def _decode_inclusive_key_end(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=None, causal=False):
    key_range = None
    if int(max_q) == 1:

        def key_range(k0, k1, total_k):
            return k0, min(k1 + 1, total_k)

    return _base(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=softmax_scale, causal=causal, key_range=key_range)


@_bug(
    "online_softmax_no_rescale",
    "bf16",
    "The online softmax rescales the running row sum but not the output accumulator when the running max "
    "grows, so documents longer than one 128-key tile are wrong.",
    "Custom FlashAttention kernel reports where the accumulator correction exp(m_old - m_new) was missed.",
    "documents with more than 128 keys",
)
def _online_softmax_no_rescale(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=None, causal=False):
    return _base(
        q,
        k,
        v,
        cu_q,
        cu_k,
        max_q,
        max_k,
        softmax_scale=softmax_scale,
        causal=causal,
        doc_fn=_doc_tiled,
        rescale_acc=False,
    )


def _drop_tail_tile(cu_k):
    docs = _documents(cu_k, cu_k)

    def edit(g):
        for _, _, k0, k1 in docs:
            lk = k1 - k0
            if lk > 128 and lk % 128:
                g[k0 + (lk // 128) * 128 : k1] = 0
        return g

    return edit


@_bug(
    "bwd_tail_tile_dropped",
    "bf16",
    "For documents longer than one 128-key tile, the backward's key-tile loop runs seqlen_k // 128 times and "
    "never writes dK/dV for the last partial tile.",
    "Backward kernel reports with tile-count rounding (floor instead of ceil) for non-multiple lengths.",
    "documents with more than 128 keys and seqlen_k % 128 != 0, backward only (dK, dV)",
)
def _bwd_tail_tile_dropped(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=None, causal=False):
    edit = _drop_tail_tile(cu_k)
    k, v = _GradEdit.apply(k, edit), _GradEdit.apply(v, edit)
    return _base(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=softmax_scale, causal=causal)


@_bug(
    "tile_overread_next_doc",
    "bf16",
    "Keys are loaded in whole 128-key tiles from the document start, reading into the next document; the "
    "extra keys are masked in the scores but P @ V still multiplies their values by 0, so an inf or NaN "
    "value in another document turns this document's output into NaN.",
    "Reports of NaN/inf in padding or neighbouring sequences leaking through 0 * inf in masked tiles.",
    "non-finite values in another document",
)
def _tile_overread_next_doc(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=None, causal=False):
    return _base(
        q,
        k,
        v,
        cu_q,
        cu_k,
        max_q,
        max_k,
        softmax_scale=softmax_scale,
        causal=causal,
        tile_overread=128,
        plain_pv=True,
    )


@_bug(
    "grid_caps_documents",
    "bf16",
    "The launch grid's batch dimension is capped at 64 programs, so documents past the 64th are never "
    "computed and their output stays zero.",
    "Reports of grid-dimension limits silently dropping work for large batch or head counts.",
    "more than 64 documents",
)
def _grid_caps_documents(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=None, causal=False):
    return _base(
        q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=softmax_scale, causal=causal, doc_filter=lambda b: b < 64
    )


_META_CACHE: dict = {}


@_bug(
    "stale_metadata_cache",
    "bf16",
    "Per-batch document metadata is cached under (batch size, max_seqlen_q, max_seqlen_k, total_q, total_k), "
    "so a later call with the same sizes but different document boundaries reuses stale offsets.",
    "Serving-engine reports of attention metadata reused across steps (graph capture, metadata caches).",
    "repeated calls with the same batch sizes but different cu_seqlens",
)
def _stale_metadata_cache(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=None, causal=False):
    key = (int(cu_q.numel()), int(max_q), int(max_k), int(q.shape[0]), int(k.shape[0]))
    if key not in _META_CACHE:
        _META_CACHE[key] = (cu_q.clone(), cu_k.clone())
    cq, ck = _META_CACHE[key]
    return _base(q, k, v, cq, ck, max_q, max_k, softmax_scale=softmax_scale, causal=causal)


@_bug(
    "rowmax_across_heads",
    "bf16",
    "The softmax running max is reduced across all heads of a query row (a shared warp reduction) instead "
    "of per head, so a head whose scores are far below another head's underflows to zero output.",
    "Reports of reductions spanning the wrong axis (heads) in fused softmax kernels.",
    "heads with very different score ranges",
)
def _rowmax_across_heads(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=None, causal=False):
    return _base(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=softmax_scale, causal=causal, rowmax_heads=True)


@_bug(
    "heads_permuted_over_8",
    "bf16",
    "With more than 8 heads the output is written through a (8, nheads/8) head tiling read back in the other "
    "order, so output heads are permuted.",
    "Reports of head-dimension reshape/transposes in epilogues producing permuted heads for large head counts.",
    "nheads > 8 (multiple of 8)",
)
def _heads_permuted_over_8(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=None, causal=False):
    out = _base(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=softmax_scale, causal=causal)
    t, h, d = out.shape
    if h > 8 and h % 8 == 0:
        out = out.reshape(t, 8, h // 8, d).transpose(1, 2).reshape(t, h, d)
    return out


@_bug(
    "bwd_dq_rescaled_heads_ge4",
    "bf16",
    "The backward processes heads in chunks of 4 and, for every chunk after the first, multiplies dQ by the "
    "softmax scale a second time.",
    "Backward reports where gradients were wrong only for some heads of a chunked launch.",
    "nheads > 4, backward only (dQ)",
)
def _bwd_dq_rescaled_heads_ge4(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=None, causal=False):
    scale = _scale_of(q, softmax_scale)

    def edit(g):
        g[:, 4:] = g[:, 4:] * scale
        return g

    q = _GradEdit.apply(q, edit)
    return _base(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=softmax_scale, causal=causal)


@_bug(
    "hdim_over_128_exp2",
    "bf16",
    "The head_dim > 128 forward instantiation uses exp2 on the scaled scores without folding in log2(e), so "
    "its effective softmax scale is softmax_scale * ln 2.",
    "Reports of large head dimensions (192, 256) taking a separate kernel path with wrong results.",
    "head_dim > 128",
)
def _hdim_over_128_exp2(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=None, causal=False):
    scale = _scale_of(q, softmax_scale)
    if q.shape[-1] > 128:
        scale = scale * LN2
    return _base(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=scale, causal=causal)


@_bug(
    "bwd_dq_hdim_tail",
    "bf16",
    "For head dimensions above 64 that are not a multiple of 64 (80, 96, 160, 192), the backward pads the "
    "head dimension to the tile and never writes the last partial chunk of dQ's columns.",
    "Reports of wrong dQ for padded head dimensions where the tile granularity and the accumulator "
    "allocation disagreed.",
    "head_dim > 64 not a multiple of 64, backward only (dQ)",
)
def _bwd_dq_hdim_tail(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=None, causal=False):
    d = q.shape[-1]
    if d > 64 and d % 64:
        cut = (d // 64) * 64

        def edit(g):
            g[..., cut:] = 0
            return g

        q = _GradEdit.apply(q, edit)
    return _base(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=softmax_scale, causal=causal)


@_bug(
    "fp16_unscaled_scores",
    "bf16",
    "For fp16 inputs the raw Q K^T is stored in fp16 before the softmax scale is applied, so large scores "
    "overflow to inf (and the softmax gives NaN).",
    "SageAttention/FP16-accumulation reports of overflow in QK^T for fp16 inputs with large activations.",
    "fp16 inputs with large-magnitude q, k",
)
def _fp16_unscaled_scores(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=None, causal=False):
    raw = None
    if q.dtype == torch.float16:

        def raw(s):
            return s.to(torch.float16).to(s.dtype)

    return _base(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=softmax_scale, causal=causal, raw_score_fn=raw)


@_bug(
    "softmax_without_max",
    "bf16",
    "The softmax exponentiates the scaled scores without subtracting the row max, clamping them at 80 to "
    "avoid fp32 overflow, so rows with scores above 80 get equal weights on all large keys.",
    "Reports of custom attention kernels skipping the max subtraction and clamping logits.",
    "large-magnitude scores (scaled scores > 80)",
)
def _softmax_without_max(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=None, causal=False):
    return _base(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=softmax_scale, causal=causal, no_max=True)


@_bug(
    "nondeterministic_dq_long",
    "bf16",
    "For documents with at least 1024 keys the backward accumulates dQ over key tiles in a random order "
    "(fp32 atomics), so dQ is not bitwise reproducible.",
    "Reports of non-deterministic FlashAttention backward (atomicAdd on dQ) for long sequences.",
    "documents with >= 1024 keys, backward determinism",
)
def _nondeterministic_dq_long(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=None, causal=False):
    return _base(
        q,
        k,
        v,
        cu_q,
        cu_k,
        max_q,
        max_k,
        softmax_scale=softmax_scale,
        causal=causal,
        doc_fn=_doc_manual,
        shuffle_from=1024,
    )


def _p_to_e4m3(p):
    return _ste(p, p.to(torch.float8_e4m3fn).to(p.dtype))


@_bug(
    "fp8_p_in_hdim128_path",
    "bf16",
    "The head_dim >= 128 fast path rounds the unnormalized probabilities P to E4M3 before P @ V while "
    "claiming bf16 precision.",
    "SageAttention/FA3-style reports of a low-precision P @ V path taken silently for some head dimensions.",
    "head_dim >= 128 (precision claim)",
)
def _fp8_p_in_hdim128_path(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=None, causal=False):
    p_round = _p_to_e4m3 if q.shape[-1] >= 128 else None
    return _base(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=softmax_scale, causal=causal, p_round=p_round)


_MXFP8 = make_kernel(DESIGNS["flamia-mxfp8"])
_FP8 = make_kernel(DESIGNS["fp8"])


@_bug(
    "mxfp8_v_blocks_packed",
    "mxfp8",
    "Before the MXFP8 kernel, V is fake-quantized along the packed token axis in 32-token blocks that "
    "ignore document boundaries, so one document's values set the scale of its neighbour's block.",
    "MXFP8 / blockwise-FP8 reports of scale blocks along the sequence crossing packed sequence boundaries.",
    "document boundaries not on a multiple of 32 tokens (low-precision layout)",
)
def _mxfp8_v_blocks_packed(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=None, causal=False):
    # the scale blocks are cut at packed positions; where a block lies inside one document this is what the
    # per-document kernel does anyway, so only the blocks that straddle a document boundary change
    tokens = v.shape[0]
    doc_of = torch.zeros(tokens, dtype=torch.long)
    for b, (_, _, k0, k1) in enumerate(_documents(cu_k, cu_k)):
        doc_of[k0:k1] = b
    block = torch.arange(tokens) // 32
    nblocks = int(block.max()) + 1 if tokens else 0
    lo = torch.full((nblocks,), tokens, dtype=torch.long).scatter_reduce(0, block, doc_of, "amin")
    hi = torch.zeros(nblocks, dtype=torch.long).scatter_reduce(0, block, doc_of, "amax")
    straddles = (lo != hi)[block].to(v.device)
    if bool(straddles.any()):
        vq = mx_fake_quantize(v.detach().float(), axis=0, block_size=32, elem=E4M3, rule=ScaleRule.RCEIL)
        v = _ste(v, torch.where(straddles[:, None, None], vq, v.detach().float()))
    return _MXFP8(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=softmax_scale, causal=causal)


def _per_head_batch_fp8(x):
    """E4M3 with one power-of-two scale per head over the whole packed batch."""
    parts = []
    for h in range(x.shape[1]):
        data, scale = fp8_tensor_quantize(x[:, h].detach().float(), elem=E4M3, power_of_two=True)
        parts.append(data * scale)
    return _ste(x, torch.stack(parts, dim=1))


def _per_row_fp8(x):
    """E4M3 with one power-of-two scale per (token, head) row, what the fp8 design does to Q and K."""
    data, scale = fp8_row_quantize(x.detach().float(), axis=-1, elem=E4M3, power_of_two=True)
    return _ste(x, data * scale)


# the fp8 design with the head_dim rounding of Q and K moved out into the wrapper below
_FP8_QK_OUTSIDE = make_kernel(
    DESIGNS["fp8"].with_quants(dict.fromkeys((Operand.Q_HD, Operand.K_HD), Quant("input")), name="fp8-qk-outside")
)


@_bug(
    "fp8_k_scale_over_batch",
    "fp8",
    "K is quantized to E4M3 with one power-of-two scale per head computed over the whole packed batch "
    "(instead of per row), so a document with large keys flushes another document's keys toward zero.",
    "FP8 attention reports of per-tensor descale factors shared across the sequences of a batch.",
    "documents with very different key magnitudes (low-precision scale layout)",
)
def _fp8_k_scale_over_batch(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=None, causal=False):
    # forward kernel: the bad K scale; the backward kernel quantizes K per row as the design says
    fwd = _FP8_QK_OUTSIDE(
        _per_row_fp8(q), _per_head_batch_fp8(k), v, cu_q, cu_k, max_q, max_k, softmax_scale=softmax_scale, causal=causal
    )
    graph = _FP8(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=softmax_scale, causal=causal)
    return _fwd_of(fwd, graph)


@_bug(
    "self_attn_fastpath_cu_q_for_k",
    "bf16",
    "A self-attention fast path, chosen when total_q == total_k and max_seqlen_q == max_seqlen_k, passes "
    "cu_seqlens_q for the keys too: right whenever the two splits agree, wrong when they differ with the "
    "same total and maximum.",
    "Packed and ring-attention wrappers that pass one cu_seqlens for queries and keys.",
    "cu_seqlens_k split differently from cu_seqlens_q, same total and maximum",
)
def _self_attn_fastpath_cu_q_for_k(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=None, causal=False):
    if q.shape[0] == k.shape[0] and max_q == max_k:
        cu_k = cu_q
    return _base(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=softmax_scale, causal=causal)


_DECODE_SPLIT = 64


@_bug(
    "splitkv_decode_tail_unmasked",
    "bf16",
    "The decode path (max_seqlen_q == 1, max_seqlen_k above one split) pads each document's keys to a "
    "multiple of 64 with zero keys and values and does not mask the padding: the zero scores join the "
    "softmax and dilute the output of documents whose key count is not a multiple of 64.",
    "Flash-decoding / split-KV kernels whose last split reads padding as keys.",
    "decode against more than 64 keys with a partial last split",
)
def _splitkv_decode_tail_unmasked(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=None, causal=False):
    if max_q == 1 and max_k > _DECODE_SPLIT:
        ck = [int(x) for x in cu_k.tolist()]
        ks, vs, cu = [], [], [0]
        for b in range(len(ck) - 1):
            n = ck[b + 1] - ck[b]
            pad = -n % _DECODE_SPLIT
            ks += [k[ck[b] : ck[b + 1]], k.new_zeros((pad, *k.shape[1:]))]
            vs += [v[ck[b] : ck[b + 1]], v.new_zeros((pad, *v.shape[1:]))]
            cu.append(cu[-1] + n + pad)
        k, v = torch.cat(ks), torch.cat(vs)
        cu_k = torch.tensor(cu, dtype=cu_k.dtype, device=cu_k.device)
        max_k = max(b - a for a, b in zip(cu[:-1], cu[1:]))
    return _base(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=softmax_scale, causal=causal)


@_bug(
    "heads_over_16_launch_kv_index",
    "bf16",
    "Heads run in launches of 16; the second launch offsets the query head but maps it to its kv head "
    "from the launch-local index, so heads 16 and up read the first launch's kv heads (right for H <= 16 "
    "and for Hk == 1).",
    "Launchers that split the head dimension over grid limits and index GQA heads per launch.",
    "more than 16 query heads with more than one kv head",
)
def _heads_over_16_launch_kv_index(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=None, causal=False):
    def kv_map(h, hk):
        group = h // hk
        return torch.tensor([(i % 16) // group if h > 16 else i // group for i in range(h)])

    return _base(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=softmax_scale, causal=causal, kv_map=kv_map)


@_bug(
    "key_loop_capped_at_4096",
    "bf16",
    "The key-tile loop of a program is bounded by a compile-time count (32 tiles of 128 keys) without an "
    "outer loop: keys past 4096 of a document are never read and the softmax is taken over the first 4096.",
    "Kernels whose tile loop bound was sized for the shared-memory pipeline, not for the sequence.",
    "a document with more than 4096 keys",
)
def _key_loop_capped_at_4096(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=None, causal=False):
    def key_range(k0, k1, total_k):
        return k0, min(k1, k0 + 4096)

    return _base(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=softmax_scale, causal=causal, key_range=key_range)


@_bug(
    "lse_zero_for_rows_without_keys",
    "bf16",
    "Returns (out, lse); a row that sees no key gets lse 0 (m started at 0 and l clamped to 1 'to avoid "
    "NaN') instead of -inf, so a merge of partial results weighs the empty row in. out is right.",
    "Ring-attention and split-KV merges that read an empty block's lse as finite.",
    "the returned lse of rows that see no key",
)
def _lse_zero_for_rows_without_keys(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=None, causal=False):
    out, lse = _base_lse(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=softmax_scale, causal=causal)
    return out, torch.where(torch.isneginf(lse), torch.zeros((), dtype=lse.dtype), lse)


@_bug(
    "cu_seqlens_raw_pointer",
    "bf16",
    "cu_seqlens_q and cu_seqlens_k are handed to the kernel as raw pointers without .contiguous(): a view "
    "with a stride (a slice of a larger metadata tensor) is read as if its elements were adjacent.",
    "Launchers that pass tensor.data_ptr() for int32 metadata and check only the dtype and the device.",
    "cu_seqlens as a strided view",
)
def _cu_seqlens_raw_pointer(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=None, causal=False):
    cu_q, cu_k = _as_if_contiguous(cu_q), _as_if_contiguous(cu_k)
    return _base(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=softmax_scale, causal=causal)


@_bug(
    "fp16_output_accumulator",
    "bf16",
    "For fp16 inputs the unnormalised output accumulator of the online softmax is kept in fp16 between key "
    "tiles of 64; rows whose sum of p * v passes 65504 become inf although the normalised output is small.",
    "fp16 accumulation options of attention kernels (half-precision PV accumulators for speed).",
    "fp16 inputs near the top of fp16's range",
)
def _fp16_output_accumulator(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=None, causal=False):
    def half(acc):
        return acc.to(torch.float16).to(acc.dtype)

    kw = {"doc_fn": _doc_tiled, "tile": 64, "acc_round": half if q.dtype == torch.float16 else None}
    return _base(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=softmax_scale, causal=causal, **kw)


def _training(*tensors) -> bool:
    """Whether the call builds a graph (grad mode on and some input requiring grad)."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def _doc_rowmax_before_scale(qd, kd, vd, scale, vis):
    """The running maximum over the raw q.k products, scaled afterwards: for a negative scale that is the
    row's smallest scaled score."""
    raw = torch.einsum("qhd,khd->hqk", qd, kd).masked_fill(~vis[None], -_INF)
    m = scale * raw.amax(-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros((), dtype=m.dtype))
    s = (scale * torch.einsum("qhd,khd->hqk", qd, kd)).masked_fill(~vis[None], -_INF)
    p = torch.exp(s - m)
    lsum = p.sum(-1)
    o = _pv(p, vd, vis, False)
    ok = lsum != 0
    o = torch.where(ok[..., None], o / torch.where(ok, lsum, torch.ones((), dtype=lsum.dtype))[..., None], 0.0)
    return o.transpose(0, 1), (m[..., 0] + torch.log(lsum)).detach()


@_bug(
    "negative_scale_rowmax_before_scale",
    "bf16",
    "The online softmax keeps its running maximum over the raw q.k products and multiplies it by the scale "
    "(the scale folded into the exp2 argument); with a negative softmax_scale that is the row minimum, so "
    "exp(s - m) overflows once a row's scores spread over more than about 88.",
    "Softmax-scale folding into the row maximum in fused attention forward loops.",
    "a negative softmax_scale with widely spread scores",
)
def _negative_scale_rowmax_before_scale(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=None, causal=False):
    kw = {"doc_fn": _doc_rowmax_before_scale} if _scale_of(q, softmax_scale) < 0 else {}
    return _base(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=softmax_scale, causal=causal, **kw)


@_bug(
    "inference_splits_by_sorted_index",
    "bf16",
    "The inference path splits each document's keys into splits of 256 after sorting the documents by key "
    "count, and the combine step reads the split counts by the real document index: a long document after a "
    "shorter one is combined from the shorter one's splits and loses its later keys. Training calls never split.",
    "Varlen split-KV schedulers that sort documents by length (virtual vs real batch index in the combine).",
    "a forward under no_grad with a document of more than 256 keys after a shorter one",
)
def _inference_splits_by_sorted_index(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=None, causal=False):
    if _training(q, k, v):
        return _base(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=softmax_scale, causal=causal)
    ck = cu_k.tolist()
    lens = [b - a for a, b in zip(ck, ck[1:])]
    splits = [-(-n // 256) for n in lens]
    order = sorted(range(len(lens)), key=lambda b: -lens[b])
    used = {ck[b]: min(splits[b], splits[order[b]]) * 256 for b in range(len(lens))}

    def key_range(k0, k1, total_k):
        return k0, min(k1, k0 + used.get(k0, k1 - k0))

    return _base(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=softmax_scale, causal=causal, key_range=key_range)


class _OutAsAttribute(torch.autograd.Function):
    """Attention whose backward reads D = rowsum(dO * O) from the output it returned, kept as a ctx
    attribute (not saved for backward): an in-place edit of that output goes unnoticed."""

    @staticmethod
    def forward(ctx, q, k, v, cu_q, cu_k, scale, causal):
        out, _ = _attend(q, k, v, cu_q, cu_k, scale, causal)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, cu_q, cu_k)
        ctx.scale, ctx.causal, ctx.out = scale, causal, out
        return out

    @staticmethod
    def backward(ctx, do):
        q, k, v, cu_q, cu_k = ctx.saved_tensors
        h, hk = q.shape[1], k.shape[1]
        idx = _kv_divide(h, hk)
        dq, dk, dv = (torch.zeros(x.shape, dtype=torch.float32) for x in (q, k, v))
        for q0, q1, k0, k1 in _documents(cu_q, cu_k):
            if q1 <= q0 or k1 <= k0:
                continue
            qd, kd, vd = q[q0:q1].float(), k[k0:k1].float()[:, idx], v[k0:k1].float()[:, idx]
            vis = _visible(q1 - q0, k1 - k0, ctx.causal)
            s = (torch.einsum("qhd,khd->hqk", qd, kd) * ctx.scale).masked_fill(~vis[None], -_INF)
            a = torch.where(vis.any(-1)[None, :, None], torch.softmax(s, -1), 0.0)  # rows without keys: 0
            g, o = do[q0:q1].float(), ctx.out[q0:q1].float()  # the output as it is now
            dvd = torch.einsum("hqk,qhd->khd", a, g)
            ds = a * (torch.einsum("qhd,khd->hqk", g, vd) - (g * o).sum(-1).transpose(0, 1)[..., None])
            dq[q0:q1] = torch.einsum("hqk,khd->qhd", ds, kd) * ctx.scale
            dkd = torch.einsum("hqk,qhd->khd", ds, qd) * ctx.scale
            dk[k0:k1] = dkd.reshape(k1 - k0, hk, h // hk, -1).sum(2)
            dv[k0:k1] = dvd.reshape(k1 - k0, hk, h // hk, -1).sum(2)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None


@_bug(
    "out_kept_as_ctx_attribute",
    "bf16",
    "The autograd Function keeps its output as a ctx attribute instead of saving it for backward, so an "
    "in-place edit of the output before the backward (dropout in place, out.mul_(gate)) is not refused and "
    "the backward's rowsum(dO * O) reads the edited values.",
    "Custom autograd Functions that store tensors on ctx to avoid save_for_backward's version checks.",
    "the output edited in place before the backward",
)
def _out_kept_as_ctx_attribute(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=None, causal=False):
    return _OutAsAttribute.apply(q, k, v, cu_q, cu_k, _scale_of(q, softmax_scale), causal)


@_bug(
    "headdim_over_256_math_fallback",
    "bf16",
    "Head dims above 256 fall back to an unfused math path that rounds the scores, P and O to the input dtype.",
    "Fallback paths for head dims beyond the fused kernel's limit that compute in the input dtype.",
    "head_dim above 256",
)
def _headdim_over_256_math_fallback(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=None, causal=False):
    kw = {}
    if q.shape[-1] > 256:

        def to_input(x):
            return _ste(x, x.to(q.dtype).to(x.dtype))

        kw = {"raw_score_fn": to_input, "p_round": to_input}
    return _base(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=softmax_scale, causal=causal, **kw)


@_bug(
    "fp16_decode_read_as_bf16",
    "bf16",
    "The inference decode path (max_seqlen_q == 1, no gradient) is built for bf16 whatever the inputs are: fp16 "
    "bits are read as bf16 and the result handed back as fp16 bits.",
    "Decode kernels whose data type was hard-coded (and left out of their compiled-graph cache key).",
    "fp16 decode under no_grad",
)
def _fp16_decode_read_as_bf16(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=None, causal=False):
    if q.dtype != torch.float16 or max_q != 1 or _training(q, k, v):
        return _base(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=softmax_scale, causal=causal)
    qb, kb, vb = (x.detach().contiguous().view(torch.bfloat16) for x in (q, k, v))
    out = _base(qb, kb, vb, cu_q, cu_k, max_q, max_k, softmax_scale=softmax_scale, causal=causal)
    return out.contiguous().view(torch.float16)


RECORDS = KNOWN_BAD.register(*_records, origin=__file__)
WILD.update({r.name: r.kernel(fp32_attention) for r in RECORDS})

# the bugs of this zoo that another catalog had written too: one record each, built on the base this
# zoo wrote it on (this file's fp32 attention), or on the record's own where the bug lives in it
import zoo.causal_bugs  # noqa: E402  (registers offset_from_max_seqlens)
import zoo.convention_bugs  # noqa: E402  (registers zero_scale_is_default)
import zoo.targeted  # noqa: E402  (registers top_left_causal)

_TWINS = {
    "gqa_repeat_not_interleave": ("wrapper.gqa.modulo", fp32_attention),
    "assumes_contiguous_layout": ("wrapper.stride.storage-as-contiguous", fp32_attention),
    "fp16_computed_in_bf16": ("wrapper.dtype.fp16-via-bf16", fp32_attention),
    "nan_to_num_output": ("wrapper.nan.out-to-num", fp32_attention),
    "scale_zero_means_default": ("zero_scale_is_default", fp32_attention),
    "causal_top_left": ("top_left_causal", None),
    "causal_offset_from_max_seqlen": ("offset_from_max_seqlens", zoo.correct.sdpa_bf16),
}
for _name, (_record, _base_fn) in _TWINS.items():
    _twin = KNOWN_BAD.get(_record)
    _fn = _twin.kernel(_base_fn)
    _fn.description, _fn.dimension = _twin.why, _twin.where
    WILD[_name] = _fn

# ----------------------------------------------------------------------------------------------
# correct kernels
# ----------------------------------------------------------------------------------------------

CORRECT_WILD: dict[str, Callable] = {}


def _correct(name, recipe, description):
    """Register a correct kernel. Each turns a caller's torch.autocast off around its arithmetic, as a
    kernel written in fp32 torch ops must (inside autocast its fp32 GEMMs would run in bf16: scores
    rounded to bf16, outside the recipe; interface.arguments calls every kernel inside autocast)."""

    def register(fn):
        @functools.wraps(fn)
        def guarded(q, *args, **kwargs):
            with torch.autocast(device_type=q.device.type, enabled=False):
                return fn(q, *args, **kwargs)

        _describe(recipe, description)(guarded)
        guarded.__name__ = name
        CORRECT_WILD[name] = guarded
        return guarded

    return register


@_correct(
    "sdpa_enable_gqa",
    "bf16",
    "Per-document torch SDPA with enable_gqa and an explicit bottom-right boolean mask; reads strided views.",
)
def _sdpa_enable_gqa(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=None, causal=False):
    out = torch.zeros_like(q)
    pieces = []
    for q0, q1, k0, k1 in _documents(cu_q, cu_k):
        lq, lk = q1 - q0, k1 - k0
        if lq == 0 or lk == 0:
            continue
        qd, kd, vd = (x.transpose(0, 1) for x in (q[q0:q1], k[k0:k1], v[k0:k1]))
        vis = _visible(lq, lk, causal, device=q.device)
        if not bool(torch.isfinite(vd).all()):
            # SDPA's math path would multiply masked inf/NaN values by 0; use the fp32 path for this document
            kv_idx = _kv_divide(q.shape[1], k.shape[1]).to(q.device)
            o, _ = _doc_attention(
                q[q0:q1].float(), k[k0:k1, kv_idx].float(), v[k0:k1, kv_idx].float(), _scale_of(q, softmax_scale), vis
            )
            pieces.append((q0, q1, o.to(q.dtype)))
            continue
        seen = vis.any(-1)
        mask = vis | (~seen[:, None] & (torch.arange(lk, device=q.device)[None] == 0))
        o = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=mask, scale=softmax_scale, enable_gqa=True)
        o = o * seen[None, :, None].to(o.dtype)
        pieces.append((q0, q1, o.transpose(0, 1)))
    if not pieces:
        return q * 0
    rows = []
    cursor = 0
    for q0, q1, o in pieces:
        if q0 > cursor:
            rows.append(out[cursor:q0])
        rows.append(o)
        cursor = q1
    if cursor < q.shape[0]:
        rows.append(out[cursor:])
    return torch.cat(rows)


@_correct(
    "fp32_math_p_fp16",
    "bf16",
    "fp32 scores and softmax, P rounded to fp16 before P @ V (row sum from the fp32 P), output in the input dtype.",
)
def _fp32_math_p_fp16(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=None, causal=False):
    def p_round(p):
        return _ste(p, p.to(torch.float16).to(p.dtype))

    return _base(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=softmax_scale, causal=causal, p_round=p_round)


@_correct("fp32_with_lse", "bf16", "fp32 per-document kernel that returns (out, lse) with lse (nheads, total_q) in ln.")
def _fp32_with_lse(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=None, causal=False):
    return _base_lse(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=softmax_scale, causal=causal)


@_correct(
    "tiled_online_softmax",
    "bf16",
    "Makes its inputs contiguous, then runs an online softmax over 64-key tiles with the accumulator "
    "rescaled on every max change.",
)
def _tiled_online_softmax(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=None, causal=False):
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    return _base(
        q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=softmax_scale, causal=causal, doc_fn=_doc_tiled, tile=64
    )


@_correct(
    "padded_batch_expand",
    "bf16",
    "Pads the documents into (batch, nheads, L, D) batches with a key padding mask, documents of similar "
    "lengths batched together (padded to power-of-two length buckets), GQA by expand+reshape, one batched "
    "fp32 softmax per bucket, then unpads.",
)
def _padded_batch_expand(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=None, causal=False):
    scale = _scale_of(q, softmax_scale)
    docs = _documents(cu_q, cu_k)
    total_q, h, d = q.shape
    if not docs:
        return q * 0
    out = torch.zeros(total_q, h, d, dtype=torch.float32, device=q.device)
    buckets: dict[tuple[int, int], list[tuple[int, int, int, int]]] = {}
    for doc in docs:
        q0, q1, k0, k1 = doc
        key = (max(1, q1 - q0 - 1).bit_length(), max(1, k1 - k0 - 1).bit_length())
        buckets.setdefault(key, []).append(doc)
    for (bq, bk), group in buckets.items():
        # padded to the bucket's bound, not to the group's longest document: a document's shapes, and so
        # its bits, do not depend on which other documents share its pack
        _padded_batch(q, k, v, group, 1 << bq, 1 << bk, scale, causal, out)
    return out.to(q.dtype)


def _padded_batch(q, k, v, docs, lq_max, lk_max, scale, causal, out):
    h, d = q.shape[1:]
    hk = k.shape[1]
    nb = len(docs)
    qp = q.new_zeros(nb, lq_max, h, d, dtype=torch.float32)
    kp = k.new_zeros(nb, lk_max, hk, d, dtype=torch.float32)
    vp = v.new_zeros(nb, lk_max, hk, d, dtype=torch.float32)
    mask = torch.zeros(nb, lq_max, lk_max, dtype=torch.bool, device=q.device)
    for b, (q0, q1, k0, k1) in enumerate(docs):
        qp[b, : q1 - q0] = q[q0:q1].float()
        kp[b, : k1 - k0] = k[k0:k1].float()
        vp[b, : k1 - k0] = v[k0:k1].float()
        mask[b, : q1 - q0, : k1 - k0] = _visible(q1 - q0, k1 - k0, causal, device=q.device)
    g = h // hk
    ke = kp.unsqueeze(3).expand(nb, lk_max, hk, g, d).reshape(nb, lk_max, h, d)
    ve = vp.unsqueeze(3).expand(nb, lk_max, hk, g, d).reshape(nb, lk_max, h, d)
    s = torch.einsum("bqhd,bkhd->bhqk", qp, ke) * scale
    s = s.masked_fill(~mask[:, None], -_INF)
    m = s.detach().amax(-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros((), dtype=m.dtype))
    p = torch.exp(s - m)
    lsum = p.sum(-1, keepdim=True)
    a = p / torch.where(lsum != 0, lsum, torch.ones((), dtype=lsum.dtype))
    for b, (q0, q1, _, _) in enumerate(docs):
        # padding and masked keys get weight 0 and never reach the output, even with inf/NaN values
        o = _pv(a[b], ve[b], mask[b], plain=False).transpose(0, 1)
        out[q0:q1] = o[: q1 - q0]


@_correct(
    "mxfp8_emulated_tuple",
    "mxfp8",
    "The project's flamia-mxfp8 emulation, returning (out, lse) with lse transposed to (nheads, total_q).",
)
def _mxfp8_emulated_tuple(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=None, causal=False):
    out = _MXFP8(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=softmax_scale, causal=causal)
    _, lse = emulated_forward_with_lse(
        DESIGNS["flamia-mxfp8"],
        q.detach(),
        k.detach(),
        v.detach(),
        cu_q,
        cu_k,
        softmax_scale=_scale_of(q, softmax_scale),
        causal=causal,
    )
    return out, lse.T.contiguous()


@_correct(
    "manual_backward",
    "bf16",
    "fp32 forward with a hand-written FlashAttention-2 backward (dS = P * (dP - rowsum(dO * O))), "
    "deterministic tile order.",
)
def _manual_backward(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=None, causal=False):
    return _base(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=softmax_scale, causal=causal, doc_fn=_doc_manual)


# ----------------------------------------------------------------------------------------------
# inputs and demonstrations
# ----------------------------------------------------------------------------------------------


def _cu(lengths) -> torch.Tensor:
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return torch.tensor(cu, dtype=torch.int32)


def make_case(
    lq,
    lk=None,
    *,
    h=2,
    hk=1,
    d=64,
    dtype=torch.bfloat16,
    layout="contiguous",
    causal=False,
    scale="default",
    max_q=None,
    max_k=None,
    seed=0,
):
    """A case dict: q, k, v (requiring grad; views for the strided layouts), cu_seqlens, max_seqlen, scale,
    causal. layout: 'contiguous', 'fused' (slices of one (T, H + 2 Hk, D) qkv tensor, needs lq == lk) or
    'transposed' (head-major storage)."""
    lk = lq if lk is None else lk
    gen = torch.Generator().manual_seed(seed)
    tq, tk = sum(lq), sum(lk)
    if layout == "fused":
        assert tq == tk
        fused = torch.randn(tq, h + 2 * hk, d, generator=gen).to(dtype).requires_grad_()
        q, k, v = fused[:, :h], fused[:, h : h + hk], fused[:, h + hk :]
    elif layout == "transposed":
        qs = torch.randn(h, tq, d, generator=gen).to(dtype).requires_grad_()
        ks = torch.randn(hk, tk, d, generator=gen).to(dtype).requires_grad_()
        vs = torch.randn(hk, tk, d, generator=gen).to(dtype).requires_grad_()
        q, k, v = qs.transpose(0, 1), ks.transpose(0, 1), vs.transpose(0, 1)
    else:
        q = torch.randn(tq, h, d, generator=gen).to(dtype).requires_grad_()
        k = torch.randn(tk, hk, d, generator=gen).to(dtype).requires_grad_()
        v = torch.randn(tk, hk, d, generator=gen).to(dtype).requires_grad_()
    return {
        "q": q,
        "k": k,
        "v": v,
        "cu_q": _cu(lq),
        "cu_k": _cu(lk),
        "max_q": max(lq) if max_q is None else max_q,
        "max_k": max(lk) if max_k is None else max_k,
        "scale": d**-0.5 if scale == "default" else scale,
        "causal": causal,
    }


def ordinary_case(causal=False, hk=1, seed=0):
    """The most ordinary input: contiguous bf16, scale passed, two equal 64-token documents, 2 heads, D 64."""
    return make_case([64, 64], h=2, hk=hk, d=64, causal=causal, seed=seed)


def _with(case, **tensors):
    """A copy of ``case`` with some of q, k, v replaced by modified leaves."""
    new = dict(case)
    for name, value in tensors.items():
        new[name] = value.detach().requires_grad_()
    return new


def run_case(fn, case, dout=None):
    """(out, lse or None, grads or None) of kernel ``fn`` on ``case``."""
    res = fn(
        case["q"],
        case["k"],
        case["v"],
        case["cu_q"],
        case["cu_k"],
        case["max_q"],
        case["max_k"],
        softmax_scale=case["scale"],
        causal=case["causal"],
    )
    out, lse = (res[0], res[1] if len(res) > 1 else None) if isinstance(res, tuple) else (res, None)
    grads = None
    if dout is not None:
        grads = torch.autograd.grad(out, (case["q"], case["k"], case["v"]), dout)
    return out, lse, grads


def run_reference(case, dout=None):
    """float64 (out, lse, grads) for ``case``."""
    q, k, v = (case[n].detach().double().requires_grad_() for n in ("q", "k", "v"))
    out, lse = reference(q, k, v, case["cu_q"], case["cu_k"], case["scale"], case["causal"])
    grads = None
    if dout is not None:
        grads = torch.autograd.grad(out, (q, k, v), dout.double())
    return out, lse, grads


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """Max |a - b| where NaN matches only NaN and inf matches only the same inf."""
    a, b = a.detach().double(), b.detach().double()
    if a.shape != b.shape:
        return _INF
    same = (a == b) | (torch.isnan(a) & torch.isnan(b))
    d = torch.where(same, torch.zeros((), dtype=a.dtype), (a - b).abs())
    d = torch.where(torch.isnan(d), torch.full((), _INF, dtype=a.dtype), d)
    return float(d.max()) if d.numel() else 0.0


def _dout(case, seed=1):
    q = case["q"]
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(q.shape, generator=gen).to(q.dtype)


def _check_out(fn, case, tol=0.05, what="output"):
    out, _, _ = run_case(fn, case)
    ref, _, _ = run_reference(case)
    err = _diff(out, ref)
    if not err > tol:
        raise AssertionError(f"{what} matches the float64 reference (max |diff| {err:.3g} <= {tol})")
    return f"{what} max |diff| vs float64 = {err:.3g} (> {tol})"


def _check_grad(fn, case, tol=0.05, dout=None):
    dout = _dout(case) if dout is None else dout
    _, _, grads = run_case(fn, case, dout)
    _, _, ref = run_reference(case, dout)
    parts, worst = [], 0.0
    for name, g, r in zip("qkv", grads, ref, strict=True):
        rel = _diff(g, r) / max(float(r.abs().max()), 1e-12)
        worst = max(worst, rel)
        parts.append(f"d{name} {rel:.3g}")
    if not worst > tol:
        raise AssertionError(f"gradients match the float64 reference ({', '.join(parts)})")
    return f"relative gradient error vs float64: {', '.join(parts)} (> {tol})"


def _check_lse(fn, case, tol=0.05):
    _, lse, _ = run_case(fn, case)
    _, ref, _ = run_reference(case)
    err = _diff(lse, ref)
    if not err > tol:
        raise AssertionError(f"lse matches the float64 reference (max |diff| {err:.3g})")
    return f"lse max |diff| vs float64 = {err:.3g} (> {tol})"


def _check_precision(fn, base, case, factor=2.0):
    """fn's mean output error vs float64 is ``factor`` times the correct base's."""
    out, _, _ = run_case(fn, case)
    good, _, _ = run_case(base, case)
    ref = run_reference(case)[0].detach()
    e_bug = float((out.detach().double() - ref).abs().mean())
    e_good = float((good.detach().double() - ref).abs().mean())
    if not e_bug > factor * e_good:
        raise AssertionError(f"error {e_bug:.3g} is not {factor}x the correct kernel's {e_good:.3g}")
    return f"mean output error vs float64 {e_bug:.3g} = {e_bug / e_good:.1f}x the correct kernel's {e_good:.3g}"


_correct_base = fp32_attention


def _demo_nondeterministic(fn):
    case = make_case([1024], h=2, hk=1, d=64)
    dout = _dout(case)
    first = run_case(fn, case, dout)[2][0]
    for attempt in range(8):
        again = run_case(fn, case, dout)[2][0]
        n = int((again != first).sum())
        if n:
            return f"dq differs bitwise between two identical calls in {n} elements (attempt {attempt + 1})"
    raise AssertionError("dq was bitwise identical in 9 runs")


def _demo_stale_cache(fn):
    _META_CACHE.clear()
    first = make_case([2, 6], causal=True, seed=3)
    run_case(fn, first)
    second = make_case([6, 2], causal=True, seed=4)
    try:
        return "second call with new boundaries: " + _check_out(fn, second)
    finally:
        _META_CACHE.clear()


def _demo_mxfp8_packed(fn):
    case = make_case([20, 20], h=2, hk=1, d=64)
    v = case["v"].detach().clone()
    v[20:] = v[20:] * 1e5
    case = _with(case, v=v)
    out, _, _ = run_case(fn, case)
    good, _, _ = run_case(_MXFP8, case)
    err = _diff(out[:20], good[:20])
    rel = err / float(good[:20].detach().abs().max())
    if not rel > 0.1:
        raise AssertionError(f"document 0 unaffected (relative diff {rel:.3g})")
    return f"document 0 output moves by {rel:.3g} (relative) vs per-document MXFP8 when document 1's V is 1e5x"


def _demo_fp8_batch_scale(fn):
    case = make_case([16, 16], h=2, hk=1, d=64)
    k = case["k"].detach().clone()
    k[16:] = k[16:] * 1e6
    case = _with(case, k=k)
    out, _, _ = run_case(fn, case)
    good, _, _ = run_case(_FP8, case)
    err = _diff(out[:16], good[:16])
    rel = err / float(good[:16].detach().abs().max())
    if not rel > 0.1:
        raise AssertionError(f"document 0 unaffected (relative diff {rel:.3g})")
    return f"document 0 output moves by {rel:.3g} (relative) vs the fp8 kernel when document 1's K is 1e6x"


def _demo_nan_output(fn):
    case = make_case([8, 8])
    q = case["q"].detach().clone()
    q[3, 0, 5] = math.nan
    return "NaN in q row 3: " + _check_out(fn, _with(case, q=q))


def _demo_overread(fn):
    case = make_case([6, 6])
    v = case["v"].detach().clone()
    v[9, 0, 0] = math.inf
    return "inf in document 1's V: " + _check_out(fn, _with(case, v=v))


def _demo_rowmax(fn):
    case = make_case([16, 16], h=2, hk=2)
    q = case["q"].detach().clone()
    q[:, 0] = q[:, 0] * 300
    return "head 0 scores 300x head 1's: " + _check_out(fn, _with(case, q=q))


def _demo_no_max(fn):
    case = make_case([16, 16], h=2, hk=1)
    q, k = case["q"].detach() * 8, case["k"].detach() * 8
    return "q, k scaled by 8: " + _check_out(fn, _with(case, q=q, k=k))


def _demo_fp16_overflow(fn):
    case = make_case([8, 8], dtype=torch.float16)
    q, k = case["q"].detach().clone(), case["k"].detach().clone()
    q[2, 0] = 40.0
    k[1, 0] = 40.0
    return "fp16 with one q.k = 102400: " + _check_out(fn, _with(case, q=q, k=k))


def _demo_dout(fn):
    case = make_case([8, 8], h=2, hk=1, d=64)
    gen = torch.Generator().manual_seed(5)
    wide = torch.randn(16, 2, 128, generator=gen).to(torch.bfloat16)
    dout = wide[..., :64]  # the gradient torch.cat([out, other], -1) hands to out: a strided slice
    return "dout sliced from a cat: " + _check_grad(fn, case, dout=dout)


def _demo_key_cap(fn):
    case = make_case([2], [4200])
    with torch.no_grad():
        case["v"][4096:] *= 20  # the keys past 4096 carry values the output must show
    return _check_out(fn, case)


def _demo_cu_strided(fn):
    case = make_case([5, 11], [9, 4])
    for side in ("cu_q", "cu_k"):
        buf = torch.full((2 * case[side].numel() + 1,), -1, dtype=torch.int32)
        buf[1::2] = case[side]
        case[side] = buf[1::2]
    try:
        return "cu_seqlens as stride-2 views: " + _check_out(fn, case)
    except RuntimeError as exc:  # the -1s between the offsets make a nonsense packing
        return f"cu_seqlens as stride-2 views: the kernel raises ({str(exc).splitlines()[0]})"


def _demo_fp16_accumulator(fn):
    case = make_case([90], dtype=torch.float16)
    with torch.no_grad():
        case["q"].mul_(2.0**-9)
        case["v"].mul_(2.0**8).add_(2.0**11)
    return "fp16, near-uniform weights over v about 2048: " + _check_out(fn, case)


def _demo_negative_scale(fn):
    case = make_case([40], d=64, scale=-(64**-0.5))
    with torch.no_grad():
        case["q"].mul_(-32.0)
    return "softmax_scale < 0 on q x -32: " + _check_out(fn, case)


def _demo_inference_splits(fn):
    case = make_case([100, 600])
    with torch.no_grad():
        return "no_grad, documents of 100 then 600 keys: " + _check_out(fn, case)


def _demo_out_edit(fn):
    case = make_case([16, 16], h=4, hk=2)
    dout = _dout(case)
    out, _, _ = run_case(fn, case)
    out.add_(1.0)
    out.backward(dout)
    got = [case[n].grad for n in ("q", "k", "v")]
    _, _, ref = run_reference(case, dout)
    err = max(_diff(g, r) / max(float(r.abs().max()), 1e-12) for g, r in zip(got, ref))
    if not err > 0.05:
        raise AssertionError(f"gradients after out.add_(1) match the float64 reference ({err:.3g})")
    return f"out.add_(1.0) before the backward: relative gradient error {err:.3g}"


def _demo_headdim_512(fn):
    case = make_case([24, 24], d=512)
    with torch.no_grad():
        case["q"].mul_(3.0)
        case["k"].mul_(3.0)
    return "head_dim 512: " + _check_out(fn, case, tol=0.01)


def _demo_fp16_decode(fn):
    case = make_case([1, 1], [20, 33], dtype=torch.float16)
    with torch.no_grad():
        return "fp16 decode under no_grad: " + _check_out(fn, case)


_DEMOS: dict[str, Callable[[Callable], str]] = {
    "scale_default_from_nheads": lambda fn: _check_out(fn, make_case([16, 16], scale=None)),
    "bwd_scale_none_is_one": lambda fn: _check_grad(fn, make_case([16, 16], scale=None)),
    "causal_top_left": lambda fn: _check_out(fn, make_case([3, 5], [7, 5], causal=True)),
    "causal_offset_from_max_seqlen": lambda fn: _check_out(fn, make_case([4, 4], [4, 8], causal=True)),
    "bwd_causal_top_left": lambda fn: _check_grad(fn, make_case([3, 5], [7, 5], causal=True)),
    "finite_mask_value": lambda fn: _check_out(fn, make_case([5], [2], causal=True)),
    "pad_without_key_mask": lambda fn: _check_out(fn, make_case([4, 8], [3, 8])),
    "splitkv_empty_split_lse": lambda fn: _check_out(fn, make_case([4, 4], max_k=1024)),
    "lse_log2_hdim128": lambda fn: _check_lse(fn, make_case([8, 8], d=128)),
    "lse_padded_layout": lambda fn: _check_lse(fn, make_case([3, 5])),
    "assumes_contiguous_layout": lambda fn: _check_out(fn, make_case([8, 8], layout="fused")),
    "v_head_stride_assumed": lambda fn: _check_out(fn, make_case([8, 8], hk=2, layout="transposed")),
    "bwd_dout_stride_check": _demo_dout,
    "gqa_repeat_not_interleave": lambda fn: _check_out(fn, make_case([8, 8], h=4, hk=2)),
    "gqa_group_shift": lambda fn: _check_out(fn, make_case([8, 8], h=6, hk=2)),
    "bwd_gqa_odd_group": lambda fn: _check_grad(fn, make_case([8, 8], h=3, hk=1)),
    "empty_key_doc_nan": lambda fn: _check_out(fn, make_case([3, 3], [4, 0])),
    "empty_doc_drops_last": lambda fn: _check_out(fn, make_case([0, 4, 4])),
    "decode_inclusive_key_end": lambda fn: _check_out(fn, make_case([1, 1], [5, 5])),
    "online_softmax_no_rescale": lambda fn: _check_out(fn, make_case([256])),
    "bwd_tail_tile_dropped": lambda fn: _check_grad(fn, make_case([200])),
    "tile_overread_next_doc": _demo_overread,
    "grid_caps_documents": lambda fn: _check_out(fn, make_case([2] * 70)),
    "stale_metadata_cache": _demo_stale_cache,
    "rowmax_across_heads": _demo_rowmax,
    "heads_permuted_over_8": lambda fn: _check_out(fn, make_case([6, 6], h=16, hk=4, d=32)),
    "bwd_dq_rescaled_heads_ge4": lambda fn: _check_grad(fn, make_case([8, 8], h=8, hk=2)),
    "hdim_over_128_exp2": lambda fn: _check_out(fn, make_case([8, 8], d=192)),
    "bwd_dq_hdim_tail": lambda fn: _check_grad(fn, make_case([8, 8], d=80)),
    "fp16_unscaled_scores": _demo_fp16_overflow,
    "fp16_computed_in_bf16": lambda fn: _check_precision(
        fn, _correct_base, make_case([32, 32], dtype=torch.float16), factor=2.0
    ),
    "nan_to_num_output": _demo_nan_output,
    "softmax_without_max": _demo_no_max,
    "nondeterministic_dq_long": _demo_nondeterministic,
    "fp8_p_in_hdim128_path": lambda fn: _check_precision(fn, _correct_base, make_case([32, 32], d=128), factor=2.0),
    "mxfp8_v_blocks_packed": _demo_mxfp8_packed,
    "fp8_k_scale_over_batch": _demo_fp8_batch_scale,
    "self_attn_fastpath_cu_q_for_k": lambda fn: _check_out(fn, make_case([3, 5], [5, 3])),
    "splitkv_decode_tail_unmasked": lambda fn: _check_out(fn, make_case([1, 1], [70, 130])),
    "heads_over_16_launch_kv_index": lambda fn: _check_out(fn, make_case([8, 8], h=32, hk=8)),
    "key_loop_capped_at_4096": lambda fn: _demo_key_cap(fn),
    "lse_zero_for_rows_without_keys": lambda fn: _check_lse(fn, make_case([3, 3], [4, 0])),
    "scale_zero_means_default": lambda fn: _check_out(fn, make_case([8, 8], scale=0.0)),
    "cu_seqlens_raw_pointer": _demo_cu_strided,
    "negative_scale_rowmax_before_scale": _demo_negative_scale,
    "inference_splits_by_sorted_index": _demo_inference_splits,
    "out_kept_as_ctx_attribute": _demo_out_edit,
    "headdim_over_256_math_fallback": _demo_headdim_512,
    "fp16_decode_read_as_bf16": _demo_fp16_decode,
    "fp16_output_accumulator": _demo_fp16_accumulator,
}


def demonstrate(name: str) -> str:
    """Run bug ``name`` on one input where it is wrong; a one-line description of the difference."""
    return f"{name}: " + _DEMOS[name](WILD[name])
