"""Hypothesis strategies for what training feeds an attention kernel.

In the style of ``hypothesis.extra.numpy``: keyword-only, typed arguments; an argument may be a value
or a strategy for one; bad arguments raise :class:`hypothesis.errors.InvalidArgument` naming the
value and the fix. Sizes default to what a CPU runs in a fraction of a second.

    document_lengths()   0, 1, 2, lengths at and around 31/32/33, 63/64/65, 127/128/129, or any
    packings()           (lens_q, lens_k): many tiny documents, one long one, mixed, empty ones,
                         seqlen_q != seqlen_k; with ``long_tokens``, rarely (1 draw in LONG_ODDS) one
                         document longer than ``max_tokens`` between short neighbours
    head_configs()       (heads, heads_k) with GQA / MQA ratios (1 < heads_k < heads included)
    call_options()       how the tensors are passed: strided views (fused QKV, transposed, offset),
                         softmax_scale=None for the default scale, max_seqlen above the maxima
    value_distributions()  gaussian, shifted, heavy tails, outlier channels, sinks, low rank, peaked,
                         late row maxima and late sinks, heads 100x apart, and the realistic families
                         (rotary q and k, massive-activation tokens, heavy-tailed dO, all at once)
    attention_cases()    a complete :class:`~flamia_verify.properties.cases.Case`

Everything shrinks toward the simple end: shorter and fewer documents, no long document, Lq = Lk,
one head, the smallest headdim, Gaussian values, seed 0, contiguous tensors with the scale passed.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

from hypothesis import strategies as st
from hypothesis.errors import InvalidArgument
from hypothesis.strategies import SearchStrategy

from flamia_verify.properties.call_options import option
from flamia_verify.properties.cases import DISTRIBUTIONS, RESIDUE_HEADDIMS, Case
from flamia_verify.settings import DTYPES

__all__ = [
    "BOUNDARY_LENGTHS",
    "attention_cases",
    "call_options",
    "GQA_RATIOS",
    "HEADDIMS",
    "document_lengths",
    "head_configs",
    "packings",
    "value_distributions",
]

T = TypeVar("T")

#: lengths where tiles and 32-element scale blocks begin and end (and the degenerate 0, 1, 2)
BOUNDARY_LENGTHS = (0, 1, 2, 31, 32, 33, 63, 64, 65, 127, 128, 129)

#: query heads per kv head that the cases draw: the powers of two and the groups of real models
#: (12:4, 28:4, 14:2 and the like), which an index written for powers of two gets wrong
GQA_RATIOS = (1, 2, 3, 4, 5, 6, 7)

#: head_dims the cases draw: 80 and 96 are not multiples of 32 (an MX block straddles a row's end);
#: 8, 24, 40, 72, 88 and 100 not multiples of 16 either (a tensor core's k-step ends inside the row,
#: 8 and 24 are shorter than one MX block, 100 not a multiple of 8: cases.RESIDUE_HEADDIMS), after
#: the others so that shrinking still goes to 32
HEADDIMS = (32, 64, 80, 96, 128, 192, 256) + RESIDUE_HEADDIMS

#: one packing draw in LONG_ODDS holds a document longer than ``max_tokens`` (when ``long_tokens``
#: allows one): rare, so that most examples stay small and cheap
LONG_ODDS = 8

#: the most heads a case with a long document gets (its cost grows with heads x length^2)
LONG_MAX_HEADS = 2


def _strategy(value, name: str) -> SearchStrategy:
    if isinstance(value, SearchStrategy):
        return value
    return st.just(value)


def _check_int(name: str, value, *, minimum: int = 0) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidArgument(f"{name}={value!r} must be an int")
    if value < minimum:
        raise InvalidArgument(f"{name}={value!r} must be at least {minimum}")


def document_lengths(*, min_len: int = 0, max_len: int = 129, boundaries: bool = True) -> SearchStrategy[int]:
    """Document lengths in [min_len, max_len]; with ``boundaries``, half of the draws come from
    :data:`BOUNDARY_LENGTHS` (the lengths where block-scaled kernels break)."""
    _check_int("min_len", min_len)
    _check_int("max_len", max_len)
    if max_len < min_len:
        raise InvalidArgument(f"max_len={max_len} must be >= min_len={min_len}; swap them or raise max_len")
    anywhere = st.integers(min_len, max_len)
    if not boundaries:
        return anywhere
    special = [n for n in BOUNDARY_LENGTHS if min_len <= n <= max_len]
    if not special:
        return anywhere
    return st.one_of(st.sampled_from(special), anywhere)


def packings(
    *,
    min_docs: int = 1,
    max_docs: int = 8,
    max_tokens: int = 256,
    lengths: SearchStrategy[int] | None = None,
    unequal_kv: bool | SearchStrategy[bool] = st.booleans(),
    long_tokens: int = 0,
) -> SearchStrategy[tuple[tuple[int, ...], tuple[int, ...]]]:
    """``(lens_q, lens_k)`` with at most ``max_tokens`` query and key tokens in total.

    Shapes: a few documents of any length, many tiny documents (1-3 tokens), one long document.
    With ``unequal_kv`` each document's key length is drawn separately (seqlen_q != seqlen_k).
    With ``long_tokens`` > ``max_tokens``, one draw in :data:`LONG_ODDS` is instead a document of
    ``max_tokens + 1`` to ``long_tokens`` tokens with up to two short neighbours on each side (at
    most ``long_tokens`` + 2 x 33 tokens in all), where tiles and scale blocks past position 256
    and long causal offsets live.
    """
    _check_int("min_docs", min_docs, minimum=1)
    _check_int("max_docs", max_docs, minimum=1)
    _check_int("max_tokens", max_tokens, minimum=1)
    _check_int("long_tokens", long_tokens)
    if max_docs < min_docs:
        raise InvalidArgument(f"max_docs={max_docs} must be >= min_docs={min_docs}")
    lens = lengths if lengths is not None else document_lengths(max_len=min(129, max_tokens))
    if not isinstance(lens, SearchStrategy):
        raise InvalidArgument(f"lengths={lengths!r} must be a strategy for ints, e.g. document_lengths(max_len=64)")
    tiny = st.lists(st.integers(1, 3), min_size=max(min_docs, 1), max_size=max(max_docs, min_docs))
    mixed = st.lists(lens, min_size=min_docs, max_size=max_docs)
    long_one = st.integers(min(max_tokens, 64), max_tokens).map(lambda n: [n])
    shapes = st.one_of(mixed, tiny, long_one) if min_docs <= 1 else st.one_of(mixed, tiny)

    neighbours = st.lists(st.sampled_from((1, 2, 17, 32, 33)), max_size=2)
    with_long = long_tokens > max_tokens

    @st.composite
    def build(draw):
        # the long shape is the last value of the odds draw, so shrinking leaves it
        if with_long and draw(st.integers(0, LONG_ODDS - 1)) == LONG_ODDS - 1:
            before = draw(neighbours)[: (max_docs - 1) // 2]
            after = draw(neighbours)[: max_docs - 1 - len(before)]
            lq = before + [draw(st.integers(max_tokens + 1, long_tokens))] + after
            budget = long_tokens + 2 * 33
            if len(lq) < min_docs:
                lq = lq + [1] * (min_docs - len(lq))
        else:
            budget = max_tokens
            lq = draw(shapes)
            lq = _fit(lq, budget)
            if len(lq) < min_docs:
                lq = lq + [1] * (min_docs - len(lq))
                lq = _fit(lq, budget)
        if draw(_strategy(unequal_kv, "unequal_kv")):
            # short documents: 0 to 40 keys past the query length (at most 129, the boundary lengths'
            # range); long ones: 64 fewer to 40 more keys than queries (long keys, long causal offsets)
            lk = [draw(st.integers(n - 64, n + 40) if n > 129 else st.integers(0, min(129, n + 40))) for n in lq]
            lk = _fit(lk, budget)
        else:
            lk = list(lq)
        return tuple(lq), tuple(lk)

    return build()


def _fit(lens: list[int], max_tokens: int) -> list[int]:
    """Trim lengths from the end so that they sum to at most max_tokens."""
    out, total = [], 0
    for n in lens:
        n = min(n, max_tokens - total)
        out.append(n)
        total += n
    return out


def head_configs(*, max_heads: int = 4, ratios: Sequence[int] = (1, 2, 4)) -> SearchStrategy[tuple[int, int]]:
    """``(heads, heads_k)`` with heads = heads_k * ratio <= max_heads (ratio 1: MHA; > 1: GQA/MQA)."""
    _check_int("max_heads", max_heads, minimum=1)
    if not ratios or any(isinstance(r, bool) or not isinstance(r, int) or r < 1 for r in ratios):
        raise InvalidArgument(f"ratios={ratios!r} must be a non-empty sequence of positive ints, e.g. (1, 2, 4)")
    pairs = sorted({(hk * r, hk) for r in ratios for hk in range(1, max_heads + 1) if hk * r <= max_heads})
    if not pairs:
        raise InvalidArgument(f"no head configuration with max_heads={max_heads} and ratios={tuple(ratios)}")
    return st.sampled_from(pairs)


def call_options(*, default_scale: bool = True) -> SearchStrategy[tuple[tuple[str, object], ...]]:
    """How a case's tensors are handed over (``Case.call``): the layout, softmax_scale=None (only with
    ``default_scale``, when the case's scale is headdim^-0.5) and a max_seqlen above the maxima.
    Shrinks to contiguous tensors, the scale passed and the true maxima."""
    layouts = st.sampled_from(option("layout").names)
    scale_args = st.sampled_from(option("scale_arg").names) if default_scale else st.just("value")
    pads = st.sampled_from((0, 7, 1000))

    @st.composite
    def build(draw):
        opts = {"layout": draw(layouts), "scale_arg": draw(scale_args), "max_seqlen_pad": draw(pads)}
        return tuple((k, v) for k, v in opts.items() if v != option(k).default)

    return build()


def value_distributions(*, include: Sequence[str] | None = None) -> SearchStrategy[str]:
    """Names of value distributions (see :mod:`flamia_verify.properties.cases`)."""
    names = tuple(include) if include is not None else DISTRIBUTIONS
    unknown = [n for n in names if n not in DISTRIBUTIONS]
    if unknown or not names:
        raise InvalidArgument(f"unknown distribution(s) {unknown or names!r}; choose from {DISTRIBUTIONS}")
    return st.sampled_from(names)


def attention_cases(
    *,
    max_tokens: int = 256,
    long_tokens: int = 0,
    headdims: Sequence[int] = HEADDIMS,
    heads: SearchStrategy[tuple[int, int]] | tuple[int, int] | None = None,
    causal: bool | SearchStrategy[bool] = st.booleans(),
    dtype: str = "bf16",
    distributions: SearchStrategy[str] | str | None = None,
    packing: SearchStrategy | None = None,
    seeds: SearchStrategy[int] = st.integers(0, 2**20),
    scale_factors: SearchStrategy[float] | float = st.sampled_from((1.0, 0.5, 2.0)),
    calls: bool = True,
) -> SearchStrategy[Case]:
    """Complete cases: packing, heads, headdim, causal, dtype, distribution, seed and softmax_scale.

    ``long_tokens`` > ``max_tokens`` lets the default packing draw, rarely, a document longer than
    ``max_tokens`` (see :func:`packings`); such a case keeps at most :data:`LONG_MAX_HEADS` heads
    (GQA 2:1 included) so that it stays cheap. Head dims default to :data:`HEADDIMS`, head
    configurations to up to 8 query heads in groups of :data:`GQA_RATIOS`. With ``calls`` the case
    also draws how its tensors are passed (:func:`call_options`).

    ``softmax_scale`` is ``factor * headdim^-0.5`` with ``factor`` drawn from ``scale_factors``
    (default 1, 1/2 or 2; shrinking goes to 1, the conventional scale), so a kernel that ignores
    its softmax_scale argument meets a scale it does not expect.
    """
    _check_int("max_tokens", max_tokens, minimum=1)
    if not headdims or any(isinstance(d, bool) or not isinstance(d, int) or d < 1 for d in headdims):
        raise InvalidArgument(
            f"headdims={headdims!r} must be a non-empty sequence of positive ints, e.g. (32, 64, 128)"
        )
    if dtype not in DTYPES:
        raise InvalidArgument(f"dtype={dtype!r} is not one of {tuple(DTYPES)}")
    _check_int("long_tokens", long_tokens)
    pk = packing if packing is not None else packings(max_tokens=max_tokens, long_tokens=long_tokens)
    hs = _strategy(heads, "heads") if heads is not None else head_configs(max_heads=8, ratios=GQA_RATIOS)
    hs_long = _strategy(heads, "heads") if heads is not None else head_configs(max_heads=LONG_MAX_HEADS)
    ds = _strategy(distributions, "distributions") if distributions is not None else value_distributions()

    @st.composite
    def build(draw):
        lens_q, lens_k = draw(pk)
        h, hk = draw(hs_long if max(sum(lens_q), sum(lens_k)) > max_tokens else hs)
        headdim = draw(st.sampled_from(tuple(headdims)))
        factor = draw(_strategy(scale_factors, "scale_factors"))
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not factor > 0:
            raise InvalidArgument(f"scale_factors must give positive numbers, got {factor!r}")
        # a third of the cases pass their tensors another way than contiguous with the scale
        call = draw(st.one_of(st.just(()), st.just(()), call_options(default_scale=factor == 1.0))) if calls else ()
        return Case(
            lens_q,
            lens_k,
            heads=h,
            heads_k=hk,
            headdim=headdim,
            causal=draw(_strategy(causal, "causal")),
            distribution=draw(ds),
            seed=draw(seeds),
            dtype=dtype,
            softmax_scale=float(factor) * headdim**-0.5,
            call=call,
        )

    return build()
