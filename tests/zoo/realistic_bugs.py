"""Planted bugs that only show on realistic shapes: unequal query and key lengths per document, GQA
with 1 < heads_k < heads, rows of more than 256 keys, several key tiles, and a dS format one bit
coarser than the recipe claims. Each is the FLAMIA MXFP8 emulation with one change: one function
patched while it runs (forward and backward), in the style of ``zoo/targeted.py``, or, where the
source-edit table's operators already express it, a mutant (``flamia_verify.known_bad.edits``: source
edits in a module of its own).

Each is a record of the known-bad registry (tags ``zoo``, ``realistic``), and its kernel carries
``recipe``, ``catches`` (the checks of the quick suite that must report ``fail`` on it) and ``quiet``
(checks its bug cannot reach, which must pass). ``dst_e5m2`` is the source-edit table's
``format.dst_quant-e5m2`` (the same edits and operand rounding), held here to the checks it names.

    kv_blocks_at_cu_q       K and V sequence blocks laid out at cu_seqlens_q instead of
                            cu_seqlens_k (the key-side block starts read from the wrong array)
    do_blocks_at_cu_k       dO's and Q's sequence blocks laid out at cu_seqlens_k (the two arrays
                            swapped on the query side of the backward)
    gqa_repeat              kv heads expanded with ``repeat`` (k0 k1 k0 k1) instead of
                            ``repeat_interleave`` (k0 k0 k1 k1): equal when heads_k = 1
    long_row_tile_order     the key-tile partial sums of every GEMM that contracts over more than
                            256 positions are added in a random order on every call (split-K /
                            atomics style): bitwise repeatable on short rows only
    bwd_tile_normalized     the backward rebuilds P per 128-key tile against the tile's own maximum
                            and sum instead of the row's log-sum-exp (exact on rows of <= 128 keys)
    bwd_tile_normalized_64  the same with 64-key tiles
    skip_rescale_after_256  the forward's online softmax stops rescaling its accumulator and row sum
                            when the running maximum rises after key 256
    ds_e5m2                 claims MXFP8 but rounds dS (dQ = dS K) and dS^T (dK = dS^T Q) to E5M2
                            elements with MX (E8M0) block scales
    dst_e5m2                the same for dS^T only (the dK GEMM)
"""

from __future__ import annotations

import math

import torch

from flamia_verify.kernels import emulation as E
from flamia_verify.kernels.emulation import Quant
from flamia_verify.known_bad import KNOWN_BAD, KnownBad, patched_emulation
from flamia_verify.known_bad.edits import Edit, Mutant, SourceEdit
from flamia_verify.known_bad.table import VARIANT_KIND_EDITS
from flamia_verify.recipes.operands import Operand

__all__ = ["REALISTIC"]


#: the tags of this file's records
ZOO = ("zoo", "realistic")
_records: list[KnownBad] = []


def _bug(name: str, build, recipe: str, catches, quiet, why: str, family: str = "realistic") -> None:
    _records.append(KnownBad(name, family, why, build, recipe=recipe, catches=catches, quiet=quiet, tags=ZOO))


def _mutant(name: str, why: str, *edits: Edit, quants: dict | None = None, **design):
    """A build: the emulation with source edits, operand roundings (``quants``) and other design changes
    (flamia_verify.known_bad.edits): no patching."""
    changes = tuple((quants or {}).items()) + tuple(design.items())
    return SourceEdit(Mutant(f"zoo.{name}", "zoo", why, tuple(edits), changes))


def _per_pass(patch):
    return None if patch is None else (lambda info: patch(info.cu_q, info.cu_k))


def _patched_kernel(fwd_patch=None, bwd_patch=None):
    """A build: the base's design forward and backward, each run inside ``patch(cu_q, cu_k)`` (a context
    that plants a change in the emulation; ``None`` for that pass: unchanged)."""
    return lambda base: patched_emulation(base.design, forward=_per_pass(fwd_patch), backward=_per_pass(bwd_patch))


# ---------------------------------------------------------------------------------------------
# cu_seqlens_q and cu_seqlens_k confused (visible only where they differ)
# ---------------------------------------------------------------------------------------------

_SEQ_QUANTIZE = E.seq_quantize


def _as_offsets(cu: torch.Tensor, length: int) -> torch.Tensor:
    """The offsets of ``cu`` used on an axis of ``length``: clipped to it (block_layout puts the rest
    in one more segment), as a kernel that reads the wrong array would."""
    return cu.clamp_max(length)


def _swap_offsets(replace_k: bool):
    """The emulation's sequence quantizer with the key side (``replace_k``) or the query side reading
    the other cu_seqlens array."""

    def patch(cu_q, cu_k):
        def seq_quantize(x, quant, design, cu, dtype):
            if replace_k and cu is cu_k:
                cu = _as_offsets(cu_q, x.shape[0])
            elif not replace_k and cu is cu_q:
                cu = _as_offsets(cu_k, x.shape[0])
            return _SEQ_QUANTIZE(x, quant, design, cu, dtype)

        return E.overriding(seq_quantize=seq_quantize)

    return patch


_bug(
    "kv_blocks_at_cu_q",
    _patched_kernel(_swap_offsets(True), _swap_offsets(True)),
    "mxfp8",
    ("isolation.neighbours", "isolation.offset_bitwise"),
    ("causal", "determinism"),
    "FLAMIA MXFP8 whose K and V sequence blocks restart at cu_seqlens_q instead of cu_seqlens_k",
)

_bug(
    "do_blocks_at_cu_k",
    _patched_kernel(None, _swap_offsets(False)),
    "mxfp8",
    ("isolation.neighbours", "isolation.offset_bitwise"),
    ("causal.forward", "determinism", "error.out", "bound.out"),
    "FLAMIA MXFP8 whose backward lays out dO's and Q's sequence blocks at cu_seqlens_k",
)

# ---------------------------------------------------------------------------------------------
# GQA: kv heads expanded in the wrong order (equal when heads_k == 1)
# ---------------------------------------------------------------------------------------------


_bug(
    "gqa_repeat",
    _mutant(
        "gqa_repeat",
        "kv heads tiled with repeat in every GEMM",
        Edit("_expand_kv", "x.repeat_interleave(groups, dim=1)", "_mut.expand_repeat(x, groups)"),
    ),
    "mxfp8",
    ("error.out", "error.dq", "error.dk", "error.dv"),
    # isolation.heads is reached: a query head reads another group's kv head
    ("causal", "isolation.neighbours", "isolation.nan", "isolation.offset", "isolation.layout_bitwise", "determinism"),
    "FLAMIA MXFP8 that expands the kv heads with repeat (k0 k1 k0 k1) instead of repeat_interleave (k0 k0 k1 k1)",
)

# ---------------------------------------------------------------------------------------------
# summation order that changes from call to call on long rows only
# ---------------------------------------------------------------------------------------------

#: rows longer than this many keys (or queries) get their tile order shuffled
LONG_ROW = 256
#: the key tile whose partial products are summed as one unit
TILE = 64
_SHUFFLED = f"tile={TILE}, min_len={LONG_ROW}"

_bug(
    "long_row_tile_order",
    _mutant(
        "long_row_tile_order",
        "sequence GEMMs over > 256 positions sum 64-wide tiles in a random order",
        Edit("gemm_seq", "return gemm_q(a, b_q)", f"return _mut.shuffled_matmul(a, b_q, {_SHUFFLED})"),
        Edit(
            "gemm_seq",
            "return gemm_q(a_full, b_q) + gemm(a_part, b_hp)",
            f"return _mut.shuffled_matmul(a_full, b_q, {_SHUFFLED}) + _mut.shuffled_matmul(a_part, b_hp, {_SHUFFLED})",
        ),
    ),
    "mxfp8",
    ("determinism.repeat",),
    # isolation.layout compares two calls bitwise over a 300-token document: a random order is seen there too
    (
        "error",
        "causal",
        "isolation.neighbours",
        "isolation.nan",
        "isolation.offset",
        "isolation.heads",
        "consistency.conservation_forward",
    ),
    "FLAMIA MXFP8 whose GEMMs over more than 256 keys (or queries) add their 64-wide tile partial sums in "
    "a random order on every call",
)

# ---------------------------------------------------------------------------------------------
# backward probabilities normalized per key tile
# ---------------------------------------------------------------------------------------------

_RECOMPUTED = E.recomputed_probabilities


def _tile_normalized(tile: int):
    """The backward's weights, renormalized so that every ``tile``-key tile of a row sums to one (its
    own maximum and sum instead of the row's log-sum-exp). Rows of at most ``tile`` keys are left
    exactly as they are."""

    def recomputed(s2, vis, lse2, design):
        a = _RECOMPUTED(s2, vis, lse2, design)
        lk = a.shape[-1]
        if lk <= tile:
            return a
        out = a.clone()
        for s in range(0, lk, tile):
            part = a[..., s : s + tile]
            tot = part.sum(-1, keepdim=True)
            out[..., s : s + tile] = torch.where(tot > 0, part / torch.where(tot > 0, tot, torch.ones_like(tot)), part)
        return out

    def patch(cu_q, cu_k):
        return E.overriding(recomputed_probabilities=recomputed)

    return patch


_bug(
    "bwd_tile_normalized",
    _patched_kernel(None, _tile_normalized(128)),
    "mxfp8",
    ("consistency.weights",),
    ("causal", "isolation", "determinism", "error.out", "bound.out", "consistency.conservation_forward"),
    "FLAMIA MXFP8 whose backward rebuilds P per 128-key tile against the tile's own maximum and sum",
)

_bug(
    "bwd_tile_normalized_64",
    _patched_kernel(None, _tile_normalized(64)),
    "mxfp8",
    ("consistency.weights",),
    ("causal", "isolation", "determinism", "error.out", "bound.out", "consistency.conservation_forward"),
    "FLAMIA MXFP8 whose backward rebuilds P per 64-key tile against the tile's own maximum and sum",
)

# ---------------------------------------------------------------------------------------------
# online softmax that stops rescaling after 256 keys
# ---------------------------------------------------------------------------------------------

_PROBABILITIES = E.probabilities
#: the forward's key tile (its online-softmax step)
FWD_TILE = 64


def _stale_rescale_probabilities(s2, vis, design, start_k, dtype):
    """FLAMIA's probabilities as a tile loop that skips the online-softmax rescale after LONG_ROW keys:
    up to key LONG_ROW every tile's contribution is rescaled to the running maximum; after it, a
    tile's P stays relative to the running maximum at the time the tile ran, while the row's log-sum-
    exp takes the final maximum. Rows of at most LONG_ROW keys are exact."""
    p_used, l, m = _PROBABILITIES(s2, vis, design, start_k, dtype)
    lk = s2.shape[-1]
    if lk <= LONG_ROW or design.p_mode != "pow2-blocks":
        return p_used, l, m
    _, mb = E.pow2_block_elements(s2, design.quant(Operand.P).block)  # (H, Lq, nblk), -inf where masked
    ntiles = (lk + FWD_TILE - 1) // FWD_TILE
    per_tile = FWD_TILE // design.quant(Operand.P).block
    pad = ntiles * per_tile - mb.shape[-1]
    mt = torch.nn.functional.pad(mb, (0, pad), value=-math.inf).view(*mb.shape[:-1], ntiles, per_tile).amax(-1)
    running = torch.cummax(mt, dim=-1).values  # running maximum after each tile
    last_rescaled = LONG_ROW // FWD_TILE - 1
    ref = running.clone()
    ref[..., : last_rescaled + 1] = running[..., last_rescaled : last_rescaled + 1]
    tile_of_key = torch.arange(lk, device=s2.device) // FWD_TILE
    ref_k = ref[..., tile_of_key]  # (H, Lq, Lk)
    shift = torch.where(
        torch.isfinite(ref_k) & torch.isfinite(m)[..., None], m[..., None] - ref_k, torch.zeros_like(ref_k)
    )
    p_bug = p_used * torch.exp2(shift)
    return p_bug, p_bug.sum(-1), m


def _stale_rescale_patch(cu_q, cu_k):
    return E.overriding(probabilities=_stale_rescale_probabilities)


_bug(
    "skip_rescale_after_256",
    _patched_kernel(_stale_rescale_patch, None),
    "mxfp8",
    ("bound.out", "bound.grad", "bias.gain"),
    # not causal.dk_dv: on the long document (2080 keys) the huge queries before t overflow the stale
    # rescale to NaN rows, and the backward's 0 x NaN (masked weights times D of those rows) reaches
    # later keys' dK, as in any FlashAttention-style backward
    ("causal.forward", "causal.dq", "causal.nan", "causal.diagonal", "isolation", "determinism"),
    "FLAMIA MXFP8 whose forward stops rescaling its accumulator and row sum when the running maximum "
    "rises after key 256",
)

# ---------------------------------------------------------------------------------------------
# dS in E5M2 under an MXFP8 (E4M3) claim
# ---------------------------------------------------------------------------------------------

_E5M2 = Quant("mx-e5m2", 32)

_bug(
    "ds_e5m2",
    _mutant("ds_e5m2", "dS and dS^T in E5M2", *VARIANT_KIND_EDITS, quants={Operand.DS: _E5M2, Operand.DST: _E5M2}),
    "mxfp8",
    ("bound.grad",),
    ("causal", "isolation", "determinism", "error.out", "bound.out", "consistency.conservation_forward"),
    "claims MXFP8 but rounds dS (dQ = dS K) and dS^T (dK = dS^T Q) to E5M2 elements with E8M0 block scales",
)

# dst_e5m2 (dS^T only, in E5M2) is the source-edit table's format.dst_quant-e5m2: its claims are on
# that record (flamia_verify/known_bad/table.py)

RECORDS = KNOWN_BAD.register(*_records, origin=__file__)
_built = {r.name: r.kernel() for r in RECORDS}
_built["dst_e5m2"] = KNOWN_BAD.kernel("format.dst_quant-e5m2")

#: every planted kernel of this file, by name
REALISTIC = {
    name: _built[name]
    for name in (
        "kv_blocks_at_cu_q",
        "do_blocks_at_cu_k",
        "gqa_repeat",
        "long_row_tile_order",
        "bwd_tile_normalized",
        "bwd_tile_normalized_64",
        "skip_rescale_after_256",
        "ds_e5m2",
        "dst_e5m2",
    )
}
globals().update(REALISTIC)  # each kernel also by its name
