"""Planted causal bugs of block-scaled kernels: each one leaks (or hides) a single position class
that a check probing a few fixed positions of one square document misses.

Each kernel follows the calling convention, is the FLAMIA MXFP8 emulation with one change (a record
of the known-bad registry, tags ``zoo``, ``causal``, built from its base), and carries ``recipe``,
``catches`` (the causal checks that must report ``fail`` on it, quick suite) and
``where`` (the position class its bug lives in).

    fallback_{v,k,do,q}_off{1,2}   the causal-safe split (diagonal fallback) of one sequence-blocked
                                   operand counts a block as whole while the row still misses 1 (2)
                                   of its positions: V in O = P V and K in dQ = dS K (rows are
                                   queries: the block's last positions, the diagonal one or two
                                   positions early); dO in dV = P^T dO and Q in dK = dS^T Q (rows
                                   are keys: the block's first positions, the diagonal one or two
                                   positions late)
    top_left_if_lq_gt_lk           the causal mask aligned top-left (j <= i) only when Lq > Lk:
                                   query i sees keys up to i instead of i + (Lk - Lq) (the future)
    top_left_if_lq_lt_lk           the same only when Lq < Lk: query i misses keys i + 1 .. i + Lk - Lq
                                   (it sees too little; no future leaks)
    no_fallback_hd128              no diagonal fallback on the head_dim-128 code path only
    backward_mask_plus1            the backward's causal mask one position too far (j <= i + offset + 1),
                                   the forward's right (the source-edit table's ``mask.backward+1``)
    offset_from_max_seqlens        torch SDPA per document with one offset for the batch,
                                   max_seqlen_k - max_seqlen_q, instead of each document's Lk - Lq
                                   (bf16; the wild zoo's causal_offset_from_max_seqlen is this record)

The fallback bugs leak only at rows whose diagonal sits 1 or 2 positions from a 32-block boundary
(t + offset = 32n - 2 or 32n - 1 for V and K; t = 32n + 1 or 32n + 2 for dO and Q).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from flamia_verify.kernels import emulation as E
from flamia_verify.kernels.emulation import Quant, make_kernel
from flamia_verify.known_bad import KNOWN_BAD, KnownBad, around, patched_emulation
from flamia_verify.recipes.operands import Operand
from zoo.correct import sdpa_bf16, sdpa_documents

__all__ = ["CAUSAL_BUGS", "RECORDS"]

_records: list[KnownBad] = []


def _bug(build, catches: tuple[str, ...], where: str, doc: str, *, name: str, **kw) -> None:
    _records.append(KnownBad(name, "causal", doc, build, catches=catches, where=where, tags=("zoo", "causal"), **kw))


def _within(context):
    """A build: the base's design, both passes inside ``context()`` (a change planted in the emulation)."""
    return lambda base: patched_emulation(base.design, forward=lambda info: context(), backward=lambda info: context())


# ---------------------------------------------------------------------------------------------
# the diagonal fallback of one operand off by one or two positions
# ---------------------------------------------------------------------------------------------

#: the sequence-blocked operands of FLAMIA_MXFP8 (path -> the operand)
PATHS = {"v": Operand.V_SEQ, "k": Operand.K_SEQ, "do": Operand.DO_SEQ, "q": Operand.Q_SEQ}


def _slack_block_mask(vis: torch.Tensor, block: int, slack: int) -> torch.Tensor:
    """full_block_mask with an off-by-``slack`` comparison: a block counts as whole for a row that
    sees at least one of its positions and misses at most ``slack`` of them."""
    rows, cols = vis.shape
    blk = torch.arange(cols, device=vis.device) // block
    nblk = int(blk[-1]) + 1
    counts = torch.zeros(rows, nblk, dtype=torch.int64, device=vis.device)
    counts.index_add_(1, blk, vis.to(torch.int64))
    sizes = torch.bincount(blk, minlength=nblk)
    return ((counts >= sizes - slack) & (counts > 0))[:, blk]


def _distinct_paths(design):
    """The design with a distinct (equal-valued) Quant object per sequence-blocked operand, so that
    the patched fallback can tell the four GEMMs apart by identity (rounding unchanged)."""
    quants = {op: design.quant(op) for op in PATHS.values()}
    return design.with_quants({op: Quant(q.kind, q.block, q.rule) for op, q in quants.items()})


def _fallback_off(path: str, slack: int):
    op = PATHS[path]
    original = E.fallback_mask

    def fallback(design_, quant, vis, causal):
        full = original(design_, quant, vis, causal)
        if full is None or quant is not design_.quant(op) or vis.shape[1] == 0:
            return full
        return _slack_block_mask(vis, quant.block, slack)

    def within(info):
        return E.overriding(fallback_mask=fallback)

    def build(base):
        design = _distinct_paths(base.design)
        return patched_emulation(design, forward=within, backward=within)

    return build


_GEMM = {"v": "V in O = P V", "k": "K in dQ = dS K", "do": "dO in dV = P^T dO", "q": "Q in dK = dS^T Q"}
_CATCH = {"v": ("causal.forward",), "k": ("causal.dq",), "do": ("causal.dk_dv",), "q": ("causal.dk_dv",)}
_WHERE = {"v": "t + offset = 32n - {s}", "k": "t + offset = 32n - {s}", "do": "t = 32n + {s}", "q": "t = 32n + {s}"}

for _p in PATHS:
    for _s in (1, 2):
        _bug(
            _fallback_off(_p, _s),
            _CATCH[_p],
            _WHERE[_p].format(s=_s),
            f"FLAMIA MXFP8 whose diagonal fallback for {_GEMM[_p]} counts a 32-block as whole while the "
            f"row still misses {_s} of its positions",
            name=f"fallback_{_p}_off{_s}",
        )

# ---------------------------------------------------------------------------------------------
# top-left causal alignment for one sign of Lk - Lq only
# ---------------------------------------------------------------------------------------------

_VISIBLE = E.visible


def _top_left_when(longer: str):
    def visible(lq: int, lk: int, causal: bool, device=None) -> torch.Tensor:
        if causal and ((lq > lk) if longer == "q" else (lq < lk)):
            return torch.arange(lk, device=device)[None, :] <= torch.arange(lq, device=device)[:, None]
        return _VISIBLE(lq, lk, causal, device)

    return _within(lambda: E.overriding(visible=visible))


_bug(
    _top_left_when("q"),
    ("causal.forward", "causal.diagonal"),
    "Lq > Lk",
    "FLAMIA MXFP8 with the causal mask aligned top-left (j <= i) when Lq > Lk: queries see future keys",
    name="top_left_if_lq_gt_lk",
)
_bug(
    _top_left_when("k"),
    ("causal.diagonal",),
    "Lq < Lk",
    "FLAMIA MXFP8 with the causal mask aligned top-left (j <= i) when Lq < Lk: queries miss their last Lk - Lq keys",
    name="top_left_if_lq_lt_lk",
)

# ---------------------------------------------------------------------------------------------
# one head_dim's code path without the fallback
# ---------------------------------------------------------------------------------------------


def _no_fallback_hd128(base):
    """A build: a dispatch by head_dim around the base, its head_dim-128 path the base's design without
    the diagonal fallback."""
    no_fallback = make_kernel(replace(base.design, name="no-fallback", diagonal_fallback=False))

    def body(fn, q, k, v, cq, ck, mq, mk, scale, causal):
        path = no_fallback if q.shape[-1] == 128 else fn
        return path(q, k, v, cq, ck, mq, mk, softmax_scale=scale, causal=causal)

    return around(base, body, name="no_fallback_hd128")


_bug(
    _no_fallback_hd128,
    ("causal.forward", "causal.dq", "causal.dk_dv"),
    "head_dim 128",
    "FLAMIA MXFP8 whose head_dim-128 code path has no diagonal fallback (every other head_dim has it)",
    name="no_fallback_hd128",
)

# ---------------------------------------------------------------------------------------------
# the backward's mask one position too far
# ---------------------------------------------------------------------------------------------


# the source-edit table's `mask.backward+1` (the emulation's backward with its visibility test edited:
# j <= i + offset + 1, one key too many; the forward is right): its claims are on that record

# ---------------------------------------------------------------------------------------------
# one causal offset per batch
# ---------------------------------------------------------------------------------------------


def _offset_from_max_seqlens(base):
    """A build: the base, torch SDPA per document (zoo/correct.py), given one causal offset for the batch."""

    def kernel(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, softmax_scale=None, causal=False):
        offset = max_seqlen_k - max_seqlen_q
        return sdpa_documents(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal, offset=offset)

    return kernel


_SDPA = "zoo.correct:sdpa_bf16"
_bug(
    _offset_from_max_seqlens,
    ("causal.forward", "causal.dq", "causal.dk_dv", "causal.diagonal"),
    "documents whose Lk - Lq is not max_seqlen_k - max_seqlen_q",
    "torch SDPA per document whose bottom-right offset is max_seqlen_k - max_seqlen_q for every document "
    "(a wrapper that assumes one key length per batch) instead of each document's Lk - Lq",
    name="offset_from_max_seqlens",
    base=_SDPA,
    recipe="bf16",
    source="Varlen wrapper reports where batch-level max sequence lengths were used in place of per-sequence "
    "lengths for the causal diagonal.",
)

RECORDS = KNOWN_BAD.register(*_records, origin=__file__)

#: every planted kernel of this file (and the table's mask.backward+1), by name
CAUSAL_BUGS: dict = {r.name: r.kernel(sdpa_bf16 if r.base == _SDPA else None) for r in RECORDS}
CAUSAL_BUGS["backward_mask_plus1"] = KNOWN_BAD.kernel("mask.backward+1")
globals().update(CAUSAL_BUGS)  # each kernel also by its name
