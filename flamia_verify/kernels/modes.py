"""The vocabularies of a design (:class:`~flamia_verify.kernels.emulation.EmulatedDesign`) as enums.

String enums: a member equals its value (``QuantKind.MX == "mx"``), so a design written with the
strings reads the same, and the values are what descriptions and reprs show. The emulation, the
designs and the fused configs compare members. This module lives outside the emulation so that a
mutant of the emulation (:mod:`flamia_verify.known_bad.edits`, which compiles the emulation's source
into a module of its own) shares these classes with the built-in designs.
"""

from __future__ import annotations

from enum import StrEnum

__all__ = ["QuantKind", "PMode", "Normalize", "SeqBlocks"]


class QuantKind(StrEnum):
    """How one GEMM operand is rounded: its element format and the granularity of its scale."""

    #: round to the kernel's input dtype (BF16 or FP16; identity for fp32 inputs)
    INPUT = "input"
    #: E4M3 elements with a power-of-two (E8M0) scale per block along the contraction axis
    MX = "mx"
    #: E2M1 elements, 16-blocks, UE4M3 block scale, fp32 scale per row (row-local amax)
    NVFP4 = "nvfp4"
    #: E4M3 with one fp32 scale amax/448 over the whole packed tensor (FlashAttention-3 style)
    TENSOR = "tensor"
    #: plain saturating E4M3 cast without a scale
    E4M3 = "e4m3"


class PMode(StrEnum):
    """How the forward forms the probabilities P."""

    #: FLAMIA: P quantized in blocks relative to the block's own power-of-two maximum
    POW2_BLOCKS = "pow2-blocks"
    #: FlashAttention: P = exp(S - m), then rounded by the design's P rounding
    FA = "fa"


class Normalize(StrEnum):
    """What the row sum l that normalizes O sums."""

    #: the rounded P that multiplied V
    QUANTIZED = "quantized"
    #: the unrounded P, in fp32
    FP32 = "fp32"


class SeqBlocks(StrEnum):
    """Where the sequence-direction blocks start."""

    #: at every document start (cu_seqlens)
    DOCUMENT = "document"
    #: at absolute positions of the packed batch (straddling documents)
    PACKED = "packed"
