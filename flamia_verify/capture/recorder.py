"""Record the attention calls of a real training or inference step, in the varlen convention.

    with recording(kernel, "captures/run1", model="my-lm", calls=8) as attn:
        for batch in batches:
            loss = model(batch, attention=attn)   # every attention layer calls attn(q, k, v, ...)
            loss.backward()
            attn.next_step()

:class:`Recorder` is the kernel wrapped: it calls ``kernel`` with the same arguments and returns
what the kernel returns, and for each *selected* call keeps a host copy of q, k, v, cu_seqlens_q,
cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale and causal. When a backward reaches the
call, a hook on its output copies the gradient flowing into it (``dout``) and returns nothing, so
the gradients are those of the run without the recorder. Each call is written to its own
safetensors file as soon as it is whole (its backward has run, or none can run: under
``torch.no_grad``, at :meth:`Recorder.next_step` or at :meth:`Recorder.close`); see
:mod:`flamia_verify.capture.store` for the layout.

Which calls: call ``index`` counts every call the recorder sees from 0; a call is recorded when
``index % every == 0``, ``select`` (call indices, or a predicate on the :class:`CallSite`) accepts
it, fewer than ``calls`` have been recorded and the size cap leaves room for it. The *step* is the
caller's (:meth:`Recorder.next_step`) or derived (``layers_per_step``: a model whose forward calls
attention that many times); the *layer* is the caller's (:meth:`Recorder.for_layer`) or the
call's position within its step (0, 1, ...).

Bounded: ``max_bytes`` caps the call files together. The first call that does not fit stops the
recording with a :class:`CaptureWarning`; what was written stays whole and the manifest says why it
stopped. A failed write (a full disk) does the same: recording never breaks the run it records.
"""

from __future__ import annotations

import json
import math
import operator
import threading
import warnings
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save

from flamia_verify._version import __version__
from flamia_verify.capture.store import (
    CALL_FORMAT,
    DOUT,
    DTYPES,
    MANIFEST,
    SCHEMA,
    TENSOR_NAMES,
    atomic_write,
    call_file_name,
    capture_digest,
    dtype_name,
    manifest_bytes,
    sha256_hex,
)
from flamia_verify.errors import CaptureError

__all__ = ["CallSite", "CaptureWarning", "DEFAULT_MAX_BYTES", "Recorder", "recording"]

#: the default cap on the call files of one capture (1 GiB)
DEFAULT_MAX_BYTES = 1 << 30
#: room kept per call for its safetensors header (a few hundred bytes for six tensors)
_HEADER_BYTES = 1024

Layer = int | str


class CaptureWarning(UserWarning):
    """Recording stopped early (the size cap, a failed write) or left out a call it cannot record."""


@dataclass(frozen=True)
class CallSite:
    """Where a call happened, as the selection sees it."""

    index: int  # among all calls the recorder saw, from 0
    step: int
    layer: Layer
    backward: bool  # autograd can reach it: gradients enabled and q, k or v requires grad


@dataclass
class _Call:
    site: CallSite
    tensors: dict[str, torch.Tensor]
    max_seqlen_q: int
    max_seqlen_k: int
    softmax_scale: float | str | None  # "nan", "inf", "-inf" for a scale JSON cannot hold
    causal: bool
    extra_kwargs: dict[str, Any]
    device: str
    reserved: int
    done: bool = False
    hook: Any = field(default=None, repr=False)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _host_copy(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().clone(memory_format=torch.contiguous_format)


def _json_float(x: float) -> float | str:
    """report.json's convention: a non-finite float as a string (strict JSON has no NaN)."""
    if math.isfinite(x):
        return x
    return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")


class Recorder:
    """``kernel`` wrapped so that its selected calls are recorded into ``out_dir``.

    Call it as the kernel (``out = rec(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
    max_seqlen_k, softmax_scale=s, causal=c)``; q: (total_q, nheads, headdim), k, v:
    (total_k, nheads_k, headdim), cu_seqlens_*: int32 (batch + 1,)); use it as a context manager or
    call :meth:`close` to finish the capture.

    Args:
        kernel: any function in the varlen convention.
        out_dir: a new or empty directory; nothing is written outside it.
        model: the model's name, kept in the manifest.
        calls: record at most this many calls (None: no limit but the size cap).
        every: record only calls whose index is a multiple of ``every``.
        select: call indices to record, or a predicate on :class:`CallSite`.
        layers_per_step: attention calls per step; the step advances by itself after that many
            calls (else call :meth:`next_step` after each step's backward).
        max_bytes: cap on the call files together (default 1 GiB).
        meta: JSON-serializable facts kept in the manifest (the run's config, a commit, ...).
    """

    def __init__(
        self,
        kernel: Callable[..., Any],
        out_dir: str | Path,
        *,
        model: str | None = None,
        calls: int | None = None,
        every: int = 1,
        select: Collection[int] | Callable[[CallSite], bool] | None = None,
        layers_per_step: int | None = None,
        max_bytes: int = DEFAULT_MAX_BYTES,
        meta: Mapping[str, Any] | None = None,
    ) -> None:
        if not callable(kernel):
            raise CaptureError(f"kernel must be callable, got {type(kernel).__name__}")
        _positive("every", every)
        _positive("max_bytes", max_bytes)
        if calls is not None:
            _positive("calls", calls, minimum=0)
        if layers_per_step is not None:
            _positive("layers_per_step", layers_per_step)
        if model is not None and not isinstance(model, str):
            raise CaptureError(f"model must be a name (str), got {type(model).__name__}")
        meta = dict(meta or {})
        try:
            json.dumps(meta, allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise CaptureError(f"meta must be JSON-serializable: {exc}") from None
        if select is None or callable(select):
            self._select: Callable[[CallSite], bool] | None = select
            select_desc: Any = None if select is None else "a function"
        else:
            try:
                if isinstance(select, (str, bytes)):
                    raise TypeError
                indices = frozenset(operator.index(i) for i in select)
            except TypeError:
                raise CaptureError(f"select must be call indices or a function of a CallSite, got {select!r}") from None
            self._select = lambda site: site.index in indices
            select_desc = sorted(indices)
        self.kernel = kernel
        self.out_dir = _prepare_out_dir(out_dir)
        self.model = model
        self.calls = calls
        self.every = every
        self.layers_per_step = layers_per_step
        self.max_bytes = max_bytes
        self.meta = meta
        #: why recording stopped before the end (the size cap, a failed write), else None
        self.stopped: str | None = None
        self._selection = {"calls": calls, "every": every, "select": select_desc, "layers_per_step": layers_per_step}
        self._lock = threading.RLock()
        self._seen = 0  # calls seen
        self._step = 0
        self._in_step = 0  # calls seen in this step
        self._admitted = 0  # calls selected and copied (whole or waiting for their backward)
        self._bytes = 0  # bytes of the call files written
        self._reserved = 0  # bytes kept for calls waiting for their backward
        self._waiting: dict[int, _Call] = {}
        self._entries: list[dict[str, Any]] = []
        self._warned: set[str] = set()
        self._closed = False
        self._write_manifest(complete=False)

    # -- the wrapped kernel -------------------------------------------------------------------------

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cu_seqlens_q: torch.Tensor,
        cu_seqlens_k: torch.Tensor,
        max_seqlen_q: int,
        max_seqlen_k: int,
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        conv = (q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
        return self._call(None, conv, args, kwargs)

    def for_layer(self, layer: int | str) -> Callable[..., Any]:
        """A kernel that records its calls under ``layer`` (a name or an index); the step and the
        selection are shared with this recorder."""
        if isinstance(layer, bool) or not isinstance(layer, (int, str)):
            raise CaptureError(f"layer must be an int or a str, got {type(layer).__name__}")

        def kernel(
            q: torch.Tensor,
            k: torch.Tensor,
            v: torch.Tensor,
            cu_seqlens_q: torch.Tensor,
            cu_seqlens_k: torch.Tensor,
            max_seqlen_q: int,
            max_seqlen_k: int,
            *args: Any,
            **kwargs: Any,
        ) -> Any:
            conv = (q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
            return self._call(layer, conv, args, kwargs)

        kernel.__name__ = f"{getattr(self.kernel, '__name__', 'kernel')}[{layer}]"
        return kernel

    # -- steps and the end ----------------------------------------------------------------------------

    @property
    def step(self) -> int:
        """The step the next call belongs to (from 0)."""
        with self._lock:
            return self._step

    @property
    def recorded(self) -> int:
        """Calls written so far."""
        with self._lock:
            return len(self._entries)

    def next_step(self) -> None:
        """Start the next step. Call it after the step's backward: calls still waiting for a gradient
        are written without one."""
        with self._lock:
            self._flush_waiting()
            self._step += 1
            self._in_step = 0

    def close(self) -> Path:
        """Write the calls still waiting for a gradient (without one) and the final manifest
        (``"complete": true``); return ``out_dir``. Calls after this pass through unrecorded."""
        with self._lock:
            if not self._closed:
                self._flush_waiting()
                self._closed = True
                self._write_manifest(complete=True)
            return self.out_dir

    def __enter__(self) -> Recorder:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: Any) -> None:
        if exc_type is None:
            self.close()
            return
        # the recorded code raised: the calls written are whole and stay; those waiting for a backward
        # that will not come are left out rather than written as if none had been due
        with self._lock:
            if self._closed:
                return
            dropped = len(self._waiting)
            for call in list(self._waiting.values()):
                self._drop(call)
            if self.stopped is None:
                self.stopped = f"interrupted: the recorded code raised {exc_type.__name__}" + (
                    f"; {dropped} call(s) waiting for their backward were left out" if dropped else ""
                )
            try:
                self.close()
            except Exception as err:  # the original exception is the one to see
                warnings.warn(f"flamia-verify capture: could not finish {self.out_dir}: {err}", CaptureWarning, 2)

    # -- recording --------------------------------------------------------------------------------------

    def _call(self, layer: Layer | None, conv: tuple[Any, ...], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        q, k, v = conv[:3]
        backward = torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in (q, k, v))
        with self._lock:
            if self.layers_per_step is not None and self._in_step >= self.layers_per_step:
                self._flush_waiting()
                self._step += 1
                self._in_step = 0
            site = CallSite(self._seen, self._step, self._in_step if layer is None else layer, backward)
            self._seen += 1
            self._in_step += 1
            call = self._admit(site, conv, args, kwargs) if self._wanted(site) else None
        try:
            result = self.kernel(*conv, *args, **kwargs)
        except BaseException:
            if call is not None:
                with self._lock:
                    self._drop(call)
                    self._admitted -= 1
            raise
        if call is not None:
            self._after(call, result)
        return result

    def _wanted(self, site: CallSite) -> bool:
        if self._closed or self.stopped is not None or site.index % self.every:
            return False
        if self.calls is not None and self._admitted >= self.calls:
            return False
        return self._select is None or bool(self._select(site))

    def _admit(
        self, site: CallSite, conv: tuple[Any, ...], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> _Call | None:
        """Copy a selected call's inputs (before the kernel runs: what went in), or say why not."""
        if args:
            self._skip(
                "positional",
                f"call {site.index} passes {len(args)} positional argument(s) after max_seqlen_k; "
                "the convention passes softmax_scale and causal by keyword",
            )
            return None
        tensors = dict(zip(TENSOR_NAMES, conv[:5]))
        for name, t in tensors.items():
            if not isinstance(t, torch.Tensor) or t.dtype not in DTYPES.values():
                what = t.dtype if isinstance(t, torch.Tensor) else type(t).__name__
                self._skip(f"type {name}", f"call {site.index}: {name} is {what}, which a capture cannot hold")
                return None
        try:
            max_q, max_k = int(conv[5]), int(conv[6])
            scale = kwargs.get("softmax_scale")
            scale_value = None if scale is None else _json_float(float(scale))
            causal = bool(kwargs.get("causal", False))
        except (TypeError, ValueError) as exc:
            self._skip("scalars", f"call {site.index}: max_seqlen, softmax_scale or causal is not a number: {exc}")
            return None
        extra = {key: val for key, val in kwargs.items() if key not in ("softmax_scale", "causal")}
        try:
            json.dumps(extra, allow_nan=False)
        except (TypeError, ValueError):
            self._skip("kwargs", f"call {site.index}: keyword arguments {sorted(extra)} are not JSON values")
            return None
        q = tensors["q"]
        need = sum(_nbytes(t) for t in tensors.values()) + _HEADER_BYTES + (_nbytes(q) if site.backward else 0)
        if self._bytes + self._reserved + need > self.max_bytes:
            self._stop(self._cap_message(site))
            return None
        self._reserved += need
        self._admitted += 1
        return _Call(
            site,
            {name: _host_copy(t) for name, t in tensors.items()},
            max_q,
            max_k,
            scale_value,
            causal,
            extra,
            str(q.device),
            need,
        )

    def _after(self, call: _Call, result: Any) -> None:
        out = result[0] if isinstance(result, (tuple, list)) and result else result
        if call.site.backward and isinstance(out, torch.Tensor) and out.requires_grad:
            with self._lock:
                # the room kept for dout assumed q's dtype; the output's own says what the gradient takes
                need = call.reserved + _nbytes(out) - _nbytes(call.tensors["q"])
                if self._bytes + self._reserved - call.reserved + need > self.max_bytes:
                    self._drop(call)
                    self._stop(self._cap_message(call.site))
                    return
                self._reserved += need - call.reserved
                call.reserved = need
                self._waiting[call.site.index] = call
                # torch leaves register_hook untyped
                call.hook = out.register_hook(lambda grad: self._on_grad(call, grad))  # type: ignore[no-untyped-call]
            return
        with self._lock:
            self._finish(call)

    def _on_grad(self, call: _Call, grad: torch.Tensor) -> None:
        """The output's gradient arrived: keep a copy, write the call. Returns None: the gradient
        flows on unchanged."""
        with self._lock:
            if call.done:  # a second backward through a retained graph: the first one is recorded
                return
            try:
                call.tensors[DOUT] = _host_copy(grad)
            except Exception as exc:
                self._drop(call)
                self._stop(f"could not copy the gradient of call {call.site.index}: {exc}")
                return
            self._finish(call)

    def _flush_waiting(self) -> None:
        for index in sorted(self._waiting):
            self._finish(self._waiting[index])

    def _drop(self, call: _Call) -> None:
        if not call.done:
            call.done = True
            self._reserved -= call.reserved
        self._waiting.pop(call.site.index, None)
        if call.hook is not None:
            call.hook.remove()
            call.hook = None

    def _finish(self, call: _Call) -> None:
        """Write a whole call: its file first, then the manifest that lists it."""
        if call.done:
            return
        self._drop(call)
        name = call_file_name(call.site.index)
        try:
            data = save(call.tensors, metadata={"format": CALL_FORMAT})
            if self._bytes + len(data) > self.max_bytes:
                self._stop(self._cap_message(call.site))
                return
            atomic_write(self.out_dir, name, data)
        except Exception as exc:
            self._stop(f"could not write {self.out_dir / name}: {type(exc).__name__}: {exc}")
            return
        self._bytes += len(data)
        site = call.site
        self._entries.append(
            {
                "index": site.index,
                "step": site.step,
                "layer": site.layer,
                "file": name,
                "sha256": sha256_hex(data),
                "bytes": len(data),
                "max_seqlen_q": call.max_seqlen_q,
                "max_seqlen_k": call.max_seqlen_k,
                "softmax_scale": call.softmax_scale,
                "causal": call.causal,
                "extra_kwargs": call.extra_kwargs,
                "device": call.device,
                "tensors": {n: {"shape": list(t.shape), "dtype": dtype_name(t.dtype)} for n, t in call.tensors.items()},
            }
        )
        call.tensors = {}
        try:
            self._write_manifest(complete=False)
        except Exception as exc:
            self._stop(f"could not write {self.out_dir / MANIFEST}: {type(exc).__name__}: {exc}")

    def _write_manifest(self, *, complete: bool) -> None:
        entries = sorted(self._entries, key=lambda e: e["index"])
        manifest = {
            "schema": SCHEMA,
            "complete": complete,
            "tool": "flamia-verify",
            "version": __version__,
            "torch": torch.__version__,
            "model": self.model,
            "meta": self.meta,
            "selection": self._selection,
            "max_bytes": self.max_bytes,
            "bytes": self._bytes,
            "calls_seen": self._seen,
            "stopped": self.stopped,
            "sha256": capture_digest((e["file"], e["sha256"]) for e in entries),
            "calls": entries,
        }
        try:
            atomic_write(self.out_dir, MANIFEST, manifest_bytes(manifest))
        except OSError as exc:
            raise CaptureError(f"{self.out_dir / MANIFEST}: cannot write the manifest: {exc}") from None

    def _cap_message(self, site: CallSite) -> str:
        return (
            f"the size cap max_bytes={self.max_bytes} is reached at call {site.index} "
            f"(step {site.step}, layer {site.layer}): {self._bytes} bytes written in {len(self._entries)} call(s); "
            "raise max_bytes or select fewer calls (calls=, every=, select=)"
        )

    def _stop(self, reason: str) -> None:
        if self.stopped is None:
            self.stopped = reason
            warnings.warn(
                f"flamia-verify capture into {self.out_dir}: {reason}; recording stopped, "
                "the calls already written are kept",
                CaptureWarning,
                stacklevel=5,
            )

    def _skip(self, kind: str, message: str) -> None:
        if kind not in self._warned:
            self._warned.add(kind)
            warnings.warn(f"flamia-verify capture: {message}: not recorded", CaptureWarning, stacklevel=5)


def recording(kernel: Callable[..., Any], out_dir: str | Path, **options: Any) -> Recorder:
    """``Recorder(kernel, out_dir, **options)``, read as a context manager:
    ``with recording(kernel, "captures/run1", calls=8) as attn: ...``."""
    return Recorder(kernel, out_dir, **options)


def _positive(name: str, value: object, *, minimum: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise CaptureError(f"{name} must be an int >= {minimum}, got {value!r}")


def _prepare_out_dir(out_dir: str | Path) -> Path:
    path = Path(out_dir)
    if path.exists() and not path.is_dir():
        raise CaptureError(f"{path}: exists and is not a directory; a capture goes into a new or empty directory")
    if path.is_dir() and any(path.iterdir()):
        raise CaptureError(f"{path}: not empty; a capture goes into a new or empty directory")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise CaptureError(f"{path}: cannot create the capture directory: {exc}") from None
    return path
