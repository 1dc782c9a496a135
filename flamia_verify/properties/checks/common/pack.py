"""The suite's many-document pack: dozens of documents (some empty, some with more keys than queries)
and one longer than every tile, packed from documents that each keep their own tensors wherever they
are packed. isolation.layout compares its layouts; determinism.repeat runs it twice; the kernel's
run-to-run noise (:mod:`flamia_verify.properties.checks.common.noise`) is seen on it.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from flamia_verify.properties.cases import Case, Inputs, cu_from_lens, make_inputs

__all__ = ["Doc", "GPU_LONG_FACTOR", "LAYOUT_HEADS", "layout_base_run", "layout_docs", "pack_docs"]


@dataclass(frozen=True)
class Doc:
    """One document of a pack: its own query and key lengths and its own seed (its tensors do not
    depend on where it is packed)."""

    lq: int
    lk: int
    seed: int


def pack_docs(ctx, docs: list[Doc], *, heads: int, heads_k: int, causal: bool, pad: int = 0) -> Inputs:
    """The documents packed in order (their tensors made one by one from their seeds)."""
    parts = []
    for d in docs:
        c = Case(
            (d.lq,),
            (d.lk,),
            heads=heads,
            heads_k=heads_k,
            headdim=ctx.settings.headdim,
            causal=causal,
            seed=d.seed,
            dtype=ctx.dtype_str,
        )
        parts.append(ctx.memo(("layout-doc", c), lambda c=c: make_inputs(c, ctx.device)))
    lens_q = tuple(d.lq for d in docs)
    lens_k = tuple(d.lk for d in docs)
    call = (("max_seqlen_pad", pad),) if pad else ()
    case = Case(
        lens_q,
        lens_k,
        heads=heads,
        heads_k=heads_k,
        headdim=ctx.settings.headdim,
        causal=causal,
        seed=docs[0].seed if docs else 0,
        dtype=ctx.dtype_str,
        call=call,
    )
    dev = ctx.device

    def cat(name):
        return torch.cat([getattr(p, name) for p in parts])

    return Inputs(case, cat("q"), cat("k"), cat("v"), cat("do"), cu_from_lens(lens_q, dev), cu_from_lens(lens_k, dev))


def layout_docs(ctx) -> list[Doc]:
    """The suite's pack: ``layout_docs`` documents of 0 to ``layout_max_len`` queries (some with more keys than
    queries), empty ones first, in the middle and last, and one of ``layout_long`` queries and keys
    (:data:`GPU_LONG_FACTOR` times that on a GPU)."""
    n, long_len = ctx.settings.layout_docs, ctx.settings.layout_long * _device_factor(ctx)
    rng = random.Random(ctx.seed * 7919 + 801)
    docs = [Doc(0, 0, 0)]
    for i in range(n):
        top = ctx.settings.layout_max_len
        choices = [n for n in (1, 2, 17, 31, 32, 33, 63, 64, 65, 96) if n <= top] + [rng.randint(3, top)]
        lq = rng.choice(choices)
        lk = lq + (rng.choice((0, 0, 3, 40)) if i % 3 else 0)
        docs.append(Doc(lq, lk, ctx.seed * 1000 + 800 + i))
        if i == n // 2:
            docs += [Doc(0, 0, 0), Doc(0, 5, ctx.seed * 1000 + 799), Doc(long_len, long_len, ctx.seed * 1000 + 798)]
    docs.append(Doc(0, 0, 0))
    return docs


#: on a GPU the pack's long document is this many times ``layout_long`` (standard: 6800 tokens, a pack
#: of about 14K): the fused kernels' splits and atomics engage on rows that long
GPU_LONG_FACTOR = 4


def _device_factor(ctx) -> int:
    return GPU_LONG_FACTOR if str(ctx.device).startswith("cuda") else 1


#: (heads, heads_k) of the many-document pack
LAYOUT_HEADS = (4, 2)


def layout_base_run(ctx, docs: list[Doc], causal: bool):
    """The kernel's run on the suite's pack (shared by isolation.layout and determinism.repeat)."""
    heads, heads_k = LAYOUT_HEADS
    return ctx.memo(
        ("layout-base", causal, tuple(docs)),
        lambda: ctx.run(pack_docs(ctx, docs, heads=heads, heads_k=heads_k, causal=causal)),
    )
