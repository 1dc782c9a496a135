"""What the kernel asks of an FP8 attention engine, and a PyTorch model of cuDNN's for CPU tests.

The kernel (:mod:`.kernel`) does everything around the attention: the refusals, the scales, the fused
quantization into a layout and the dequantization of the results. An engine runs the attention on
E4M3 codes: :class:`flamia_verify.kernels.cudnn_fp8.cudnn_graphs.CudnnEngine` with cuDNN's graphs,
:class:`EmulatedEngine` with PyTorch. Both read and write the same buffers (:mod:`.layout`) with the
same scalar tensors, named after cuDNN's arguments (``descale_q``, ``scale_s``, ``scale_dP``, ...).

:class:`EmulatedEngine` models the semantics of cuDNN's FP8 attention as its frontend's reference
describes them (not its arithmetic: no online softmax, no tensor-core accumulation order): scores from
the codes times the descales, probabilities formed against the row maximum and quantized with
``scale_s`` for P V (divided by the sum of the unquantized ones), O written as E4M3 with
``scale_o``; the backward rebuilds P from the saved log-sum-exp, ``dV = E4M3(P) dO``, ``dP = dO V^T``,
``D = rowsum(dO * O)``, ``dS = P (dP - D) softmax_scale`` quantized with ``scale_dP``, ``dQ = dS K``,
``dK = dS^T Q``, each output written as E4M3 with its scale, and every amax taken before its
quantization. It lets the CPU tests run the whole glue (scales, calibration, freeze, the two-pass
backward, both layouts, the refusals) and the property checks (causal leakage of ``current``
scaling, none for ``delayed``); it says nothing about cuDNN's numerics, which only the GPU smoke
script (benchmarks/cudnn_fp8_smoke.py) measures.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

import torch

from flamia_verify.formats import E4M3, decode, encode
from flamia_verify.kernels.cudnn_fp8.layout import Layout

__all__ = ["CudnnFp8Refused", "EmulatedEngine", "Engine", "Geometry", "GraphKey", "MASKS"]


class CudnnFp8Refused(RuntimeError):
    """The kernel cannot run this call as asked (a limit of cuDNN's FP8 attention, named in one line);
    raised before any cuDNN call, never answered by computing something else."""


#: the causal masks an engine is asked for: none, top-left (query i sees keys j <= i) and bottom-right
#: (j <= i + Lk - Lq, the calling convention's); they agree when Lq == Lk
MASKS = ("none", "top_left", "bottom_right")


@dataclass(frozen=True)
class GraphKey:
    """Everything a cuDNN graph is built for (the cache key); the lengths and offsets are run-time."""

    padded: bool
    batch: int
    heads: int
    heads_k: int
    head_dim: int
    seq_q: int
    seq_k: int
    mask: str
    softmax_scale: float
    deterministic: bool
    device: str


@dataclass(frozen=True)
class Geometry:
    """One call's pack as the engines read it: the layouts, the cu_seqlens (int32, on the device),
    cuDNN's per-document lengths (int32 (B, 1, 1, 1)) and, packed, its ragged offsets (int64
    (B + 1, 1, 1, 1), in elements: ``cu * heads * head_dim`` for q, o, dO, dQ; ``cu * heads_k *
    head_dim`` for k, v, dK, dV; ``cu * heads`` for the softmax statistics)."""

    key: GraphKey
    layout_q: Layout
    layout_k: Layout
    cu_q: torch.Tensor
    cu_k: torch.Tensor
    seqlen_q: torch.Tensor
    seqlen_k: torch.Tensor
    offsets: Mapping[str, torch.Tensor]


class Engine(Protocol):
    """An FP8 attention on E4M3 codes in the layouts of :mod:`.layout`."""

    name: str

    def arch(self, device: torch.device) -> int:
        """The compute capability's major version the engine's limits follow (9 Hopper, 10 Blackwell)."""
        ...

    def device_refusal(self, device: torch.device) -> str | None:
        """Why the engine cannot run on ``device`` (one line), or None."""
        ...

    def choose_padded(self, key: GraphKey, need_backward: bool) -> bool:
        """Whether to use the padded layout for ``key`` (whose ``padded`` field is ignored), building
        what it needs; raises :class:`CudnnFp8Refused` (one line) when neither layout can run."""
        ...

    def forward(
        self,
        geo: Geometry,
        q8: torch.Tensor,
        k8: torch.Tensor,
        v8: torch.Tensor,
        sc: Mapping[str, torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(o8, stats, amax_s, amax_o): O's codes in layout_q, the softmax statistics (log-sum-exp,
        natural log, fp32: ``layout_q.rows * heads`` values in the engine's own order, handed back to its
        backward), and two (1,) fp32 amaxes. ``sc``: descale_q, descale_k, descale_v,
        descale_s, scale_s, scale_o."""
        ...

    def backward(
        self,
        geo: Geometry,
        q8: torch.Tensor,
        k8: torch.Tensor,
        v8: torch.Tensor,
        o8: torch.Tensor,
        do8: torch.Tensor,
        stats: torch.Tensor,
        sc: Mapping[str, torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(dq8, dk8, dv8, amax_dq, amax_dk, amax_dv, amax_dp). ``sc``: descale_q, descale_k, descale_v,
        descale_o, descale_dO, descale_s, descale_dP, scale_s, scale_dQ, scale_dK, scale_dV, scale_dP."""
        ...


# ------------------------------------------------------------------------------------------------
# the PyTorch model
# ------------------------------------------------------------------------------------------------


def _values(codes: torch.Tensor, descale: torch.Tensor) -> torch.Tensor:
    return decode(codes.view(torch.uint8), E4M3) * descale.reshape(()).to(torch.float32)


def _codes(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """E4M3 codes of ``x * scale`` (RNE, saturating) as float8_e4m3fn."""
    return encode(x * scale.reshape(()).to(torch.float32), E4M3, saturate=True).view(torch.float8_e4m3fn)


def _round(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x`` rounded as E4M3 with ``scale`` and read back (fake quantization)."""
    return decode(_codes(x, scale).view(torch.uint8), E4M3) / scale.reshape(()).to(torch.float32)


def _visible(lq: int, lk: int, mask: str, device: torch.device) -> torch.Tensor:
    i = torch.arange(lq, device=device)[:, None]
    j = torch.arange(lk, device=device)[None, :]
    if mask == "top_left":
        return j <= i
    if mask == "bottom_right":
        return j <= i + (lk - lq)
    return torch.ones(lq, lk, dtype=torch.bool, device=device)


def _rows_of(layout: Layout, cu: list[int], b: int) -> slice:
    start = b * layout.seq if layout.padded else cu[b]
    return slice(start, start + cu[b + 1] - cu[b])


class EmulatedEngine:
    """A PyTorch model of cuDNN's FP8 attention (the module docstring says what it models), for the CPU.

    arch: the compute capability whose limits the kernel applies (9: Hopper's top-left-only causal mask
    and head_dim 128 backward). ragged_backward: whether the model offers a packed (ragged) backward;
    False, as cuDNN frontend 1.22+ on Hopper, makes a call that needs a backward use the padded layout.
    """

    name = "PyTorch model of cuDNN FP8 attention"

    def __init__(self, arch: int = 9, ragged_backward: bool = False) -> None:
        self._arch = arch
        self.ragged_backward = ragged_backward
        self.calls = {"forward": 0, "backward": 0}

    def arch(self, device: torch.device) -> int:
        return self._arch

    def device_refusal(self, device: torch.device) -> str | None:
        return None

    def choose_padded(self, key: GraphKey, need_backward: bool) -> bool:
        return need_backward and not self.ragged_backward

    def forward(self, geo, q8, k8, v8, sc):
        self.calls["forward"] += 1
        key = geo.key
        cu_q = [int(c) for c in geo.cu_q.tolist()]
        cu_k = [int(c) for c in geo.cu_k.tolist()]
        q = _values(q8, sc["descale_q"])
        k = _values(k8, sc["descale_k"])
        v = _values(v8, sc["descale_v"])
        o = torch.zeros_like(q)
        stats = torch.zeros(q.shape[:2], dtype=torch.float32, device=q.device)
        amax_s = torch.zeros(1, dtype=torch.float32, device=q.device)
        group = key.heads // key.heads_k
        for b in range(key.batch):
            rq, rk = _rows_of(geo.layout_q, cu_q, b), _rows_of(geo.layout_k, cu_k, b)
            lq, lk = rq.stop - rq.start, rk.stop - rk.start
            if lq == 0:
                continue
            vis = _visible(lq, lk, key.mask, q.device)
            for h in range(key.heads):
                kh = h // group
                s = (q[rq, h] @ k[rk, kh].T) * key.softmax_scale
                s = s.masked_fill(~vis, -math.inf)
                m = s.amax(dim=1, keepdim=True) if lk else torch.full((lq, 1), -math.inf, device=q.device)
                p = torch.exp(s - torch.where(torch.isinf(m), 0.0, m)) if lk else s
                l_sum = p.sum(dim=1, keepdim=True)
                if lk:
                    amax_s = torch.maximum(amax_s, p.amax().reshape(1))
                    p8 = _round(p, sc["scale_s"])
                    o[rq, h] = torch.where(l_sum == 0, 0.0, (p8 @ v[rk, kh]) / l_sum)  # NaN stays NaN
                stats[rq, h] = (m + torch.log(l_sum)).reshape(-1)
        amax_o = o.abs().amax().reshape(1)
        return _codes(o, sc["scale_o"]), stats, amax_s, amax_o

    def backward(self, geo, q8, k8, v8, o8, do8, stats, sc):
        self.calls["backward"] += 1
        key = geo.key
        cu_q = [int(c) for c in geo.cu_q.tolist()]
        cu_k = [int(c) for c in geo.cu_k.tolist()]
        q = _values(q8, sc["descale_q"])
        k = _values(k8, sc["descale_k"])
        v = _values(v8, sc["descale_v"])
        o = _values(o8, sc["descale_o"])
        do = _values(do8, sc["descale_dO"])
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        amax_dp = torch.zeros(1, dtype=torch.float32, device=q.device)
        group = key.heads // key.heads_k
        for b in range(key.batch):
            rq, rk = _rows_of(geo.layout_q, cu_q, b), _rows_of(geo.layout_k, cu_k, b)
            lq, lk = rq.stop - rq.start, rk.stop - rk.start
            if lq == 0 or lk == 0:
                continue
            vis = _visible(lq, lk, key.mask, q.device)
            for h in range(key.heads):
                kh = h // group
                s = (q[rq, h] @ k[rk, kh].T) * key.softmax_scale
                lse = stats[rq, h][:, None]
                p = torch.where(vis & (lse != -math.inf), torch.exp(s - lse), 0.0)  # NaN stays NaN
                dv[rk, kh] += _round(p, sc["scale_s"]).T @ do[rq, h]
                dp = do[rq, h] @ v[rk, kh].T
                d_row = (do[rq, h] * o[rq, h]).sum(dim=1, keepdim=True)
                ds_exact = p * (dp - d_row) * key.softmax_scale
                # cuDNN's amax_dP is that of the tensor it quantizes with scale_dP: dS times softmax_scale
                # (measured on the H200, cuDNN 9.19: 0.378 against 0.358 in float64, where dP's is 59.8)
                amax_dp = torch.maximum(amax_dp, torch.where(vis, ds_exact.abs(), 0.0).amax().reshape(1))
                ds = _round(ds_exact, sc["scale_dP"])
                dq[rq, h] += ds @ k[rk, kh]
                dk[rk, kh] += ds.T @ q[rq, h]
        amaxes = [t.abs().amax().reshape(1) for t in (dq, dk, dv)]
        return (
            _codes(dq, sc["scale_dQ"]),
            _codes(dk, sc["scale_dK"]),
            _codes(dv, sc["scale_dV"]),
            amaxes[0],
            amaxes[1],
            amaxes[2],
            amax_dp,
        )
