"""The zoo: kernels with one planted bug each, built as small variations of the FLAMIA emulation.

Each is a record of the known-bad registry (``flamia_verify.known_bad``, tag ``zoo``): its ``build``
makes it from the correct kernel it names as its base (the FLAMIA MXFP8 emulation), and the kernel
built from it carries ``recipe`` (what it claims) and ``catches`` (the checks that must catch it).
The buggy quantizers of ``truncating``, ``scale_off_by_one`` and
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

Interface specimens: ``inplace_scale`` (scales q in place), ``forward_only``, ``nondeterministic``
(atomics-like noise in dK), ``wrong_shape``. Engine fixtures (not known-bad records: kernels the
engine's own tests call): ``raises_on_gqa``, ``hangs_on_long``, ``always_crashes``.
"""

from __future__ import annotations

import threading
from dataclasses import replace

import torch

from flamia_verify.kernels.designs import FLAMIA_MXFP8
from flamia_verify.kernels.emulation import Quant, make_kernel
from flamia_verify.known_bad import KNOWN_BAD, Forwarding, KnownBad, patched_emulation
from flamia_verify.known_bad.forwarding import STE, EditGrad
from flamia_verify.recipes.operands import Operand

E4M3_MAX = 448.0
MX_BLOCK = 32

_flamia = make_kernel(FLAMIA_MXFP8)

#: the tags of this file's records
ZOO = ("zoo", "kernels")


# ---------------------------------------------------------------------------------------------
# split designs: one design for the forward, another for the backward
# ---------------------------------------------------------------------------------------------


def _no_fallback(design):
    return replace(design, name="no-fallback", diagonal_fallback=False)


def _bf16_recompute(design):
    """The design whose backward rebuilds P from BF16 scores (Q, K and P in the input dtype)."""
    return design.with_quants(
        dict.fromkeys((Operand.Q_HD, Operand.K_HD, Operand.P), Quant("input")), name="bf16-recompute", p_mode="fa"
    )


def _split(fwd, bwd):
    """A build: the emulation with ``fwd(design)`` forward and ``bwd(design)`` backward (design: the base's)."""
    return lambda base: patched_emulation(fwd(base.design), bwd(base.design))


def _same(design):
    return design


_SPLIT_RECORDS = (
    KnownBad(
        "v_scale_leak",
        "causal",
        "FLAMIA MXFP8 whose forward multiplies P V with V blocks that straddle the causal diagonal",
        _split(_no_fallback, _same),
        catches=("causal.forward",),
        tags=ZOO,
    ),
    KnownBad(
        "backward_leak",
        "causal",
        "FLAMIA MXFP8 with a clean forward and backward GEMMs whose sequence blocks straddle the diagonal",
        _split(_same, _no_fallback),
        catches=("causal.dq", "causal.dk_dv"),
        tags=ZOO,
    ),
    KnownBad(
        "document_leak",
        "isolation",
        "FLAMIA MXFP8 with sequence blocks at packed positions (a block spans two documents)",
        lambda base: make_kernel(replace(base.design, name="document-leak", seq_blocks="packed")),
        catches=("isolation.neighbours", "isolation.nan", "isolation.offset_bitwise", "isolation.nonfinite"),
        tags=ZOO,
    ),
    KnownBad(
        "fwd_bwd_mismatch",
        "consistency",
        "FLAMIA MXFP8 forward; the backward rebuilds P from BF16 scores and the forward's log-sum-exp",
        _split(_same, _bf16_recompute),
        catches=("consistency.weights", "consistency.grad_forward_ratio"),
        tags=ZOO,
    ),
    KnownBad(
        "mass_underflow",
        "normalisation",
        "MXFP8 operands, but P = exp(S - m) cast to E4M3 without a scale and normalized by the fp32 sum",
        lambda base: make_kernel(
            base.design.with_quants({Operand.P: Quant("e4m3")}, name="mass-underflow", p_mode="fa", normalize="fp32")
        ),
        catches=(
            "consistency.conservation_forward",
            "consistency.shift_invariance",
            "special.attention_sink",
            "bound.out",
        ),
        tags=ZOO,
    ),
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


_STE = STE  # forward: a buggy quantizer; backward: the identity (the gradient reaches the original input)
_GradQuant = EditGrad  # forward: the identity; backward: the incoming gradient through a buggy quantizer


def _truncating(fn, q, k, v, cq, ck, mq, mk, scale, causal):
    along_hd = lambda x: _blockwise(x, None, 2, _mx_truncate)  # noqa: E731
    along_seq_k = lambda x: _blockwise(x, ck, 0, _mx_truncate)  # noqa: E731
    qt, kt, vt = _STE.apply(q, along_hd), _STE.apply(k, along_hd), _STE.apply(v, along_seq_k)
    out = fn(qt, kt, vt, cq, ck, mq, mk, softmax_scale=scale, causal=causal)
    return _GradQuant.apply(out, lambda g: _blockwise(g, None, 2, _mx_truncate))


def _v_quant(quantize):
    """A body that runs the base on V blocked along the keys by ``quantize`` (a front quantizer)."""

    def body(fn, q, k, v, cq, ck, mq, mk, scale, causal):
        vq = _STE.apply(v, lambda x: _blockwise(x, ck, 0, quantize))
        return fn(q, k, vq, cq, ck, mq, mk, softmax_scale=scale, causal=causal)

    return body


def _one_token_wrong(fn, q, k, v, cq, ck, mq, mk, scale, causal):
    out = fn(q, k, v, cq, ck, mq, mk, softmax_scale=scale, causal=causal)
    lens = (cq[1:] - cq[:-1]).tolist()
    keep = torch.ones(out.shape[0], 1, 1, dtype=out.dtype, device=out.device)
    for b, n in enumerate(lens):
        if n == 1:
            keep[int(cq[b])] = 0
    return out * keep


def _inplace_scale(fn, q, k, v, cq, ck, mq, mk, scale, causal):
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    with torch.no_grad():
        q.mul_(2.0)  # writes into the caller's tensor
    return fn(q, k, v, cq, ck, mq, mk, softmax_scale=scale / 2.0, causal=causal)


def _forward_only(fn, q, k, v, cq, ck, mq, mk, scale, causal):
    with torch.no_grad():
        return fn(q, k, v, cq, ck, mq, mk, softmax_scale=scale, causal=causal)


class _Jitter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, k):
        return k.view_as(k)

    @staticmethod
    def backward(ctx, g):
        # atomics-like: a different summation order changes the last bits from run to run
        noise = torch.randint(-1, 2, g.shape, device=g.device).to(g.dtype) * g.abs() * 2.0**-8
        return g + noise


def _nondeterministic(fn, q, k, v, cq, ck, mq, mk, scale, causal):
    return fn(q, _Jitter.apply(k), v, cq, ck, mq, mk, softmax_scale=scale, causal=causal)


def _wrong_shape(fn, q, k, v, cq, ck, mq, mk, scale, causal):
    out = fn(q, k, v, cq, ck, mq, mk, softmax_scale=scale, causal=causal)
    return (out[:, :, : max(1, out.shape[2] // 2)], None)


def _zoo(name: str, family: str, why: str, body, catches: tuple[str, ...]) -> KnownBad:
    """A bug of this file written around the base kernel (the forwarding wrapper)."""
    return KnownBad(name, family, why, Forwarding(body, name), catches=catches, tags=ZOO)


RECORDS = KNOWN_BAD.register(
    *_SPLIT_RECORDS,
    _zoo(
        "truncating",
        "rounding",
        "MXFP8 whose E4M3 conversions of q, k, v and dO truncate toward zero instead of rounding to nearest",
        _truncating,
        ("bias.gain", "bias.mean"),
    ),
    _zoo(
        "scale_off_by_one",
        "rounding",
        "MXFP8 whose V block scale exponent is one too small: every element above half the block max saturates",
        _v_quant(_mx_off_by_one),
        ("bound.out", "error.out", "bias.gain"),
    ),
    _zoo(
        "zero_block_nan",
        "special",
        "MXFP8 whose V block scale has no zero guard: an all-zero block of 32 tokens becomes 0/0 = NaN",
        _v_quant(_mx_no_zero_guard),
        ("special.zero_blocks",),
    ),
    _zoo(
        "one_token_wrong",
        "special",
        "FLAMIA MXFP8 that treats documents of length 1 as empty (outputs 0 for them)",
        _one_token_wrong,
        ("special.short_documents", "bound.out", "error.out"),
    ),
    _zoo(
        "inplace_scale",
        "interface",
        "FLAMIA MXFP8 that pre-scales q in place (the caller's tensor changes)",
        _inplace_scale,
        ("interface.inputs_unmodified",),
    ),
    _zoo(
        "forward_only", "interface", "FLAMIA MXFP8 forward without a backward", _forward_only, ("interface.backward",)
    ),
    _zoo(
        "nondeterministic",
        "determinism",
        "FLAMIA MXFP8 whose dK changes in the last bits from run to run (atomics)",
        _nondeterministic,
        ("determinism.repeat",),
    ),
    _zoo("wrong_shape", "interface", "returns (out[..., :headdim/2], None)", _wrong_shape, ("interface.output",)),
    origin=__file__,
)

_built = {r.name: r.kernel() for r in RECORDS}
v_scale_leak = _built["v_scale_leak"]
backward_leak = _built["backward_leak"]
document_leak = _built["document_leak"]
fwd_bwd_mismatch = _built["fwd_bwd_mismatch"]
mass_underflow = _built["mass_underflow"]
truncating = _built["truncating"]
scale_off_by_one = _built["scale_off_by_one"]
zero_block_nan = _built["zero_block_nan"]
one_token_wrong = _built["one_token_wrong"]
inplace_scale = _built["inplace_scale"]
forward_only = _built["forward_only"]
nondeterministic = _built["nondeterministic"]
wrong_shape = _built["wrong_shape"]


# ---------------------------------------------------------------------------------------------
# engine fixtures: not bugs of the numbers, kernels the engine's tests call
# ---------------------------------------------------------------------------------------------


def raises_on_gqa(q, k, v, *args, **kwargs):
    """FLAMIA MXFP8 that raises on GQA inputs"""
    if q.shape[1] != k.shape[1]:
        raise NotImplementedError(f"GQA is not supported ({q.shape[1]} query heads, {k.shape[1]} kv heads)")
    return _flamia(q, k, v, *args, **kwargs)


_HANG = threading.Event()


def hangs_on_long(q, k, v, *args, **kwargs):
    """FLAMIA MXFP8 that hangs on more than 200 query tokens"""
    if q.shape[0] > 200:
        _HANG.wait(30.0)  # far longer than the tests' case timeout
    return _flamia(q, k, v, *args, **kwargs)


def always_crashes(q, *args, **kwargs):
    """a kernel that always raises"""
    raise RuntimeError("CUDA error: an illegal memory access was encountered")


for _fixture in (raises_on_gqa, hangs_on_long, always_crashes):
    _fixture.recipe = "mxfp8"  # type: ignore[attr-defined]
    _fixture.catches = ()  # type: ignore[attr-defined]

#: every planted-bug kernel and the checks that must catch it
BUGS = {
    name: _built[name]
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
__all__ = ["BUGS", "RECORDS", *BUGS, "forward_only", "raises_on_gqa", "hangs_on_long", "always_crashes"]
