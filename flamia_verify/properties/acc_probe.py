"""The accumulation probe: inputs on which every recipe's operands are exact and only the GEMM
accumulator decides O (``bound.accumulation``).

One document of 64 keys, one head, head_dim 64, not causal. Q = K = 0, so every score is 0 and the
weights are exactly 1/64 whatever a design rounds P to (FlashAttention's P = 2^0 = 1, FLAMIA's
power-of-two blocks, an unscaled E4M3 cast). Every channel c of V holds one cancelling pair
+448 / -448 in one 32-key slice (slice c mod 2, at a position that moves with c) and small positive
values m 2^-6, m in {1, 1.5, 1.75}, everywhere else. All of them are E4M3 values that stay exact
under every scaling the recipes admit: a block or tensor that holds the pair has amax 448, so the
scale is 1 under MX RCEIL and FLOOR, the fp8 design's per-row and per-128 scales and a per-tensor
fp32 scale amax / 448; a block without it has amax at most 1.75 * 2^-6 and a smaller power-of-two
scale, under which the small values are E4M3 values too (multiplied by a power of two).

O[c] is the sum of the small values over 64: the pair cancels exactly in an fp32 sum. An
accumulator that keeps fewer bits below the largest product of a slice than the small values need
loses them: the E4M3 tensor cores keep 13 bits below the largest product (2^-5 of the pair's 448),
so every small value in the pair's slice (below 2^-5) is cut to 0 and O[c] drops by about half. A
recipe that allows that accumulator (``fp8-mma``) allows the drop in its bound; every other recipe
promises fp32 sums, and its bound (exact operands: fp32 accumulation and the output's rounding)
does not. The same pattern in dO's columns (V = 0) probes dV = P^T dO, the backward's GEMM of the
same shape (site ``dv``).
"""

from __future__ import annotations

import torch

from flamia_verify.formats.constants import E4M3_MAX

__all__ = ["ACC_LEN", "ACC_DIM", "ACC_SCALE", "SITES", "accumulation_probe"]

ACC_LEN = 64
ACC_DIM = 64
ACC_SCALE = 0.125
BIG = E4M3_MAX
SMALL = (1.0, 1.5, 1.75)  # times 2^-6: E4M3 normals below 2^-5, the MMA's step at 448


#: the GEMM each probe site puts the pattern into, and the output it observes
SITES = {"pv": "out", "dv": "dv"}


def _pattern(seed: int) -> torch.Tensor:
    """(64, 64): small values m 2^-6 with one +448 / -448 pair per column inside one 32-row slice."""
    g = torch.Generator().manual_seed(seed)
    x = torch.tensor(SMALL)[torch.randint(0, len(SMALL), (ACC_LEN, ACC_DIM), generator=g)] * 2.0**-6
    for c in range(ACC_DIM):
        p = 32 * (c % 2) + (c * 7) % 31  # the pair at p, p + 1: inside one 32-long slice
        x[p, c], x[p + 1, c] = BIG, -BIG
    return x


def accumulation_probe(seed: int, site: str = "pv") -> dict[str, torch.Tensor]:
    """q, k, v, do (float32, (64, 1, 64)) of the probe at ``site``; small values drawn from ``seed``.

    ``pv``: the pattern in V's columns (along keys), observed in O = P V. ``dv``: the pattern in dO's
    columns (along queries) with V = 0, observed in dV = P^T dO: O = 0, so D = rowsum(dO * O) = 0,
    dP = 0 and dS = 0 exactly (dQ = dK = 0), and P^T is 1/64 everywhere, exact in every format of
    the recipes (an E4M3 normal, a power-of-two block, NVFP4's uniform block)."""
    if site not in SITES:
        raise ValueError(f"unknown accumulation probe site {site!r}; the sites are {', '.join(SITES)}")
    zeros = torch.zeros(ACC_LEN, 1, ACC_DIM)
    x = _pattern(seed)[:, None, :]
    if site == "pv":
        return {"q": zeros.clone(), "k": zeros.clone(), "v": x, "do": zeros.clone()}
    return {"q": zeros.clone(), "k": zeros.clone(), "v": zeros.clone(), "do": x}
