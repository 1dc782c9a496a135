"""The built-in kernels as emulated designs (the specification the fused Triton kernels follow).

| kernel          | Q,K (head_dim) | P              | V, dO, K, Q (sequence)        | P^T, dS, dS^T          | fixes |
|-----------------|----------------|----------------|-------------------------------|------------------------|-------|
| bf16            | bf16           | bf16, fp32 l   | bf16                          | bf16                   | -     |
| fp8             | E4M3 per row   | pow2 128-block | E4M3 pow2 128-blocks/channel  | E4M3 pow2 128-blocks   | all   |
| fp8-mma         | as fp8, with S and O = PV on Hopper's E4M3 tensor cores (their accumulator modelled)  | all   |
| fp8-tensor      | E4M3 per tensor| E4M3, fp32 l   | E4M3 per tensor               | E4M3 (dS per row)      | none  |
| flamia-mxfp8    | MXFP8          | pow2 32-block  | MXFP8                         | MXFP8                  | all   |
| flamia-mxfp8-floor | as flamia-mxfp8 with the FLOOR scale rule on every MXFP8 operand                 | all   |
| flamia-nvfp4    | MXFP8          | pow2 32-block  | MXFP8                         | NVFP4 (row scale)      | all   |
| mxfp8-naive     | MXFP8          | MXFP8, fp32 l  | MXFP8 at packed positions     | MXFP8                  | none  |

Every power-of-two scale uses the RCEIL rule unless the row says otherwise; each description names the
rule from the design's operands (``{rule}`` in the text), so it cannot disagree with them. Each design
is written as one rounding for every operand and the operands that differ
(:meth:`~flamia_verify.kernels.emulation.EmulatedDesign.of`), keyed by :class:`Operand`.
"""

from __future__ import annotations

from dataclasses import replace

from flamia_verify.formats import ScaleRule
from flamia_verify.kernels.emulation import EmulatedDesign, Quant, with_rule
from flamia_verify.kernels.modes import Normalize, PMode, QuantKind, SeqBlocks
from flamia_verify.recipes import RECIPES, Gemm, Operand

__all__ = ["DESIGNS", "scale_rules"]


def scale_rules(design: EmulatedDesign) -> tuple[ScaleRule, ...]:
    """The scale rules of a design's power-of-two-scaled (``mx``) operands, in the order of :class:`Operand`."""
    found: list[ScaleRule] = []
    for quant in design.quants.values():
        if quant.kind is QuantKind.MX and quant.rule not in found:
            found.append(quant.rule)
    return tuple(found)


def _described(design: EmulatedDesign, text: str) -> EmulatedDesign:
    """`design` with the description `text`, its ``{rule}`` filled in from the design's own operands
    (so a variant made by `with_rule` cannot keep its parent's rule in its description)."""
    rules = "/".join(rule.name for rule in scale_rules(design))
    if "{rule}" in text and not rules:
        raise ValueError(f"{design.name}: the description names a scale rule but no operand has one")
    return replace(design, description=text.format(rule=rules))


_IN = Quant(QuantKind.INPUT)
_MX = Quant(QuantKind.MX, 32)
_ROW = Quant(QuantKind.MX, 0)  # one power-of-two scale per row (the whole head_dim)
_T128 = Quant(QuantKind.MX, 128)  # Hopper FP8 tile: one power-of-two scale per 128 positions (per channel)
_NV = Quant(QuantKind.NVFP4, 16)
_TENSOR = Quant(QuantKind.TENSOR)
_E4M3 = Quant(QuantKind.E4M3)

#: the operands contracted along head_dim (Q, K in S; dO, V in dP)
_HEAD_DIM = tuple(op for op in Operand if op.axis == "head_dim")
#: FLAMIA's probabilities: power-of-two P blocks, l summed over the P that multiplies V
_FLAMIA_P = dict(p_mode=PMode.POW2_BLOCKS, normalize=Normalize.QUANTIZED)
#: FlashAttention's: P = exp(S - m) rounded as the design says, l the fp32 sum of unrounded P
_FA_P = dict(p_mode=PMode.FA, normalize=Normalize.FP32)

BF16 = EmulatedDesign.of(
    "bf16",
    RECIPES["bf16"],
    _IN,
    **_FA_P,
    diagonal_fallback=False,
    description="FlashAttention-2 numerics: BF16/FP16 operands, P and dS rounded to the input dtype, fp32 accumulation",
)

FP8 = _described(
    EmulatedDesign.of("fp8", RECIPES["fp8"], _T128, {op: _ROW for op in _HEAD_DIM}, **_FLAMIA_P),
    "Hopper-native E4M3 with power-of-two scales ({rule}) per row (head_dim GEMMs) and per "
    "128-position tile (sequence GEMMs), restarted at document starts, diagonal tiles in the input "
    "precision",
)

FP8_MMA = _described(
    replace(FP8, name="fp8-mma", recipe=RECIPES["fp8-mma"], mma=frozenset({Gemm.S, Gemm.O})),
    "the fp8 design's roundings ({rule}) with S = QK^T (forward and recompute) and O = PV on Hopper's "
    "E4M3 tensor cores, which keep about 13 bits of each 32-long slice; the gradient GEMMs and the "
    "input-precision diagonal tiles in fp32",
)

FP8_TENSOR = _described(
    EmulatedDesign.of(
        "fp8-tensor",
        RECIPES["fp8"],
        _TENSOR,
        {Operand.P: _E4M3, Operand.PT: _E4M3, Operand.DS: _ROW, Operand.DST: _ROW},
        **_FA_P,
        diagonal_fallback=False,
    ),
    "FlashAttention-3-style per-tensor current scaling (amax/448 over the whole packed "
    "tensor); P cast to E4M3 unscaled, normalized by the fp32 row sum; dS with a power-of-two "
    "({rule}) scale per row",
)

_FLAMIA_MXFP8_TEXT = (
    "MXFP8 (E4M3, 32-blocks, E8M0 {rule}) on all six GEMMs with FLAMIA's causal-safe, "
    "document-safe scaling and a forward-consistent backward"
)
FLAMIA_MXFP8 = _described(EmulatedDesign.of("flamia-mxfp8", RECIPES["mxfp8"], _MX, **_FLAMIA_P), _FLAMIA_MXFP8_TEXT)

FLAMIA_MXFP8_FLOOR = _described(
    with_rule(FLAMIA_MXFP8, ScaleRule.FLOOR, "flamia-mxfp8-floor", RECIPES["mxfp8-floor"]), _FLAMIA_MXFP8_TEXT
)

FLAMIA_NVFP4 = _described(
    EmulatedDesign.of(
        "flamia-nvfp4",
        RECIPES["nvfp4"],
        _MX,
        {Operand.PT: _NV, Operand.DS: _NV, Operand.DST: _NV},
        **_FLAMIA_P,
    ),
    "mixed NVFP4/FP8: the MXFP8 (E8M0 {rule}) forward, S recompute and dP; NVFP4 "
    "(row-local fp32 scale) for P^T, dS and dS^T in the dV, dQ, dK GEMMs",
)

MXFP8_NAIVE = _described(
    EmulatedDesign.of(
        "mxfp8-naive",
        RECIPES["mxfp8"],
        _MX,
        **_FA_P,
        seq_blocks=SeqBlocks.PACKED,
        diagonal_fallback=False,
        recompute_from_seq=True,
    ),
    "MXFP8 (E8M0 {rule}) without the fixes: sequence blocks at packed positions "
    "straddle the diagonal and documents, the fp32 row sum normalizes quantized P, the backward "
    "rebuilds S from other quantizations",
)

DESIGNS: dict[str, EmulatedDesign] = {
    d.name: d for d in (BF16, FP8, FP8_MMA, FP8_TENSOR, FLAMIA_MXFP8, FLAMIA_MXFP8_FLOOR, FLAMIA_NVFP4, MXFP8_NAIVE)
}
