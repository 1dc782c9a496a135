"""How one GEMM operand is rounded before its GEMM: :class:`Quant`, the per-operand spec of a design.

An :class:`~flamia_verify.kernels.emulation.EmulatedDesign` holds one :class:`Quant` for each
:class:`~flamia_verify.recipes.operands.Operand`; the emulation rounds by it and the fused kernels'
switches (``kernels.triton.config``) are derived from it. This module imports no tensor library.
"""

from __future__ import annotations

from dataclasses import dataclass

from flamia_verify.formats import ScaleRule
from flamia_verify.kernels.modes import QuantKind

__all__ = ["Quant"]


@dataclass(frozen=True)
class Quant:
    """How one GEMM operand is rounded before the GEMM.

    kind (:class:`~flamia_verify.kernels.modes.QuantKind`; a string of one is taken as it):
      ``input``  round to the kernel's input dtype (BF16 or FP16; identity for fp32 inputs)
      ``mx``     E4M3 elements with a power-of-two (E8M0) scale per ``block`` elements along the
                 contraction axis (``block=0``: one scale for the whole axis, i.e. per row)
      ``nvfp4``  E2M1 elements, 16-blocks, UE4M3 block scale, fp32 scale per row (row-local amax)
      ``tensor`` E4M3 with one fp32 scale amax/448 over the whole packed tensor (FlashAttention-3 style)
      ``e4m3``   plain saturating E4M3 cast without a scale
    """

    #: a QuantKind; other strings only in the mutant table's emulations ("mx-<variant>")
    kind: QuantKind | str
    block: int = 32
    rule: ScaleRule = ScaleRule.RCEIL

    def __post_init__(self) -> None:
        if self.kind in QuantKind.__members__.values():
            object.__setattr__(self, "kind", QuantKind(self.kind))

    def describe(self) -> str:
        if self.kind is QuantKind.MX:
            size = "row" if self.block == 0 else f"{self.block}-blocks"
            return f"E4M3, {size}, pow2 scale ({self.rule.name})"
        return _KIND_TEXT[QuantKind(self.kind)]


_KIND_TEXT = {
    QuantKind.INPUT: "input dtype",
    QuantKind.NVFP4: "NVFP4",
    QuantKind.TENSOR: "E4M3 per-tensor",
    QuantKind.E4M3: "E4M3 unscaled",
}
