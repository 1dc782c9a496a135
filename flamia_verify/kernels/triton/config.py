"""Which fused kernel computes a design: its constexpr switches and tile sizes (no Triton needed).

An :class:`~flamia_verify.kernels.emulation.EmulatedDesign` names the rounding of every GEMM
operand; :func:`config_for` turns it into a :class:`FusedConfig`, keyed by
:class:`~flamia_verify.recipes.operands.Operand` like the design, whose (kind, block) pairs the
kernels in ``attention.py`` take as constexprs, and :func:`unsupported_reason` says why a design has no fused
kernel (the known-bad designs keep their deliberate bugs only in the emulation). Importing this
module does not import Triton, so the registry can decide dispatch anywhere.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import NamedTuple

from flamia_verify.formats import ScaleRule
from flamia_verify.kernels.emulation import EmulatedDesign
from flamia_verify.kernels.modes import Normalize, PMode, QuantKind, SeqBlocks
from flamia_verify.kernels.quant_spec import Quant
from flamia_verify.recipes.operands import Gemm, Operand

__all__ = [
    "FUSED_OPERANDS",
    "KIND_INPUT",
    "KIND_MX",
    "KIND_NVFP4",
    "FusedConfig",
    "OperandRounding",
    "TileConfig",
    "config_for",
    "head_dim_limit",
    "head_dim_supported",
    "tile_multiples",
    "tiles",
    "unsupported_reason",
]

# operand kinds, the constexpr values of quant.KIND_* (see emulation.Quant)
KIND_INPUT = 0  # round to the input dtype (bf16 / fp16)
KIND_MX = 1  # E4M3 elements, power-of-two (E8M0, RCEIL or FLOOR) scale per block
KIND_NVFP4 = 2  # E2M1 elements, 16-blocks, UE4M3 block scale, fp32 per-row scale

# the parts of a dK/dV launch, the constexpr values of backward.PART_*: both gradients in one program, or
# (when one program cannot hold two accumulators) dV alone, then dK alone
PART_BOTH = 0
PART_DV = 1  # dV only: no dP
PART_DK = 2  # dK only


# ----------------------------------------------------------------------------------------------
# design -> constexpr switches
# ----------------------------------------------------------------------------------------------


class OperandRounding(NamedTuple):
    """How the fused kernels round one GEMM operand: ``kind`` (``KIND_INPUT``, ``KIND_MX`` or
    ``KIND_NVFP4``, a constexpr of the kernels) and ``block`` (the block size along the contraction;
    0 along head_dim means 'the whole row', and 0 for an input-precision operand)."""

    kind: int
    block: int


#: the operands whose rounding the fused kernels take as switches: every one but P, which the
#: kernels form themselves (``FusedConfig.p_pow2``, ``FusedConfig.p_block``)
FUSED_OPERANDS: tuple[Operand, ...] = tuple(op for op in Operand if op is not Operand.P)
#: operands that the kernels round by one switch: Q and K in S, dO and V in dP
_SHARED: tuple[tuple[Operand, Operand], ...] = ((Operand.Q_HD, Operand.K_HD), (Operand.DO_HD, Operand.V_HD))


@dataclass(frozen=True)
class FusedConfig:
    """The constexpr switches of the fused kernels: each GEMM operand's rounding (``cfg[op]``, an
    :class:`OperandRounding`, for every operand of :data:`FUSED_OPERANDS`), how P is formed, the
    scale rule, the causal-safe split and the E4M3 tensor cores."""

    #: the rounding of every operand but P, keyed by :class:`Operand` (read it as ``cfg[op]``)
    roundings: Mapping[Operand, OperandRounding] = field(hash=False)
    p_pow2: bool  # FLAMIA power-of-two P blocks (else FlashAttention P = exp2(s - m), bf16-rounded)
    p_block: int
    rceil: bool
    fallback: bool
    #: S = QK^T (forward and recompute) and O = PV on the E4M3 tensor cores (``EmulatedDesign.mma``)
    mma8: bool = False

    def __post_init__(self) -> None:
        if set(self.roundings) != set(FUSED_OPERANDS):
            raise ValueError(
                f"a fused config rounds exactly {', '.join(op.name for op in FUSED_OPERANDS)}; "
                f"got {', '.join(op.name for op in self.roundings)}"
            )
        for a, b in _SHARED:
            if self.roundings[a] != self.roundings[b]:
                raise ValueError(f"the fused kernels round {a.name} and {b.name} by one switch: they must agree")
        frozen = {op: OperandRounding(*self.roundings[op]) for op in FUSED_OPERANDS}
        object.__setattr__(self, "roundings", MappingProxyType(frozen))

    def __getitem__(self, op: Operand) -> OperandRounding:
        """The (kind, block) of the GEMM operand ``op`` (P has none: see ``p_pow2``, ``p_block``)."""
        try:
            return self.roundings[op]
        except KeyError:
            raise KeyError(f"the fused kernels form {op.name} themselves: see p_pow2 and p_block") from None

    # NVFP4 operands need the amax of a whole row (their fp32 row scale) before any tile is
    # quantized: the kernel that rounds one sweeps its loop twice, amaxes first

    def two_pass_dkdv(self, part: int = PART_BOTH) -> bool:
        """Whether the dK/dV kernel's launch ``part`` (PART_BOTH, PART_DV, PART_DK) sweeps twice: an
        NVFP4 P^T (dV) or dS^T (dK)."""
        ops = {PART_BOTH: (Operand.PT, Operand.DST), PART_DV: (Operand.PT,), PART_DK: (Operand.DST,)}[part]
        return any(self[op].kind == KIND_NVFP4 for op in ops)

    def two_pass_dq(self) -> bool:
        """Whether the dQ kernel sweeps twice: an NVFP4 dS."""
        return self[Operand.DS].kind == KIND_NVFP4

    def seq_block(self, *ops: Operand) -> int:
        """The largest block size among the given sequence-axis operands (tiles are multiples of it)."""
        sizes = [self[o].block for o in ops if self[o].kind != KIND_INPUT]
        return max(sizes + [16])


def _where(op: Operand) -> str:
    """How the fused kernels round ``op``: along head_dim, as a sequence-blocked right operand, or as
    the computed left operand of a sequence GEMM."""
    if op.axis == "head_dim":
        return "head_dim"
    return "sequence" if op.side == "right" else "left"


def _kind(quant: Quant, where: str) -> OperandRounding:
    if quant.kind is QuantKind.INPUT:
        return OperandRounding(KIND_INPUT, 0)
    if quant.kind is QuantKind.MX:
        return OperandRounding(KIND_MX, quant.block)
    if quant.kind is QuantKind.NVFP4 and where == "left":
        return OperandRounding(KIND_NVFP4, quant.block)
    raise NotImplementedError(f"no fused rounding for {quant.describe()} as a {where} operand")


def head_dim_supported(head_dim: int, cfg: FusedConfig | None = None) -> bool:
    """The fused kernels take head_dim 32, 64, 128 or 256 (a power of two: tl.arange); with a design's
    ``cfg``, also whether its tiles fit the GPU at that head_dim (``head_dim_limit``)."""
    if not (32 <= head_dim <= 256 and not head_dim & (head_dim - 1)):
        return False
    return cfg is None or head_dim <= head_dim_limit(cfg)


def head_dim_limit(cfg: FusedConfig) -> int:
    """The largest head_dim whose dK/dV kernel fits an H200's shared memory (232 448 bytes per block).

    Query-axis blocks of 128 (``fp8``: P^T, dS^T, dO and Q in 128-blocks) need 128-query tiles in the
    dK/dV kernel. At head_dim 256 its one-launch form needed 262 144 bytes with one pipeline stage
    (measured on the H200, benchmarks/RESULTS.md, "head_dim 256"); the split launches that are now
    fp8's default have not been tried there. Such designs run head_dim 256 in the emulation.
    """
    return 128 if tile_multiples(cfg)["dkdv"][0] >= 128 else 256


def unsupported_reason(design: EmulatedDesign) -> str | None:
    """Why ``design`` has no fused kernel (None when it has one)."""
    if design.seq_blocks is not SeqBlocks.DOCUMENT:
        return "sequence blocks at packed positions (a deliberate bug of the emulated known-bad design)"
    if design.mma and design.mma != {Gemm.S, Gemm.O}:
        return "E4M3 tensor cores on other GEMMs than S and O = PV together"
    if design.mma and not (
        design.quant(Operand.Q_HD).kind is QuantKind.MX
        and design.quant(Operand.Q_HD).block == 0
        and design.p_mode is PMode.POW2_BLOCKS
        and design.quant(Operand.V_SEQ).kind is QuantKind.MX
        and design.quant(Operand.V_SEQ).block == design.quant(Operand.P).block
    ):
        return "E4M3 tensor cores need row-scaled Q, K and P and V blocks of one size (one scale per tile row)"
    if design.recompute_from_seq:
        return "backward rebuilds S from the sequence quantization (a deliberate bug)"
    if design.p_mode is PMode.POW2_BLOCKS and design.normalize is not Normalize.QUANTIZED:
        return "power-of-two P blocks normalized by an unrounded sum"
    if design.p_mode is PMode.FA and (
        design.quant(Operand.P).kind is not QuantKind.INPUT or design.normalize is not Normalize.FP32
    ):
        return "FlashAttention P rounded to something other than the input dtype"
    rules = {q.rule for q in _quants(design) if q.kind is QuantKind.MX}
    if len(rules) > 1:
        return "MX operands on different scale rules"
    blocks = {
        q.block
        for q in _quants(design) + (design.quant(Operand.P),)
        if q.kind in (QuantKind.MX, QuantKind.NVFP4) and q.block
    }
    if any(b & (b - 1) or b > 128 for b in blocks):
        return f"block sizes {sorted(blocks)}: the tiles take powers of two up to 128"
    try:
        config_for(design)
    except NotImplementedError as exc:
        return str(exc)
    return None


def _quants(d: EmulatedDesign):
    """The roundings of the operands that the fused kernels take as switches (every one but P)."""
    return tuple(d.quant(op) for op in FUSED_OPERANDS)


def config_for(design: EmulatedDesign) -> FusedConfig:
    """The constexpr switches that make the fused kernels compute ``design``."""
    rules = {q.rule for q in _quants(design) if q.kind is QuantKind.MX}
    return FusedConfig(
        {op: _kind(design.quant(op), _where(op)) for op in FUSED_OPERANDS},
        p_pow2=design.p_mode is PMode.POW2_BLOCKS,
        p_block=design.quant(Operand.P).block if design.p_mode is PMode.POW2_BLOCKS else 0,
        rceil=ScaleRule.FLOOR not in rules,
        fallback=design.diagonal_fallback,
        mma8=Gemm.S in design.mma,
    )


@dataclass(frozen=True)
class TileConfig:
    """Tile sizes and launch parameters of one kernel."""

    block_m: int
    block_n: int
    num_warps: int = 4
    num_stages: int = 2
    #: dK/dV only: two launches, dV then dK, each program holding one (block_n, head_dim) fp32
    #: accumulator instead of two (S and P are recomputed in both; the results are the same bits)
    split: bool = False


def tile_multiples(cfg: FusedConfig) -> dict[str, tuple[int, int]]:
    """What each kernel's (block_m, block_n) must be a multiple of: every block along that axis.

    fwd: M queries (any), N keys (P and V blocks); dkdv: M queries (P^T, dO, dS^T, Q blocks), N keys
    (P blocks); dq: M queries (any), N keys (P, dS, K blocks). 16 at the least (the MMA's K step).
    """
    p = cfg.p_block if cfg.p_pow2 else 16
    return {
        "fwd": (1, max(p, cfg.seq_block(Operand.V_SEQ))),
        "dkdv": (cfg.seq_block(Operand.PT, Operand.DO_SEQ, Operand.DST, Operand.Q_SEQ), p),
        "dq": (1, max(p, cfg.seq_block(Operand.DS, Operand.K_SEQ))),
    }


def tiles(cfg: FusedConfig, head_dim: int, *, interpret: bool) -> dict[str, TileConfig]:
    """Tile sizes of the forward, dK/dV and dQ kernels, multiples of ``tile_multiples``."""
    mult = tile_multiples(cfg)
    p, fwd_n, dkdv_m, dq_n = mult["dkdv"][1], mult["fwd"][1], mult["dkdv"][0], mult["dq"][1]
    if interpret:  # few, large tiles: the interpreter's cost is per operation
        return {
            "fwd": TileConfig(64, max(64, fwd_n)),
            "dkdv": TileConfig(max(64, dkdv_m), max(64, p)),
            "dq": TileConfig(64, max(64, dq_n)),
        }
    # H200 tile sweeps (benchmarks/RESULTS.md, "Tile sweep"): each choice below was the fastest
    # measured candidate of its kernel that matched the default's results; 128-wide sequence
    # blocks (fp8) need 128 x 128 tiles and fewer stages to fit shared memory, and their dK/dV
    # kernel runs in two launches (two 128 x 128 fp32 accumulators spilled 412 registers)
    if max(fwd_n, dkdv_m, dq_n) >= 128:
        return {
            "fwd": TileConfig(128, max(64, fwd_n), num_warps=8, num_stages=2),
            "dkdv": TileConfig(max(32, dkdv_m), 128, num_warps=8, num_stages=1, split=True),
            "dq": TileConfig(128, max(32, dq_n), num_warps=8, num_stages=1),
        }
    if cfg.p_pow2:  # 32-key P blocks (MX): the dQ sweep takes 64 keys per step
        return {
            "fwd": TileConfig(128, max(64, fwd_n), num_warps=8, num_stages=3),
            "dkdv": TileConfig(max(32, dkdv_m), max(128, p), num_warps=8, num_stages=3),
            "dq": TileConfig(128, max(64, dq_n), num_warps=8, num_stages=2),
        }
    return {
        "fwd": TileConfig(128, max(64, fwd_n), num_warps=8, num_stages=3),
        "dkdv": TileConfig(max(32, dkdv_m), 128, num_warps=8, num_stages=3),
        "dq": TileConfig(128, max(32, dq_n), num_warps=4, num_stages=3),
    }
