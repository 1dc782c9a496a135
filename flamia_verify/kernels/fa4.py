"""FlashAttention-4 (the ``flash-attn-4`` package, ``flash_attn.cute``) in the varlen calling convention.

Two kernels, registered as adapters in :mod:`flamia_verify.kernels.adapters`:

``fa4`` (:func:`make_kernel`): BF16/FP16 forward and backward through
``flash_attn.cute.interface.flash_attn_varlen_func``. The mapping onto the convention:

* q, k, v go positionally, everything else by keyword: the interface's fourth positional parameter
  is ``qv`` (MLA's absorbed query), not ``cu_seqlens_q``, so a positional call in FlashAttention-2's
  order would hand cu_seqlens_q to ``qv``;
* ``cu_seqlens_q``/``cu_seqlens_k`` as contiguous int32 tensors (the interface asserts stride 1; a
  strided view of the convention gets a contiguous copy), ``max_seqlen_q``/``max_seqlen_k`` as Python
  ints (upper bounds for the launch, as FA defines them), ``softmax_scale`` as a float or None (FA's
  default, head_dim^-0.5), ``causal`` as a bool;
* causal is FlashAttention's bottom-right alignment (``mask.py``: key j is visible to query i iff
  j <= i + Lk - Lq), which is the convention's; GQA/MQA as FA4 does it (H a multiple of Hk);
* ``return_lse=True``: the kernel returns ``(out, lse)``, lse (nheads, total_q) float32, in the graph
  (FA4's backward takes a dlse), so ``interface.lse`` checks it; ``make_kernel(return_lse=False)``
  returns out alone;
* ``deterministic=False`` (FA4's default, what a training run wires; its dQ accumulation is then not
  bitwise repeatable, a reproducibility finding); ``make_kernel(deterministic=True)`` passes True.

``fa4-fp8`` and its policies (:func:`make_fp8_kernel`): the FP8 forward (forward only: FA4 raises on an
FP8 input that requires grad). q, k and v are quantized here to E4M3 with power-of-two scales (the
rule of :func:`flamia_verify.kernels.cudnn_fp8.scaling.pow2_scale`: dequantization adds no rounding)
and handed to FA4 with their descales as ``scales=TensorwiseScales(q, k, v)``: one fp32 value per
(document, kv head) each, the only granularity the interface takes (the q descale of a GQA group is
shared by its query heads). FA4 returns BF16 out (cast to the input dtype) and its log-sum-exp. The
scaling policies are the ones users wire:

==============  ================================================  =============  ===============
policy          each call's scales                                causal-safe    document-safe
==============  ================================================  =============  ===============
``delayed``     an amax history of earlier calls (TransformerEngine's  yes           yes
                recipe; for checking, calibrated on the first call
                and frozen): no scale depends on this call's data
``current``     one amax per tensor over the whole pack           no             no
``document``    one amax per (document, kv head) over the         no             yes
                document's tokens (q: over the group's heads)
==============  ================================================  =============  ===============

``current`` leaks across the causal mask and across documents (a later token, or another document,
moves the one amax and so the rounding of every output); ``document`` keeps documents apart and still
leaks causally (a later token of the same document moves its amax); ``delayed`` leaks neither within a
call. The checks (``causal``, ``isolation``) say so on the GPU; the CPU tests show it with a stand-in
of the interface.

Where it runs: FA4 is for Hopper (sm_90) and Blackwell (sm_100 and later); its FP8 forward runs on
compute capability 10.x only (the interface asserts it), so on a Hopper GPU ``fa4-fp8`` is unavailable
with that reason. :func:`unavailable` answers without importing FA4 (whose import compiles nothing but
takes seconds: it loads CUTLASS's DSL).
"""

from __future__ import annotations

import collections
import enum
import importlib
import importlib.util
from collections.abc import Callable
from typing import Any

import torch

from flamia_verify.kernels.cudnn_fp8.scaling import (
    E4M3_MAX,
    FORWARD_MEASURED,
    ScalingMode,
    ScalingRecipe,
    ScalingState,
    scale_policy,
)

__all__ = [
    "BF16_ARCHS",
    "FP8_ARCHS",
    "INTERFACE",
    "LIBRARIES",
    "PINNED",
    "Fp8Scaling",
    "adapter_fields",
    "document_head_amax",
    "fp8_descales",
    "make_fp8_kernel",
    "make_kernel",
    "quantize_e4m3",
    "tensor_amax",
    "unavailable",
]

#: the flash-attn-4 release whose interface this adapter was written against (the extra pins it)
PINNED = "4.0.0b40"
#: the module whose ``flash_attn_varlen_func`` (and, for FP8, ``TensorwiseScales``) the kernels call
INTERFACE = "flash_attn.cute.interface"
#: the distributions whose code runs (their versions go into the report and a sweep's cache key)
LIBRARIES = ("flash-attn-4", "nvidia-cutlass-dsl", "quack-kernels", "apache-tvm-ffi")
#: what ``flash_attn.cute`` imports beyond torch: (module, the distribution that provides it)
DEPENDENCIES = (
    ("flash_attn.cute", "flash-attn-4"),
    ("cutlass", "nvidia-cutlass-dsl"),
    ("quack", "quack-kernels"),
    ("tvm_ffi", "apache-tvm-ffi"),
    ("torch_c_dlpack_ext", "torch-c-dlpack-ext"),
    ("einops", "einops"),
)
#: compute capability majors FA4 is made for: Hopper (9) and Blackwell (10, 11, 12)
BF16_ARCHS = (9, 10, 11, 12)
#: compute capability majors of FA4's FP8 forward (``FP8 is only supported on SM100``)
FP8_ARCHS = (10,)
_INSTALL = "pip install 'flamia-verify[fa4]'"


def _found(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent that is no package, or a module without a spec
        return False


def unavailable(*, fp8: bool = False) -> str | None:
    """None when FA4 (its FP8 forward with ``fp8``) can run here, else why not, in one line. Imports
    neither FA4 nor CUTLASS."""
    for module, dist in DEPENDENCIES:
        if not _found(module):
            if dist == "flash-attn-4":
                return f"flash-attn-4 is not installed (no module {module}; {_INSTALL})"
            return f"flash-attn-4 needs {dist} (module {module}), which is not installed ({_INSTALL})"
    if not torch.cuda.is_available():
        return "needs a CUDA GPU (FlashAttention-4 has only CUDA kernels)"
    major, minor = torch.cuda.get_device_capability()
    if fp8 and major not in FP8_ARCHS:
        return (
            "FlashAttention-4's FP8 forward runs on Blackwell (compute capability 10.x) only "
            f"(flash_attn.cute refuses FP8 elsewhere); this GPU is sm_{major}{minor}"
        )
    if major not in BF16_ARCHS:
        return (
            f"FlashAttention-4 runs on Hopper (sm_90) and Blackwell (sm_100 and later); this GPU is sm_{major}{minor}"
        )
    return None


def _interface() -> Any:
    return importlib.import_module(INTERFACE)


def _lengths(cu: torch.Tensor) -> torch.Tensor:
    """cu_seqlens as FA4 takes them: int32 with stride 1 (a copy only where the view is not)."""
    return cu.to(torch.int32).contiguous()


def _varlen_call(
    varlen: Callable[..., Any],
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    softmax_scale: float | None,
    causal: bool,
    **extra: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One call of ``flash_attn_varlen_func``: q, k, v positionally, the rest by keyword (the fourth
    positional parameter is ``qv``). Returns (out, lse)."""
    result = varlen(
        q,
        k,
        v,
        cu_seqlens_q=_lengths(cu_seqlens_q),
        cu_seqlens_k=_lengths(cu_seqlens_k),
        max_seqlen_q=int(max_seqlen_q),
        max_seqlen_k=int(max_seqlen_k),
        softmax_scale=None if softmax_scale is None else float(softmax_scale),
        causal=bool(causal),
        **extra,
    )
    if isinstance(result, (tuple, list)):
        return result[0], (result[1] if len(result) > 1 else None)
    return result, None


def make_kernel(*, return_lse: bool = True, deterministic: bool = False) -> Callable[..., Any]:
    """The ``fa4`` kernel: FA4's BF16/FP16 varlen attention, forward and backward, in the convention.

    return_lse: return ``(out, lse)`` (lse (nheads, total_q) float32, differentiable), else out.
    deterministic: FA4's deterministic backward (default False, FA4's own default)."""
    varlen = _interface().flash_attn_varlen_func
    paths: collections.Counter[str] = collections.Counter()
    label = "FA4 varlen" + (", deterministic backward" if deterministic else "")

    def fa4_varlen(
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
    ) -> Any:
        """flash_attn.cute.interface.flash_attn_varlen_func, in the varlen convention."""
        out, lse = _varlen_call(
            varlen, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
            deterministic=deterministic, return_lse=return_lse,
        )  # fmt: skip
        paths[label] += 1
        return (out, lse) if return_lse else out

    fa4_varlen.paths = paths  # type: ignore[attr-defined]  # the report's kernel_paths
    return fa4_varlen


# ------------------------------------------------------------------------------------------------
# FP8: the scaling policies
# ------------------------------------------------------------------------------------------------


class Fp8Scaling(enum.StrEnum):
    """Where a call's FP8 scales come from (see the module docstring)."""

    DELAYED = "delayed"  # an amax history of earlier calls, one scale per tensor
    CURRENT = "current"  # this call's amax over the whole pack, one scale per tensor
    DOCUMENT = "document"  # this call's amax per (document, kv head)

    @property
    def causal_safe(self) -> bool:
        """No output depends on a later token of its document through a scale."""
        return self is Fp8Scaling.DELAYED

    @property
    def document_safe(self) -> bool:
        """No document's scales depend on another document."""
        return self is not Fp8Scaling.CURRENT


def tensor_amax(x: torch.Tensor) -> torch.Tensor:
    """max |x| over the whole tensor, (1,) float32 (0 for an empty tensor; NaN propagates)."""
    if x.numel() == 0:
        return torch.zeros(1, dtype=torch.float32, device=x.device)
    return x.detach().abs().amax().to(torch.float32).reshape(1)


def _document_ids(cu: torch.Tensor, total: int) -> torch.Tensor:
    """Each packed row's document index (long, on cu's device)."""
    cu = cu.to(torch.long)
    lengths = cu[1:] - cu[:-1]
    return torch.repeat_interleave(torch.arange(lengths.numel(), device=cu.device), lengths, output_size=total)


def document_head_amax(x: torch.Tensor, cu: torch.Tensor, heads_kv: int) -> torch.Tensor:
    """max |x| per (document, kv head), (batch, heads_kv) float32: x (total, H, D) with H a multiple
    of ``heads_kv``; a query head h counts for kv head h // (H // heads_kv), as FA4 indexes the q
    descale. An empty document's amax is 0; NaN propagates into its own (document, head) only."""
    total, heads, _ = x.shape
    batch = cu.numel() - 1
    per_row = x.detach().abs().amax(dim=-1).to(torch.float32)  # (total, H)
    per_row = per_row.view(total, heads_kv, heads // heads_kv).amax(dim=-1)  # (total, Hk)
    doc = _document_ids(cu.to(x.device), total)
    out = torch.zeros(batch, heads_kv, dtype=torch.float32, device=x.device)
    return out.scatter_reduce(0, doc[:, None].expand(-1, heads_kv), per_row, "amax", include_self=True)


def quantize_e4m3(x: torch.Tensor, scale: torch.Tensor, cu: torch.Tensor | None = None) -> torch.Tensor:
    """E4M3 codes of ``x * scale``, saturated at +-448 (NaN stays NaN), in float8_e4m3fn.

    scale: (1,) (one per tensor) or (batch, heads_kv) (one per document and kv head, then ``cu``
    gives the documents); x (total, H, D), H a multiple of heads_kv."""
    x = x.detach()
    if scale.numel() == 1 or cu is None:
        scaled = x.to(torch.float32) * scale.reshape(()).to(torch.float32)
    else:
        total, heads, dim = x.shape
        heads_kv = scale.shape[1]
        rows = scale.to(torch.float32)[_document_ids(cu.to(x.device), total)]  # (total, Hk)
        grouped = x.to(torch.float32).view(total, heads_kv, heads // heads_kv, dim)
        scaled = (grouped * rows[:, :, None, None]).view(total, heads, dim)
    return scaled.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def fp8_descales(scale: torch.Tensor, batch: int, heads_kv: int) -> torch.Tensor:
    """The (batch, heads_kv) fp32 descales FA4 takes, from scales of one of the two shapes."""
    descale = 1.0 / scale.to(torch.float32)
    if descale.numel() == 1:
        return descale.reshape(1, 1).expand(batch, heads_kv).contiguous()
    return descale.reshape(batch, heads_kv).contiguous()


_FP8_LABELS = {
    Fp8Scaling.DELAYED: "delayed per-tensor scaling",
    Fp8Scaling.CURRENT: "current per-tensor scaling over the pack",
    Fp8Scaling.DOCUMENT: "current scaling per document and kv head",
}


def make_fp8_kernel(
    scaling: Fp8Scaling | str = Fp8Scaling.DELAYED,
    *,
    freeze_after_calibration: bool = True,
    history_len: int = 1024,
    margin: int = 0,
    return_lse: bool = True,
) -> Callable[..., Any]:
    """An ``fa4-fp8`` kernel: E4M3 q, k, v with the descales of ``scaling`` (:class:`Fp8Scaling`),
    FA4's FP8 forward, out in the input dtype (FA4 writes BF16). Forward only.

    freeze_after_calibration, history_len, margin: the delayed policy's state (as cudnn-fp8's:
    :class:`flamia_verify.kernels.cudnn_fp8.scaling.ScalingRecipe`; a check run freezes after the
    first call so every call is a pure function of its inputs; a training run would not). margin
    applies to every policy. The function carries ``scaling`` (the delayed or per-tensor
    :class:`ScalingState`, None for ``document``), ``policy`` and ``paths``."""
    policy = Fp8Scaling(scaling)
    interface = _interface()
    varlen, tensorwise = interface.flash_attn_varlen_func, getattr(interface, "TensorwiseScales", None)
    if tensorwise is None:
        raise ImportError(
            f"{INTERFACE} has no TensorwiseScales: fa4-fp8 was written against flash-attn-4 {PINNED}'s FP8 interface"
        )
    state = None
    if policy is not Fp8Scaling.DOCUMENT:
        mode = ScalingMode.DELAYED if policy is Fp8Scaling.DELAYED else ScalingMode.CURRENT
        state = ScalingState(
            ScalingRecipe(
                mode, history_len=history_len, margin=margin, freeze_after_calibration=freeze_after_calibration
            )
        )
    paths: collections.Counter[str] = collections.Counter()
    label = f"FA4 FP8 forward ({_FP8_LABELS[policy]}" + (
        ", calibrated then frozen)" if policy is Fp8Scaling.DELAYED and freeze_after_calibration else ")"
    )

    def scales(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor
    ) -> list[torch.Tensor]:
        """This call's scales of q, k, v: (1,) each, or (batch, heads_kv) each for ``document``."""
        if state is None:  # per document and kv head, from this call's data
            heads_kv = k.shape[1]
            amax = [document_head_amax(x, cu, heads_kv) for x, cu in ((q, cu_q), (k, cu_k), (v, cu_k))]
            return [scale_policy(a, torch.ones_like(a), margin) for a in amax]
        measured = None
        if state.needs_measurement(FORWARD_MEASURED):  # current, or delayed before its calibration
            measured = torch.cat([tensor_amax(q), tensor_amax(k), tensor_amax(v)])
        s = state.scales(FORWARD_MEASURED, q.device, measured=measured)
        if measured is None and not all(state.frozen(r) for r in FORWARD_MEASURED):  # delayed, learning
            state.record(FORWARD_MEASURED, torch.cat([tensor_amax(q), tensor_amax(k), tensor_amax(v)]))
        return [s[0:1], s[1:2], s[2:3]]

    def fa4_fp8_varlen(
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
    ) -> Any:
        """FA4's FP8 forward on E4M3 copies of q, k, v, in the varlen convention (forward only)."""
        batch, heads_kv = cu_seqlens_q.numel() - 1, k.shape[1]
        with torch.no_grad(), torch.autocast(device_type=q.device.type, enabled=False):
            s_q, s_k, s_v = scales(q, k, v, cu_seqlens_q, cu_seqlens_k)
            q8 = quantize_e4m3(q, s_q, cu_seqlens_q)
            k8 = quantize_e4m3(k, s_k, cu_seqlens_k)
            v8 = quantize_e4m3(v, s_v, cu_seqlens_k)
            descales = tensorwise(*(fp8_descales(s, batch, heads_kv) for s in (s_q, s_k, s_v)))
            out, lse = _varlen_call(
                varlen, q8, k8, v8, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                return_lse=return_lse, scales=descales,
            )  # fmt: skip
            if out.dtype != q.dtype:
                out = out.to(q.dtype)
        paths[label] += 1
        return (out, lse) if return_lse else out

    fa4_fp8_varlen.scaling = state  # type: ignore[attr-defined]
    fa4_fp8_varlen.policy = policy  # type: ignore[attr-defined]
    fa4_fp8_varlen.paths = paths  # type: ignore[attr-defined]
    fa4_fp8_varlen.__doc__ = (
        f"FlashAttention-4 FP8 forward, {_FP8_LABELS[policy]}; causal-safe: {'yes' if policy.causal_safe else 'no'}; "
        f"document-safe: {'yes' if policy.document_safe else 'no'}"
    )
    return fa4_fp8_varlen


# ------------------------------------------------------------------------------------------------
# the adapters (registered by flamia_verify.kernels.adapters)
# ------------------------------------------------------------------------------------------------

_LIMITS = (
    f"extra flamia-verify[fa4] (flash-attn-4 {PINNED}; on CUDA 13 also flash-attn-4[cu13]); the first call of each "
    "shape, dtype and mask compiles (CuTe DSL, seconds); strided cu_seqlens go in as contiguous copies (FA4 asserts "
    "stride 1); not yet run on a GPU by this project"
)
_FP8_LIMITS = (
    "Blackwell only (FA4's FP8 forward asserts compute capability 10.x: unavailable on Hopper); forward only; "
    "power-of-two scales, q, k, v quantized by torch ops around the call (timed with it); out is FA4's BF16 "
    "cast to the input dtype; " + _LIMITS
)


def adapter_fields() -> list[dict[str, Any]]:
    """The fields of the :class:`flamia_verify.kernels.adapters.Adapter` records of ``fa4``,
    ``fa4-fp8`` (delayed), ``fa4-fp8-current`` and ``fa4-fp8-doc``.

    Recipes: ``fa4`` claims ``bf16`` (BF16/FP16 operands, fp32 accumulation, as FlashAttention);
    the FP8 forward claims ``fp8-mma``, as ``cudnn-fp8`` does: E4M3 operands with power-of-two scales,
    S = QK^T and O = PV on the FP8 tensor cores, whose accumulator no interface promises to be fp32
    (on Hopper it keeps about 13 bits; on Blackwell it is not measured here: ``--recipe fp8`` there
    asks ``bound.accumulation`` whether it is fp32)."""

    def fp8(name: str, policy: Fp8Scaling, wraps: str) -> dict[str, Any]:
        return {
            "name": name,
            "wraps": wraps,
            "recipe": "fp8-mma",
            "forward_only": True,
            "runs_on": "CUDA",
            "limits": _FP8_LIMITS,
            "probe": lambda: unavailable(fp8=True),
            "build": lambda: make_fp8_kernel(policy),
            "libraries": LIBRARIES,
        }

    fp8_call = "FlashAttention-4's FP8 forward (flash_attn_varlen_func on E4M3 q, k, v with TensorwiseScales descales)"
    return [
        {
            "name": "fa4",
            "wraps": "FlashAttention-4's flash_attn.cute.interface.flash_attn_varlen_func: q, k, v positionally, "
            "the rest by keyword (its fourth parameter is qv); returns (out, lse)",
            "recipe": "bf16",
            "forward_only": False,
            "runs_on": "CUDA",
            "limits": "Hopper or Blackwell; fp16/bf16 inputs and FA4's head_dim limits; FA4's default backward "
            "(deterministic=False: dQ is not bitwise repeatable); " + _LIMITS,
            "probe": lambda: unavailable(fp8=False),
            "build": make_kernel,
            "libraries": LIBRARIES,
        },
        fp8(
            "fa4-fp8",
            Fp8Scaling.DELAYED,
            f"{fp8_call}; delayed per-tensor scaling, calibrated on the first call and then frozen "
            "(causal-safe, document-safe)",
        ),
        fp8(
            "fa4-fp8-current",
            Fp8Scaling.CURRENT,
            f"{fp8_call}; current per-tensor scaling, each call's amax over the whole pack: not causal-safe, "
            "not document-safe",
        ),
        fp8(
            "fa4-fp8-doc",
            Fp8Scaling.DOCUMENT,
            f"{fp8_call}; current scaling per document and kv head (FA4's descale granularity): document-safe, "
            "not causal-safe",
        ),
    ]
