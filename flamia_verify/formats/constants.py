"""Every number of every low-precision format flamia-verify knows, written exactly.

Numbers only: no logic lives here. Each constant says its value (and encoding where it has one)
and where it comes from. Sources:

- [OFP8]   OCP 8-bit Floating Point Specification (OFP8), rev. 1.0 (2023): E4M3 and E5M2.
- [MX]     OCP Microscaling Formats (MX) Specification v1.0 (2023): block size 32, E8M0 scale,
           FP4 E2M1 element, the FLOOR scale rule (shared exponent = floor(log2 amax) - emax_elem).
- [PTX]    NVIDIA PTX ISA, `cvt` with `.ue8m0x2` / `.rp` (round toward +inf) and `.satfinite`:
           the RCEIL scale rule and saturating E4M3 conversion used by Blackwell hardware.
- [NVFP4]  NVIDIA NVFP4 (cuBLAS / TransformerEngine docs): E2M1 elements, 16-element blocks,
           UE4M3 block scale, fp32 per-tensor scale; s_global = amax / (448 * 6).
- [FORMATS] the project's collected facts on the formats and their known bug classes (table
           "Element formats"), summarized with their derivations in docs/formats.md.
"""

from __future__ import annotations

__all__ = [
    "E4M3_EXP_BITS",
    "E4M3_MAN_BITS",
    "E4M3_BIAS",
    "E4M3_MAX",
    "E4M3_MIN_NORMAL",
    "E4M3_MIN_SUBNORMAL",
    "E4M3_MAX_CODE",
    "E4M3_NAN_CODE",
    "E4M3_EMAX",
    "E5M2_EXP_BITS",
    "E5M2_MAN_BITS",
    "E5M2_BIAS",
    "E5M2_MAX",
    "E5M2_MIN_NORMAL",
    "E5M2_MIN_SUBNORMAL",
    "E5M2_MAX_CODE",
    "E5M2_INF_CODE",
    "E5M2_NAN_CODE",
    "E5M2_EMAX",
    "E2M1_EXP_BITS",
    "E2M1_MAN_BITS",
    "E2M1_BIAS",
    "E2M1_MAX",
    "E2M1_MIN_NORMAL",
    "E2M1_MIN_SUBNORMAL",
    "E2M1_MAX_CODE",
    "E2M1_EMAX",
    "E2M1_MAGNITUDES",
    "E8M0_BIAS",
    "E8M0_MIN_BYTE",
    "E8M0_MAX_BYTE",
    "E8M0_NAN_BYTE",
    "E8M0_MIN_EXPONENT",
    "E8M0_MAX_EXPONENT",
    "E8M0_MIN",
    "E8M0_MAX",
    "UE4M3_MAX",
    "UE4M3_MIN_SUBNORMAL",
    "MX_BLOCK_SIZE",
    "NVFP4_BLOCK_SIZE",
    "NVFP4_GLOBAL_DIVISOR",
    "FP32_MIN_NORMAL",
    "FP32_MAX",
]

# --- E4M3 ("fn": finite, NaN only) -- [OFP8] E4M3 column; [FORMATS] -------------------------------
E4M3_EXP_BITS = 4
E4M3_MAN_BITS = 3
E4M3_BIAS = 7
E4M3_MAX = float.fromhex("0x1.cp8")  # 448 = 1.75 * 2^8, code S.1111.110 = 0x7E
E4M3_MIN_NORMAL = float.fromhex("0x1p-6")  # 0.015625, code S.0001.000 = 0x08
E4M3_MIN_SUBNORMAL = float.fromhex("0x1p-9")  # 0.001953125, code S.0000.001 = 0x01
E4M3_EMAX = 8  # floor(log2 448); the OCP "emax_elem" of FP8 E4M3 [MX]
E4M3_MAX_CODE = 0x7E  # S.1111.110
E4M3_NAN_CODE = 0x7F  # S.1111.111, the only NaN pattern (with either sign); no Inf [OFP8]

# --- E5M2 (IEEE-like: Inf and NaN) -- [OFP8] E5M2 column; [FORMATS] --------------------------------
E5M2_EXP_BITS = 5
E5M2_MAN_BITS = 2
E5M2_BIAS = 15
E5M2_MAX = float.fromhex("0x1.cp15")  # 57344 = 1.75 * 2^15, code S.11110.11 = 0x7B
E5M2_MIN_NORMAL = float.fromhex("0x1p-14")  # code S.00001.00 = 0x04
E5M2_MIN_SUBNORMAL = float.fromhex("0x1p-16")  # code S.00000.01 = 0x01
E5M2_EMAX = 15  # floor(log2 57344); OCP "emax_elem" of FP8 E5M2 [MX]
E5M2_MAX_CODE = 0x7B  # S.11110.11
E5M2_INF_CODE = 0x7C  # S.11111.00 [OFP8]
E5M2_NAN_CODE = 0x7F  # S.11111.11; 0x7D and 0x7E are NaN too [OFP8]. torch writes 0x7F, ml_dtypes 0x7E.

# --- E2M1 (FP4; no Inf, no NaN) -- [MX] FP4 element type; [FORMATS] ---------------------------------
E2M1_EXP_BITS = 2
E2M1_MAN_BITS = 1
E2M1_BIAS = 1
E2M1_MAX = float.fromhex("0x1.8p2")  # 6 = 1.5 * 2^2, code S.11.1 = 0x7
E2M1_MIN_NORMAL = float.fromhex("0x1p0")  # 1.0, code S.01.0 = 0x2
E2M1_MIN_SUBNORMAL = float.fromhex("0x1p-1")  # 0.5, code S.00.1 = 0x1
E2M1_EMAX = 2  # floor(log2 6); OCP "emax_elem" of FP4 E2M1 [MX]
E2M1_MAX_CODE = 0x7  # S.11.1; the sign is bit 3 of the 4-bit code
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # codes 0..7 [FORMATS]

# --- E8M0 (MX scale; unsigned, exponent only) -- [MX] scale data type E8M0; [FORMATS] ---------------
E8M0_BIAS = 127
E8M0_MIN_BYTE = 0  # 2^-127 = 0x1p-127: an fp32 SUBNORMAL (a `b << 23` decode gives 0: wrong)
E8M0_MAX_BYTE = 254  # 2^127
E8M0_NAN_BYTE = 0xFF  # the only NaN; E8M0 has no zero, no Inf, no sign
E8M0_MIN_EXPONENT = -127
E8M0_MAX_EXPONENT = 127
E8M0_MIN = float.fromhex("0x1p-127")
E8M0_MAX = float.fromhex("0x1p127")

# --- UE4M3 (NVFP4 block scale: E4M3 with the sign bit unused) -- [NVFP4]; [FORMATS] -----------------
UE4M3_MAX = E4M3_MAX  # 448, code 0x7E
UE4M3_MIN_SUBNORMAL = E4M3_MIN_SUBNORMAL  # 2^-9

# --- Block sizes and scale constants ----------------------------------------------------------------
MX_BLOCK_SIZE = 32  # k = 32 elements share one E8M0 scale in every concrete MX format [MX]
NVFP4_BLOCK_SIZE = 16  # 16 E2M1 elements share one UE4M3 scale [NVFP4]
NVFP4_GLOBAL_DIVISOR = E4M3_MAX * E2M1_MAX  # 2688 = 448 * 6, exact in fp32: s_global = amax / 2688 [NVFP4]

# --- IEEE binary32 limits used by the scale computations ------------------------------------------
FP32_MIN_NORMAL = float.fromhex("0x1p-126")
FP32_MAX = float.fromhex("0x1.fffffep127")
