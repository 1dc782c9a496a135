"""Where the E4M3 copies and cuDNN's outputs live: packed (THD, ragged offsets) or padded (BSHD).

The calling convention packs documents back to back: ``x[t, h, :]``, t in [0, total). cuDNN reads a
pack in one of two ways, both one graph call for the whole pack (never a loop over documents):

* **packed** (THD): the same rows, with ragged offsets (the element offset of each document's first
  row, ``cu_seqlens * heads * head_dim``) and per-document sequence lengths. The buffer has
  ``round_up(total, 64)`` token rows (cuDNN's own FP8 tests allocate ragged buffers that way); the
  rows after ``total`` are zeros.
* **padded** (BSHD): document b's token s at row ``b * seq + s``, ``seq`` = the graph's sequence
  length (``max_seqlen`` rounded up to 64); rows past a document's length are zeros. Used where
  cuDNN has no ragged graph (cuDNN frontend 1.22+ refuses a ragged FP8 backward on Hopper).

Zeros in the pad rows matter: a masked key still passes through the tensor cores as ``P = 0`` times
its value, and an E4M3 NaN there would turn the product NaN.

The quantization kernels write these layouts directly (the gather costs nothing on top of the pass
that reads the input anyway) and the dequantization kernels read them back into the packed rows.
The ``*_reference`` functions here are the slow, obviously correct twins (a loop over documents).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["ROW_ALIGN", "Layout", "from_layout_reference", "make_layout", "round_up", "to_layout_reference"]

#: token rows of every buffer are a multiple of this; the graph's sequence length too
ROW_ALIGN = 64


def round_up(n: int, m: int) -> int:
    return -(-n // m) * m


@dataclass(frozen=True)
class Layout:
    """One side of a pack (queries, or keys and values) as cuDNN reads it.

    padded: BSHD with ``seq`` rows per document, else THD with ragged offsets.
    tokens: packed rows of the convention (``cu_seqlens[-1]``).
    batch: documents (``len(cu_seqlens) - 1``).
    seq: the graph's sequence dimension (``max_seqlen`` rounded up to ROW_ALIGN).
    rows: token rows of the buffer: ``batch * seq`` padded, ``round_up(tokens, ROW_ALIGN)`` packed.
    """

    padded: bool
    tokens: int
    batch: int
    seq: int
    rows: int

    @property
    def kind(self) -> str:
        return "padded" if self.padded else "packed"


def make_layout(padded: bool, tokens: int, batch: int, max_seqlen: int) -> Layout:
    """The layout of one side of a pack of ``batch`` documents, ``tokens`` rows, ``max_seqlen`` at most."""
    seq = round_up(max(int(max_seqlen), 1), ROW_ALIGN)
    rows = batch * seq if padded else round_up(max(int(tokens), 1), ROW_ALIGN)
    return Layout(bool(padded), int(tokens), int(batch), seq, rows)


def to_layout_reference(x: torch.Tensor, layout: Layout, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """``x`` (tokens, H, D) placed in ``layout``'s rows, zeros elsewhere: (rows, H, D), x's dtype."""
    out = torch.zeros((layout.rows, *x.shape[1:]), dtype=x.dtype, device=x.device)
    if not layout.padded:
        out[: layout.tokens] = x
        return out
    cu = [int(c) for c in cu_seqlens.tolist()]
    for b in range(layout.batch):
        n = cu[b + 1] - cu[b]
        out[b * layout.seq : b * layout.seq + n] = x[cu[b] : cu[b + 1]]
    return out


def from_layout_reference(y: torch.Tensor, layout: Layout, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """The packed rows (tokens, H, D) of ``y`` (rows, H, D) in ``layout``: the inverse of
    :func:`to_layout_reference` on the rows it wrote."""
    if not layout.padded:
        return y[: layout.tokens]
    cu = [int(c) for c in cu_seqlens.tolist()]
    parts = [y[b * layout.seq : b * layout.seq + cu[b + 1] - cu[b]] for b in range(layout.batch)]
    return torch.cat(parts, dim=0) if parts else y[:0]
