"""The ``cudnn-fp8`` kernel: cuDNN's FP8 attention in the varlen calling convention, forward and backward.

    out = fn(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, softmax_scale=None, causal=False)

q: (total_q, H, D), k and v: (total_k, Hk, D), bf16 or fp16, H a multiple of Hk (GQA); out like q.
The whole pack is one cuDNN call (packed THD with ragged offsets, or padded BSHD where cuDNN has no
ragged graph: :mod:`.layout`), never a loop over documents. The layout is chosen per shape for the
backward whenever the shape has one, with or without gradients in this call, so that every call of a
shape runs the same graphs (the checks compare calls with and without gradients bit for bit); the
kernel's ``paths`` count the calls per layout and mode.

A call, forward (:func:`_forward`):

1. the refusals (:func:`refusal`), before anything runs;
2. the scales of q, k, v (:mod:`.scaling`): measured first with one fused amax launch when the mode
   needs it (``current``, or ``delayed`` not yet calibrated), else from the history;
3. one fused launch per tensor quantizes q, k, v into E4M3 in cuDNN's layout and reduces its amax;
4. cuDNN's forward (E4M3 O, the softmax statistics, amax_s, amax_o);
5. one launch dequantizes O into the packed rows in the input dtype;
6. ``delayed``: the amaxes of q, k, v, o, s are appended to the history.

Backward (:func:`_backward`): dO's scale (measured or from the history), one launch quantizes dO; the scales of dP, dQ,
dK, dV from the history, or, when they must be measured, from a first run of cuDNN's backward with
provisional scales (only its amax outputs are used); cuDNN's backward; three launches dequantize dQ,
dK, dV; ``delayed``: the amaxes of dO, dP, dQ, dK, dV are appended to the history.

Autograd keeps only the E4M3 copies of q, k, v and O and the statistics for the backward (no
BF16 copy): the extra memory beyond cuDNN BF16's is the E4M3 copies themselves.

Between the big launches a call makes a few small ones (scales, lengths, offsets); the scalars are
packed into one buffer and reused for as long as the scaling state does not change (every call of a
frozen state), the lengths and offsets for as long as the same cu_seqlens tensors come back.

What cuDNN's FP8 attention cannot do on Hopper (cuDNN 9.19) is adapted where the adaptation computes the
same attention, and refused otherwise, with one line naming the limit, before any cuDNN call:

* O, dQ, dK, dV only as E4M3: dequantized here;
* the backward only at head_dim 128: every head_dim up to 128 runs as 128, on inputs with zero columns
  (no score changes; O's extra columns are zero and sliced off); above 128 the backward is refused;
* the causal mask top-left only, which is the convention's bottom-right mask only when Lq == Lk: a
  causal pack with Lq != Lk runs as one with Lq == Lk (:func:`equal_length_remap`: zero query rows in
  front of a document with Lq < Lk, whose outputs are dropped; a document with Lq > Lk keeps its last
  Lk queries, the others see no key and get 0). Blackwell runs the bottom-right mask itself.
"""

from __future__ import annotations

import collections
import importlib
import importlib.util
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from flamia_verify.convention import no_attention, seqlens
from flamia_verify.kernels.cudnn_fp8.engine import CudnnFp8Refused, Engine, Geometry, GraphKey
from flamia_verify.kernels.cudnn_fp8.layout import Layout, make_layout, round_up
from flamia_verify.kernels.cudnn_fp8.scaling import (
    BACKWARD_MEASURED,
    E4M3_MAX,
    FORWARD_MEASURED,
    FORWARD_RECORDED,
    P_SCALE_EXPONENT,
    ROLES,
    ScalingMode,
    ScalingRecipe,
    ScalingState,
    scale_policy,
)
from flamia_verify.kernels.state import StateKind, StatePolicy, StateSharing

__all__ = [
    "DEFAULT_HISTORY",
    "DEFAULT_MARGIN",
    "MIN_CUDNN_VERSION",
    "CudnnFp8Refused",
    "current_kernel",
    "default_kernel",
    "frozen_kernel",
    "make_kernel",
    "refusal",
    "unavailable",
]

#: cuDNN's backend version (major * 10000 + minor * 100 + patch) from which the FP8 attention is used:
#: the frontend's own FP8 attention tests start at 9.14.0; the issue's measurements used 9.19
MIN_CUDNN_VERSION = 91400
#: compute capability majors with cuDNN FP8 attention: Hopper (sm_90) and Blackwell (sm_100)
SUPPORTED_ARCHS = (9, 10)


#: cuDNN quantizes dS = P (dP - D) softmax_scale with scale_dP, and its amax_dP output is that tensor's
#: amax (measured on the H200 with cuDNN 9.19: 0.378 and 0.813 where float64 gives 0.358 and 0.815 for
#: dS softmax_scale, and 59.8 and 54.7 for dP), so dP's scale comes from amax_dP as every other scale
#: from its amax. Before any amax_dP exists, the provisional scale of a measuring run bounds that
#: tensor by 2 softmax_scale max |dP| (|dP - D| <= 2 max |dP|, P <= 1).
def ds_bound_factor(softmax_scale: float) -> float:
    """The factor from a bound of |dP| to a bound of the tensor quantized with scale_dP."""
    return 2.0 * softmax_scale


_GRAD_ROLES = ("dp", "dq", "dk", "dv")


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"


def unavailable() -> str | None:
    """None when cuDNN's FP8 attention can run here, else why not, in one line."""
    if importlib.util.find_spec("cudnn") is None:
        return "nvidia-cudnn-frontend is not installed (pip install 'flamia-verify[cudnn]')"
    if not torch.cuda.is_available():
        return "needs a CUDA GPU (cuDNN's FP8 attention has no CPU kernel)"
    major, minor = torch.cuda.get_device_capability()
    if major not in SUPPORTED_ARCHS:
        return (
            f"needs a Hopper (sm_90) or Blackwell (sm_100) GPU for cuDNN's FP8 attention; this one is sm_{major}{minor}"
        )
    try:
        cudnn = importlib.import_module("cudnn")
        version = int(cudnn.backend_version())
    except Exception as exc:  # a broken install says why instead of breaking `list`
        return f"import cudnn failed: {_first_line(exc)}"
    if version < MIN_CUDNN_VERSION:
        found = f"{version // 10000}.{version // 100 % 100}.{version % 100}"
        return f"needs cuDNN >= 9.14.0 for FP8 attention; found {found}"
    return None


def refusal(
    *,
    arch: int,
    dtype: torch.dtype,
    head_dim: int,
    heads: int,
    heads_k: int,
    causal: bool,
    lengths: Sequence[tuple[int, int]] | None = None,
    backward: bool = False,
) -> str | None:
    """Why cuDNN's FP8 attention (on compute capability ``arch``) cannot run this call, in one line
    starting with ``cudnn-fp8:``, or None. ``lengths``: (Lq, Lk) per document, needed only for a causal
    call whose documents may have Lq != Lk (None: known to be equal). ``backward``: the backward's
    limits too."""
    if dtype not in (torch.bfloat16, torch.float16):
        return f"cudnn-fp8: inputs must be bfloat16 or float16 (the E4M3 copies are made from them); got {dtype}"
    if heads_k < 1 or heads % heads_k:
        return f"cudnn-fp8: {heads} query heads are not a multiple of {heads_k} key/value heads"
    fwd_limit = 256 if arch == 9 else 128
    if head_dim % 16 or not 16 <= head_dim <= fwd_limit:
        return (
            f"cudnn-fp8: cuDNN's FP8 attention on sm_{arch}0 takes head_dim a multiple of 16 up to {fwd_limit}; "
            f"got {head_dim}"
        )
    if backward and arch == 9 and head_dim != 128:
        return f"cudnn-fp8: cuDNN's FP8 backward on Hopper (sm_90) needs head_dim 128; got {head_dim}"
    if backward and arch != 9 and head_dim > 128:
        return f"cudnn-fp8: cuDNN's FP8 backward on sm_{arch}0 takes head_dim up to 128; got {head_dim}"
    if causal and arch == 9 and lengths is not None:
        for i, (lq, lk) in enumerate(lengths):
            if lq != lk and lq > 0:
                return (
                    f"cudnn-fp8: causal attention with Lq != Lk (document {i}: Lq={lq}, Lk={lk}) needs a bottom-right "
                    "causal mask, which cuDNN's FP8 attention has only on Blackwell; Hopper's top-left mask agrees "
                    "with it only for Lq == Lk"
                )
    return None


# ------------------------------------------------------------------------------------------------
# one call
# ------------------------------------------------------------------------------------------------


def _scalars(values: torch.Tensor, names: Sequence[str]) -> dict[str, torch.Tensor]:
    """``values`` (n,) as n named 1-element fp32 tensors 16 bytes apart in one allocation (what cuDNN
    reads: one scalar tensor per scale)."""
    buf = torch.empty(len(names), 4, dtype=torch.float32, device=values.device)
    buf[:, 0] = values
    return {name: buf[i, :1] for i, name in enumerate(names)}


@dataclass
class _Runner:
    """What a kernel function keeps between calls: the scaling state, the engine, the options, and
    caches that save the small per-call launches: the scalars (valid while the state's generation does
    not change, i.e. for every call of a frozen state) and the per-document lengths and offsets (valid
    for the same cu_seqlens tensors, unmodified)."""

    state: ScalingState
    engine: Engine
    deterministic: bool
    paths: collections.Counter[str]
    scalars: dict[tuple[Any, ...], tuple[int, Any, Any]] = field(default_factory=dict)
    geometries: collections.OrderedDict[tuple[Any, ...], tuple[torch.Tensor, torch.Tensor, Geometry]] = field(
        default_factory=collections.OrderedDict
    )

    def cached(self, key: tuple[Any, ...], make: Callable[[], Any], tag: Any = None) -> Any:
        """``make()``, or its value from an earlier call with the same key, state generation and ``tag``
        (compared by identity)."""
        hit = self.scalars.get(key)
        if hit is not None and hit[0] == self.state.generation and hit[1] is tag:
            return hit[2]
        value = make()
        self.scalars[key] = (self.state.generation, tag, value)  # make() may have moved the generation
        return value


#: the forward's scalars, in the order of the values tensor
_FWD_NAMES = (
    "scale_q",
    "scale_k",
    "scale_v",
    "descale_q",
    "descale_k",
    "descale_v",
    "descale_s",
    "scale_s",
    "scale_o",
    "descale_o",
)
#: the backward's scalars (cuDNN's names; descale_dq/dk/dv for our dequantization)
_BWD_NAMES = (
    "descale_q",
    "descale_k",
    "descale_v",
    "descale_o",
    "descale_s",
    "scale_s",
    "scale_dO",
    "descale_dO",
    "scale_dP",
    "scale_dQ",
    "scale_dK",
    "scale_dV",
    "descale_dP",
    "descale_dq",
    "descale_dk",
    "descale_dv",
)


def _forward_scalars(s_qkv: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """From the scales of q, k, v: every scalar of the forward (``_FWD_NAMES``). O's scale is V's halved
    (O never saturates: scaling.py); P's is the constant 2^P_SCALE_EXPONENT."""
    p = math.ldexp(1.0, P_SCALE_EXPONENT)
    consts = torch.full((2,), p, dtype=torch.float32, device=s_qkv.device)
    consts[0] = 1.0 / p
    scale_o = s_qkv[2:3] * 0.5
    values = torch.cat([s_qkv, 1.0 / s_qkv, consts, scale_o, 1.0 / scale_o])
    return values, _scalars(values, _FWD_NAMES)


def _backward_scalars(fwd: torch.Tensor, s_do: torch.Tensor, grads: torch.Tensor) -> dict[str, torch.Tensor]:
    """From the forward's values, dO's scale and the scales of (dp, dq, dk, dv): every scalar of the
    backward (``_BWD_NAMES``)."""
    values = torch.cat([fwd[3:6], fwd[9:10], fwd[6:8], s_do, 1.0 / s_do, grads, 1.0 / grads])
    return _scalars(values, _BWD_NAMES)


def _geometry(key: GraphKey, layout_q: Layout, layout_k: Layout, cu_q: torch.Tensor, cu_k: torch.Tensor) -> Geometry:
    cu_q = cu_q.to(torch.int32).contiguous()
    cu_k = cu_k.to(torch.int32).contiguous()
    b = key.batch
    seqlen_q = (cu_q[1:] - cu_q[:-1]).reshape(b, 1, 1, 1).contiguous()
    seqlen_k = (cu_k[1:] - cu_k[:-1]).reshape(b, 1, 1, 1).contiguous()
    offsets: dict[str, torch.Tensor] = {}
    if not key.padded:
        q64, k64 = cu_q.to(torch.int64).reshape(b + 1, 1, 1, 1), cu_k.to(torch.int64).reshape(b + 1, 1, 1, 1)
        q_rows = (q64 * (key.heads * key.head_dim)).contiguous()
        k_rows = (k64 * (key.heads_k * key.head_dim)).contiguous()
        offsets = {"q": q_rows, "o": q_rows, "k": k_rows, "v": k_rows, "stats": (q64 * key.heads).contiguous()}
    return Geometry(key, layout_q, layout_k, cu_q, cu_k, seqlen_q, seqlen_k, offsets)


def _cached_geometry(
    run: _Runner, key: GraphKey, layout_q: Layout, layout_k: Layout, cu_q: torch.Tensor, cu_k: torch.Tensor
) -> Geometry:
    """:func:`_geometry`, reused while the same cu_seqlens tensors come back unmodified (the cache holds
    them, so their memory cannot be reused by another tensor meanwhile)."""
    ident = (id(cu_q), id(cu_k), cu_q._version, cu_k._version, key, layout_q, layout_k)
    hit = run.geometries.get(ident)
    if hit is not None:
        return hit[2]
    geo = _geometry(key, layout_q, layout_k, cu_q, cu_k)
    run.geometries[ident] = (cu_q, cu_k, geo)
    while len(run.geometries) > 8:
        run.geometries.popitem(last=False)
    return geo


@dataclass
class _Saved:
    """What the forward keeps for the backward."""

    geo: Geometry
    q8: torch.Tensor
    k8: torch.Tensor
    v8: torch.Tensor
    o8: torch.Tensor
    stats: torch.Tensor
    fwd: torch.Tensor  # the forward's scalars (_FWD_NAMES)
    arch: int
    dtype: torch.dtype


def _forward(
    run: _Runner,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_q: torch.Tensor,
    cu_k: torch.Tensor,
    key: GraphKey,
    arch: int,
    need_backward: bool,
) -> tuple[torch.Tensor, _Saved]:
    from flamia_verify.kernels.cudnn_fp8.quantize import amax_many, dequantize_e4m3, quantize_e4m3

    state, engine, device = run.state, run.engine, q.device
    key = replace(key, padded=engine.choose_padded(key, need_backward))
    lay_q = make_layout(key.padded, q.shape[0], key.batch, key.seq_q)
    lay_k = make_layout(key.padded, k.shape[0], key.batch, key.seq_k)
    geo = _cached_geometry(run, key, lay_q, lay_k, cu_q, cu_k)

    if state.needs_measurement(FORWARD_MEASURED):
        measured: torch.Tensor | None = amax_many([q, k, v])
        fwd, sc = _forward_scalars(state.scales(FORWARD_MEASURED, device, measured=measured))
    else:
        measured = None
        fwd, sc = run.cached(("fwd", device), lambda: _forward_scalars(state.scales(FORWARD_MEASURED, device)))
    amax_bits = torch.zeros(3, dtype=torch.int32, device=device) if measured is None else None
    a = [None, None, None] if amax_bits is None else [amax_bits[i : i + 1] for i in range(3)]
    q8, _ = quantize_e4m3(q, sc["scale_q"], lay_q, geo.cu_q, record_amax=measured is None, amax_out=a[0])
    k8, _ = quantize_e4m3(k, sc["scale_k"], lay_k, geo.cu_k, record_amax=measured is None, amax_out=a[1])
    v8, _ = quantize_e4m3(v, sc["scale_v"], lay_k, geo.cu_k, record_amax=measured is None, amax_out=a[2])

    o8, stats, amax_s, amax_o = engine.forward(geo, q8, k8, v8, sc)
    out = dequantize_e4m3(o8, sc["descale_o"], lay_q, geo.cu_q, q.dtype)

    if state.mode is ScalingMode.DELAYED:  # a calibrating call's measurement was its record
        os_amax = torch.cat([amax_o.reshape(1), amax_s.reshape(1)])
        if amax_bits is not None:
            state.record(FORWARD_RECORDED, torch.cat([amax_bits.view(torch.float32), os_amax]))
        else:
            state.record(FORWARD_RECORDED[3:], os_amax)
    run.paths[f"cuDNN FP8 {lay_q.kind} ({_scaling_label(state.recipe)})"] += 1
    return out, _Saved(geo, q8, k8, v8, o8, stats, fwd, arch, q.dtype)


def _backward(run: _Runner, saved: _Saved, dout: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    from flamia_verify.kernels.cudnn_fp8.quantize import amax_many, dequantize_e4m3, quantize_e4m3

    state, engine, geo = run.state, run.engine, saved.geo
    key, device = geo.key, dout.device
    reason = refusal(
        arch=saved.arch,
        dtype=saved.dtype,
        head_dim=key.head_dim,
        heads=key.heads,
        heads_k=key.heads_k,
        causal=False,  # the forward refused what the backward would
        backward=True,
    )
    if reason is not None:
        raise CudnnFp8Refused(reason)
    if dout.shape != (geo.layout_q.tokens, key.heads, key.head_dim):
        raise ValueError(f"cudnn-fp8: dO has shape {tuple(dout.shape)}, the output {(geo.layout_q.tokens, key.heads)}")
    assert BACKWARD_MEASURED == ("do", *_GRAD_ROLES)

    measured_do = amax_many([dout]) if state.needs_measurement(("do",)) else None
    measured_grads = state.needs_measurement(_GRAD_ROLES)
    if measured_do is None and not measured_grads:  # every scale from the history
        ident = ("bwd", device)

        def make() -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
            s_do = state.scales(("do",), device)
            grads = state.scales(_GRAD_ROLES, device)
            return s_do, _backward_scalars(saved.fwd, s_do, grads)

        s_do, sc = run.cached(ident, make, tag=saved.fwd)
    else:
        s_do = state.scales(("do",), device, measured=measured_do)
        sc = None
    amax_do_bits = torch.zeros(1, dtype=torch.int32, device=device) if measured_do is None else None
    do_scale = sc["scale_dO"] if sc is not None else _scalars(s_do, ("scale_dO",))["scale_dO"]
    do8, _ = quantize_e4m3(
        dout, do_scale, geo.layout_q, geo.cu_q, record_amax=measured_do is None, amax_out=amax_do_bits
    )

    def cudnn_backward(scalars: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        return engine.backward(geo, saved.q8, saved.k8, saved.v8, saved.o8, do8, saved.stats, scalars)

    measured = None
    if sc is None:
        if measured_grads:
            # provisional scales: dS from a bound that never saturates (|dP| <= D amax(dO) amax(V) over the
            # dequantized codes), the outputs at 1; only the amax outputs of this run are used
            bound = key.head_dim * (E4M3_MAX / s_do[0]) * (E4M3_MAX * saved.fwd[5])  # fwd[5]: descale_v
            prov = (bound * ds_bound_factor(key.softmax_scale)).reshape(1)
            prov_dp = scale_policy(prov, torch.ones(1, dtype=torch.float32, device=device))
            first = cudnn_backward(
                _backward_scalars(saved.fwd, s_do, torch.cat([prov_dp, torch.ones(3, device=device)]))
            )
            measured = torch.cat([first[6].reshape(1), first[3].reshape(1), first[4].reshape(1), first[5].reshape(1)])
        grads = state.scales(_GRAD_ROLES, device, measured=measured)
        sc = _backward_scalars(saved.fwd, s_do, grads)
    dq8, dk8, dv8, amax_dq, amax_dk, amax_dv, amax_dp = cudnn_backward(sc)
    dq = dequantize_e4m3(dq8, sc["descale_dq"], geo.layout_q, geo.cu_q, saved.dtype)
    dk = dequantize_e4m3(dk8, sc["descale_dk"], geo.layout_k, geo.cu_k, saved.dtype)
    dv = dequantize_e4m3(dv8, sc["descale_dv"], geo.layout_k, geo.cu_k, saved.dtype)
    if state.mode is ScalingMode.DELAYED:  # a calibrating call's measurement was its record
        grad_amax = torch.cat([t.reshape(1) for t in (amax_dp, amax_dq, amax_dk, amax_dv)])
        if amax_do_bits is not None and measured is None:
            state.record(BACKWARD_MEASURED, torch.cat([amax_do_bits.view(torch.float32), grad_amax]))
        elif amax_do_bits is not None:
            state.record(("do",), amax_do_bits.view(torch.float32))
        elif measured is None:
            state.record(_GRAD_ROLES, grad_amax)
    return dq, dk, dv


class _CudnnFp8Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, run, cu_q, cu_k, key, arch, need_backward):
        with torch.autocast(device_type=q.device.type, enabled=False):  # the glue's torch ops as written
            out, saved = _forward(run, q, k, v, cu_q, cu_k, key, arch, need_backward)
        ctx.run = run
        ctx.saved = saved
        return out

    @staticmethod
    @once_differentiable  # cuDNN's gradients are outside autograd: a double backward is refused in words
    def backward(ctx, dout):
        with torch.autocast(device_type=dout.device.type, enabled=False):
            dq, dk, dv = _backward(ctx.run, ctx.saved, dout)
        return dq, dk, dv, None, None, None, None, None, None


# ------------------------------------------------------------------------------------------------
# the kernel function
# ------------------------------------------------------------------------------------------------


def _mask(causal: bool, lengths: list[tuple[int, int]] | None, arch: int) -> str:
    if not causal:
        return "none"
    if lengths is None or all(lq == lk for lq, lk in lengths):
        return "top_left"
    # Hopper gets here only with documents whose Lq == Lk or that have no query (nothing to mask)
    return "bottom_right" if arch >= 10 else "top_left"


def _scaling_label(recipe: ScalingRecipe) -> str:
    """The scaling mode as the report's run line names it (the kernel's ``paths``)."""
    if recipe.mode is ScalingMode.DELAYED and recipe.freeze_after_calibration:
        return "delayed scaling, calibrated then frozen"
    return f"{recipe.mode.value} scaling"


def graph_seq(max_seqlen: int) -> int:
    """The sequence dimension of the graphs a call with ``max_seqlen`` runs: a power of two of at least
    ROW_ALIGN, so that the many lengths of a check run share a few graphs (a graph takes about a second
    to build) at the cost of at most twice the padded layout's rows."""
    seq = make_layout(False, 0, 0, max_seqlen).seq
    return 1 << (seq - 1).bit_length()


def graph_head_dim(head_dim: int, arch: int) -> int:
    """The head_dim of the graphs a call with ``head_dim`` runs: on Hopper 128 for every head_dim up to
    128 (the only one its FP8 backward takes; the inputs get zero columns), elsewhere the next multiple
    of 16. Zero columns change no score, and O's extra columns are zero and sliced off."""
    if arch == 9 and 0 < head_dim <= 128:
        return 128
    return round_up(head_dim, 16) if head_dim > 0 else head_dim


@dataclass(frozen=True)
class _EqualLengths:
    """Causal documents with Lq != Lk as documents with Lq == Lk, where Hopper's top-left mask is the
    convention's bottom-right one: a document with Lq < Lk gets Lk - Lq zero query rows in front (their
    outputs are dropped, so their dO is zero and they add nothing to dK or dV); one with Lq > Lk keeps
    its last Lk queries (the first Lq - Lk see no key: output and dq zero); one without keys keeps none.

    gather: for each row of the new pack, its query's row in the old one, or ``T`` (a zero row);
    scatter: for each old query row, its row in the new pack, or ``T'`` (a zero row)."""

    gather: torch.Tensor
    scatter: torch.Tensor
    cu_q: torch.Tensor
    max_q: int

    def queries(self, q: torch.Tensor) -> torch.Tensor:
        return torch.cat([q, q.new_zeros((1, *q.shape[1:]))])[self.gather]

    def outputs(self, out: torch.Tensor) -> torch.Tensor:
        return torch.cat([out, out.new_zeros((1, *out.shape[1:]))])[self.scatter]


def equal_length_remap(lengths: Sequence[tuple[int, int]], device: torch.device) -> _EqualLengths | None:
    """The :class:`_EqualLengths` of a causal pack with per-document ``lengths`` (Lq, Lk), or None when
    every document with queries already has Lq == Lk."""
    if all(lq == lk or lq == 0 for lq, lk in lengths):
        return None
    total = sum(lq for lq, _ in lengths)
    gather: list[int] = []
    scatter = [-1] * total
    cu, start = [0], 0
    for lq, lk in lengths:
        new = 0 if lq == 0 else lk
        for i in range(new):  # new row i holds old query i - (new - lq), when there is one
            old = i - (new - lq)
            if old >= 0:
                scatter[start + old] = len(gather)
            gather.append(start + old if old >= 0 else total)
        start += lq
        cu.append(cu[-1] + new)
    rows = len(gather)
    scatter = [rows if j < 0 else j for j in scatter]
    as_long = lambda xs: torch.tensor(xs, dtype=torch.long, device=device)  # noqa: E731
    return _EqualLengths(
        as_long(gather),
        as_long(scatter),
        torch.tensor(cu, dtype=torch.int32, device=device),
        max((lk if lq else 0) for lq, lk in lengths) if lengths else 0,
    )


def _attend(
    run: _Runner,
    arch: int,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_q: torch.Tensor,
    cu_k: torch.Tensor,
    max_q: int,
    max_k: int,
    scale: float,
    causal: bool,
    lengths: list[tuple[int, int]] | None,
) -> torch.Tensor:
    """One call that cuDNN can run as it comes (the head_dim and the causal lengths already adapted)."""
    _, heads, head_dim = q.shape
    heads_k = k.shape[1]
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    # the layout is chosen for a backward whenever this shape could have one, grad or not, so that a
    # call with gradients and one without run the same graphs and give the same bits
    need_backward = (
        refusal(arch=arch, dtype=q.dtype, head_dim=head_dim, heads=heads, heads_k=heads_k, causal=False, backward=True)
        is None
    )
    key = GraphKey(
        padded=False,
        batch=int(cu_q.shape[0]) - 1,
        heads=heads,
        heads_k=heads_k,
        head_dim=head_dim,
        seq_q=graph_seq(max_q),
        seq_k=graph_seq(max_k),
        mask=_mask(causal, lengths, arch),
        softmax_scale=scale,
        deterministic=run.deterministic,
        device=str(q.device),
    )
    args: tuple[Any, ...] = (run, cu_q, cu_k, key, arch, need_backward)
    if grad:
        return _CudnnFp8Attention.apply(q, k, v, *args)
    with torch.no_grad(), torch.autocast(device_type=q.device.type, enabled=False):
        return _forward(run, q, k, v, cu_q, cu_k, key, arch, need_backward)[0]


#: the default amax history: TransformerEngine's documented example recipe (``amax_history_len=16``)
DEFAULT_HISTORY = 16
#: the default margin: one binade of headroom over the history's maximum, so that a tensor may double
#: from one call to the next without saturating (TransformerEngine's default is 0, with scales 448/amax)
DEFAULT_MARGIN = 1


def make_kernel(
    mode: ScalingMode | str = ScalingMode.DELAYED,
    *,
    history_len: int = DEFAULT_HISTORY,
    margin: int = DEFAULT_MARGIN,
    freeze_after_calibration: bool = False,
    deterministic: bool = True,
    engine: Engine | None = None,
    factory: bool = True,
) -> Callable[..., torch.Tensor]:
    """A ``cudnn-fp8`` kernel function with its own scaling state (:mod:`.scaling`).

    The default is what a model trains with: delayed scaling with an amax history of ``history_len``
    calls and ``margin`` binades of headroom, updated every call, one state per instance; a model (and
    the checks) builds one instance per attention layer from ``new_instance()``. ``freeze_after_calibration``
    freezes each role's scales after the first call that measures them (for checking a pure function:
    not for training); ``factory=False`` leaves ``new_instance`` out, so that every layer that calls the
    function shares its one state (how the former default was used).

    deterministic: cuDNN's deterministic backward algorithm (the checks compare repeated calls bit for
    bit). engine: what runs the attention on the E4M3 codes: cuDNN (default) or
    :class:`.EmulatedEngine` (CPU tests). The function carries ``recipe = "fp8"``, ``forward_only =
    False``, ``paths`` (calls per layout and mode), ``scaling`` (the :class:`.ScalingState`: freeze,
    reset, history), ``engine`` and the stateful kernel protocol of :mod:`flamia_verify.kernels.state`
    (``state_policy``, ``new_instance`` for a factory, ``state_snapshot``, ``state_restore``,
    ``state_describe``).
    """
    recipe = ScalingRecipe(
        mode=ScalingMode(mode),
        history_len=history_len,
        margin=margin,
        freeze_after_calibration=freeze_after_calibration,
    )
    if engine is None:
        from flamia_verify.kernels.cudnn_fp8.cudnn_graphs import CudnnEngine

        engine = CudnnEngine()
    run = _Runner(ScalingState(recipe), engine, deterministic, collections.Counter())

    def cudnn_fp8_attention(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cu_seqlens_q: torch.Tensor,
        cu_seqlens_k: torch.Tensor,
        max_seqlen_q: int,
        max_seqlen_k: int,
        *,
        softmax_scale: float | None = None,
        causal: bool = False,
    ) -> torch.Tensor:
        for name, t in (("q", q), ("k", k), ("v", v)):
            if not isinstance(t, torch.Tensor) or t.dim() != 3:
                raise ValueError(f"cudnn-fp8: {name} must be a (tokens, heads, head_dim) tensor")
        refused = run.engine.device_refusal(q.device)
        if refused is not None:
            raise CudnnFp8Refused(refused)
        if q.dtype != k.dtype or q.dtype != v.dtype:
            raise CudnnFp8Refused(f"cudnn-fp8: q, k, v must share a dtype; got {q.dtype}, {k.dtype}, {v.dtype}")
        arch = run.engine.arch(q.device)
        head_dim = q.shape[2]
        scale = float(softmax_scale) if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
        lengths = None
        if causal and cu_seqlens_q is not cu_seqlens_k and not torch.equal(cu_seqlens_q, cu_seqlens_k):
            lengths = list(zip(seqlens(cu_seqlens_q), seqlens(cu_seqlens_k)))
        dim = graph_head_dim(head_dim, arch)
        remap = equal_length_remap(lengths, q.device) if lengths is not None and arch == 9 else None
        reason = refusal(
            arch=arch,
            dtype=q.dtype,
            head_dim=dim,
            heads=q.shape[1],
            heads_k=k.shape[1],
            causal=causal,
            lengths=None if remap is not None else lengths,
        )
        if reason is not None:
            raise CudnnFp8Refused(reason)
        if q.shape[0] == 0 or k.shape[0] == 0 or (remap is not None and remap.max_q == 0):
            return no_attention(q, k, v)  # no query, or no key for any query: output 0
        if dim != head_dim:  # zero columns: the same scores, O's extra columns zero (sliced off)
            q, k, v = (F.pad(t, (0, dim - head_dim)) for t in (q, k, v))
        if remap is not None:
            q, cu_seqlens_q, max_seqlen_q, lengths = remap.queries(q), remap.cu_q, remap.max_q, None
        out = _attend(
            run, arch, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, causal, lengths
        )
        if remap is not None:
            out = remap.outputs(out)
        return out[..., :head_dim] if dim != head_dim else out

    fn: Any = cudnn_fp8_attention
    fn.recipe = "fp8"
    fn.forward_only = False
    fn.paths = run.paths
    fn.scaling = run.state
    fn.engine = run.engine
    # the stateful kernel protocol (flamia_verify.kernels.state)
    fn.state_policy = state_policy(recipe, shared=not factory)
    fn.state_snapshot = run.state.snapshot
    fn.state_restore = run.state.restore
    fn.state_describe = lambda: run.state.describe(ROLES)
    if factory:
        fn.new_instance = lambda: make_kernel(
            mode,
            history_len=history_len,
            margin=margin,
            freeze_after_calibration=freeze_after_calibration,
            deterministic=deterministic,
            engine=run.engine,  # the graphs are shared; the scaling state is the instance's own
        )
    fn.__doc__ = (
        f"cuDNN FP8 attention, {recipe.mode.value} per-tensor scaling"
        f"{' (calibrated on the first call, then frozen)' if freeze_after_calibration else ''}; "
        f"causal-safe: {'yes' if recipe.mode.causal_safe else 'no'}; {fn.state_policy.describe()}"
    )
    return cudnn_fp8_attention


def state_policy(recipe: ScalingRecipe, *, shared: bool) -> StatePolicy:
    """The declared state of a kernel with this scaling recipe (:mod:`flamia_verify.kernels.state`)."""
    if recipe.mode is ScalingMode.CURRENT:
        return StatePolicy(StateKind.CURRENT)
    kind = StateKind.FROZEN if recipe.freeze_after_calibration else StateKind.DELAYED
    sharing = StateSharing.SHARED if shared else StateSharing.PER_INSTANCE
    return StatePolicy(kind, recipe.history_len, recipe.margin, sharing)


def default_kernel() -> Callable[..., torch.Tensor]:
    """``cudnn-fp8``: delayed scaling to train with (history 16, margin 1, updated every call), one state
    per instance; a factory (``new_instance()``: one per attention layer). Causal- and document-safe
    within a call: no scale of a call depends on that call's data (after an instance's first call,
    which measures its own amaxes)."""
    return make_kernel(ScalingMode.DELAYED)


def frozen_kernel() -> Callable[..., torch.Tensor]:
    """``cudnn-fp8-frozen``, the former default, kept as an explicit option for checking a pure function:
    delayed scaling (history 1024, margin 0) with each role calibrated on the first call that needs it
    and frozen after it, one state for every layer that calls the function (not a factory). Not for
    training: a scale fitted to one call saturates when another layer's activations, or the same
    layer's later ones, are larger (the state family fails it)."""
    return make_kernel(ScalingMode.DELAYED, history_len=1024, margin=0, freeze_after_calibration=True, factory=False)


def current_kernel() -> Callable[..., torch.Tensor]:
    """``cudnn-fp8-current``: current (per-call amax) scaling, for comparison: not causal-safe."""
    return make_kernel(ScalingMode.CURRENT)
