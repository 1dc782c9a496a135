"""A byte-level text corpus that needs no download: the Python standard library's own source.

Every ``*.py`` file under the running interpreter's standard library (``sysconfig``'s ``stdlib``
path; site-packages and bytecode caches excluded) is one document of raw UTF-8 bytes (tokens 0-255:
code, comments and docstrings, i.e. the library's source and its documentation). A file goes to the
validation split when the SHA-1 of its relative path, read as an integer, is divisible by
``val_every`` (default 20: about 5 %), so the split is the same on every machine that has the file,
whatever else its library holds. Different Python versions ship different libraries: the corpus
``fingerprint`` (SHA-256 over the names and bytes) says which one a run saw.

Batches pack windows of documents into one varlen batch: for each window, ``length + 1`` bytes from
a random offset of a random document (a document shorter than that is taken whole); input tokens
are the window's first ``length`` bytes, targets the next byte of each. ``cu_seqlens`` marks the
windows; positions restart at each (RoPE) and the causal kernel keeps windows apart.
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch

from flamia_verify.errors import ConfigError

__all__ = ["Corpus", "build_corpus", "Batch", "make_batches"]


@dataclass(frozen=True)
class Corpus:
    train: tuple[torch.Tensor, ...]  # uint8 documents
    val: tuple[torch.Tensor, ...]
    root: str
    fingerprint: str

    @property
    def train_bytes(self) -> int:
        return sum(int(d.numel()) for d in self.train)

    @property
    def val_bytes(self) -> int:
        return sum(int(d.numel()) for d in self.val)

    def describe(self) -> str:
        return (
            f"{len(self.train)} train / {len(self.val)} validation documents "
            f"({self.train_bytes / 1e6:.1f} / {self.val_bytes / 1e6:.2f} MB) from {self.root}, "
            f"fingerprint {self.fingerprint[:12]}"
        )


def _stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def build_corpus(
    root: str | os.PathLike | None = None, *, val_every: int = 20, min_bytes: int = 64, max_bytes: int | None = None
) -> Corpus:
    """The documents under ``root`` (default: this interpreter's standard library), split by path
    hash. ``max_bytes`` caps the training split at about that many bytes of files (in path order) and
    the validation split at 1/``val_every`` of it, for small runs."""
    base = Path(root) if root is not None else _stdlib_root()
    if not base.is_dir():
        raise ConfigError(f"corpus root {str(base)!r} is not a directory")
    paths = sorted(
        p for p in base.rglob("*.py") if "site-packages" not in p.parts and "__pycache__" not in p.parts and p.is_file()
    )
    digest = hashlib.sha256()
    train: list[torch.Tensor] = []
    val: list[torch.Tensor] = []
    size = {"train": 0, "val": 0}
    budget = {"train": max_bytes, "val": None if max_bytes is None else max(1, max_bytes // val_every)}
    for p in paths:
        rel = p.relative_to(base).as_posix()
        split = "val" if int(hashlib.sha1(rel.encode()).hexdigest(), 16) % val_every == 0 else "train"
        if budget[split] is not None and size[split] >= budget[split]:  # type: ignore[operator]
            if all(size[k] >= budget[k] for k in size):  # type: ignore[operator]  # both set: max_bytes given
                break
            continue
        try:
            data = p.read_bytes()
        except OSError:
            continue
        if len(data) < min_bytes:
            continue
        digest.update(rel.encode() + b"\0" + hashlib.sha256(data).digest())
        (val if split == "val" else train).append(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        size[split] += len(data)
    if not train or not val:
        raise ConfigError(
            f"corpus root {str(base)!r} holds too few .py files for a train and a validation split "
            f"({len(train)} / {len(val)})"
        )
    return Corpus(tuple(train), tuple(val), str(base), digest.hexdigest())


@dataclass(frozen=True)
class Batch:
    tokens: torch.Tensor  # int64 (T,)
    targets: torch.Tensor  # int64 (T,)
    cu_seqlens: torch.Tensor  # int32 (B + 1,)
    max_seqlen: int

    def to(self, device) -> Batch:
        return Batch(self.tokens.to(device), self.targets.to(device), self.cu_seqlens.to(device), self.max_seqlen)


def make_batches(
    docs: tuple[torch.Tensor, ...], *, n: int, tokens: int, max_len: int, min_len: int = 8, seed: int
) -> list[Batch]:
    """``n`` packed batches of exactly ``tokens`` input tokens each, windows of at most ``max_len``,
    drawn with ``seed`` (the same batches for every kernel of a run)."""
    if tokens < min_len or max_len < 2 * min_len:
        raise ConfigError(
            f"tokens per step ({tokens}) must be >= {min_len} and the window length ({max_len}) >= {2 * min_len}"
        )
    g = torch.Generator().manual_seed(int(seed))
    usable = [d for d in docs if d.numel() >= min_len + 1]
    if not usable:
        raise ConfigError("no document is long enough to draw a window from")
    out = []
    for _ in range(n):
        xs, ys, lens, left, tries = [], [], [], tokens, 0
        while left > 0:  # invariant: left == 0 or left >= min_len
            tries += 1
            if tries > 100 * (tokens // min_len + 10):
                raise ConfigError(f"cannot pack {tokens} tokens from these documents (windows {min_len}..{max_len})")
            doc = usable[int(torch.randint(len(usable), (1,), generator=g))]
            length = min(max_len, int(doc.numel()) - 1, left)
            if 0 < left - length < min_len:  # the rest would be a window shorter than min_len
                if length - min_len >= min_len:
                    length -= min_len
                elif int(doc.numel()) - 1 >= left and left <= max_len:
                    length = left
                else:
                    continue  # another document
            start = int(torch.randint(int(doc.numel()) - length, (1,), generator=g))
            w = doc[start : start + length + 1].to(torch.int64)
            xs.append(w[:-1])
            ys.append(w[1:])
            lens.append(length)
            left -= length
        cu = torch.zeros(len(lens) + 1, dtype=torch.int32)
        cu[1:] = torch.cumsum(torch.tensor(lens), 0)
        out.append(Batch(torch.cat(xs), torch.cat(ys), cu, max(lens)))
    return out
