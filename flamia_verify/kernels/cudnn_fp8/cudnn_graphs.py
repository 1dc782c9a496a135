"""cuDNN's FP8 attention graphs, built with the frontend's Python API (``import cudnn``) and cached.

Everything that touches cuDNN is here, so that it can be debugged on the GPU in one place; nothing here
runs on the CPU (tests/test_cudnn_fp8.py covers the rest of the kernel with :class:`.EmulatedEngine`).
Written from the frontend's documentation and its FP8 attention tests (frontend 1.2x), not run before
a GPU session: benchmarks/cudnn_fp8_smoke.py is the first thing to run on the H200.

The graphs (one per :class:`.GraphKey`, built on first use, cached per engine):

* forward: ``pygraph.sdpa_fp8`` on E4M3 q, k, v of dims (B, H, S, D) with BSHD strides
  ``(S*H*D, D, H*D, 1)``, a padding mask with per-document lengths (int32 (B, 1, 1, 1)), the causal mask
  as ``diagonal_alignment`` + ``right_bound=0``, softmax statistics on (``generate_stats``); outputs
  O (E4M3: Hopper writes no BF16), the statistics (fp32, (B, H, S, 1)) and amax_s, amax_o.
* backward: ``pygraph.sdpa_fp8_backward`` on E4M3 q, k, v, O, dO and the statistics; outputs dQ, dK, dV
  (E4M3) and amax_dQ, amax_dK, amax_dV, amax_dP.
* packed layout: every token tensor gets a ragged offset (int64 (B + 1, 1, 1, 1), elements); padded:
  none, the rows are ``b * S + s``.

Every scalar (scales, descales, amaxes) is a (1, 1, 1, 1) fp32 tensor: one value per tensor (Hopper's
FP8 attention has no per-token or per-block scales).
"""

from __future__ import annotations

import dataclasses
import enum
import importlib
from typing import Any

import torch

from flamia_verify.kernels.cudnn_fp8.engine import CudnnFp8Refused, Geometry, GraphKey

__all__ = ["CudnnEngine", "cudnn_module"]


def cudnn_module() -> Any:
    """``import cudnn`` (the nvidia-cudnn-frontend package), imported on first use only."""
    return importlib.import_module("cudnn")


class _Fwd(enum.IntEnum):
    Q = 1
    K = 2
    V = 3
    DESCALE_Q = 4
    DESCALE_K = 5
    DESCALE_V = 6
    DESCALE_S = 7
    SCALE_S = 8
    SCALE_O = 9
    O = 10
    STATS = 11
    AMAX_S = 12
    AMAX_O = 13
    SEQ_Q = 14
    SEQ_K = 15
    OFF_Q = 16
    OFF_K = 17
    OFF_V = 18
    OFF_O = 19
    OFF_STATS = 20


class _Bwd(enum.IntEnum):
    Q = 101
    K = 102
    V = 103
    O = 104
    DO = 105
    STATS = 106
    DESCALE_Q = 107
    DESCALE_K = 108
    DESCALE_V = 109
    DESCALE_O = 110
    DESCALE_DO = 111
    DESCALE_S = 112
    DESCALE_DP = 113
    SCALE_S = 114
    SCALE_DQ = 115
    SCALE_DK = 116
    SCALE_DV = 117
    SCALE_DP = 118
    DQ = 119
    DK = 120
    DV = 121
    AMAX_DQ = 122
    AMAX_DK = 123
    AMAX_DV = 124
    AMAX_DP = 125
    SEQ_Q = 126
    SEQ_K = 127
    OFF_Q = 128
    OFF_K = 129
    OFF_V = 130
    OFF_O = 131
    OFF_STATS = 132
    OFF_DO = 133


_SCALAR = {"dim": (1, 1, 1, 1), "stride": (1, 1, 1, 1)}


def _bshd(b: int, h: int, s: int, d: int) -> dict[str, tuple[int, ...]]:
    return {"dim": (b, h, s, d), "stride": (s * h * d, d, h * d, 1)}


def _stats_dims(b: int, h: int, s: int, padded: bool) -> dict[str, tuple[int, ...]]:
    """The softmax statistics: token-major with ragged offsets (packed), head-major (padded), as the
    frontend's FP8 tests lay them out; only cuDNN reads them (forward to backward)."""
    return {"dim": (b, h, s, 1), "stride": (s * h, s, 1, 1) if padded else (s * h, 1, h, 1)}


def _mask_kwargs(c: Any, mask: str) -> dict[str, Any]:
    if mask == "none":
        return {}
    align = c.diagonal_alignment.TOP_LEFT if mask == "top_left" else c.diagonal_alignment.BOTTOM_RIGHT
    return {"diagonal_alignment": align, "right_bound": 0}


def _finish(c: Any, g: Any) -> Any:
    g.validate()
    g.build_operation_graph()
    g.create_execution_plans([c.heur_mode.A, c.heur_mode.FALLBACK])
    g.check_support()
    g.build_plans()
    return g


def build_forward(key: GraphKey, handle: Any) -> Any:
    """The forward graph of ``key`` (built and planned)."""
    c = cudnn_module()
    fp8, f32 = c.data_type.FP8_E4M3, c.data_type.FLOAT
    b, h, hk, d, sq, sk = key.batch, key.heads, key.heads_k, key.head_dim, key.seq_q, key.seq_k
    g = c.pygraph(io_data_type=fp8, intermediate_data_type=f32, compute_data_type=f32, handle=handle)
    q = g.tensor(uid=_Fwd.Q, data_type=fp8, **_bshd(b, h, sq, d))
    k = g.tensor(uid=_Fwd.K, data_type=fp8, **_bshd(b, hk, sk, d))
    v = g.tensor(uid=_Fwd.V, data_type=fp8, **_bshd(b, hk, sk, d))
    lens = {"dim": (b, 1, 1, 1), "stride": (1, 1, 1, 1), "data_type": c.data_type.INT32}
    seq_q = g.tensor(uid=_Fwd.SEQ_Q, **lens)
    seq_k = g.tensor(uid=_Fwd.SEQ_K, **lens)
    offs: dict[str, Any] = {}
    if not key.padded:
        ragged = {"dim": (b + 1, 1, 1, 1), "stride": (1, 1, 1, 1), "data_type": c.data_type.INT64}
        for name, uid in (("q", _Fwd.OFF_Q), ("k", _Fwd.OFF_K), ("v", _Fwd.OFF_V), ("o", _Fwd.OFF_O)):
            offs[name] = g.tensor(uid=uid, **ragged)
        offs["stats"] = g.tensor(uid=_Fwd.OFF_STATS, **ragged)
        q.set_ragged_offset(offs["q"])
        k.set_ragged_offset(offs["k"])
        v.set_ragged_offset(offs["v"])
    scalars = {u: g.tensor(uid=u, data_type=f32, **_SCALAR) for u in (_Fwd.DESCALE_Q, _Fwd.DESCALE_K, _Fwd.DESCALE_V)}
    scalars.update({u: g.tensor(uid=u, data_type=f32, **_SCALAR) for u in (_Fwd.DESCALE_S, _Fwd.SCALE_S, _Fwd.SCALE_O)})
    o, stats, amax_s, amax_o = g.sdpa_fp8(
        q=q,
        k=k,
        v=v,
        descale_q=scalars[_Fwd.DESCALE_Q],
        descale_k=scalars[_Fwd.DESCALE_K],
        descale_v=scalars[_Fwd.DESCALE_V],
        descale_s=scalars[_Fwd.DESCALE_S],
        scale_s=scalars[_Fwd.SCALE_S],
        scale_o=scalars[_Fwd.SCALE_O],
        generate_stats=True,
        attn_scale=float(key.softmax_scale),
        use_padding_mask=True,
        seq_len_q=seq_q,
        seq_len_kv=seq_k,
        name="flamia_cudnn_fp8_fwd",
        **_mask_kwargs(c, key.mask),
    )
    o.set_uid(_Fwd.O).set_output(True).set_dim(_bshd(b, h, sq, d)["dim"]).set_stride(_bshd(b, h, sq, d)["stride"])
    o.set_data_type(fp8)
    st = _stats_dims(b, h, sq, key.padded)
    stats.set_uid(_Fwd.STATS).set_output(True).set_dim(st["dim"]).set_stride(st["stride"]).set_data_type(f32)
    if not key.padded:
        o.set_ragged_offset(offs["o"])
        stats.set_ragged_offset(offs["stats"])
    for t, uid in ((amax_s, _Fwd.AMAX_S), (amax_o, _Fwd.AMAX_O)):
        t.set_uid(uid).set_output(True).set_dim(_SCALAR["dim"]).set_stride(_SCALAR["stride"]).set_data_type(f32)
    return _finish(c, g)


def build_backward(key: GraphKey, handle: Any) -> Any:
    """The backward graph of ``key`` (built and planned)."""
    c = cudnn_module()
    fp8, f32 = c.data_type.FP8_E4M3, c.data_type.FLOAT
    b, h, hk, d, sq, sk = key.batch, key.heads, key.heads_k, key.head_dim, key.seq_q, key.seq_k
    g = c.pygraph(io_data_type=fp8, intermediate_data_type=f32, compute_data_type=f32, handle=handle)
    q = g.tensor(uid=_Bwd.Q, data_type=fp8, **_bshd(b, h, sq, d))
    k = g.tensor(uid=_Bwd.K, data_type=fp8, **_bshd(b, hk, sk, d))
    v = g.tensor(uid=_Bwd.V, data_type=fp8, **_bshd(b, hk, sk, d))
    o = g.tensor(uid=_Bwd.O, data_type=fp8, **_bshd(b, h, sq, d))
    do = g.tensor(uid=_Bwd.DO, data_type=fp8, **_bshd(b, h, sq, d))
    stats = g.tensor(uid=_Bwd.STATS, data_type=f32, **_stats_dims(b, h, sq, key.padded))
    lens = {"dim": (b, 1, 1, 1), "stride": (1, 1, 1, 1), "data_type": c.data_type.INT32}
    seq_q = g.tensor(uid=_Bwd.SEQ_Q, **lens)
    seq_k = g.tensor(uid=_Bwd.SEQ_K, **lens)
    offs: dict[str, Any] = {}
    if not key.padded:
        ragged = {"dim": (b + 1, 1, 1, 1), "stride": (1, 1, 1, 1), "data_type": c.data_type.INT64}
        for name, uid in (
            ("q", _Bwd.OFF_Q),
            ("k", _Bwd.OFF_K),
            ("v", _Bwd.OFF_V),
            ("o", _Bwd.OFF_O),
            ("do", _Bwd.OFF_DO),
            ("stats", _Bwd.OFF_STATS),
        ):
            offs[name] = g.tensor(uid=uid, **ragged)
        for t, name in ((q, "q"), (k, "k"), (v, "v"), (o, "o"), (do, "do"), (stats, "stats")):
            t.set_ragged_offset(offs[name])
    names = (
        _Bwd.DESCALE_Q,
        _Bwd.DESCALE_K,
        _Bwd.DESCALE_V,
        _Bwd.DESCALE_O,
        _Bwd.DESCALE_DO,
        _Bwd.DESCALE_S,
        _Bwd.DESCALE_DP,
        _Bwd.SCALE_S,
        _Bwd.SCALE_DQ,
        _Bwd.SCALE_DK,
        _Bwd.SCALE_DV,
        _Bwd.SCALE_DP,
    )
    s = {u: g.tensor(uid=u, data_type=f32, **_SCALAR) for u in names}
    dq, dk, dv, amax_dq, amax_dk, amax_dv, amax_dp = g.sdpa_fp8_backward(
        q=q,
        k=k,
        v=v,
        o=o,
        dO=do,
        stats=stats,
        descale_q=s[_Bwd.DESCALE_Q],
        descale_k=s[_Bwd.DESCALE_K],
        descale_v=s[_Bwd.DESCALE_V],
        descale_o=s[_Bwd.DESCALE_O],
        descale_dO=s[_Bwd.DESCALE_DO],
        descale_s=s[_Bwd.DESCALE_S],
        descale_dP=s[_Bwd.DESCALE_DP],
        scale_s=s[_Bwd.SCALE_S],
        scale_dQ=s[_Bwd.SCALE_DQ],
        scale_dK=s[_Bwd.SCALE_DK],
        scale_dV=s[_Bwd.SCALE_DV],
        scale_dP=s[_Bwd.SCALE_DP],
        attn_scale=float(key.softmax_scale),
        use_padding_mask=True,
        seq_len_q=seq_q,
        seq_len_kv=seq_k,
        use_deterministic_algorithm=key.deterministic,
        name="flamia_cudnn_fp8_bwd",
        **_mask_kwargs(c, key.mask),
    )
    for t, uid, heads, name in ((dq, _Bwd.DQ, h, "q"), (dk, _Bwd.DK, hk, "k"), (dv, _Bwd.DV, hk, "v")):
        dims = _bshd(b, heads, sq if name == "q" else sk, d)
        t.set_uid(uid).set_output(True).set_dim(dims["dim"]).set_stride(dims["stride"]).set_data_type(fp8)
        if not key.padded:
            t.set_ragged_offset(offs[name])
    for t, uid in ((amax_dq, _Bwd.AMAX_DQ), (amax_dk, _Bwd.AMAX_DK), (amax_dv, _Bwd.AMAX_DV), (amax_dp, _Bwd.AMAX_DP)):
        t.set_uid(uid).set_output(True).set_dim(_SCALAR["dim"]).set_stride(_SCALAR["stride"]).set_data_type(f32)
    return _finish(c, g)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"


def _describe(key: GraphKey) -> str:
    return (
        f"{key.batch} documents, heads {key.heads}/{key.heads_k}, head_dim {key.head_dim}, "
        f"seq {key.seq_q}x{key.seq_k}, mask {key.mask}"
    )


def _scalars(n: int, device: torch.device) -> list[torch.Tensor]:
    """n fp32 scalar tensors 16 bytes apart (one allocation), zero."""
    buf = torch.zeros(n, 4, dtype=torch.float32, device=device)
    return [buf[i, :1] for i in range(n)]


class CudnnEngine:
    """cuDNN's FP8 attention (:mod:`flamia_verify.kernels.cudnn_fp8.engine` describes the interface).

    One cuDNN handle per device (its stream set to the caller's current stream at every call), graphs
    cached per :class:`.GraphKey`, and the layout chosen per key: packed (ragged) when cuDNN builds
    the forward (and, when a backward is needed, the backward) graph for it, else padded. Which one
    ran is counted in the kernel's ``paths``.
    """

    name = "cuDNN FP8 attention"

    def __init__(self) -> None:
        self._handles: dict[int, Any] = {}
        self._graphs: dict[tuple[str, GraphKey], tuple[Any, int]] = {}
        self._padded: dict[tuple[GraphKey, bool], bool] = {}
        # devices (and determinism) where cuDNN declined a packed backward: Hopper declines it for every
        # shape ("not supported on Hopper architecture"), so later keys go to the padded layout at once
        # instead of building a packed forward and failing the backward again (a second or so each)
        self._packed_backward_declined: set[tuple[str, bool]] = set()

    def arch(self, device: torch.device) -> int:
        return int(torch.cuda.get_device_capability(device)[0])

    def device_refusal(self, device: torch.device) -> str | None:
        if device.type != "cuda":
            return f"cudnn-fp8: cuDNN's FP8 attention runs on CUDA tensors; got {device.type} tensors"
        return None

    def _handle(self, device: torch.device) -> Any:
        c = cudnn_module()
        index = device.index if device.index is not None else torch.cuda.current_device()
        if index not in self._handles:
            with torch.cuda.device(index):
                self._handles[index] = c.create_handle()
        handle = self._handles[index]
        c.set_stream(handle=handle, stream=torch.cuda.current_stream(index).cuda_stream)
        return handle

    def _graph(self, which: str, key: GraphKey) -> tuple[Any, int]:
        cached = self._graphs.get((which, key))
        if cached is None:
            handle = self._handle(torch.device(key.device))
            g = (build_forward if which == "fwd" else build_backward)(key, handle)
            cached = (g, int(g.get_workspace_size()))
            self._graphs[(which, key)] = cached
        return cached

    def choose_padded(self, key: GraphKey, need_backward: bool) -> bool:
        base = dataclasses.replace(key, padded=False)
        known = self._padded.get((base, need_backward))
        if known is not None:
            return known
        c = cudnn_module()
        reasons = []
        declined = (key.device, key.deterministic) in self._packed_backward_declined
        for padded in (True,) if need_backward and declined else (False, True):
            k = dataclasses.replace(key, padded=padded)
            try:
                self._graph("fwd", k)
            except c.cudnnGraphNotSupportedError as exc:
                reasons.append(f"{'padded' if padded else 'packed'}: {_first_line(exc)}")
                continue
            if need_backward:
                try:
                    self._graph("bwd", k)
                except c.cudnnGraphNotSupportedError as exc:
                    reasons.append(f"{'padded' if padded else 'packed'} backward: {_first_line(exc)}")
                    if not padded:
                        self._packed_backward_declined.add((key.device, key.deterministic))
                    continue
            self._padded[(base, need_backward)] = padded
            return padded
        raise CudnnFp8Refused(
            f"cudnn-fp8: cuDNN built no FP8 attention graph for {_describe(key)}: {'; '.join(reasons)}"
        )

    def _run(self, which: str, geo: Geometry, pack: dict[int, torch.Tensor]) -> None:
        g, ws = self._graph(which, geo.key)
        device = torch.device(geo.key.device)
        workspace = torch.empty(max(ws, 1), dtype=torch.uint8, device=device)
        g.execute(pack, workspace, handle=self._handle(device))

    def forward(self, geo, q8, k8, v8, sc):
        key, lq = geo.key, geo.layout_q
        device = q8.device
        # zeros: the backward reads O and the statistics of pad rows too (masked, but not NaN garbage)
        o8 = torch.zeros((lq.rows, key.heads, key.head_dim), dtype=torch.float8_e4m3fn, device=device)
        stats = torch.zeros((lq.rows, key.heads), dtype=torch.float32, device=device)
        amax_s, amax_o = _scalars(2, device)
        pack = {
            _Fwd.Q: q8,
            _Fwd.K: k8,
            _Fwd.V: v8,
            _Fwd.DESCALE_Q: sc["descale_q"],
            _Fwd.DESCALE_K: sc["descale_k"],
            _Fwd.DESCALE_V: sc["descale_v"],
            _Fwd.DESCALE_S: sc["descale_s"],
            _Fwd.SCALE_S: sc["scale_s"],
            _Fwd.SCALE_O: sc["scale_o"],
            _Fwd.O: o8,
            _Fwd.STATS: stats,
            _Fwd.AMAX_S: amax_s,
            _Fwd.AMAX_O: amax_o,
            _Fwd.SEQ_Q: geo.seqlen_q,
            _Fwd.SEQ_K: geo.seqlen_k,
        }
        if not key.padded:
            pack.update(
                {
                    _Fwd.OFF_Q: geo.offsets["q"],
                    _Fwd.OFF_K: geo.offsets["k"],
                    _Fwd.OFF_V: geo.offsets["v"],
                    _Fwd.OFF_O: geo.offsets["o"],
                    _Fwd.OFF_STATS: geo.offsets["stats"],
                }
            )
        self._run("fwd", geo, {int(u): t for u, t in pack.items()})
        return o8, stats, amax_s, amax_o

    def backward(self, geo, q8, k8, v8, o8, do8, stats, sc):
        key, lq, lk = geo.key, geo.layout_q, geo.layout_k
        device = q8.device
        dq8 = torch.empty((lq.rows, key.heads, key.head_dim), dtype=torch.float8_e4m3fn, device=device)
        dk8 = torch.empty((lk.rows, key.heads_k, key.head_dim), dtype=torch.float8_e4m3fn, device=device)
        dv8 = torch.empty((lk.rows, key.heads_k, key.head_dim), dtype=torch.float8_e4m3fn, device=device)
        amax_dq, amax_dk, amax_dv, amax_dp = _scalars(4, device)
        pack = {
            _Bwd.Q: q8,
            _Bwd.K: k8,
            _Bwd.V: v8,
            _Bwd.O: o8,
            _Bwd.DO: do8,
            _Bwd.STATS: stats,
            _Bwd.DESCALE_Q: sc["descale_q"],
            _Bwd.DESCALE_K: sc["descale_k"],
            _Bwd.DESCALE_V: sc["descale_v"],
            _Bwd.DESCALE_O: sc["descale_o"],
            _Bwd.DESCALE_DO: sc["descale_dO"],
            _Bwd.DESCALE_S: sc["descale_s"],
            _Bwd.DESCALE_DP: sc["descale_dP"],
            _Bwd.SCALE_S: sc["scale_s"],
            _Bwd.SCALE_DQ: sc["scale_dQ"],
            _Bwd.SCALE_DK: sc["scale_dK"],
            _Bwd.SCALE_DV: sc["scale_dV"],
            _Bwd.SCALE_DP: sc["scale_dP"],
            _Bwd.DQ: dq8,
            _Bwd.DK: dk8,
            _Bwd.DV: dv8,
            _Bwd.AMAX_DQ: amax_dq,
            _Bwd.AMAX_DK: amax_dk,
            _Bwd.AMAX_DV: amax_dv,
            _Bwd.AMAX_DP: amax_dp,
            _Bwd.SEQ_Q: geo.seqlen_q,
            _Bwd.SEQ_K: geo.seqlen_k,
        }
        if not key.padded:
            pack.update(
                {
                    _Bwd.OFF_Q: geo.offsets["q"],
                    _Bwd.OFF_K: geo.offsets["k"],
                    _Bwd.OFF_V: geo.offsets["v"],
                    _Bwd.OFF_O: geo.offsets["o"],
                    _Bwd.OFF_DO: geo.offsets["o"],
                    _Bwd.OFF_STATS: geo.offsets["stats"],
                }
            )
        self._run("bwd", geo, {int(u): t for u, t in pack.items()})
        return dq8, dk8, dv8, amax_dq, amax_dk, amax_dv, amax_dp
