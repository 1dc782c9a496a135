"""What depends on a case alone, kept across the runs of one process.

A case's tensors, its float64 reference, its a-priori bound under a recipe's rounding model and the
model's predicted error are functions of the case (its packing, shapes, distribution, seed, dtype),
the device and the recipe's model; none of them depends on the kernel under test. A process that
checks several kernels (a sweep's long-lived worker, ``flamia-verify survey`` on the CPU, a test
session, the API in a loop) computes them once per case, not once per kernel. Within a run the
context's memo already shares them between checks; this cache shares them between runs.

The cache holds at most ``FLAMIA_VERIFY_CASE_CACHE_MB`` MiB of tensors (1024 by default; 0 turns it
off), least recently used first out. A captured case is never kept (its tensors come from files that
may change between runs). The values are the same objects a run's memo would hold: nothing may write
into them (the harness hands the kernel copies of the inputs). ``FLAMIA_VERIFY_CASE_CACHE_VERIFY=1``
holds that to account: every value is fingerprinted when kept (a hash of its tensors' bytes) and again
on every hit, and a value that changed raises, naming its key (the test suite turns it on).
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import threading
import warnings
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator
from typing import Any

import torch

__all__ = ["CaseCache", "CASE_CACHE", "fingerprint", "nbytes"]

_DEFAULT_MB = 1024


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    """Every tensor reachable from ``value`` (tensors, mappings, sequences, dataclasses), each once."""
    seen: set[int] = set()

    def walk(x: Any) -> Iterator[torch.Tensor]:
        if id(x) in seen:
            return
        seen.add(id(x))
        if isinstance(x, torch.Tensor):
            yield x
        elif isinstance(x, dict):
            for v in x.values():
                yield from walk(v)
        elif isinstance(x, (list, tuple)):
            for v in x:
                yield from walk(v)
        elif dataclasses.is_dataclass(x) and not isinstance(x, type):
            for f in dataclasses.fields(x):
                yield from walk(getattr(x, f.name))

    return walk(value)


def nbytes(value: Any) -> int:
    """The bytes of every tensor reachable from ``value``."""
    return sum(t.numel() * t.element_size() for t in _tensors(value))


def fingerprint(value: Any) -> str:
    """A hash of the dtype, shape and bytes of every tensor reachable from ``value``."""
    h = hashlib.blake2b(digest_size=16)
    for x in _tensors(value):
        t = x.detach().to("cpu").contiguous()
        h.update(str((t.dtype, tuple(t.shape))).encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


class CaseCache:
    """A least-recently-used map of case-keyed values, bounded by the bytes of their tensors; with
    ``verify``, a value whose tensors changed since it was kept raises on its next hit."""

    def __init__(self, max_bytes: int, *, verify: bool = False) -> None:
        self.max_bytes = max_bytes
        self.verify = verify
        self._items: OrderedDict[Hashable, tuple[Any, int]] = OrderedDict()
        self._prints: dict[Hashable, str] = {}
        self._bytes = 0
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def get(self, key: Hashable, compute: Callable[[], Any]) -> Any:
        """The value kept under ``key``, else ``compute()`` (kept when it fits the budget)."""
        if self.max_bytes <= 0:
            return compute()
        with self._lock:
            if key in self._items:
                self._items.move_to_end(key)
                self.hits += 1
                kept = self._items[key][0]
                if self.verify and fingerprint(kept) != self._prints.get(key):
                    raise RuntimeError(
                        f"the case cache's value for {key!r} changed after it was kept: something wrote into "
                        "tensors the cache shares (FLAMIA_VERIFY_CASE_CACHE_VERIFY)"
                    )
                return kept
        value = compute()
        size = nbytes(value)
        with self._lock:
            self.misses += 1
            if size > self.max_bytes or key in self._items:
                return value
            self._items[key] = (value, size)
            if self.verify:
                self._prints[key] = fingerprint(value)
            self._bytes += size
            while self._bytes > self.max_bytes:
                gone, (_, old) = self._items.popitem(last=False)
                self._prints.pop(gone, None)
                self._bytes -= old
        return value

    def clear(self) -> None:
        with self._lock:
            self._items.clear()
            self._prints.clear()
            self._bytes = 0

    def __len__(self) -> int:
        return len(self._items)

    @property
    def bytes(self) -> int:
        return self._bytes


def _budget() -> int:
    raw = os.environ.get("FLAMIA_VERIFY_CASE_CACHE_MB", "")
    try:
        mb = float(raw) if raw.strip() else _DEFAULT_MB
    except ValueError:
        warnings.warn(
            f"FLAMIA_VERIFY_CASE_CACHE_MB={raw!r} is not a number of MiB; the case cache keeps its default "
            f"({_DEFAULT_MB} MiB)",
            stacklevel=2,
        )
        mb = _DEFAULT_MB
    return int(max(0.0, mb) * 2**20)


#: the process's cache (budget and verification read once, at import)
CASE_CACHE = CaseCache(_budget(), verify=os.environ.get("FLAMIA_VERIFY_CASE_CACHE_VERIFY", "") == "1")
