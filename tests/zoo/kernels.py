"""The zoo: kernels with one planted bug each, built as small variations of the FLAMIA emulation.

Each kernel follows the calling convention and carries ``recipe`` (what it claims) and ``catches``
(the checks that must catch it). The buggy quantizers of ``truncating``, ``scale_off_by_one`` and
``zero_block_nan`` run in front of the FLAMIA kernel along the sequence without its diagonal
fallback, so they also leak causally (a second finding, not the one they are for). They double as command-line specs:
``flamia-verify check --kernel tests/zoo/kernels.py:v_scale_leak``.

    v_scale_leak        forward V blocks straddle the causal diagonal (no diagonal fallback in P V)
    backward_leak       clean forward; the backward's sequence blocks (K in dQ, Q in dK, dO in dV)
                        straddle the diagonal
    document_leak       sequence blocks at packed positions: a block spans two documents
    fwd_bwd_mismatch    the backward rebuilds P from BF16 scores, the forward used MXFP8 ones
    truncating          q, k, v (and dO in the backward) truncated toward zero instead of RNE
    scale_off_by_one    V's MX scale exponent one too small: the top half of every block saturates
    mass_underflow      P cast to E4M3 without a scale (mass below 2^-10 of the row max vanishes)
                        and normalized by the fp32 sum of unrounded P
    zero_block_nan      V's block scale computed as 2^ceil(log2(amax / 448)) with no zero guard
    one_token_wrong     documents of length 1 output 0 (treated as empty)

Engine and interface specimens: ``inplace_scale`` (scales q in place), ``forward_only``,
``nondeterministic`` (atomics-like noise in dK), ``raises_on_gqa``, ``hangs_on_long``,
``always_crashes``, ``wrong_shape``.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import replace

import torch

from flamia_verify.kernels.designs import FLAMIA_MXFP8
from flamia_verify.kernels.emulation import Quant, backward_pass, forward_pass, make_kernel
from flamia_verify.recipes.operands import Operand

E4M3_MAX = 448.0
MX_BLOCK = 32

_flamia = make_kernel(FLAMIA_MXFP8)


def _tag(fn, recipe: str, catches: tuple[str, ...], doc: str):
    fn.recipe = recipe
    fn.catches = catches
    fn.__doc__ = doc
    return fn


# ---------------------------------------------------------------------------------------------
# split designs: one design for the forward, another for the backward
# ---------------------------------------------------------------------------------------------


class _Split(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cu_q, cu_k, scale, causal, fwd_design, bwd_design, within):
        with within():
            out, lse2 = forward_pass(fwd_design, q, k, v, cu_q, cu_k, scale, causal)
        ctx.save_for_backward(q, k, v, out, lse2, cu_q, cu_k)
        ctx.scale, ctx.causal, ctx.bwd, ctx.within = scale, causal, bwd_design, within
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse2, cu_q, cu_k = ctx.saved_tensors
        with ctx.within():
            dq, dk, dv = backward_pass(ctx.bwd, q, k, v, out, lse2, dout, cu_q, cu_k, ctx.scale, ctx.causal)
        return dq, dk, dv, None, None, None, None, None, None, None


def _split_kernel(fwd_design, bwd_design, within=contextlib.nullcontext):
    """The emulation with one design for the forward and another for the backward, both run inside
    ``within()`` (a context that plants a change in the emulation itself, e.g. another mask)."""

    def kernel(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, softmax_scale=None, causal=False):
        scale = q.shape[-1] ** -0.5 if softmax_scale is None else float(softmax_scale)
        return _Split.apply(q, k, v, cu_seqlens_q, cu_seqlens_k, scale, bool(causal), fwd_design, bwd_design, within)

    return kernel


_NO_FALLBACK = replace(FLAMIA_MXFP8, name="no-fallback", diagonal_fallback=False)

v_scale_leak = _tag(
    _split_kernel(_NO_FALLBACK, FLAMIA_MXFP8),
    "mxfp8",
    ("causal.forward",),
    "FLAMIA MXFP8 whose forward multiplies P V with V blocks that straddle the causal diagonal",
)

backward_leak = _tag(
    _split_kernel(FLAMIA_MXFP8, _NO_FALLBACK),
    "mxfp8",
    ("causal.dq", "causal.dk_dv"),
    "FLAMIA MXFP8 with a clean forward and backward GEMMs whose sequence blocks straddle the diagonal",
)

document_leak = _tag(
    make_kernel(replace(FLAMIA_MXFP8, name="document-leak", seq_blocks="packed")),
    "mxfp8",
    ("isolation.neighbours", "isolation.nan", "isolation.offset_bitwise", "isolation.nonfinite"),
    "FLAMIA MXFP8 with sequence blocks at packed positions (a block spans two documents)",
)

_BF16_RECOMPUTE = FLAMIA_MXFP8.with_quants(
    dict.fromkeys((Operand.Q_HD, Operand.K_HD, Operand.P), Quant("input")), name="bf16-recompute", p_mode="fa"
)

fwd_bwd_mismatch = _tag(
    _split_kernel(FLAMIA_MXFP8, _BF16_RECOMPUTE),
    "mxfp8",
    ("consistency.weights", "consistency.grad_forward_ratio"),
    "FLAMIA MXFP8 forward; the backward rebuilds P from BF16 scores and the forward's log-sum-exp",
)

mass_underflow = _tag(
    make_kernel(
        FLAMIA_MXFP8.with_quants({Operand.P: Quant("e4m3")}, name="mass-underflow", p_mode="fa", normalize="fp32")
    ),
    "mxfp8",
    ("consistency.conservation_forward", "consistency.shift_invariance", "special.attention_sink", "bound.out"),
    "MXFP8 operands, but P = exp(S - m) cast to E4M3 without a scale and normalized by the fp32 sum",
)


# ---------------------------------------------------------------------------------------------
# buggy block quantizers applied in front of the FLAMIA kernel (straight-through gradient)
# ---------------------------------------------------------------------------------------------


def _e4m3_truncate(y: torch.Tensor) -> torch.Tensor:
    """Round toward zero to the E4M3 grid (3 mantissa bits, subnormal step 2^-9), saturating."""
    a = y.abs()
    e = torch.floor(torch.log2(a.clamp_min(2.0**-30))).clamp_min(-6.0)
    ulp = torch.exp2(e - 3)
    return torch.sign(y) * torch.minimum(torch.floor(a / ulp) * ulp, torch.full_like(a, E4M3_MAX))


def _e4m3_rne(y: torch.Tensor) -> torch.Tensor:
    from flamia_verify.formats import E4M3, round_to_format

    return round_to_format(y, E4M3, saturate=True)


def _blockwise(x: torch.Tensor, cu: torch.Tensor | None, axis: int, quantize) -> torch.Tensor:
    """Apply ``quantize(block)`` to 32-element blocks along ``axis`` (restarting at each document
    start when ``cu`` is given, axis 0 only). ``quantize`` gets (..., 32-or-fewer, ...) float32."""
    xf = x.float()
    out = torch.empty_like(xf)
    starts = cu.tolist() if cu is not None else [0, xf.shape[axis]]
    for a, b in zip(starts[:-1], starts[1:]):
        for s in range(a, b, MX_BLOCK):
            e = min(s + MX_BLOCK, b)
            sl = [slice(None)] * xf.dim()
            sl[axis] = slice(s, e)
            out[tuple(sl)] = quantize(xf[tuple(sl)], axis)
    return out.to(x.dtype)


def _mx_truncate(block: torch.Tensor, axis: int) -> torch.Tensor:
    amax = block.abs().amax(dim=axis, keepdim=True)
    scale = torch.where(amax > 0, torch.exp2(torch.ceil(torch.log2(amax / E4M3_MAX))), torch.ones_like(amax))
    return _e4m3_truncate(block / scale) * scale


def _mx_off_by_one(block: torch.Tensor, axis: int) -> torch.Tensor:
    amax = block.abs().amax(dim=axis, keepdim=True)
    scale = torch.where(amax > 0, torch.exp2(torch.ceil(torch.log2(amax / E4M3_MAX)) - 1), torch.ones_like(amax))
    return _e4m3_rne((block / scale).clamp(-E4M3_MAX, E4M3_MAX)) * scale


def _mx_no_zero_guard(block: torch.Tensor, axis: int) -> torch.Tensor:
    amax = block.abs().amax(dim=axis, keepdim=True)
    scale = torch.exp2(torch.ceil(torch.log2(amax / E4M3_MAX)))  # amax = 0 -> scale 0 -> 0/0 = NaN
    return _e4m3_rne(block / scale) * scale


class _STE(torch.autograd.Function):
    """Forward: a buggy quantizer; backward: identity (the gradient reaches the original input)."""

    @staticmethod
    def forward(ctx, x, fn):
        return fn(x)

    @staticmethod
    def backward(ctx, g):
        return g, None


class _GradQuant(torch.autograd.Function):
    """Forward: identity; backward: the incoming gradient goes through a buggy quantizer."""

    @staticmethod
    def forward(ctx, x, fn):
        ctx.fn = fn
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return ctx.fn(g), None


def _truncating(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, softmax_scale=None, causal=False):
    along_hd = lambda x: _blockwise(x, None, 2, _mx_truncate)  # noqa: E731
    along_seq_k = lambda x: _blockwise(x, cu_seqlens_k, 0, _mx_truncate)  # noqa: E731
    qt, kt, vt = _STE.apply(q, along_hd), _STE.apply(k, along_hd), _STE.apply(v, along_seq_k)
    out = _flamia(
        qt, kt, vt, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale=softmax_scale, causal=causal
    )
    return _GradQuant.apply(out, lambda g: _blockwise(g, None, 2, _mx_truncate))


truncating = _tag(
    _truncating,
    "mxfp8",
    ("bias.gain", "bias.mean"),
    "MXFP8 whose E4M3 conversions of q, k, v and dO truncate toward zero instead of rounding to nearest",
)


def _v_quant_kernel(quantize):
    def kernel(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, softmax_scale=None, causal=False):
        vq = _STE.apply(v, lambda x: _blockwise(x, cu_seqlens_k, 0, quantize))
        return _flamia(
            q, k, vq, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale=softmax_scale, causal=causal
        )

    return kernel


scale_off_by_one = _tag(
    _v_quant_kernel(_mx_off_by_one),
    "mxfp8",
    ("bound.out", "error.out", "bias.gain"),
    "MXFP8 whose V block scale exponent is one too small: every element above half the block max saturates",
)

zero_block_nan = _tag(
    _v_quant_kernel(_mx_no_zero_guard),
    "mxfp8",
    ("special.zero_blocks",),
    "MXFP8 whose V block scale has no zero guard: an all-zero block of 32 tokens becomes 0/0 = NaN",
)


def _one_token_wrong(
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, softmax_scale=None, causal=False
):
    out = _flamia(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale=softmax_scale, causal=causal
    )
    lens = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).tolist()
    keep = torch.ones(out.shape[0], 1, 1, dtype=out.dtype, device=out.device)
    for b, n in enumerate(lens):
        if n == 1:
            keep[int(cu_seqlens_q[b])] = 0
    return out * keep


one_token_wrong = _tag(
    _one_token_wrong,
    "mxfp8",
    ("special.short_documents", "bound.out", "error.out"),
    "FLAMIA MXFP8 that treats documents of length 1 as empty (outputs 0 for them)",
)


# ---------------------------------------------------------------------------------------------
# engine and interface specimens
# ---------------------------------------------------------------------------------------------


def _inplace_scale(
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, softmax_scale=None, causal=False
):
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    with torch.no_grad():
        q.mul_(2.0)  # writes into the caller's tensor
    return _flamia(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale=scale / 2.0, causal=causal
    )


inplace_scale = _tag(
    _inplace_scale,
    "mxfp8",
    ("interface.inputs_unmodified",),
    "FLAMIA MXFP8 that pre-scales q in place (the caller's tensor changes)",
)


def _forward_only(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, softmax_scale=None, causal=False):
    with torch.no_grad():
        return _flamia(
            q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale=softmax_scale, causal=causal
        )


forward_only = _tag(_forward_only, "mxfp8", ("interface.backward",), "FLAMIA MXFP8 forward without a backward")


class _Jitter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, k):
        return k.view_as(k)

    @staticmethod
    def backward(ctx, g):
        # atomics-like: a different summation order changes the last bits from run to run
        noise = torch.randint(-1, 2, g.shape, device=g.device).to(g.dtype) * g.abs() * 2.0**-8
        return g + noise


def _nondeterministic(
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, softmax_scale=None, causal=False
):
    return _flamia(
        q,
        _Jitter.apply(k),
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        softmax_scale=softmax_scale,
        causal=causal,
    )


nondeterministic = _tag(
    _nondeterministic,
    "mxfp8",
    ("determinism.repeat",),
    "FLAMIA MXFP8 whose dK changes in the last bits from run to run (atomics)",
)


def _raises_on_gqa(q, k, v, *args, **kwargs):
    if q.shape[1] != k.shape[1]:
        raise NotImplementedError(f"GQA is not supported ({q.shape[1]} query heads, {k.shape[1]} kv heads)")
    return _flamia(q, k, v, *args, **kwargs)


raises_on_gqa = _tag(_raises_on_gqa, "mxfp8", (), "FLAMIA MXFP8 that raises on GQA inputs")

_HANG = threading.Event()


def _hangs_on_long(q, k, v, *args, **kwargs):
    if q.shape[0] > 200:
        _HANG.wait(30.0)  # far longer than the tests' case timeout
    return _flamia(q, k, v, *args, **kwargs)


hangs_on_long = _tag(_hangs_on_long, "mxfp8", (), "FLAMIA MXFP8 that hangs on more than 200 query tokens")


def _always_crashes(q, *args, **kwargs):
    raise RuntimeError("CUDA error: an illegal memory access was encountered")


always_crashes = _tag(_always_crashes, "mxfp8", (), "a kernel that always raises")


def _wrong_shape(q, k, v, *args, **kwargs):
    out = _flamia(q, k, v, *args, **kwargs)
    return (out[:, :, : max(1, out.shape[2] // 2)], None)


wrong_shape = _tag(_wrong_shape, "mxfp8", ("interface.output",), "returns (out[..., :headdim/2], None)")

#: every planted-bug kernel and the checks that must catch it
BUGS = {
    name: globals()[name]
    for name in (
        "v_scale_leak",
        "backward_leak",
        "document_leak",
        "fwd_bwd_mismatch",
        "truncating",
        "scale_off_by_one",
        "mass_underflow",
        "zero_block_nan",
        "one_token_wrong",
        "inplace_scale",
        "nondeterministic",
        "wrong_shape",
    )
}

#: the planted bugs and the engine specimens (forward-only, raising, hanging, crashing kernels)
__all__ = ["BUGS", *BUGS, "forward_only", "raises_on_gqa", "hangs_on_long", "always_crashes"]
