"""The hypothesis search behind ``flamia-verify fuzz`` and the isolation.fuzz check, and the
evaluation of one example.

:func:`search` draws cases from :func:`flamia_verify.properties.strategies.attention_cases` (packings,
GQA ratios, head dims, value distributions) plus a target document, a position t and a
perturbation, and checks on every example, in this order:

    finite      out (and dQ, dK, dV) finite where the float64 reference is finite
    bound       every element within the recipe's rigorous a-priori bound
    causal      (causal cases) out and dQ of the target document at or before t bitwise unchanged when
                everything after t is replaced (huge / tiny; NaN only in q and dO, see causal.nan);
                then dK and dV of its keys at or after t + (Lk - Lq) bitwise unchanged when q and dO
                before t are replaced (huge / tiny; with NaN this half is not run: 0 * NaN in a masked
                product poisons correct kernels there)
    isolation   (2+ documents) the target document bitwise unchanged when every other document is
                replaced (huge / tiny / NaN)

A leak is usually outside the bound as well, and the bound is checked first; so an example that
fails finite or bound is also tested for causal and isolation (on its target document and on the
documents where the violations are), and is reported under the leak when there is one, with the
bound failure noted beside it (``detail["also_failed"]``). Shrinking keeps the kind of the first
failure (a leak stays a leak); after hypothesis's shrinking, empty documents the failure does not
need are dropped, and a leak's other documents too, and its document is shortened while it still
leaks (:func:`_shorten`).

A kernel that raises on a valid case breaks the calling convention ("crash"); so does one whose
output has no grad_fn on a case whose reference gradients are not all zero, when its backward works
elsewhere. On a case with nothing to differentiate (every reference gradient exactly 0, e.g. every
document empty) an output without grad_fn is accepted and its gradients read as 0. The first failing
example is shrunk by hypothesis to a minimal one; its reproducer is a JSON-able dict

    {"seed", "lens_q", "lens_k", "heads", "heads_k", "headdim", "causal", "dtype", "distribution",
     "softmax_scale", "overrides", "property", "document", "t", "perturbation", "recipe", "kernel"}

that :func:`flamia_verify.properties.fuzz.replay_case` (and ``flamia-verify fuzz --replay case.json``)
reruns deterministically.

This module sits below the check modules (isolation.fuzz runs :func:`search` on the running
check's context) and below :mod:`flamia_verify.properties.fuzz`, the fuzzing API, which builds the
context through the engine.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from hypothesis import HealthCheck, Phase, find, settings
from hypothesis import strategies as st
from hypothesis.errors import NoSuchExample

from flamia_verify.properties.bounds import bounds_of
from flamia_verify.properties.cases import Case, Inputs, make_inputs
from flamia_verify.properties.compare import compare_bitwise, compare_within
from flamia_verify.properties.harness import KernelCallError, KernelHungError, KernelOutputs, _NoBackward
from flamia_verify.properties.perturb import doc_bounds, future_inputs, perturb_rows, replace_others
from flamia_verify.properties.strategies import attention_cases
from flamia_verify.settings import dtype_name

__all__ = [
    "PROPERTIES",
    "MAX_TOKENS",
    "LONG_TOKENS",
    "Finding",
    "Search",
    "evaluate_example",
    "fuzz_sizes",
    "search",
    "traceback_of",
]

#: tokens of an ordinary example (queries and keys, all documents); a long document (rare) may hold
#: up to LONG_TOKENS
MAX_TOKENS = 256
LONG_TOKENS = 1024
#: the same on a GPU, where the fused kernels' tiles, splits and atomics engage only on longer rows
CUDA_MAX_TOKENS = 1024
CUDA_LONG_TOKENS = 8192


def fuzz_sizes(device: str) -> tuple[int, int]:
    """(max_tokens, long_tokens) of the examples on ``device``: CPU sizes, or the GPU's."""
    return (CUDA_MAX_TOKENS, CUDA_LONG_TOKENS) if str(device).startswith("cuda") else (MAX_TOKENS, LONG_TOKENS)


#: property -> the check name it is reported under
PROPERTIES = {
    "crash": "interface.fuzz",
    "finite": "special.fuzz",
    "bound": "bound.fuzz",
    "causal": "causal.fuzz",
    "isolation": "isolation.fuzz",
}
_KINDS = ("huge", "tiny", "nan")


@dataclass
class Finding:
    """One failing property of an example. ``document`` and ``perturbation``: the target document and
    the perturbation the finding was seen with, when they are not the example's own (an attributed
    failure, see :func:`_evaluate`); ``rows``: the token rows of ``detail["tensor"]`` that broke a
    finite or bound rule (where to look for a leak)."""

    prop: str
    message: str
    detail: dict
    document: int | None = None
    perturbation: str | None = None
    rows: tuple[int, ...] = ()

    def example(self, document: int, perturbation: str) -> tuple[int, str]:
        """(document, perturbation) of the example that reproduces this finding."""
        return (
            document if self.document is None else self.document,
            perturbation if self.perturbation is None else self.perturbation,
        )


#: properties whose failure may be the visible symptom of a leak: a failing example is also tested
#: for ATTRIBUTABLE_TO, and a leak found there names the failure
SYMPTOMS = ("finite", "bound")
ATTRIBUTABLE_TO = ("causal", "isolation")

#: documents tested for a leak behind a finite or bound failure: the example's target and the first
#: ones holding a violating row (each costs up to three kernel calls, spent only on failing examples)
ATTRIBUTION_DOCUMENTS = 3


def _call(ctx, inp: Inputs) -> tuple[KernelOutputs, bool]:
    """The kernel on ``inp``; (outputs, gradless): an output without grad_fn runs forward only."""
    try:
        return ctx.run(inp), False
    except _NoBackward:
        return ctx.run(inp, backward=False), True


def _zero_grads(res: KernelOutputs, inp: Inputs) -> KernelOutputs:
    """Gradients of an output that depends on nothing: zeros shaped like q, k, v."""
    res.dq, res.dk, res.dv = (torch.zeros_like(getattr(inp, n)) for n in ("q", "k", "v"))
    return res


def evaluate_example(
    ctx, case: Case, *, document: int, t: int, perturbation: str, only: str | None = None
) -> Finding | None:
    """Check one example; the failing property it is attributed to (see :func:`_evaluate`), or only
    ``only``. A kernel that raises, on the case or on one of its perturbed copies, is a "crash" finding,
    except on a pack without any query: no training run produces one, and refusing it with an exception
    is allowed (special.degenerate, robustness, asks it)."""
    try:
        return _evaluate(ctx, case, document=document, t=t, perturbation=perturbation, only=only)
    except KernelHungError as err:  # an earlier example's call hung: no call is made any more
        return Finding("crash", str(err), {"exception": "hung", "stage": "call"})
    except KernelCallError as err:
        if case.total_q == 0:
            return None
        return Finding(
            "crash",
            f"the kernel raised on a valid case: {err.summary}",
            {"exception": err.summary, "stage": err.where, "traceback": err.traceback},
        )


def traceback_of(finding: Finding | None) -> dict:
    """``{"traceback": ...}`` for a finding of a kernel that raised, else nothing."""
    trace = finding.detail.get("traceback") if finding is not None else None
    return {"traceback": trace} if trace else {}


def _bad_rows(mask: torch.Tensor | None) -> tuple[int, ...]:
    if mask is None:
        return ()
    return tuple(int(i) for i in mask.flatten(1).any(dim=1).nonzero().flatten().tolist())


def _documents_of(case: Case, tensor: str, rows: tuple[int, ...]) -> list[int]:
    """The documents holding ``rows`` of ``tensor`` (query rows for out and dq, key rows for dk and dv),
    in row order, each once."""
    lens = case.lens_q if tensor in ("out", "dq") else case.lens_k
    ends, total = [], 0
    for n in lens:
        total += n
        ends.append(total)
    docs: list[int] = []
    b = 0
    for r in rows:
        while b < len(ends) and r >= ends[b]:
            b += 1
        if b < len(ends) and b not in docs:
            docs.append(b)
    return docs


def _evaluate(ctx, case: Case, *, document: int, t: int, perturbation: str, only: str | None) -> Finding | None:
    """The properties in order: finite, bound, causal, isolation. The first causal or isolation failure
    is the finding. A finite or bound failure is a symptom that a leak shows too (a kernel that attends
    across documents, or ignores the causal flag, is outside the bound long before anything else), so
    the example is then also tested for causal and isolation failures, on its target document and on
    the documents where the violations are (with huge values as well when its perturbation is NaN,
    which the causal test puts only in q and dO); a leak found there names the failure, with the
    symptom recorded beside it (``detail["also_failed"]``). Without one, the finite or bound failure
    stands."""
    inp = make_inputs(case, ctx.device)
    res, gradless = _call(ctx, inp)
    ref = ctx.reference(inp)
    if gradless and ctx.has_backward:
        nonzero = [n for n in ("dq", "dk", "dv") if bool((getattr(ref, n) != 0).any())]
        if nonzero:
            return Finding(
                "crash",
                f"the output has no grad_fn on this case (its backward works on others): {', '.join(nonzero)} "
                "are lost where the reference's are not zero",
                {"stage": "backward", "exception": "no grad_fn", "lost": nonzero},
            )
        _zero_grads(res, inp)  # nothing to differentiate: the gradients are 0 and read as such

    def run(new_inp: Inputs) -> KernelOutputs:
        out, no_grad = _call(ctx, new_inp)
        return _zero_grads(out, new_inp) if no_grad and ctx.has_backward else out

    names = ("out", "dq", "dk", "dv") if ctx.has_backward else ("out",)
    symptom = None
    if only in (None, "finite"):
        symptom = _finite(res, ref, names)
    if symptom is None and only in (None, "bound"):
        symptom = _bound(ctx, case, inp, res, ref, names)
    if symptom is not None and only is not None:
        return symptom
    targets = [(document, perturbation)]
    if symptom is not None:
        rows_docs = _documents_of(case, symptom.detail.get("tensor", "out"), symptom.rows)
        targets += [(b, perturbation) for b in rows_docs if b != document][: ATTRIBUTION_DOCUMENTS - 1]
        if perturbation == "nan":
            targets += [(b, "huge") for b, _ in targets]
    for b, kind in targets:
        for prop in ATTRIBUTABLE_TO:
            if only not in (None, prop):
                continue
            test = _causal if prop == "causal" else _isolation
            leak = test(ctx, case, inp, res, run, document=b, t=t, perturbation=kind)
            if leak is None:
                continue
            if b != document:
                leak.document = b
            if kind != perturbation:
                leak.perturbation = kind
            if symptom is not None:
                leak.detail["also_failed"] = {symptom.prop: symptom.message}
                leak.message += (
                    f" (the example is {'outside the bound' if symptom.prop == 'bound' else 'non-finite'} "
                    f"too: {symptom.prop} fails on {symptom.detail.get('tensor', 'out')}, a consequence of the leak)"
                )
            return leak
    return symptom


def _finite(res: KernelOutputs, ref, names) -> Finding | None:
    for n in names:
        x, r = getattr(res, n), getattr(ref, n)
        if x is None:
            continue
        bad = ~torch.isfinite(x) & torch.isfinite(r.to(x.device))
        if bool(bad.any()):
            return Finding(
                "finite",
                f"{int(bad.sum())} non-finite {n} elements where the reference is finite",
                {"tensor": n, "nonfinite": int(bad.sum())},
                rows=_bad_rows(bad),
            )
    return None


def _bound(ctx, case: Case, inp: Inputs, res: KernelOutputs, ref, names) -> Finding | None:
    B = bounds_of(inp, ref, scale=case.scale, causal=case.causal, model=ctx.bound_model)
    for n in names:
        x = getattr(res, n)
        if x is None:
            continue
        m = compare_within(x, getattr(ref, n), getattr(B, n), what=f"|{n} - reference|", rule="within the bound")
        if not m.ok:
            return Finding("bound", m.summary(), {"tensor": n, "mismatch": m.to_dict()}, rows=_bad_rows(m.mask))
    return None


def _causal(ctx, case: Case, inp: Inputs, res: KernelOutputs, run, *, document: int, t: int, perturbation: str):
    """(causal cases) out and dQ of ``document`` at or before t unchanged when everything after t is
    replaced; then dK and dV of its keys at or after t + offset unchanged when q and dO before t are."""
    lq = case.lens_q[document] if document < len(case.lens_q) else 0
    if not case.causal or lq < 2:
        return None
    tt = min(t, lq - 2)
    tensors = ("q", "do") if perturbation == "nan" else ("q", "k", "v", "do")
    new = run(future_inputs(inp, document, tt, perturbation, seed=case.seed + 1, tensors=tensors))
    q0, q1, k0, k1 = doc_bounds(case, document)
    region = torch.zeros(res.out.shape[0], 1, 1, dtype=torch.bool, device=res.out.device)
    region[q0 : q0 + tt + 1] = True
    for n in ("out", "dq"):
        a, b_ = getattr(new, n), getattr(res, n)
        if a is None or b_ is None:
            continue
        m = compare_bitwise(a, b_, what=f"{n} at/before t={tt} of document {document}", region=region)
        if not m.ok:
            return Finding("causal", m.summary(), {"tensor": n, "t": tt, "mismatch": m.to_dict()})
    # dK, dV of keys j >= t + offset see only queries i >= t: replace q and dO before t
    td = min(max(t, 1), lq - 1)
    lo = k0 + max(0, td + (k1 - k0) - lq)
    if ctx.has_backward and perturbation != "nan" and lo < k1:
        g = torch.Generator().manual_seed(case.seed + 3)
        rows = slice(q0, q0 + td)
        new = run(
            inp.replace(q=perturb_rows(inp.q, rows, perturbation, g), do=perturb_rows(inp.do, rows, perturbation, g))
        )
        region = torch.zeros(res.dk.shape[0], 1, 1, dtype=torch.bool, device=res.dk.device)  # type: ignore[union-attr]
        region[lo:k1] = True
        for n in ("dk", "dv"):
            a, b_ = getattr(new, n), getattr(res, n)
            if a is None or b_ is None:
                continue
            m = compare_bitwise(
                a,
                b_,
                what=f"{n} at/after key {lo - k0} of document {document} (q, dO before t={td} replaced)",
                region=region,
            )
            if not m.ok:
                return Finding("causal", m.summary(), {"tensor": n, "t": td, "mismatch": m.to_dict()})
    return None


def _isolation(ctx, case: Case, inp: Inputs, res: KernelOutputs, run, *, document: int, t: int, perturbation: str):
    """(2+ documents) ``document`` bitwise unchanged when every other document is replaced."""
    lq = case.lens_q[document] if document < len(case.lens_q) else 0
    nonempty = [b for b, (a, c) in enumerate(zip(case.lens_q, case.lens_k)) if a or c]
    if len(nonempty) < 2 or lq == 0:
        return None
    new = run(replace_others(inp, document, perturbation, seed=case.seed + 2))
    q0, q1, k0, k1 = doc_bounds(case, document)
    for n in ("out", "dq", "dk", "dv"):
        a, b_ = getattr(new, n), getattr(res, n)
        if a is None or b_ is None:
            continue
        lo, hi = (q0, q1) if n in ("out", "dq") else (k0, k1)
        m = compare_bitwise(a[lo:hi], b_[lo:hi], what=f"{n} of document {document} (others: {perturbation})")
        if not m.ok:
            return Finding("isolation", m.summary(), {"tensor": n, "mismatch": m.to_dict()})
    return None


def _reproducer(
    case: Case, document: int, t: int, perturbation: str, finding: Finding, recipe: str, kernel: str
) -> dict:
    rep = case.to_dict()
    document, perturbation = finding.example(document, perturbation)
    rep.update(
        property=finding.prop,
        document=document,
        t=t,
        perturbation=perturbation,
        recipe=recipe,
        kernel=kernel,
        message=finding.message,
    )
    return rep


def _without_document(case: Case, b: int) -> Case:
    return case.with_(lens_q=case.lens_q[:b] + case.lens_q[b + 1 :], lens_k=case.lens_k[:b] + case.lens_k[b + 1 :])


@dataclass
class Search:
    """What one hypothesis search found.

    ``requested``: the examples asked for (hypothesis's ``max_examples``); ``generated``: examples
    drawn before the search stopped (at its first failure, or after ``requested``); ``shrinking``:
    examples drawn after the first failure to shrink it (hypothesis's shrinker, then the attempts to
    drop empty documents); ``examples`` = generated + shrinking, every example drawn; ``distinct``:
    of those, the ones run on the kernel (a repeated example is answered from its first run);
    ``counts``: per property, the distinct examples that failed it; ``attributed``: per symptom
    (finite, bound), the distinct examples that failed it too but were reported under the leak behind
    it; the minimal failing example (``finding`` with its ``reproducer``) or None;
    ``shrink_stopped``: the shrinking budget ran out.
    """

    examples: int
    counts: dict
    finding: Finding | None
    reproducer: dict | None
    shrink_stopped: bool = False
    distinct: int = 0
    cases: list = field(default_factory=list)
    requested: int = 0
    generated: int = 0
    shrinking: int = 0
    attributed: dict = field(default_factory=dict)

    def applicable(self, prop: str) -> int:
        """Of the distinct examples run, those ``prop`` is tested on: causal needs a causal case with
        a document of 2 or more queries, isolation two or more non-empty documents; the others run on
        every example."""
        if prop == "causal":
            return sum(c.causal and max(c.lens_q, default=0) >= 2 for c in self.cases)
        if prop == "isolation":
            return sum(sum(bool(a or b) for a, b in zip(c.lens_q, c.lens_k)) >= 2 for c in self.cases)
        return len(self.cases)

    def coverage(self, max_tokens: int = MAX_TOKENS) -> dict[str, int]:
        """How many evaluated examples reached each shape the strategies aim at."""
        cs = self.cases
        return {
            "long_document_examples": sum(max(c.lens_q + c.lens_k, default=0) > max_tokens for c in cs),
            "headdim_128_examples": sum(c.headdim == 128 for c in cs),
            "gqa_examples": sum(c.heads_k < c.heads for c in cs),
            "lq_ne_lk_examples": sum(c.lens_q != c.lens_k for c in cs),
            "causal_examples": sum(c.causal for c in cs),
        }

    def counts_text(self) -> str:
        """The numbers of the search in words, e.g. "30 examples asked for; 92 drawn: 12 until the first
        failure stopped the search and 80 while shrinking it; 61 distinct ones run on the kernel"."""
        text = f"{self.requested} examples asked for; {self.examples} drawn"
        if self.shrinking:
            text += (
                f": {self.generated} until the first failure stopped the search and {self.shrinking} while shrinking it"
            )
        return text + f"; {self.distinct} distinct ones run on the kernel"


def search(
    ctx,
    *,
    examples: int,
    seed: int,
    max_tokens: int = MAX_TOKENS,
    long_tokens: int = LONG_TOKENS,
    shrink_limit: int | None = None,
    on_example: Callable[[int], None] | None = None,
) -> Search:
    """Draw ``examples`` hypothesis examples (deterministic in ``seed``), evaluate each on ``ctx``'s
    kernel and shrink the first failure. ``shrink_limit`` bounds the kernel evaluations spent on
    shrinking (None: hypothesis's own limit); past it, the smallest failing example so far stands (the
    attempts to drop its empty documents, one evaluation each, come on top).

    Shrinking keeps the kind of the first failure (:func:`_keeps`): a smaller example that fails
    another property, such as a leak that shrinks into a mere bound violation, is counted but not
    taken. After hypothesis's shrinking, each empty document (no queries or no keys) is dropped in
    turn, kept out when the failure persists: hypothesis cannot remove one itself when the target
    document's index would move, nor once the shrinking budget is spent."""
    counts = {p: 0 for p in PROPERTIES}
    attributed = {p: 0 for p in SYMPTOMS}
    state: dict[str, Any] = {"n": 0, "distinct": 0, "failed": 0, "last": None, "stopped": False, "prop": None}
    cases: list[Case] = []  # the distinct examples' cases, in evaluation order
    seen: dict = {}  # example -> its finding (None: passed); a repeated example is not rerun

    strategy = st.tuples(
        attention_cases(max_tokens=max_tokens, long_tokens=long_tokens, dtype=dtype_name(ctx.dtype)),
        st.integers(0, 16),
        st.integers(0, 160),
        st.sampled_from(_KINDS),
    )

    def budget_spent() -> bool:
        return (
            shrink_limit is not None
            and bool(state["failed"])
            and state["distinct"] - state["failed_at"] >= shrink_limit
        )

    def evaluate(case: Case, document: int, t: int, kind: str, budgeted: bool = True) -> Finding | None | bool:
        """The finding of one example (None: it passes); False when the shrinking budget is spent (and
        ``budgeted``)."""
        key = (case, document, t, kind)
        state["n"] += 1
        if key in seen:  # a repeated draw: its answer is known, and it counts toward the progress
            if on_example is not None:
                on_example(state["n"])
            return seen[key]
        if budgeted and budget_spent():
            state["stopped"] = True
            return False  # shrinking budget spent: an unevaluated example is not known to fail
        state["distinct"] += 1
        cases.append(case)
        f = evaluate_example(ctx, case, document=document, t=t, perturbation=kind)
        if on_example is not None:
            on_example(state["n"])
        seen[key] = f
        if f is not None:
            counts[f.prop] += 1
            for symptom in f.detail.get("also_failed", {}):
                attributed[symptom] += 1
            if not state["failed"]:
                state["failed_at"] = state["distinct"]
                state["generated"] = state["n"]
                state["prop"] = f.prop
            state["failed"] += 1
        return f

    def unbudgeted(case: Case, document: int, t: int, kind: str) -> Finding | None | bool:
        return evaluate(case, document, t, kind, budgeted=False)

    def fails(example) -> bool:
        case, document, t, kind = example
        document = document % max(1, len(case.lens_q))
        f = evaluate(case, document, t, kind)
        if not f or not _keeps(state["prop"], f.prop):  # type: ignore[union-attr]  # f is a finding here
            return False
        state["last"] = (case, document, t, kind, f)
        return True

    cfg = settings(
        max_examples=examples,
        database=None,
        deadline=None,
        derandomize=False,
        suppress_health_check=list(HealthCheck),
        phases=(Phase.generate, Phase.shrink),
    )
    try:
        find(strategy, fails, settings=cfg, random=random.Random(seed))
    except NoSuchExample:
        pass
    reproducer, found = None, None
    if state["last"] is not None:
        case, document, t, kind, f = state["last"]
        document, kind = f.example(document, kind)
        # past the shrinking budget too: at most one evaluation per empty document (8 at most)
        case, document = _drop_empty_documents(case, document, t, kind, unbudgeted, f.prop)
        case, document = _shorten(case, document, t, kind, unbudgeted, f.prop)
        # hypothesis ends on the minimal example; rerun it to make sure it fails deterministically
        again = evaluate_example(ctx, case, document=document, t=t, perturbation=kind)
        if again is not None:
            f = again
        reproducer = _reproducer(case, document, t, kind, f, ctx.recipe.name, ctx.kernel_name)
        found = f
    generated = state.get("generated", state["n"])
    return Search(
        state["n"],
        counts,
        found,
        reproducer,
        state["stopped"],
        state["distinct"],
        cases,
        requested=examples,
        generated=generated,
        shrinking=state["n"] - generated,
        attributed=attributed,
    )


def _keeps(first: str, prop: str) -> bool:
    """Whether a smaller example failing ``prop`` reproduces a failure of ``first`` while shrinking: the
    same property; or a leak for a leak (causal for isolation and back: the smaller example is named
    by what it fails); or a leak for a finite or bound failure (the more specific finding). A leak
    never shrinks into a mere bound violation, nor anything into a crash or out of one."""
    return prop == first or (prop in ATTRIBUTABLE_TO and first in ATTRIBUTABLE_TO + SYMPTOMS)


def _still_fails(evaluate, case: Case, target: int, t: int, kind: str, prop: str) -> bool:
    """Whether the example (case, target, t, kind) still fails ``prop`` (or what :func:`_keeps` lets
    stand for it), seen on its own target with its own perturbation (``evaluate`` gives an example's
    finding)."""
    g = evaluate(case, target, t, kind)
    return bool(g) and _keeps(prop, g.prop) and g.example(target, kind) == (target, kind)


def _drop_documents(case: Case, document: int, t: int, kind: str, evaluate, prop: str, droppable):
    """(case, document) of the failing example (case, document, t, kind) with the documents
    ``droppable(case, b)`` allows removed where the failure does not need them: each is dropped in
    turn, last first, and stays out when the example still fails ``prop``. ``document``, the target,
    follows its document; a leak's own document is never dropped (the failure was seen there)."""
    b = len(case.lens_q) - 1
    while b >= 0:
        if len(case.lens_q) > 1 and droppable(case, b):
            if b != document:
                target = document - (b < document)
            elif prop in ATTRIBUTABLE_TO:  # the failure was seen on this document: it is needed
                b -= 1
                continue
            else:  # the target of a bound, finite or crash failure only matters for attribution
                target = min(b, len(case.lens_q) - 2)
            smaller = _without_document(case, b)
            if _still_fails(evaluate, smaller, target, t, kind, prop):
                case, document = smaller, target
        b -= 1
    return case, document


def _drop_empty_documents(case: Case, document: int, t: int, kind: str, evaluate, prop: str):
    """(case, document) of the failing example with every empty document (no queries or no keys) that
    the failure does not need removed (:func:`_drop_documents`)."""
    return _drop_documents(case, document, t, kind, evaluate, prop, lambda c, b: c.lens_q[b] == 0 or c.lens_k[b] == 0)


#: lengths tried for the failing document after hypothesis's shrinking, shortest first (see
#: :func:`_shorten`): the smallest packs, then the 32-block boundaries block-scaled kernels break at
SHORTER = (1, 2, 3, 4, 8, 16, 31, 32, 33, 63, 64)


def _shorten(case: Case, document: int, t: int, kind: str, evaluate, prop: str):
    """(case, document) of the failing example with the other documents dropped and the target
    document shortened, where the failure persists. Hypothesis shrinks within the shape an example was
    drawn in, and one of them, the single long document, starts at 64 tokens: a leak that two tokens
    show would stay a 64-token reproducer. A leak (causal, isolation) is tried without each other
    document, then its target at each length of :data:`SHORTER` below its own, shortest first, with
    the document's keys changed by as much (its Lk - Lq kept); the first that still fails ``prop``
    stands. Other findings are left as hypothesis shrank them. At most len(SHORTER) + 7 evaluations."""
    if prop not in ATTRIBUTABLE_TO:
        return case, document
    case, document = _drop_documents(case, document, t, kind, evaluate, prop, lambda c, b: True)
    lq, lk = case.lens_q[document], case.lens_k[document]
    for n in SHORTER:
        if n >= lq or lk + n - lq < 0:
            continue
        new_q = case.lens_q[:document] + (n,) + case.lens_q[document + 1 :]
        new_k = case.lens_k[:document] + (lk + n - lq,) + case.lens_k[document + 1 :]
        smaller = case.with_(lens_q=tuple(new_q), lens_k=tuple(new_k))
        if _still_fails(evaluate, smaller, document, t, kind, prop):
            return smaller, document
    return case, document
