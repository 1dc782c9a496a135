"""The coverage model: every dimension of a call (arguments, layouts, shapes, lengths, values) and
every invariance of attention, with the checks that exercise it.

Each row of :data:`MODEL` is one value of one input dimension and the checks of the standard suite
that make a kernel call with it; :func:`features` reads those values off a call, so the table is
measured, not only declared: :func:`observe` runs a suite with a recording harness and returns what
each check's calls exercised (tests/test_coverage_model.py holds the two together, and requires
every row to be exercised by at least one check of the standard suite). :data:`INVARIANCES` lists
the properties of attention the checks state, each with the checks that state it.

``flamia-verify list --coverage`` prints both tables; docs/checks.md shows them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flamia_verify.properties.call_options import OPTIONS
from flamia_verify.properties.cases import Case, Inputs
from flamia_verify.properties.engine import RunSpec, build_context, list_checks, run_one
from flamia_verify.recipes import Recipe

__all__ = ["Row", "MODEL", "INVARIANCES", "features", "observe", "BIG_PACK_TOKENS"]

#: the total token count of a call that counts as a realistic pack (tiles, splits and atomics engage)
BIG_PACK_TOKENS = 4096
#: fp16's largest finite value
FP16_MAX = torch.finfo(torch.float16).max


@dataclass(frozen=True)
class Row:
    dimension: str
    value: str
    meaning: str
    checks: tuple[str, ...]

    @property
    def feature(self) -> str:
        return f"{self.dimension}={self.value}"


_ARG = "interface.arguments"
_BASE = ("error.out", "bound.out", "determinism.repeat")
#: the checks that run the dimension cases (cases.dimension_cases) but the long document
_WIDE = ("error.out", "bound.out", "consistency.homogeneity")
#: the checks that run a document past 2048 keys (4096 in the standard suite on the CPU)
_LONG = ("error.out", "bound.out", "causal.forward", "causal.dq", "special.attention_sink")
#: the factor between two heads' RMS that counts as a magnitude spread between heads
HEAD_SPREAD_RATIO = 10.0

#: every value of every input dimension and the checks (standard suite) whose calls exercise it
MODEL: tuple[Row, ...] = (
    *(
        Row(opt.dimension, v.coverage, v.doc, v.checks or (_BASE if n == 0 else (_ARG,)))
        for opt in OPTIONS
        if opt.in_coverage
        for n, v in enumerate(opt.values)
    ),
    Row("softmax_scale", "other", "a scale other than the default", ("error.out", "bound.out", "bound.grad")),
    Row("softmax_scale", "zero", "softmax_scale=0.0 (uniform weights; not the default)", ("special.degenerate",)),
    Row(
        "softmax_scale",
        "negative",
        "a negative softmax_scale (on sign-flipped queries, scores spread past exp's range)",
        ("special.degenerate",),
    ),
    Row("dtype", "bf16", "bf16 inputs", _BASE),
    Row("dtype", "fp16", "fp16 inputs", (_ARG,)),
    Row("causal", "true", "causal, bottom-right aligned", _BASE + ("causal.forward",)),
    Row("causal", "false", "not causal", ("error.out", "bound.out", "isolation.layout", "bound.shapes")),
    *(
        Row("gqa_group", str(g), f"{g} query heads per kv head", checks)
        for g, checks in (
            (1, ("error.out", "bound.out")),
            (2, ("error.out", "isolation.neighbours")),
            (3, (_ARG, "isolation.heads", "bound.shapes", "isolation.nonfinite")),
            (4, ("error.out",)),
            (5, (_ARG, "bound.shapes")),
            (6, ("bound.shapes",)),
            (7, ("isolation.heads", "bound.shapes")),
            (8, ("bound.shapes",)),
        )
    ),
    Row("heads", "odd", "an odd number of query heads", (_ARG, "isolation.heads", "bound.shapes")),
    Row("heads", "over_8", "more than 8 query heads", ("bound.shapes",)),
    Row("heads", "over_16", "more than 16 query heads (heads split over launches)", ("bound.shapes",)),
    Row("heads_k", "odd_over_1", "an odd number of kv heads above one", ("bound.shapes",)),
    *(
        Row("headdim", str(d), f"head_dim {d}", checks)
        # 8, 24, 40, 72, 88, 100: not multiples of 16 (cases.RESIDUE_HEADDIMS; 40 and 72 in the quick suite)
        for d, checks in (
            (8, _WIDE),
            (24, _WIDE),
            (32, ("isolation.fuzz",)),
            (40, _WIDE),
            (64, _BASE),
            (72, _WIDE),
            (80, ("bound.shapes", _ARG)),
            (88, _WIDE),
            (96, ("bound.shapes",)),
            (100, _WIDE),
            (128, ("error.out", "causal.forward", "bound.shapes", _ARG)),
            (192, ("bound.shapes",)),
            (256, ("bound.shapes",)),
            (512, ("bound.shapes",)),
        )
    ),
    Row("documents", "1", "one document", ("error.out", "determinism.repeat")),
    Row("documents", "few", "2 to 9 documents", _BASE),
    Row("documents", "many", "10 to 23 documents", ("error.out",)),
    Row("decode", "yes", "one query per document against several keys (max_seqlen_q = 1)", (_ARG,)),
    Row(
        "decode",
        "long_keys",
        "decode against more than 64 keys, a key count not a multiple of 64 (split-KV decode paths, a partial "
        "last tile)",
        (_ARG,),
    ),
    Row(
        "key_split",
        "same_total_and_max",
        "cu_seqlens_k split differently from cu_seqlens_q with the same total and maximum (a kernel reading "
        "one for the other)",
        (_ARG,),
    ),
    Row("documents", "dozens", "24 documents or more", ("isolation.layout", "determinism.repeat")),
    Row("empty_document", "start", "an empty document first", ("isolation.layout",)),
    Row("empty_document", "middle", "an empty document between others", ("isolation.layout", _ARG, "error.out")),
    Row("empty_document", "end", "an empty document last", ("isolation.layout",)),
    Row("document_length", "1", "a document of one query", ("error.out", "isolation.layout")),
    Row(
        "document_length",
        "block_edge",
        "a length at 31/32/33, 63/64/65 or 127/128/129",
        ("error.out", "isolation.layout"),
    ),
    Row(
        "lengths",
        "lq<lk",
        "a document with more keys than queries",
        ("error.out", "isolation.offset", "isolation.layout"),
    ),
    Row("lengths", "lq>lk", "a document with more queries than keys", ("error.out", "special.short_documents")),
    Row(
        "long_document", "yes", "a document longer than 512 tokens (every tile)", ("determinism.repeat", "bound.shapes")
    ),
    Row(
        "long_document",
        "over_1024_rows",
        "a causal document of more than 1024 queries and keys (rows past per-row softmax fast paths)",
        ("bound.shapes",),
    ),
    Row(
        "long_document",
        "over_2048_keys",
        "a document with more than 2048 keys (split-K and long-row paths; values judged by error, bound, causal "
        "and special)",
        _LONG,
    ),
    Row("long_document", "over_4096_keys", "a document with more than 4096 keys (capped tile loops)", (_ARG,) + _LONG),
    Row(
        "tokens",
        "no_query",
        "a pack without a query (every query document empty; keys or none)",
        ("special.degenerate",),
    ),
    Row("tokens", ">=4096", f"a call of {BIG_PACK_TOKENS} tokens or more", ("isolation.layout", "determinism.repeat")),
    *(
        Row("distribution", d, f"{d} values", checks)
        for d, checks in (
            ("gaussian", _BASE),
            ("shifted", ("error.out", "bound.out")),
            ("heavy_tail", ("error.out", "bound.shapes")),
            ("outliers", ("error.out", "determinism.repeat")),
            ("sink", ("special.attention_sink",)),
            ("low_rank", ("error.out",)),
            ("peaked", ("error.out", "determinism.repeat")),
            ("late_max", _WIDE),
            ("late_sink", _WIDE + ("special.attention_sink",)),
            ("head_spread", _WIDE),
        )
    ),
    # the realistic families, calibrated on a trained model's attention inputs (cases.py)
    Row(
        "distribution",
        "rotary",
        "rotary values: q and k rotated by their position in the document, the high-frequency pairs carrying "
        "most of the norm (scores depend on the distance between query and key)",
        _WIDE,
    ),
    Row(
        "distribution",
        "massive",
        "massive-activation tokens: the first and a delimiter-like key of each document with two channels x100 in "
        "v (and k)",
        _WIDE,
    ),
    Row(
        "distribution",
        "heavy_do",
        "heavy-tailed dO: rows (tokens) of very different magnitudes, a few several times the median",
        _WIDE,
    ),
    Row(
        "distribution",
        "realistic",
        "realistic values: rotary q and k, v channels of unequal RMS, massive-activation tokens, heavy-tailed dO",
        _WIDE,
    ),
    Row(
        "values",
        "head_spread",
        f"one head's RMS {HEAD_SPREAD_RATIO:g}x another's in q, k, v or dO (a scale shared by the heads, or taken "
        "from another head, is off by that much)",
        ("error.out", "consistency.homogeneity"),
    ),
    Row("values", "nonfinite", "a NaN or Inf in q, k, v or dO", ("isolation.nonfinite", "isolation.nan", "causal.nan")),
    Row("values", "huge", "elements of 1e4 or more", ("isolation.neighbours", "special.magnitudes")),
    Row(
        "values",
        "fp16_range",
        f"fp16 inputs whose sum of v over a document's keys passes fp16's largest value ({FP16_MAX:g}): an fp16 "
        "accumulator overflows, the output does not",
        (_ARG,),
    ),
)

#: the invariances of attention the checks state, each with the checks that state it
INVARIANCES: tuple[Row, ...] = (
    Row(
        "invariance",
        "causality",
        "no output or gradient depends on a position it must not see",
        ("causal.forward", "causal.dq", "causal.dk_dv", "causal.nan", "causal.diagonal"),
    ),
    Row(
        "invariance",
        "document_isolation",
        "a document's results do not depend on other documents' values",
        ("isolation.neighbours", "isolation.nan"),
    ),
    Row(
        "invariance",
        "batch_layout",
        "nor on their order, number, lengths, offsets or max_seqlen",
        ("isolation.offset", "isolation.layout"),
    ),
    Row(
        "invariance", "head_independence", "a head's results do not depend on other heads' values", ("isolation.heads",)
    ),
    Row(
        "invariance",
        "head_permutation",
        "permuting heads (inside a group, or kv groups) permutes the results",
        ("isolation.heads",),
    ),
    Row(
        "invariance",
        "nonfinite_reach",
        "a NaN or Inf reaches exactly what depends on it",
        ("special.nonfinite",),
    ),
    Row(
        "invariance",
        "shift_invariance",
        "adding a constant to a row's scores changes nothing (sum of dK = 0)",
        ("consistency.shift_invariance",),
    ),
    Row(
        "invariance",
        "probability_conservation",
        "weights sum to one in the forward and the backward",
        ("consistency.conservation_forward", "consistency.conservation_backward"),
    ),
    Row(
        "invariance",
        "positive_homogeneity",
        "c V gives c O (c dQ, c dK, the same dV) and c dO gives c dQ, c dK, c dV for a power of two c, bitwise "
        "where the recipe's scales follow the data",
        ("consistency.homogeneity",),
    ),
    Row(
        "invariance",
        "forward_backward",
        "the backward differentiates the forward that ran",
        ("consistency.weights", "consistency.grad_forward_ratio"),
    ),
    Row(
        "invariance", "determinism", "repeated calls are bitwise equal, also at 4K-token packs", ("determinism.repeat",)
    ),
    Row(
        "invariance",
        "calling_convention",
        "equivalent calls (views, defaults, upper bounds) agree",
        ("interface.arguments",),
    ),
    Row(
        "invariance",
        "grad_mode",
        "a forward under no_grad or inference_mode is the training forward (within the bound), and which inputs "
        "require grad changes none of the gradients asked for",
        ("interface.arguments",),
    ),
    Row(
        "invariance",
        "sign_symmetry",
        "negating q and softmax_scale together is the same attention",
        ("interface.arguments",),
    ),
    Row(
        "invariance",
        "edited_output",
        "an in-place edit of the output before the backward is refused by autograd or changes no gradient",
        ("interface.arguments",),
    ),
    Row(
        "invariance",
        "autocast",
        "a forward inside torch.autocast gives the bits of the same call outside it (autocast rewrites the caller's "
        "ops, not the kernel's)",
        ("interface.arguments",),
    ),
    Row(
        "invariance",
        "default_dtype",
        "torch's default dtype changes no bit (a kernel's allocations name their dtype)",
        ("interface.arguments",),
    ),
    Row(
        "invariance",
        "call_independence",
        "another call between a forward and its backward changes no bit of its gradients",
        ("interface.arguments",),
    ),
    Row(
        "invariance",
        "higher_order",
        "with create_graph=True every gradient stays in the graph (differentiable, or a double backward refused "
        "in words)",
        ("interface.arguments",),
    ),
    Row(
        "invariance",
        "repeated_backward",
        "a second backward through one graph gives the gradients of the first (or is refused in words)",
        ("interface.arguments",),
    ),
    Row(
        "invariance",
        "upstream_strides",
        "the gradients depend on dO's values, not on its strides (a broadcast dO of stride 0)",
        ("interface.arguments",),
    ),
    Row("invariance", "returned_lse", "a returned log-sum-exp is that of the scores", ("interface.lse",)),
    Row("invariance", "inputs_unmodified", "the kernel never writes into its inputs", ("interface.inputs_unmodified",)),
    Row(
        "invariance",
        "process_state",
        "a call leaves the process as it found it (default dtype, grad mode, precision flags, threads, device, "
        "random generators' seeds)",
        ("interface.process_state",),
    ),
)


def _scale_value(inputs: Inputs) -> str:
    c = inputs.case
    if c.calls("scale_arg", "none"):
        return "none"
    if c.softmax_scale == 0:
        return "zero"
    if c.scale < 0:
        return "negative"
    return "default" if c.softmax_scale == c.headdim**-0.5 else "other"


def _document_value_sum(inputs: Inputs) -> float:
    """The largest |sum of v| over one document's keys (per head and channel): what an unnormalised
    accumulator holds for a row that weighs every key the same."""
    best, start = 0.0, 0
    v = torch.nan_to_num(inputs.v.double(), nan=0.0)
    for n in inputs.case.lens_k:
        if n:
            best = max(best, float(v[start : start + n].sum(0).abs().max()))
        start += n
    return best


def features(inputs: Inputs) -> set[str]:
    """The ``dimension=value`` features of one call (the rows of :data:`MODEL` it exercises)."""
    c = inputs.case
    lq, lk = c.lens_q, c.lens_k
    out = {
        f"{o.dimension}={o.coverage_value(c.call_option(o.key))}"
        for o in OPTIONS
        if o.in_coverage and o.key != "scale_arg"
    }
    out |= {
        f"softmax_scale={_scale_value(inputs)}",
        f"dtype={c.dtype}",
        f"causal={'true' if c.causal else 'false'}",
        f"gqa_group={c.heads // c.heads_k}",
        f"headdim={c.headdim}",
        f"distribution={c.distribution}",
    }
    if c.heads % 2:
        out.add("heads=odd")
    if c.heads > 8:
        out.add("heads=over_8")
    if c.heads > 16:
        out.add("heads=over_16")
    if c.heads_k > 1 and c.heads_k % 2:
        out.add("heads_k=odd_over_1")
    n = len(lq)
    out.add("documents=" + ("1" if n == 1 else "few" if n < 10 else "dozens" if n >= 24 else "many"))
    sizes = [a + b for a, b in zip(lq, lk)]
    if n > 1 and sizes[0] == 0:
        out.add("empty_document=start")
    if n > 1 and sizes[-1] == 0:
        out.add("empty_document=end")
    if any(s == 0 for s in sizes[1:-1]):
        out.add("empty_document=middle")
    if 1 in lq:
        out.add("document_length=1")
    if max(lq, default=0) == 1 and max(lk, default=0) > 1:
        out.add("decode=yes")
        if any(b > 64 and b % 64 for b in lk):
            out.add("decode=long_keys")
    if list(lq) != list(lk) and sum(lq) == sum(lk) and max(lq, default=0) == max(lk, default=0):
        out.add("key_split=same_total_and_max")
    if any(x % 32 in (31, 0, 1) and x > 1 for x in lq):
        out.add("document_length=block_edge")
    if any(a < b for a, b in zip(lq, lk)):
        out.add("lengths=lq<lk")
    if any(a > b for a, b in zip(lq, lk)):
        out.add("lengths=lq>lk")
    if max(list(lq) + list(lk) + [0]) > 512:
        out.add("long_document=yes")
    if c.causal and any(a > 1024 and b > 1024 for a, b in zip(lq, lk)):
        out.add("long_document=over_1024_rows")
    if max(lk, default=0) > 2048:
        out.add("long_document=over_2048_keys")
    if max(lk, default=0) > 4096:
        out.add("long_document=over_4096_keys")
    if c.total_q == 0:
        out.add("tokens=no_query")
    if c.total_q >= BIG_PACK_TOKENS:
        out.add("tokens=>=4096")
    tensors = [inputs.q, inputs.k, inputs.v, inputs.do]
    if any(t.numel() and not bool(torch.isfinite(t).all()) for t in tensors):
        out.add("values=nonfinite")
    if any(t.numel() and float(torch.nan_to_num(t.float(), nan=0.0).abs().max()) >= 1e4 for t in tensors):
        out.add("values=huge")
    if c.dtype == "fp16" and _document_value_sum(inputs) > FP16_MAX:
        out.add("values=fp16_range")
    if any(_head_spread(t) >= HEAD_SPREAD_RATIO for t in tensors):
        out.add("values=head_spread")
    return out


def _head_spread(x: torch.Tensor) -> float:
    """The largest ratio of two heads' RMS in a (tokens, heads, channels) tensor (1 for one head, NaN
    and Inf ignored; 0 when every head is zero)."""
    if x.dim() != 3 or x.shape[1] < 2 or not x.numel():
        return 1.0
    rms = torch.nan_to_num(x.double(), nan=0.0, posinf=0.0, neginf=0.0).pow(2).mean(dim=(0, 2)).sqrt()
    top, low = float(rms.max()), float(rms.min())
    return 0.0 if top == 0 else (float("inf") if low == 0 else top / low)


def observe(
    kernel, *, suite: str = "standard", seed: int = 0, recipe: str | Recipe | None = None
) -> dict[str, set[str]]:
    """Run ``suite`` on ``kernel`` and return, for every check, the features of the kernel calls it
    judges: the calls it made, the cached runs of cases another check ran first (bound.out judges the
    runs error.out made of the same cases) and the runs behind a shared value (``ctx.memo``: the
    perturbed runs causal.forward makes and causal.dq reads)."""
    ctx = build_context(RunSpec.resolve(kernel, recipe=recipe, suite=suite, seed=seed))
    seen: dict[str, set[str]] = {}
    open_buckets: list[set[str]] = []  # the current check's, then one per shared value being computed
    behind: dict = {}  # memo key -> the features of the runs made to compute it
    run, memo = ctx.run, ctx.memo

    def record(found: set[str]) -> None:
        for b in open_buckets:
            b.update(found)

    def judged_run(what, **kw):
        if isinstance(what, Case):
            record(features(ctx.inputs(what)))
        return run(what, **kw)

    def judged_memo(key, compute):
        if key not in behind:
            open_buckets.append(set())
            try:
                value = memo(key, compute)
            finally:
                behind[key] = open_buckets.pop()
        else:
            value = memo(key, compute)
        record(behind[key])
        return value

    ctx.run, ctx.memo = judged_run, judged_memo  # type: ignore[method-assign]
    ctx.harness.recorder = lambda inputs: record(features(inputs))
    for spec in list_checks(suite):
        open_buckets[:] = [seen.setdefault(spec.name, set())]
        run_one(ctx, spec)
    return seen
