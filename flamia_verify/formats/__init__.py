"""Low-precision number formats, bit-exact: E4M3, E5M2, E2M1, UE4M3, E8M0; MX, NVFP4, scaled FP8.

- ``constants``: every number of every format, exact, with its source.
- ``elements``: element formats, ``round_to_format`` (RNE, saturating or not), ``encode`` /
  ``decode``, E8M0 scale bytes.
- ``blocks``: block quantizers (``mx_quantize``, ``nvfp4_quantize``, ``fp8_*_quantize``) with
  document-aware block layouts (``cu_seqlens``).

Everything is computed with explicit float32/float64 arithmetic; torch's float8 casts and
ml_dtypes serve as independent oracles in the tests. docs/formats.md explains the choices.
"""

from __future__ import annotations

from flamia_verify.formats import constants
from flamia_verify.formats.blocks import (
    MXTensor,
    NVFP4Tensor,
    ScaleRule,
    block_layout,
    fp8_block_quantize,
    fp8_row_quantize,
    fp8_tensor_quantize,
    mx_fake_quantize,
    mx_quantize,
    mx_scale_exponent,
    nvfp4_fake_quantize,
    nvfp4_quantize,
)
from flamia_verify.formats.elements import (
    E2M1,
    E4M3,
    E5M2,
    ELEMENT_FORMATS,
    UE4M3,
    ElementFormat,
    decode,
    e8m0_decode,
    e8m0_exponent,
    e8m0_from_exponent,
    encode,
    round_to_format,
)

__all__ = [
    "constants",
    # elements
    "ElementFormat",
    "E4M3",
    "E5M2",
    "E2M1",
    "UE4M3",
    "ELEMENT_FORMATS",
    "round_to_format",
    "encode",
    "decode",
    "e8m0_decode",
    "e8m0_from_exponent",
    "e8m0_exponent",
    # blocks
    "ScaleRule",
    "MXTensor",
    "NVFP4Tensor",
    "block_layout",
    "mx_quantize",
    "mx_fake_quantize",
    "mx_scale_exponent",
    "nvfp4_quantize",
    "nvfp4_fake_quantize",
    "fp8_tensor_quantize",
    "fp8_row_quantize",
    "fp8_block_quantize",
]
