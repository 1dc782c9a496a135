"""Adapters: attention kernels from torch and other libraries, wrapped into the varlen calling convention.

Each adapter is found by name like a built-in kernel (``load_kernel("sdpa-math")``; a built-in of the
same name would win) and declares its recipe, whether it is forward-only, where it runs and what it
cannot do. Its availability probe answers None (available here) or a one-line reason; loading an
unavailable adapter raises :class:`KernelLoadError` with that reason (exit 3 on the command line).

| adapter          | wraps                                                         | runs on     | backward |
|------------------|---------------------------------------------------------------|-------------|----------|
| ``sdpa-math``      | ``F.scaled_dot_product_attention``, math backend, per document  | CPU, CUDA   | yes      |
| ``sdpa-flash``     | the same, FlashAttention-2 backend only                       | CPU, CUDA   | yes      |
| ``sdpa-efficient`` | the same, memory-efficient backend only                       | CUDA        | yes      |
| ``sdpa-cudnn``     | the same, cuDNN backend only                                  | CUDA        | yes      |
| ``flex``           | ``flex_attention``, documents from block boundaries, doc mask   | CUDA        | yes      |
| ``flex-packed``    | ``flex_attention`` over the tight pack, document block mask     | CUDA        | yes      |
| ``flash-attn``     | ``flash_attn.flash_attn_varlen_func`` (when installed)          | CUDA        | yes      |
| ``sage``           | ``sageattention.sageattn_varlen`` (when installed)              | CUDA        | no       |
| ``cudnn-fp8``      | cuDNN's FP8 attention, fused E4M3 quantization, delayed scaling | CUDA (sm_90+) | yes |
|                  | (history per instance, updated every call; a factory)         |             |          |
| ``cudnn-fp8-frozen`` | the same, scales frozen after the first call, one shared state | CUDA (sm_90+) | yes |
| ``cudnn-fp8-current`` | the same, current scaling (not causal-safe)                 | CUDA (sm_90+) | yes |
| ``fa4``, ``fa4-fp8*`` | FlashAttention-4 (``flash_attn.cute``), BF16; FP8 forward, three scalings | CUDA | BF16 only |
| ``te-fp8``         | not built: needs transformer_engine (the probe says why)      | -           | -        |

The SDPA adapters call torch once per document under ``sdpa_kernel`` with their one backend: kv heads
are repeated for GQA; a causal document with Lq > Lk gives its first Lq - Lk query rows (which see no
key) output 0 and calls torch on the last Lk rows with ``is_causal``; Lq == Lk uses ``is_causal``;
Lq < Lk uses ``causal_lower_right``. A backend that has no kernel for a document raises
:class:`BackendRefusedError` naming the adapter, the document's shape and torch's reasons: an adapter
never falls back to another backend. Every adapter reads its inputs only (views and new tensors).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.metadata
import importlib.util
import re
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from flamia_verify.convention import no_attention, validate_varlen_inputs, zeros_in_graph
from flamia_verify.errors import KernelLoadError

__all__ = ["ADAPTERS", "Adapter", "BackendRefusedError", "adapter_kernel"]


class BackendRefusedError(RuntimeError):
    """A library backend has no kernel for the configuration it was given (the adapter does not fall
    back to another one)."""


@dataclass(frozen=True)
class Adapter:
    """One adapter: what it wraps, the recipe it claims, and how to probe and build it."""

    name: str
    wraps: str  # the library function and how it is called
    recipe: str
    forward_only: bool
    runs_on: str  # "CPU, CUDA" or "CUDA"
    limits: str  # what it cannot do
    probe: Callable[[], str | None]  # None: available here; else the reason in one line
    build: Callable[[], Callable[..., Any]]  # the kernel function (called only when available)
    #: the distributions whose code the kernel runs besides torch and Triton (their versions go into
    #: the report's environment and into a sweep's cache key)
    libraries: tuple[str, ...] = ()

    @property
    def description(self) -> str:
        return f"{self.wraps}; {'forward-only; ' if self.forward_only else ''}limits: {self.limits}"

    def library_versions(self) -> dict[str, str | None]:
        """The installed version of each of :attr:`libraries` (None where it is not installed), and
        the cuDNN runtime torch loads when the adapter calls cuDNN."""
        versions: dict[str, str | None] = {}
        for dist in self.libraries:
            try:
                versions[dist] = importlib.metadata.version(dist)
            except importlib.metadata.PackageNotFoundError:
                versions[dist] = None
        if "cudnn" in self.name:
            runtime = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
            versions["cudnn-runtime"] = None if runtime is None else str(runtime)
        return versions

    def unavailable(self) -> str | None:
        """None when the adapter can be loaded here, else why not (one line)."""
        try:
            return self.probe()
        except Exception as exc:  # a probe that breaks says so instead of breaking `list`
            return f"probe failed: {type(exc).__name__}: {exc}"

    def load(self) -> Callable[..., Any]:
        """The kernel function; :class:`KernelLoadError` with the probe's reason when unavailable."""
        reason = self.unavailable()
        if reason is not None:
            raise KernelLoadError(f"adapter {self.name!r} is not available: {reason}")
        try:
            fn = self.build()
        except KernelLoadError:
            raise
        except Exception as exc:
            raise KernelLoadError(f"adapter {self.name!r} failed to load: {type(exc).__name__}: {exc}") from exc
        fn.recipe = self.recipe  # type: ignore[attr-defined]  # read by the loader (kernels.metadata)
        fn.forward_only = self.forward_only  # type: ignore[attr-defined]
        fn.adapter = self.name  # type: ignore[attr-defined]
        fn.libraries = self.library_versions()  # type: ignore[attr-defined]  # read into the report
        return fn


def adapter_kernel(name: str) -> Callable[..., Any]:
    """The kernel function of adapter ``name`` (KernelLoadError when unknown or unavailable)."""
    if name not in ADAPTERS:
        raise KernelLoadError(f"unknown adapter {name!r}; adapters: {', '.join(ADAPTERS)}")
    return ADAPTERS[name].load()


# ------------------------------------------------------------------------------------------------
# shared pieces
# ------------------------------------------------------------------------------------------------


def _needs_cuda(what: str) -> Callable[[], str | None]:
    def probe() -> str | None:
        return None if torch.cuda.is_available() else f"needs CUDA ({what})"

    return probe


def _installed(module: str) -> str | None:
    """None when ``module`` can be imported (found on the path), else the reason."""
    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        found = False
    return None if found else f"{module} is not installed"


def _first_reason(*probes: Callable[[], str | None]) -> Callable[[], str | None]:
    def probe() -> str | None:
        for p in probes:
            reason = p()
            if reason is not None:
                return reason
        return None

    return probe


# ------------------------------------------------------------------------------------------------
# torch SDPA, one backend per adapter
# ------------------------------------------------------------------------------------------------

_REFUSALS = ("No available kernel", "No viable backend")


def _refused(exc: BaseException) -> bool:
    return isinstance(exc, RuntimeError) and any(text in str(exc) for text in _REFUSALS)


#: per adapter, the reasons torch gave at its first refusal (torch warns once per process)
_FIRST_REASONS: dict[str, str] = {}
_TRIGGERED = re.compile(r"\s*\(Triggered internally at [^)]*\)\.?")


def _backend_reasons(caught: list[warnings.WarningMessage]) -> str:
    """torch's warnings on why its backends were not used, in one line: the other backends' "runtime
    disabled" notes, empty headers and source locations left out."""
    lines: list[str] = []
    for w in caught:
        text = " ".join(_TRIGGERED.sub("", str(w.message)).split())
        if not text or "runtime disabled" in text or text.endswith("because:") or text in lines:
            continue
        lines.append(text)
    return "; ".join(lines)


def _calling(run: Callable[[], Any]) -> tuple[Any, list[warnings.WarningMessage], BaseException | None]:
    """``run()`` with its warnings recorded (torch gives a backend's reasons once per process, so
    they are caught on the call that fails); on success the warnings are issued again as usual."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            result, error = run(), None
        except RuntimeError as exc:
            result, error = None, exc
    if error is None:
        for w in caught:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno, source=w.source)
    return result, caught, error


@contextlib.contextmanager
def _deterministic_algorithms():
    """torch's deterministic mode (``use_deterministic_algorithms(True)``, not warn-only) for the
    duration, the caller's setting restored after."""
    enabled = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(enabled, warn_only=warn_only)


class _DeterministicCall(torch.autograd.Function):
    """Runs ``run(q, k, v)`` and, later, its backward, both in torch's deterministic mode: the mode
    is read when the backward runs (in the caller's ``autograd.grad``), outside the adapter's call, so
    the adapter keeps the graph it built and differentiates it itself."""

    @staticmethod
    def forward(ctx, run, q, k, v):
        leaves = [t.detach().requires_grad_(t.requires_grad) for t in (q, k, v)]
        with torch.enable_grad(), _deterministic_algorithms():
            out = run(*leaves)
        ctx.leaves, ctx.out = leaves, out
        return out.detach()

    @staticmethod
    @once_differentiable  # the inner graph is differentiated here, outside the caller's graph
    def backward(ctx, dout):
        wanted = [t for t in ctx.leaves if t.requires_grad]
        if not ctx.out.requires_grad or not wanted:
            return None, None, None, None
        # the inner graph lives as long as this node: a caller that retains the outer graph (and
        # differentiates again) finds it again; it is freed with the outer graph
        with _deterministic_algorithms():
            grads = iter(torch.autograd.grad(ctx.out, wanted, dout, allow_unused=True, retain_graph=True))
        return (None, *(next(grads) if t.requires_grad else None for t in ctx.leaves))


def _make_sdpa(name: str, backend_name: str, label: str, *, deterministic: bool = False) -> Callable[..., Any]:
    """One SDPA backend in the convention. ``deterministic``: the CUDA calls and their backward run
    in torch's deterministic mode (the FlashAttention-2 backward accumulates dQ with atomic adds
    otherwise, and the memory-efficient one may; neither is then bitwise repeatable). A backend
    without a kernel for a document with one key (cuDNN) gets it as two copies of that key: softmax
    gives each copy weight 1/2 exactly, so O and the gradients are those of the one key."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right

    backend = getattr(SDPBackend, backend_name)

    def call_document(qd, kd, vd, scale, causal, where):
        # qd: (1, H, Lq, D), kd/vd: (1, H, Lk, D), Lq >= 1, Lk >= 1, and Lq <= Lk when causal
        lq, lk = qd.shape[2], kd.shape[2]
        mask = causal_lower_right(lq, lk) if causal and lq < lk else None
        is_causal = bool(causal and lq == lk)

        def run():
            with sdpa_kernel([backend]):
                return F.scaled_dot_product_attention(qd, kd, vd, attn_mask=mask, is_causal=is_causal, scale=scale)

        out, caught, error = _calling(run)
        if error is None:
            return out
        if not _refused(error):
            raise error
        why = _backend_reasons(caught)
        if why:
            _FIRST_REASONS.setdefault(name, why)
        elif name in _FIRST_REASONS:
            why = f"torch gives its reasons once per process; at {name}'s first refusal: {_FIRST_REASONS[name]}"
        else:
            why = "torch gave no reason"
        shape = (
            f"{where}: {lq} queries, {lk} keys, {qd.shape[1]} heads, head_dim {qd.shape[3]}, "
            f"{str(qd.dtype).removeprefix('torch.')} on {qd.device.type}, "
            + ("causal, lower-right mask" if mask is not None else "causal" if is_causal else "not causal")
        )
        raise BackendRefusedError(
            f"{name}: torch SDPA's {label} backend has no kernel for {shape} ({why}); "
            f"{name} never falls back to another backend"
        ) from error

    def kernel(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, softmax_scale=None, causal=False):
        validate_varlen_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
        cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()

        def run(q, k, v):
            return documents(q, k, v, cq, ck, softmax_scale, bool(causal))

        if deterministic and q.is_cuda and torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
            return _DeterministicCall.apply(run, q, k, v)
        if deterministic and q.is_cuda:
            with _deterministic_algorithms():
                return run(q, k, v)
        return run(q, k, v)

    def documents(q, k, v, cq, ck, softmax_scale, causal):
        scale = None if softmax_scale is None else float(softmax_scale)
        group = q.shape[1] // k.shape[1]
        pieces, called = [], False
        for b in range(len(cq) - 1):
            q0, q1, k0, k1 = cq[b], cq[b + 1], ck[b], ck[b + 1]
            lq, lk = q1 - q0, k1 - k0
            if lq == 0:
                continue
            if lk == 0:  # no key: every row outputs 0
                pieces.append(zeros_in_graph(q[q0:q1]))
                continue
            if causal and lq > lk:  # the first lq - lk rows see no key; the rest are a square causal block
                pieces.append(zeros_in_graph(q[q0 : q1 - lk]))
                q0 = q1 - lk
            qd = q[q0:q1].transpose(0, 1).unsqueeze(0)
            kd = k[k0:k1].transpose(0, 1).repeat_interleave(group, dim=0).unsqueeze(0)
            vd = v[k0:k1].transpose(0, 1).repeat_interleave(group, dim=0).unsqueeze(0)
            if k1 - k0 == 1 and name in _NO_SINGLE_KEY:  # one key: two copies, each of weight 1/2
                kd, vd = torch.cat([kd, kd], dim=2), torch.cat([vd, vd], dim=2)
                o = call_document(qd, kd, vd, scale, False, f"document {b} (its one key twice)")
            else:
                o = call_document(qd, kd, vd, scale, causal, f"document {b}")
            pieces.append(o[0].transpose(0, 1))
            called = True
        if not called:
            return no_attention(q, k, v)
        return torch.cat(pieces)

    kernel.__name__ = kernel.__qualname__ = name.replace("-", "_")
    kernel.__doc__ = f"torch SDPA with only its {label} backend, one call per document, in the varlen convention."
    return kernel


#: the SDPA adapters whose backend has no kernel for a key length of 1
_NO_SINGLE_KEY = frozenset({"sdpa-cudnn"})


# ------------------------------------------------------------------------------------------------
# FlexAttention over the packed batch
# ------------------------------------------------------------------------------------------------

_FLEX_COMPILED: list[Callable[..., Any]] = []
_FLEX_BLOCK = 128  # FlexAttention's default block
_FLEX_RECOMPILES = 256  # distinct (shape, heads, head_dim, dtype, mask) compiles before an error


def _flex_call(device: torch.device, *args: Any, **kwargs: Any) -> torch.Tensor:
    """flex_attention compiled once (CUDA; whole graph, a new shape recompiles, and running past the
    recompile limit raises instead of silently running the unfused eager code), or eager on any other
    device (the CPU: a forward without gradients in torch 2.13)."""
    from torch.nn.attention.flex_attention import flex_attention

    if device.type != "cuda":
        return flex_attention(*args, **kwargs)
    if not _FLEX_COMPILED:
        _FLEX_COMPILED.append(torch.compile(flex_attention, dynamic=False, fullgraph=True))
    config = torch._dynamo.config
    limits: dict[str, Any] = {"recompile_limit": _FLEX_RECOMPILES, "fail_on_recompile_limit_hit": True}
    with config.patch({key: value for key, value in limits.items() if hasattr(config, key)}):
        return _FLEX_COMPILED[0](*args, **kwargs)


def _flex_padded(n: int) -> int:
    """The padded pack length: a power of two of at least one block (so that the many pack lengths
    of a check run compile a few kernels; padding blocks are empty in the block mask and skipped)."""
    return max(_FLEX_BLOCK, 1 << (n - 1).bit_length())


def _document_of(cu: torch.Tensor, total: int) -> torch.Tensor:
    """Each packed position's document index (cu: long offsets on the tensors' device)."""
    return torch.repeat_interleave(torch.arange(cu.numel() - 1, device=cu.device), cu[1:] - cu[:-1], output_size=total)


def _places(cu: torch.Tensor, doc: torch.Tensor, aligned: bool) -> tuple[torch.Tensor, int]:
    """Where each packed position (of document ``doc``) goes in FlexAttention's sequence, and that
    sequence's length: the same place (packed), or each document starting on a block boundary (aligned)."""
    total = doc.numel()
    if not aligned:
        return torch.arange(total, device=doc.device), total
    lengths = cu[1:] - cu[:-1]
    blocks = (lengths + _FLEX_BLOCK - 1) // _FLEX_BLOCK * _FLEX_BLOCK
    starts = torch.cumsum(blocks, 0) - blocks
    local = torch.arange(total, device=doc.device) - cu[:-1][doc]
    return starts[doc] + local, int(blocks.sum())


def _flex_kernel_of(aligned: bool) -> Callable[..., Any]:
    def kernel(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, softmax_scale=None, causal=False):
        return _flex_kernel(
            q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale=softmax_scale, causal=bool(causal), aligned=aligned,
            limits=(max_seqlen_q, max_seqlen_k),
        )  # fmt: skip

    kernel.__name__ = kernel.__qualname__ = "flex_aligned" if aligned else "flex_packed"
    return kernel


def _flex_kernel(q, k, v, cu_seqlens_q, cu_seqlens_k, *, softmax_scale, causal: bool, aligned: bool, limits):
    """torch FlexAttention over the whole pack (batch 1) with a block mask from document ids; each
    document from a block boundary (``aligned``) or packed as it comes (documents share blocks)."""
    from torch.nn.attention.flex_attention import create_block_mask

    validate_varlen_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, *limits)
    tq, tk, device = q.shape[0], k.shape[0], q.device
    if tq == 0 or tk == 0:
        return no_attention(q, k, v)
    cu_q = cu_seqlens_q.to(device=device, dtype=torch.long)
    cu_k = cu_seqlens_k.to(device=device, dtype=torch.long)
    doc_of_q, doc_of_k = _document_of(cu_q, tq), _document_of(cu_k, tk)
    place_q, nq = _places(cu_q, doc_of_q, aligned)
    place_k, nk = _places(cu_k, doc_of_k, aligned)
    pq, pk = _flex_padded(nq), _flex_padded(nk)
    # padding positions belong to documents -1 (queries) and -2 (keys): they see, and are seen by, nothing
    doc_q = torch.full((pq,), -1, dtype=torch.long, device=device).index_copy(0, place_q, doc_of_q)
    doc_k = torch.full((pk,), -2, dtype=torch.long, device=device).index_copy(0, place_k, doc_of_k)
    # positions to the end of the document: bottom-right causal lets query i see key j iff rem_k >= rem_q
    rem_q = torch.zeros(pq, dtype=torch.long, device=device).index_copy(
        0, place_q, cu_q[1:][doc_of_q] - torch.arange(tq, device=device)
    )
    rem_k = torch.zeros(pk, dtype=torch.long, device=device).index_copy(
        0, place_k, cu_k[1:][doc_of_k] - torch.arange(tk, device=device)
    )
    if causal:

        def mask_mod(b, h, qi, kj):
            return (doc_q[qi] == doc_k[kj]) & (rem_k[kj] >= rem_q[qi])
    else:

        def mask_mod(b, h, qi, kj):
            return doc_q[qi] == doc_k[kj]

    block_mask = create_block_mask(mask_mod, None, None, pq, pk, device=device)

    def heads_first(x: torch.Tensor, place: torch.Tensor, padded: int) -> torch.Tensor:  # -> (1, H, padded, D)
        return x.new_zeros((padded, *x.shape[1:])).index_copy(0, place, x).transpose(0, 1).unsqueeze(0)

    out = _flex_call(
        device,
        heads_first(q, place_q, pq),
        heads_first(k, place_k, pk),
        heads_first(v, place_k, pk),
        block_mask=block_mask,
        scale=None if softmax_scale is None else float(softmax_scale),
        enable_gqa=q.shape[1] != k.shape[1],
    )
    out = out[0].transpose(0, 1)[place_q]
    # rows that see no key (a document without keys; causal rows above a document's Lq - Lk): 0
    lk_of_row = (cu_k[1:] - cu_k[:-1])[doc_of_q]
    seen = lk_of_row > 0
    if causal:
        seen &= (cu_q[1:][doc_of_q] - torch.arange(tq, device=device)) <= lk_of_row
    return torch.where(seen[:, None, None], out, out.new_zeros(()))


def _flex_probe() -> str | None:
    try:
        importlib.import_module("torch.nn.attention.flex_attention")
    except ImportError:
        return f"torch {torch.__version__} has no torch.nn.attention.flex_attention"
    if not torch.cuda.is_available():
        return "needs CUDA (torch's FlexAttention has no CPU backward; its CPU forward runs eagerly)"
    return None


# ------------------------------------------------------------------------------------------------
# libraries that are not part of the install
# ------------------------------------------------------------------------------------------------


def _make_flash_attn() -> Callable[..., Any]:
    flash_attn = importlib.import_module("flash_attn")
    varlen = flash_attn.flash_attn_varlen_func

    def flash_attn_varlen(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, softmax_scale=None, causal=False
    ):
        """flash_attn.flash_attn_varlen_func, called as the convention calls it."""
        return varlen(
            q,
            k,
            v,
            cu_seqlens_q,
            cu_seqlens_k,
            max_seqlen_q,
            max_seqlen_k,
            softmax_scale=softmax_scale,
            causal=bool(causal),
        )

    return flash_attn_varlen


def _flash_attn2_probe() -> str | None:
    """flash_attn as FlashAttention-2 installs it: flash-attn-4 alone leaves a namespace package
    ``flash_attn`` that holds only ``flash_attn.cute`` (the fa4 adapters)."""
    missing = _installed("flash_attn")
    if missing is None and getattr(importlib.util.find_spec("flash_attn"), "origin", None) is None:
        return "flash_attn is not installed (only flash_attn.cute, FlashAttention-4: see the fa4 adapter)"
    return missing


def _make_sage() -> Callable[..., Any]:
    sage = importlib.import_module("sageattention")
    varlen = sage.sageattn_varlen

    def sage_varlen(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, softmax_scale=None, causal=False
    ):
        """sageattention.sageattn_varlen (INT8 Q K^T, FP8/FP16 P V), forward only."""
        out = varlen(
            q,
            k,
            v,
            cu_seqlens_q,
            cu_seqlens_k,
            max_seqlen_q,
            max_seqlen_k,
            is_causal=bool(causal),
            sm_scale=softmax_scale,
        )
        return out[0] if isinstance(out, (tuple, list)) else out

    return sage_varlen


def _te_probe() -> str | None:
    missing = _installed("transformer_engine")
    if missing is not None:
        return f"not built: needs transformer_engine ({missing.replace(' installed', ' importable')})"
    return "not built: flamia-verify has no transformer_engine adapter yet (none was written or tested)"


def _not_built() -> Callable[..., Any]:
    raise KernelLoadError("adapter 'te-fp8' is not built")


_FLEX_LIMITS = (
    "the sequence is padded to a power of two (at least 128) and compiled once per padded length, heads, "
    "head_dim, dtype and causal (most of a quick suite's time on an H200 is compiles); a block mask built "
    "per call; no CPU backward (its eager CPU forward is tested, not offered)"
)

_CUDNN_FP8_LIMITS = (
    "Hopper or Blackwell, cuDNN >= 9.14 (pip install 'flamia-verify[cudnn]'); bf16/fp16 inputs; O, dQ, dK, dV "
    "come out of cuDNN as E4M3 on Hopper and are dequantized; on Hopper the backward needs head_dim 128 and "
    "a causal document needs Lq == Lk (cuDNN's mask is top-left there): other calls are refused with the "
    "limit named, never computed otherwise"
)


def _cudnn_fp8_probe() -> str | None:
    from flamia_verify.kernels import cudnn_fp8  # imports neither cuDNN nor Triton

    return cudnn_fp8.unavailable()


def _cudnn_fp8(factory: str) -> Callable[..., Any]:
    from flamia_verify.kernels.cudnn_fp8 import kernel  # Triton and cuDNN load only when the kernel is built

    return getattr(kernel, factory)()


def _fa4_adapters() -> list[Adapter]:
    """fa4 and fa4-fp8 with its scaling policies (flamia_verify/kernels/fa4.py, which imports no FA4)."""
    from flamia_verify.kernels.fa4 import adapter_fields

    return [Adapter(**fields) for fields in adapter_fields()]


_SDPA_LIMITS = (
    "one torch call per document (slow for many documents); GQA by repeating kv heads; "
    "no fallback when the backend has no kernel for a shape, dtype or mask"
)

ADAPTERS: dict[str, Adapter] = {
    a.name: a
    for a in (
        Adapter(
            "sdpa-math",
            "torch SDPA, math backend only, per document",
            "bf16",
            False,
            "CPU, CUDA",
            _SDPA_LIMITS + "; materializes each document's scores (memory Lq x Lk per head)",
            lambda: None,
            lambda: _make_sdpa("sdpa-math", "MATH", "math"),
        ),
        Adapter(
            "sdpa-flash",
            "torch SDPA, FlashAttention-2 backend only, per document; on CUDA in torch's deterministic mode",
            "bf16",
            False,
            "CPU, CUDA",
            _SDPA_LIMITS + "; on CUDA fp16/bf16 only (float32 is refused); on the CPU a causal document with "
            "Lq < Lk passes a materialized lower-right mask",
            lambda: None,
            lambda: _make_sdpa("sdpa-flash", "FLASH_ATTENTION", "flash", deterministic=True),
        ),
        Adapter(
            "sdpa-efficient",
            "torch SDPA, memory-efficient backend only, per document, in torch's deterministic mode",
            "bf16",
            False,
            "CUDA",
            _SDPA_LIMITS,
            _needs_cuda("torch SDPA's memory-efficient backend has no CPU kernel"),
            lambda: _make_sdpa("sdpa-efficient", "EFFICIENT_ATTENTION", "memory-efficient", deterministic=True),
        ),
        Adapter(
            "sdpa-cudnn",
            "torch SDPA, cuDNN backend only, per document",
            "bf16",
            False,
            "CUDA",
            _SDPA_LIMITS + "; a document with one key runs as two copies of it (cuDNN SDPA has no key length 1: "
            "weights 1/2 each give the same O and gradients); refuses float32; "
            "a causal document with Lq < Lk passes a materialized lower-right mask",
            _first_reason(
                _needs_cuda("torch SDPA's cuDNN backend has no CPU kernel"),
                lambda: None if torch.backends.cudnn.is_available() else "cuDNN is not available to torch",
            ),
            lambda: _make_sdpa("sdpa-cudnn", "CUDNN_ATTENTION", "cuDNN"),
        ),
        Adapter(
            "flex",
            "torch FlexAttention over the packed batch (batch 1), each document from a 128-token block boundary, "
            "block mask from document ids; torch.compile on CUDA",
            "bf16",
            False,
            "CUDA",
            _FLEX_LIMITS + "; no block holds two documents (each starts on a block boundary, at the cost of "
            "the padding)",
            _flex_probe,
            lambda: _flex_kernel_of(aligned=True),
        ),
        Adapter(
            "flex-packed",
            "torch FlexAttention over the packed batch as it comes (documents share 128-token blocks), "
            "block mask from document ids; torch.compile on CUDA",
            "bf16",
            False,
            "CUDA",
            _FLEX_LIMITS + "; a block holds the end of one document and the start of the next (the wiring "
            "that packs tightest)",
            _flex_probe,
            lambda: _flex_kernel_of(aligned=False),
        ),
        Adapter(
            "flash-attn",
            "flash_attn.flash_attn_varlen_func, called unchanged",
            "bf16",
            False,
            "CUDA",
            "whatever the installed flash_attn supports (fp16/bf16, its head_dim limits); "
            "not run here: flash_attn was installed on neither the CPU nor the GPU machine",
            _first_reason(_flash_attn2_probe, _needs_cuda("flash_attn has only CUDA kernels")),
            _make_flash_attn,
            ("flash-attn",),
        ),
        Adapter(
            "sage",
            "sageattention.sageattn_varlen (INT8 Q K^T, low-precision P V)",
            "bf16",
            True,
            "CUDA",
            "no backward; GQA, bottom-right causal with Lq != Lk and empty documents as the installed "
            "version does them; not run here: sageattention was installed on neither machine",
            _first_reason(lambda: _installed("sageattention"), _needs_cuda("sageattention has only CUDA kernels")),
            _make_sage,
            ("sageattention",),
        ),
        Adapter(
            "cudnn-fp8",
            "cuDNN's FP8 attention (sdpa_fp8, sdpa_fp8_backward) on the whole pack, with fused Triton E4M3 "
            "quantization around it; delayed per-tensor scaling to train with (an amax history of 16 calls "
            "per instance, margin 1, updated every call; causal-safe), a factory: one instance per layer",
            "fp8-mma",
            False,
            "CUDA",
            _CUDNN_FP8_LIMITS,
            _cudnn_fp8_probe,
            lambda: _cudnn_fp8("default_kernel"),
            ("nvidia-cudnn-frontend",),
        ),
        Adapter(
            "cudnn-fp8-frozen",
            "the same kernel with its former default, for checking a pure function: delayed scaling "
            "calibrated on the first call and then frozen, one state for every layer (the state family "
            "fails it: not for training)",
            "fp8-mma",
            False,
            "CUDA",
            _CUDNN_FP8_LIMITS,
            _cudnn_fp8_probe,
            lambda: _cudnn_fp8("frozen_kernel"),
            ("nvidia-cudnn-frontend",),
        ),
        Adapter(
            "cudnn-fp8-current",
            "the same kernel with current scaling (each call's own per-tensor amax): for comparison, not causal-safe",
            "fp8-mma",
            False,
            "CUDA",
            _CUDNN_FP8_LIMITS,
            _cudnn_fp8_probe,
            lambda: _cudnn_fp8("current_kernel"),
            ("nvidia-cudnn-frontend",),
        ),
        *_fa4_adapters(),
        Adapter(
            "te-fp8",
            "not built: needs transformer_engine",
            "fp8",
            False,
            "-",
            "no adapter was written: transformer_engine is installed on neither machine to test one against",
            _te_probe,
            _not_built,
            ("transformer-engine",),
        ),
    )
}
