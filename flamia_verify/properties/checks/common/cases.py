"""The cases that checks of several families run: the bias family's cases on the MX-exact grid (bias.*,
bound.out, bound.grad; special takes their q and k) and the calling convention's packings
(interface.arguments, interface.lse, special.degenerate).
"""

from __future__ import annotations

from flamia_verify.properties.cases import Case

__all__ = ["GRID_QK", "argument_cases", "bias_cases"]


# ----------------------------------------------------------------------------------------------
# cases with q and k on the MX-exact E4M3 grid (bias, bound, special)
# ----------------------------------------------------------------------------------------------


#: q and k on the MX-exact grid: exact scores, so the bound is tight on P, V and dO
GRID_QK = (("grid_q", True), ("grid_k", True))


def bias_cases(ctx):
    """The cases of the bias family (see :mod:`flamia_verify.properties.checks.bias`), which bound.out
    and bound.grad judge too: q and k on the MX-exact grid, v and dO shifted, ``seeds`` seeds."""
    cases = []
    for s in range(max(1, ctx.settings.seeds)):
        o = 2000 + 100 * s
        cases += [
            ctx.case((64, 130, 62), heads=2, heads_k=1, distribution="shifted", overrides=GRID_QK, seed_offset=o),
            ctx.case((50, 1, 77), (64, 3, 40), distribution="shifted", overrides=GRID_QK, seed_offset=o + 1),
            ctx.case((128, 96), causal=False, distribution="shifted", overrides=GRID_QK, seed_offset=o + 2),
            ctx.case((96,), distribution="shifted", overrides=(("scale_q", 4.0),) + GRID_QK, seed_offset=o + 3),
            # one long document (long_len keys, 512 in the quick suite): a row's running maximum
            # still rises after many key tiles, where an online softmax must keep rescaling; q x 2
            # spreads the scores so that a rise of the (integer, log2) block maximum is common
            ctx.case(
                (ctx.settings.long_len,),
                distribution="shifted",
                overrides=(("scale_q", 2.0),) + GRID_QK,
                seed_offset=o + 4,
            ),
        ]
    return cases


# ----------------------------------------------------------------------------------------------
# the calling convention's packings (interface.arguments, interface.lse, special.degenerate)
# ----------------------------------------------------------------------------------------------


def argument_cases(ctx) -> list[Case]:
    """Three packings: equal lengths with 6:2 GQA (group 3) and an empty document, head_dim 64 (q, k, v
    fused into one QKV buffer); Lq != Lk in both directions with 5:1 GQA, head_dim 128, whose key split
    differs from the query split while the totals (128) and the maxima (77) agree, so that a kernel
    reading cu_seqlens_q or max_seqlen_q for the keys goes wrong (q, k, v fused into one buffer);
    decode, one query per document against up to 4200 keys (max_seqlen_q = 1; key counts of one 64-key
    tile, of two and three tiles with a partial last one, and past 4096), 4:1 GQA, head_dim 80 (k, v
    fused into one KV buffer; softmax_scale=None must mean 80^-0.5 there too: judged by the bound, not
    bitwise). The first two are also called with softmax_scale=0.0 (uniform weights)."""
    return [
        ctx.case((37, 0, 64, 90), heads=6, heads_k=2, headdim=64, causal=True, seed_offset=601),
        ctx.case(
            (50, 1, 77),
            (77, 27, 24),
            heads=5,
            heads_k=1,
            headdim=128,
            causal=True,
            distribution="shifted",
            seed_offset=602,
        ),
        # decode: one query per document (max_seqlen_q = 1) against many keys, an empty document
        ctx.case((1, 1, 0, 1, 1), (64, 97, 5, 4200, 130), heads=4, heads_k=1, headdim=80, causal=True, seed_offset=603),
    ]
