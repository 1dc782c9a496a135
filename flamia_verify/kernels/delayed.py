"""``fp8-delayed``: per-tensor FP8 attention with TransformerEngine-style delayed scaling, in PyTorch.

The PyTorch specification of a stateful kernel: what a training framework's FP8 attention with
delayed scaling computes (the scaling of cuDNN's FP8 attention in ``cudnn-fp8``, on any device), so
that the checks of a kernel's state (:mod:`flamia_verify.properties.checks.state`) have a correct
stateful kernel to pass and planted stateful bugs (tests/zoo/state_bugs.py) to fail.

Numerics (the ``fp8`` recipe): Q, K, V, dO and dS are rounded to E4M3 with one power-of-two scale per
tensor each (RNE, saturating at 448); the probabilities P = exp(S - m) (at most 1) with the constant
scale 2^7; O = P V / l with l the sum of the rounded P (numerator and normalizer agree); every GEMM
sums in fp32; the backward rebuilds the forward's weights from the same rounded Q and K, takes
D = rowsum(dO O) from the rounded dO and the fp32 O (so that dS = A (dP - D) sums to zero over a
row), and rounds dS once for dQ = dS K and dK = dS^T Q.

Scaling (:mod:`flamia_verify.kernels.cudnn_fp8.scaling`, the state cuDNN's kernel uses too): each
of the roles q, k, v, do and dp (dS) keeps a history of its last ``history_len`` amaxes; a call's
scale is the largest power of two that maps the history's maximum to at most 448, divided by
``2^margin``; the call's own amaxes are appended after it has used its scales (TransformerEngine's
recipe, ``amax_compute_algo="max"``). The first call of an instance has no history: it measures its
own amaxes (current scaling, once). After that no scale of a call depends on that call's data: the
kernel is causal- and document-safe within a call. Across calls the scales follow the activations
with a delay; a tensor that grows faster than the margin allows between two calls saturates (a local
error), which is why the default margin is 1: one doubling per call fits.

Defaults: ``history_len`` 16 (TransformerEngine's documented example recipe), ``margin`` 1, one state
per instance. The kernel is a factory (``new_instance()``): a model builds one per attention layer.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.autograd.function import once_differentiable

from flamia_verify.convention import validate_varlen_inputs
from flamia_verify.formats import E4M3, round_to_format
from flamia_verify.kernels.cudnn_fp8.scaling import ScalingMode, ScalingRecipe, ScalingState
from flamia_verify.kernels.state import StateKind, StatePolicy, StateSharing

__all__ = ["DEFAULT_HISTORY", "DEFAULT_MARGIN", "DelayedScalingAttention", "ROLES_USED", "P_SCALE", "fp8_delayed"]

#: TransformerEngine's documented example (``DelayedScaling(amax_history_len=16, amax_compute_algo="max")``)
DEFAULT_HISTORY = 16
#: one binade of headroom: a tensor may double between two calls without saturating
DEFAULT_MARGIN = 1
#: the probabilities' constant scale: P <= 1 maps to at most 2^7 (E4M3's largest binade is 256..448)
P_SCALE = 128.0
#: the roles of :class:`ScalingState` this kernel scales ("dp" is dS, as in cuDNN's naming)
ROLES_USED = ("q", "k", "v", "do", "dp")
_FWD = ("q", "k", "v")


def _amax(x: torch.Tensor) -> torch.Tensor:
    """fp32 amax of a tensor, (1,); 0 for an empty one; NaN stays NaN."""
    if x.numel() == 0:
        return torch.zeros(1, dtype=torch.float32, device=x.device)
    return x.detach().abs().amax().to(torch.float32).reshape(1)


def fake_e4m3(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x`` rounded to E4M3 with a per-tensor ``scale`` (RNE, saturating finite values at 448) and read
    back, fp32. An infinite input becomes NaN (E4M3 has no Inf: saturating it would hide it)."""
    s = scale.reshape(()).to(torch.float32)
    xf = x.float()
    return torch.where(torch.isinf(xf), torch.full_like(xf, math.nan), round_to_format(xf * s, E4M3)) / s


def _visible(lq: int, lk: int, causal: bool, device: torch.device) -> torch.Tensor:
    """(lq, lk): key j visible to query i iff not causal or j <= i + (lk - lq) (bottom-right)."""
    if not causal:
        return torch.ones(lq, lk, dtype=torch.bool, device=device)
    i = torch.arange(lq, device=device)[:, None]
    j = torch.arange(lk, device=device)[None, :]
    return j <= i + (lk - lq)


def _documents(cu_q: torch.Tensor, cu_k: torch.Tensor):
    sq, sk = cu_q.tolist(), cu_k.tolist()
    for b in range(len(sq) - 1):
        q0, q1, k0, k1 = sq[b], sq[b + 1], sk[b], sk[b + 1]
        if q1 > q0 and k1 > k0:
            yield q0, q1, k0, k1


def _weights(qd, kd, groups: int, vis: torch.Tensor, scale: float) -> torch.Tensor:
    """(H, Lq, Lk) fp32 weights of one document as the forward multiplies V: the rounded P over the sum
    of the rounded P (0 in rows that see no key)."""
    kh = kd.repeat_interleave(groups, dim=1) if groups > 1 else kd
    s = torch.einsum("qhd,khd->hqk", qd, kh) * scale
    s = torch.where(vis, s, s.new_full((), -math.inf))
    m = s.amax(dim=-1, keepdim=True)
    m = torch.where(torch.isinf(m) & (m < 0), torch.zeros_like(m), m)  # a row that sees nothing
    p = torch.exp(s - m)
    p = round_to_format(p * P_SCALE, E4M3) / P_SCALE
    l_sum = p.sum(dim=-1, keepdim=True)
    ok = l_sum != 0
    return torch.where(ok, p / torch.where(ok, l_sum, torch.ones_like(l_sum)), p.new_zeros(()))


@dataclass
class _Saved:
    """What the forward keeps for the backward: the rounded q, k, v, the fp32 O, the pack."""

    qd: torch.Tensor
    kd: torch.Tensor
    vd: torch.Tensor
    o: torch.Tensor
    cu_q: torch.Tensor
    cu_k: torch.Tensor
    scale: float
    causal: bool
    dtype: torch.dtype
    k_shape: tuple[int, ...]
    groups: int


class _DelayedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cu_q, cu_k, scale, causal, kernel):
        with torch.autocast(device_type=q.device.type, enabled=False):
            out, saved = kernel._forward(q, k, v, cu_q, cu_k, scale, causal)
        ctx.saved, ctx.kernel = saved, kernel
        return out

    @staticmethod
    @once_differentiable  # a double backward through roundings has no meaning: refused in words
    def backward(ctx, dout):
        with torch.autocast(device_type=dout.device.type, enabled=False):
            dq, dk, dv = ctx.kernel._backward(ctx.saved, dout)
        return dq, dk, dv, None, None, None, None, None


class DelayedScalingAttention:
    """Per-tensor FP8 attention with delayed scaling (the module docstring), a kernel in the calling
    convention with its own :class:`ScalingState` (``state``): ``fn(q, k, v, cu_seqlens_q,
    cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale=None, causal=False)``.

    history_len, margin: the delayed recipe. freeze_after_calibration: the scales calibrated on the first
    call that needs them and never changed after it (a frozen, checked-as-pure-function kernel: not one
    to train with). state: share this state object instead of a new one (one history for several
    layers: not one to train with either).

    The stateful kernel protocol (:mod:`flamia_verify.kernels.state`): ``state_policy``,
    ``new_instance()``, ``state_snapshot()`` / ``state_restore()``, ``state_describe()``.
    """

    recipe = "fp8"
    forward_only = False

    def __init__(
        self,
        *,
        history_len: int = DEFAULT_HISTORY,
        margin: int = DEFAULT_MARGIN,
        freeze_after_calibration: bool = False,
        state: ScalingState | None = None,
        name: str = "fp8-delayed",
    ) -> None:
        self.scaling = ScalingRecipe(
            ScalingMode.DELAYED,
            history_len=history_len,
            margin=margin,
            freeze_after_calibration=freeze_after_calibration,
        )
        self.shared = state is not None
        self.state = state if state is not None else self._new_state()
        self.name = name
        self.__name__ = name.replace("-", "_")
        self.__doc__ = f"{name}: per-tensor E4M3 attention, {self.state_policy.describe()}"
        self.paths: collections.Counter[str] = collections.Counter()

    def _new_state(self) -> ScalingState:
        return ScalingState(self.scaling)

    # ------------------------------------------------------------------ the stateful kernel protocol

    @property
    def state_policy(self) -> StatePolicy:
        kind = StateKind.FROZEN if self.scaling.freeze_after_calibration else StateKind.DELAYED
        sharing = StateSharing.SHARED if self.shared else StateSharing.PER_INSTANCE
        return StatePolicy(kind, self.scaling.history_len, self.scaling.margin, sharing)

    def new_instance(self) -> DelayedScalingAttention:
        """A fresh kernel of the same recipe with its own state (one per attention layer)."""
        return type(self)(
            history_len=self.scaling.history_len,
            margin=self.scaling.margin,
            freeze_after_calibration=self.scaling.freeze_after_calibration,
            name=self.name,
        )

    def state_snapshot(self) -> Any:
        return self.state.snapshot()

    def state_restore(self, snapshot: Any) -> None:
        self.state.restore(snapshot)

    def state_describe(self) -> dict[str, Any]:
        return self.state.describe(ROLES_USED)

    # ------------------------------------------------------------------ the scales (hooks of the zoo)

    def _use(self, roles: Sequence[str], amax: torch.Tensor, device: torch.device) -> torch.Tensor:
        """The scales of ``roles`` for this call, from the history (or measured, ``amax``, on the call
        that calibrates them); then this call's amaxes are appended to the history."""
        measuring = self.state.needs_measurement(roles)
        scales = self.state.scales(roles, device, measured=amax if measuring else None)
        if not measuring:  # a calibrating call's measurement was its record
            self.state.record(roles, amax)
        return scales

    def forward_scales(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """(3,) scales of q, k, v."""
        return self._use(_FWD, torch.cat([_amax(q), _amax(k), _amax(v)]), q.device)

    def do_scale(self, dout: torch.Tensor) -> torch.Tensor:
        """(1,) scale of dO."""
        return self._use(("do",), _amax(dout), dout.device)

    def ds_scale(self, amax_ds: torch.Tensor) -> torch.Tensor:
        """(1,) scale of dS, whose amax over the call is ``amax_ds``."""
        return self._use(("dp",), amax_ds, amax_ds.device)

    # ------------------------------------------------------------------ the call

    def __call__(
        self,
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
        validate_varlen_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
        scale = q.shape[-1] ** -0.5 if softmax_scale is None else float(softmax_scale)
        self.paths["PyTorch emulation (delayed scaling)"] += 1
        cu_q = cu_seqlens_q.detach().to(torch.int64).contiguous()
        cu_k = cu_seqlens_k.detach().to(torch.int64).contiguous()
        if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
            return _DelayedAttention.apply(q, k, v, cu_q, cu_k, scale, bool(causal), self)
        with torch.no_grad(), torch.autocast(device_type=q.device.type, enabled=False):
            return self._forward(q, k, v, cu_q, cu_k, scale, bool(causal))[0]

    def _forward(self, q, k, v, cu_q, cu_k, scale: float, causal: bool):
        sc = self.forward_scales(q, k, v)
        qd, kd, vd = fake_e4m3(q, sc[0]), fake_e4m3(k, sc[1]), fake_e4m3(v, sc[2])
        groups = q.shape[1] // k.shape[1]
        o = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        for q0, q1, k0, k1 in _documents(cu_q, cu_k):
            vis = _visible(q1 - q0, k1 - k0, causal, q.device)
            a = _weights(qd[q0:q1], kd[k0:k1], groups, vis, scale)
            vh = vd[k0:k1].repeat_interleave(groups, dim=1) if groups > 1 else vd[k0:k1]
            o[q0:q1] = torch.einsum("hqk,khd->qhd", a, vh)
        saved = _Saved(qd, kd, vd, o, cu_q, cu_k, scale, causal, q.dtype, tuple(k.shape), groups)
        return o.to(q.dtype), saved

    def _backward(self, saved: _Saved, dout: torch.Tensor):
        qd, kd, vd, o = saved.qd, saved.kd, saved.vd, saved.o
        k_shape, groups, scale, causal = saved.k_shape, saved.groups, saved.scale, saved.causal
        dof = dout.to(saved.dtype).float()
        dod = fake_e4m3(dof, self.do_scale(dof))
        delta = (dod * o).sum(dim=-1)  # (Tq, H): D = rowsum(dO O) from what dP reads
        docs = list(_documents(saved.cu_q, saved.cu_k))
        parts = []
        amax_ds = torch.zeros(1, dtype=torch.float32, device=dof.device)
        for q0, q1, k0, k1 in docs:
            vis = _visible(q1 - q0, k1 - k0, causal, dof.device)
            a = _weights(qd[q0:q1], kd[k0:k1], groups, vis, scale)
            vh = vd[k0:k1].repeat_interleave(groups, dim=1) if groups > 1 else vd[k0:k1]
            dp = torch.einsum("qhd,khd->hqk", dod[q0:q1], vh)
            ds = torch.where(vis, a * (dp - delta[q0:q1].T[..., None]), a.new_zeros(()))
            if ds.numel():
                amax_ds = torch.maximum(amax_ds, ds.abs().amax().reshape(1))  # NaN stays NaN
            parts.append((a, ds))
        s_ds = self.ds_scale(amax_ds)
        dq = torch.zeros(qd.shape, dtype=torch.float32, device=dof.device)
        dk = torch.zeros((k_shape[0], qd.shape[1], k_shape[2]), dtype=torch.float32, device=dof.device)
        dv = torch.zeros_like(dk)
        scale32 = torch.tensor(scale, dtype=torch.float32).item()
        for (q0, q1, k0, k1), (a, ds) in zip(docs, parts, strict=True):
            dsd = fake_e4m3(ds, s_ds)
            kh = kd[k0:k1].repeat_interleave(groups, dim=1) if groups > 1 else kd[k0:k1]
            dq[q0:q1] = torch.einsum("hqk,khd->qhd", dsd, kh) * scale32
            dk[k0:k1] = torch.einsum("hqk,qhd->khd", dsd, qd[q0:q1]) * scale32
            dv[k0:k1] = torch.einsum("hqk,qhd->khd", a, dod[q0:q1])
        if groups > 1:
            dk = dk.view(k_shape[0], k_shape[1], groups, k_shape[2]).sum(dim=2)
            dv = dv.view(k_shape[0], k_shape[1], groups, k_shape[2]).sum(dim=2)
        return dq.to(saved.dtype), dk.to(saved.dtype), dv.to(saved.dtype)


def fp8_delayed() -> Callable[..., torch.Tensor]:
    """The built-in ``fp8-delayed`` kernel: a factory whose instances each keep their own delayed state."""
    return DelayedScalingAttention()
