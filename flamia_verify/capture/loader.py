"""Read a capture back, refusing anything that is not whole and valid.

``load_capture(path)`` returns a :class:`Capture` of :class:`CapturedCall` records, or raises
:class:`~flamia_verify.errors.CaptureError` with one line that names the file and the problem:
no manifest, a manifest without ``"complete": true`` or of another schema, a temporary file left by
an interrupted write, a call file that is missing, is a link, has another name than its index gives
or another SHA-256 than the manifest's, tensors whose names, shapes or dtypes differ from the
manifest's or break the calling convention (:func:`flamia_verify.convention.validate_varlen_inputs`),
and NaN or Inf already in q, k, v or dout. Each file is read once: its bytes are hashed and parsed
from the same buffer, so what is checked is what is returned.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load

from flamia_verify.capture.store import (
    CALL_FORMAT,
    DOUT,
    MANIFEST,
    SCHEMA,
    TENSOR_NAMES,
    TMP_PREFIX,
    capture_digest,
    dtype_name,
    is_call_file_name,
    sha256_hex,
)
from flamia_verify.convention import validate_varlen_inputs
from flamia_verify.errors import CaptureError, InputError

__all__ = ["Capture", "CapturedCall", "load_capture"]


@dataclass(frozen=True)
class CapturedCall:
    """One recorded kernel call. q: (total_q, nheads, headdim); k, v: (total_k, nheads_k, headdim);
    cu_seqlens_*: int32 (batch + 1,); dout: like q (the gradient of the call's output), or None when
    no backward reached the call. Tensors are on the CPU."""

    index: int
    step: int
    layer: int | str
    file: str
    sha256: str
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int
    softmax_scale: float | None  # None: the call left it to the kernel's default (headdim^-0.5)
    causal: bool
    dout: torch.Tensor | None
    extra_kwargs: Mapping[str, Any]  # other keyword arguments of the call, as JSON values
    device: str  # where the recorded call ran

    def run(self, kernel: Callable[..., Any]) -> Any:
        """Call ``kernel`` as the recorded call was made (on these tensors: clone them first if the
        kernel may write into its inputs or if autograd should track them)."""
        return kernel(
            self.q,
            self.k,
            self.v,
            self.cu_seqlens_q,
            self.cu_seqlens_k,
            self.max_seqlen_q,
            self.max_seqlen_k,
            softmax_scale=self.softmax_scale,
            causal=self.causal,
            **self.extra_kwargs,
        )


@dataclass(frozen=True)
class Capture:
    """A whole capture: its calls in index order and the manifest's facts."""

    path: Path
    model: str | None
    version: str  # of flamia-verify that recorded it
    sha256: str  # over every call file's name and hash (store.capture_digest)
    stopped: str | None  # why recording stopped before the end (the size cap, ...), else None
    meta: Mapping[str, Any]
    calls: tuple[CapturedCall, ...]

    def __len__(self) -> int:
        return len(self.calls)

    def __iter__(self) -> Iterator[CapturedCall]:
        return iter(self.calls)


def load_capture(path: str | Path) -> Capture:
    """Load and validate the capture in directory ``path``; raise :class:`CaptureError` on the first
    problem (one line naming the file)."""
    root = Path(path)
    if not root.is_dir():
        raise CaptureError(f"{root}: no capture here (not a directory)")
    manifest_path = root / MANIFEST
    leftovers = sorted(p.name for p in root.iterdir() if p.name.startswith(TMP_PREFIX))
    if not manifest_path.is_file():
        raise CaptureError(f"{manifest_path}: missing: not a capture, or its recording did not finish")
    manifest = _read_manifest(manifest_path)
    if leftovers:
        raise CaptureError(
            f"{root / leftovers[0]}: a temporary file left by an interrupted write; the capture is incomplete"
        )
    where = str(manifest_path)
    entries = _get(manifest, "calls", list, where)
    if not entries:
        raise CaptureError(f"{manifest_path}: the capture holds no calls")
    calls = []
    seen: set[int] = set()
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict):
            raise CaptureError(f"{manifest_path}: calls[{i}] is not an object")
        call = _load_call(root, entry, f"{manifest_path} calls[{i}]")
        if call.index in seen:
            raise CaptureError(f"{manifest_path}: call {call.index} is listed twice")
        seen.add(call.index)
        calls.append(call)
    calls.sort(key=lambda c: c.index)
    digest = _get(manifest, "sha256", str, where)
    if digest != capture_digest((c.file, c.sha256) for c in calls):
        raise CaptureError(f"{manifest_path}: sha256 {digest[:12]}... does not match its calls' files and hashes")
    model = manifest.get("model")
    stopped = manifest.get("stopped")
    meta = manifest.get("meta", {})
    if model is not None and not isinstance(model, str):
        raise CaptureError(f"{manifest_path}: model must be a string or null")
    if stopped is not None and not isinstance(stopped, str):
        raise CaptureError(f"{manifest_path}: stopped must be a string or null")
    if not isinstance(meta, dict):
        raise CaptureError(f"{manifest_path}: meta must be an object")
    return Capture(root, model, _get(manifest, "version", str, where), digest, stopped, meta, tuple(calls))


def _read_manifest(path: Path) -> dict[str, Any]:
    try:
        manifest = json.loads(path.read_bytes())
    except OSError as exc:
        raise CaptureError(f"{path}: cannot read: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise CaptureError(f"{path}: not JSON ({exc})") from None
    if not isinstance(manifest, dict):
        raise CaptureError(f"{path}: not a capture manifest (a JSON object)")
    if manifest.get("schema") != SCHEMA:
        raise CaptureError(f"{path}: schema is {manifest.get('schema')!r}, expected {SCHEMA!r}")
    if manifest.get("complete") is not True:
        stopped = manifest.get("stopped")
        why = f" ({stopped})" if isinstance(stopped, str) and stopped else ""
        raise CaptureError(
            f"{path}: the capture is incomplete (complete is not true: the recording was interrupted or is "
            f"still running{why})"
        )
    return manifest


def _get(entry: Mapping[str, Any], key: str, kind: type | tuple[type, ...], where: str) -> Any:
    if key not in entry:
        raise CaptureError(f"{where}: {key!r} is missing")
    value = entry[key]
    if isinstance(value, bool) and kind is not bool:
        raise CaptureError(f"{where}: {key!r} must not be a boolean")
    if not isinstance(value, kind):
        names = " or ".join(t.__name__ for t in (kind if isinstance(kind, tuple) else (kind,)))
        raise CaptureError(f"{where}: {key!r} must be {names}, got {type(value).__name__}")
    return value


def _load_call(root: Path, entry: dict[str, Any], where: str) -> CapturedCall:
    index = _get(entry, "index", int, where)
    name = _get(entry, "file", str, where)
    if not is_call_file_name(name, index):
        raise CaptureError(f"{where}: file {name!r} is not the file name of call {index} in this capture")
    file = root / name
    if file.is_symlink():
        raise CaptureError(f"{file}: a link; a capture's files are regular files inside it")
    if not file.is_file():
        raise CaptureError(f"{file}: missing")
    try:
        data = file.read_bytes()
    except OSError as exc:
        raise CaptureError(f"{file}: cannot read: {exc.strerror or exc}") from None
    expected = _get(entry, "sha256", str, where)
    actual = sha256_hex(data)
    if actual != expected:
        raise CaptureError(
            f"{file}: sha256 {actual[:12]}... differs from the manifest's {expected[:12]}...: "
            "the file changed after recording"
        )
    tensors = _parse(file, data)
    want = _get(entry, "tensors", dict, where)
    names = set(TENSOR_NAMES) | ({DOUT} if DOUT in want else set())
    if set(tensors) != names or set(want) != names:
        raise CaptureError(
            f"{file}: holds tensors {sorted(tensors)}, the manifest lists {sorted(want)}; "
            f"a call holds {', '.join(TENSOR_NAMES)} and optionally {DOUT}"
        )
    for n in sorted(names):
        spec = want[n]
        t = tensors[n]
        shape = spec.get("shape") if isinstance(spec, dict) else None
        dtype = spec.get("dtype") if isinstance(spec, dict) else None
        if shape != list(t.shape) or dtype != dtype_name(t.dtype):
            raise CaptureError(
                f"{file}: {n} is {dtype_name(t.dtype)} {list(t.shape)}, the manifest says {dtype} {shape}"
            )
    max_q = _get(entry, "max_seqlen_q", int, where)
    max_k = _get(entry, "max_seqlen_k", int, where)
    scale = entry.get("softmax_scale")
    if scale is not None and (
        isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale)
    ):
        raise CaptureError(f"{file}: softmax_scale is {scale!r}; a capture needs a finite number or null")
    causal = _get(entry, "causal", bool, where)
    extra = entry.get("extra_kwargs", {})
    if not isinstance(extra, dict):
        raise CaptureError(f"{where}: 'extra_kwargs' must be an object")
    q, k, v, cu_q, cu_k = (tensors[n] for n in TENSOR_NAMES)
    dout = tensors.get(DOUT)
    if min(max_q, max_k) < 0:
        raise CaptureError(f"{file}: max_seqlen_q = {max_q}, max_seqlen_k = {max_k}; both must be >= 0")
    try:
        validate_varlen_inputs(q, k, v, cu_q, cu_k, max_q, max_k)
    except InputError as exc:
        raise CaptureError(f"{file}: breaks the calling convention: {exc}") from None
    if dout is not None and (dout.shape != q.shape or not dout.is_floating_point()):
        raise CaptureError(
            f"{file}: dout is {dtype_name(dout.dtype)} {list(dout.shape)}; it must be a floating-point tensor "
            f"shaped like q {list(q.shape)}"
        )
    for n, t in (("q", q), ("k", k), ("v", v)):
        _finite(file, n, t)
    if dout is not None:
        _finite(file, DOUT, dout)
    return CapturedCall(
        index=index,
        step=_get(entry, "step", int, where),
        layer=_get(entry, "layer", (int, str), where),
        file=name,
        sha256=expected,
        q=q,
        k=k,
        v=v,
        cu_seqlens_q=cu_q,
        cu_seqlens_k=cu_k,
        max_seqlen_q=max_q,
        max_seqlen_k=max_k,
        softmax_scale=None if scale is None else float(scale),
        causal=causal,
        dout=dout,
        extra_kwargs=extra,
        device=str(entry.get("device", "cpu")),
    )


def _parse(file: Path, data: bytes) -> dict[str, torch.Tensor]:
    header = _header(file, data)
    meta = header.get("__metadata__")
    if not isinstance(meta, dict) or meta.get("format") != CALL_FORMAT:
        raise CaptureError(f"{file}: not a call file of a capture (its metadata has no format {CALL_FORMAT!r})")
    for name, info in header.items():
        if name != "__metadata__" and isinstance(info, dict) and info.get("dtype") not in _SAFETENSORS_DTYPES:
            raise CaptureError(f"{file}: {name} has dtype {info.get('dtype')!r}, which a capture does not hold")
    try:
        return load(data)
    except (SafetensorError, ValueError, RuntimeError) as exc:
        raise CaptureError(f"{file}: not a valid safetensors file ({_one_line(exc)})") from None


#: safetensors' names of the dtypes in store.DTYPES
_SAFETENSORS_DTYPES = {"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2", "I32"}


def _header(file: Path, data: bytes) -> dict[str, Any]:
    """The JSON header of a safetensors file: 8 bytes of little-endian length, then the header."""
    if len(data) < 8:
        raise CaptureError(f"{file}: not a safetensors file ({len(data)} bytes)")
    n = int.from_bytes(data[:8], "little")
    if n > len(data) - 8:
        raise CaptureError(f"{file}: not a safetensors file (a header of {n} bytes in a file of {len(data)})")
    try:
        header = json.loads(data[8 : 8 + n])
    except ValueError as exc:
        raise CaptureError(f"{file}: not a safetensors file (its header is not JSON: {exc})") from None
    if not isinstance(header, dict):
        raise CaptureError(f"{file}: not a safetensors file (its header is not a JSON object)")
    return header


def _finite(file: Path, name: str, t: torch.Tensor) -> None:
    x = t.float() if t.element_size() < 2 else t  # fp8: isnan/isinf are not implemented for every fp8 dtype
    nan = int(torch.isnan(x).sum())
    inf = int(torch.isinf(x).sum())
    if nan or inf:
        raise CaptureError(
            f"{file}: {name} already holds {nan} NaN and {inf} Inf value(s) of {t.numel()}; "
            "a capture's inputs must be finite"
        )


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())
