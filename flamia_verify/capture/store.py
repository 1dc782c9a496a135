"""The on-disk form of a capture: one safetensors file per recorded call and a JSON manifest.

    OUT_DIR/
      manifest.json             written first with "complete": false, rewritten after every call,
                                and last with "complete": true when the recording closes
      call-000000.safetensors   q, k, v, cu_seqlens_q, cu_seqlens_k and, when a backward reached
      call-000003.safetensors   the call, dout (the gradient flowing into its output)

Every file is written atomically: to a temporary file ``.tmp-*`` in OUT_DIR, flushed to disk, then
renamed over its name. A process killed mid-write leaves a ``.tmp-*`` file and a manifest without
``"complete": true``; the loader refuses both. File names come from the call index only
(:func:`call_file_name`), never from anything a caller passes, so nothing is written outside OUT_DIR.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "SCHEMA",
    "CALL_FORMAT",
    "MANIFEST",
    "TMP_PREFIX",
    "TENSOR_NAMES",
    "DOUT",
    "DTYPES",
    "call_file_name",
    "is_call_file_name",
    "atomic_write",
    "sha256_hex",
    "capture_digest",
    "manifest_bytes",
    "dtype_name",
]

#: the manifest's schema (its "schema" field)
SCHEMA = "flamia-verify/capture/v1"
#: the one metadata entry of every call file (safetensors keeps its metadata in a hash map whose
#: order changes from run to run, so a single entry keeps the file's bytes, and its hash, reproducible)
CALL_FORMAT = "flamia-verify/capture-call/v1"
MANIFEST = "manifest.json"
#: prefix of the temporary files of atomic writes; one left behind means a write was interrupted
TMP_PREFIX = ".tmp-"
#: the tensors of every call file, in the convention's argument order
TENSOR_NAMES = ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k")
#: the gradient of the call's output (FlashAttention's name), present when a backward reached the call
DOUT = "dout"

#: the dtypes a capture may hold, by the name the manifest gives them
DTYPES: dict[str, torch.dtype] = {
    "float64": torch.float64,
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
    "int32": torch.int32,
}

_CALL_FILE = re.compile(r"call-([0-9]{6,})\.safetensors")


def call_file_name(index: int) -> str:
    """The file of call ``index``: ``call-000042.safetensors``."""
    return f"call-{index:06d}.safetensors"


def is_call_file_name(name: str, index: int) -> bool:
    """Whether ``name`` is exactly the file name of call ``index`` (no directory part, no other name)."""
    m = _CALL_FILE.fullmatch(name)
    return m is not None and int(m.group(1)) == index and name == call_file_name(index)


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def capture_digest(files: Iterable[tuple[str, str]]) -> str:
    """The content hash of a whole capture: SHA-256 over one ``"<file> <sha256>\\n"`` line per call,
    in the manifest's order."""
    h = hashlib.sha256()
    for name, digest in files:
        h.update(f"{name} {digest}\n".encode())
    return h.hexdigest()


def manifest_bytes(manifest: dict[str, Any]) -> bytes:
    """The manifest as written: sorted keys (the same capture gives the same bytes), ``calls`` last
    with one line per call."""
    rest = {key: value for key, value in manifest.items() if key != "calls"}
    head = json.dumps(rest, indent=1, sort_keys=True, allow_nan=False)[: -len("\n}")]
    calls = [json.dumps(c, sort_keys=True, allow_nan=False) for c in manifest.get("calls", [])]
    body = "[\n" + ",\n".join(f"  {c}" for c in calls) + "\n ]" if calls else "[]"
    return f'{head},\n "calls": {body}\n}}\n'.encode()


def atomic_write(directory: Path, name: str, data: bytes) -> None:
    """Write ``data`` to ``directory / name`` so that a reader sees the old file or the whole new one:
    a temporary file in the same directory, flushed to disk, renamed over ``name``. On any failure
    (a full disk, an interrupt) the temporary file is removed and the exception propagates."""
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f"{TMP_PREFIX}{name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            if hasattr(os, "fchmod"):  # mkstemp's 0600 would keep a shared capture from its readers
                os.fchmod(f.fileno(), 0o644)
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, directory / name)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    _fsync_directory(directory)


def _fsync_directory(directory: Path) -> None:
    """Make the rename itself durable where the platform allows it (not on Windows)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
