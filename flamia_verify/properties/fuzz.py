"""Property-based fuzzing of a kernel, and deterministic replay of what it finds.

``fuzz`` builds a run context through the engine and runs the hypothesis search of
:mod:`flamia_verify.properties.search`, the one the isolation.fuzz check runs: cases drawn from
:func:`flamia_verify.properties.strategies.attention_cases` plus a target document, a position t and
a perturbation, each checked for the properties finite, bound, causal and isolation (that module
gives their order and rules, the attribution of a bound failure to a leak, and the shrinking). It
reports one check per property (``PROPERTIES``); the minimal failing example's reproducer is a
JSON-able dict

    {"seed", "lens_q", "lens_k", "heads", "heads_k", "headdim", "causal", "dtype", "distribution",
     "softmax_scale", "overrides", "property", "document", "t", "perturbation", "recipe", "kernel"}

that ``replay_case`` (and ``flamia-verify fuzz --replay case.json``) reruns deterministically.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from flamia_verify.errors import ConfigError, FlamiaVerifyError
from flamia_verify.properties.cases import Case
from flamia_verify.properties.engine import ProgressEvent, RunSpec, build_context, environment
from flamia_verify.properties.harness import KernelCallError
from flamia_verify.properties.search import (
    PROPERTIES,
    Finding,
    Search,
    evaluate_example,
    fuzz_sizes,
    search,
    traceback_of,
)
from flamia_verify.recipes import Recipe
from flamia_verify.results import CheckResult, Report
from flamia_verify.settings import dtype_name, torch_threads

__all__ = ["FuzzResult", "fuzz", "fuzz_sizes", "replay_case", "search", "Search", "PROPERTIES"]

_CASE_FIELDS = set(Case.__dataclass_fields__)


@dataclass
class FuzzResult:
    """What a fuzzing run found.

    passed: no example failed. requested: the examples asked for (``fuzz(examples=...)``, the command's
    ``--examples``). examples: every example drawn, ``requested`` or fewer until the first failure
    plus ``shrinking``, those drawn while shrinking it (so it can exceed ``requested``). reproducer:
    the minimal failing example (JSON-able, see the module docstring) or None. report: a Report with
    one check per property (``causal.fuzz``, ...). message: one line for a person. counts: per
    property, the distinct examples that failed it.
    """

    passed: bool
    examples: int
    seed: int
    reproducer: dict | None
    report: Report
    message: str = ""
    seconds: float = 0.0
    counts: dict = field(default_factory=dict)
    requested: int = 0
    shrinking: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "passed": self.passed,
            "examples_requested": self.requested,
            "examples": self.examples,
            "examples_shrinking": self.shrinking,
            "seed": self.seed,
            "reproducer": self.reproducer,
            "message": self.message,
            "seconds": self.seconds,
            "counts": self.counts,
            "report": self.report.to_dict(),
        }


def fuzz(
    kernel,
    *,
    recipe: str | Recipe | None = None,
    examples: int = 100,
    seed: int = 0,
    device: str = "cpu",
    dtype: torch.dtype | str = torch.bfloat16,
    on_progress: Callable[[ProgressEvent], None] | None = None,
    max_tokens: int | None = None,
    long_tokens: int | None = None,
    forward_only: bool = False,
    case_timeout_s: float | None = None,
    threads: int | None = None,
) -> FuzzResult:
    """Fuzz ``kernel`` with ``examples`` hypothesis examples (deterministic in ``seed``).

    A kernel whose backward is missing or raises on the smallest case is fuzzed on its forward and
    the report fails ``interface.backward`` with the reason, unless it is declared ``forward_only``
    (then gradients are not checked and the report says so), as in ``check``.

    Examples hold at most ``max_tokens`` tokens; one packing in
    :data:`~flamia_verify.properties.strategies.LONG_ODDS` holds a document of up to ``long_tokens``
    (at most two heads); by default :func:`fuzz_sizes` of the device (256 and 1024 tokens on the
    CPU, 1024 and 8192 on a GPU). ``case_timeout_s`` bounds each kernel call as in ``check``: the
    example whose call runs past it is a crash finding, and the kernel is not called again. ``threads``
    as for :func:`~flamia_verify.properties.engine.run_checks`."""
    if isinstance(examples, bool) or not isinstance(examples, int) or examples < 1:
        raise ConfigError(f"examples must be a positive integer, got {examples!r}")
    spec = RunSpec.resolve(
        kernel,
        recipe=recipe,
        device=device,
        dtype=dtype,
        seed=seed,
        case_timeout_s=case_timeout_s,
        forward_only=forward_only,
        threads=threads,
    )
    with torch_threads(spec.threads):
        return _fuzz(spec, examples, on_progress, max_tokens, long_tokens)


def _fuzz(spec: RunSpec, examples: int, on_progress, max_tokens: int | None, long_tokens: int | None) -> FuzzResult:
    """The body of :func:`fuzz`, under its thread count."""
    loaded, device, dtype, seed = spec.kernel, spec.device, spec.dtype, spec.seed
    default_max, default_long = fuzz_sizes(device)
    max_tokens = default_max if max_tokens is None else max_tokens
    long_tokens = default_long if long_tokens is None else long_tokens
    ctx = build_context(spec)
    start = time.perf_counter()

    def on_example(n: int) -> None:
        if on_progress is not None:
            elapsed = time.perf_counter() - start
            frac = min(1.0, n / examples)
            on_progress(ProgressEvent("fuzz", 0, 1, frac, elapsed, elapsed / frac if frac > 0 else None, frac))

    try:
        res = search(
            ctx, examples=examples, seed=seed, max_tokens=max_tokens, long_tokens=long_tokens, on_example=on_example
        )
    except FlamiaVerifyError:
        raise
    found, reproducer, n, counts = res.finding, res.reproducer, res.examples, res.counts
    report = Report(
        kernel=loaded.name, recipe=spec.recipe.name, suite="fuzz", seed=seed, environment=environment(device, loaded.fn)
    )
    report.environment.update(
        dtype=dtype_name(dtype), backward=ctx.has_backward, examples_requested=examples, examples_drawn=n
    )
    numbers = res.counts_text()
    for prop, name in PROPERTIES.items():
        family = name.partition(".")[0]
        shrunk = found is not None and found.prop == prop
        if shrunk:
            message = found.message  # type: ignore[union-attr]  # shrunk: found is set
        elif counts[prop]:
            # the search shrinks only its first failure; this property failed on other examples too
            first = f", {'an' if found.prop[0] in 'aeiou' else 'a'} {found.prop} one" if found is not None else ""
            message = (
                f"{prop}: failed on {counts[prop]} of the {res.distinct} distinct examples run (not shrunk: the "
                f"search shrinks only its first failure{first}); {numbers}"
            )
        elif found is not None and res.attributed.get(prop):
            message = (
                f"{prop}: {'outside the bound' if prop == 'bound' else 'non-finite'} on {res.attributed[prop]} of "
                f"the failing examples, each reported under the leak behind it ({PROPERTIES[found.prop]}); no "
                f"example failed {prop} alone; {numbers}"
            )
        else:
            message = f"{prop}: no failure on {_tested(res, prop)}; {numbers}"
        report.checks.append(
            CheckResult(
                name=name,
                family=family,
                status="fail" if shrunk or counts[prop] or res.attributed.get(prop) else "pass",
                metrics={
                    "failing_examples": counts[prop] + res.attributed.get(prop, 0),
                    "tested_examples": res.applicable(prop),
                    "examples_requested": res.requested,
                    "examples_drawn": n,
                    "examples_shrinking": res.shrinking,
                    "distinct_examples": res.distinct,
                },
                thresholds={"failing_examples": 0},
                # the reproducer, and the full traceback of a crash (report.json only, not fuzz-case.json)
                worst_case={**reproducer, **traceback_of(found)} if shrunk else {},  # type: ignore[dict-item]
                message=message,
                duration_s=0.0,
            )
        )
    support = ctx.backward
    if not support.available:
        declared = support.declared
        report.checks.insert(
            0,
            CheckResult(
                name="interface.backward",
                family="interface",
                status="skip" if declared else "fail",
                metrics={"backward_available": 0},
                thresholds={},
                worst_case={}
                if declared
                else {"case": support.case.to_dict() if support.case else {}, "cause": support.cause},
                message=(
                    f"gradients were not checked: {support.reason}"
                    if declared
                    else f"{support.reason}; only the forward was fuzzed (declare a forward-only kernel with "
                    "--forward-only)"
                ),
            ),
        )
    seconds = time.perf_counter() - start
    msg = (
        f"{found.prop} failed; minimal case {reproducer['lens_q']} / {reproducer['lens_k']}: {found.message}"  # type: ignore[index]
        if found
        else f"no failure; {numbers}"
    )
    if not support.available and not support.declared:
        msg = f"the backward cannot run ({support.reason}); " + msg
    return FuzzResult(
        found is None and (support.available or support.declared),
        n,
        seed,
        reproducer,
        report,
        msg,
        seconds,
        counts,
        requested=examples,
        shrinking=res.shrinking,
    )


def _tested(res: Search, prop: str) -> str:
    """The examples ``prop`` was tested on, in words: "the 35 distinct examples run (12 of them causal
    ones with 2+ queries)"."""
    n = len(res.cases)
    text = f"the {n} distinct example{'s' if n != 1 else ''} run"
    kinds = {"causal": "causal ones with 2+ queries", "isolation": "with 2+ documents"}
    if prop in kinds:
        text += f" ({res.applicable(prop)} of them {kinds[prop]})"
    return text


def replay_case(kernel, case: dict, *, recipe: str | Recipe | None = None, device: str = "cpu") -> CheckResult:
    """Rerun one reproducer (a dict from :class:`FuzzResult` or a case.json) deterministically.

    The recipe is ``recipe``, else the reproducer's, else the kernel's own; the result's
    ``worst_case["recipe"]`` says which ran (and ``worst_case["kernel"]`` which kernel)."""
    if not isinstance(case, dict):
        raise ConfigError(f"a reproducer must be a JSON object, got {type(case).__name__}")
    if "lens_q" not in case and isinstance(case.get("case"), dict):  # a check's worst case, not a reproducer
        raise ConfigError(
            f"this is the worst case of a `flamia-verify check` run (case seed {case['case'].get('seed')!r}), "
            "not a fuzz reproducer: re-run it with the command its report prints (flamia-verify check ... "
            "--seed RUN_SEED --only FAMILY draws the same case again); Case.from_dict(worst_case['case']) "
            "and make_inputs rebuild its tensors"
        )
    prop = case.get("property", "bound")
    if prop not in PROPERTIES:
        raise ConfigError(f"unknown property {prop!r} in the reproducer; known: {', '.join(PROPERTIES)}")
    fields = {k: v for k, v in case.items() if k in _CASE_FIELDS}
    c = Case.from_dict(fields)
    if isinstance(c.seed, bool) or not isinstance(c.seed, int) or c.seed < 0:
        raise ConfigError(f"the reproducer's seed must be a non-negative integer, got {c.seed!r}")
    spec = RunSpec.resolve(kernel, recipe=recipe or case.get("recipe"), device=device, dtype=c.dtype, seed=c.seed)
    loaded, chosen = spec.kernel, spec.recipe
    ctx = build_context(spec)
    name = PROPERTIES[prop]
    t0 = time.perf_counter()
    document = int(case.get("document", 0))
    kw: dict[str, Any] = dict(
        document=document, t=int(case.get("t", 0)), perturbation=str(case.get("perturbation", "huge"))
    )
    try:
        f = evaluate_example(ctx, c, only=None if prop == "crash" else prop, **kw)
    except KernelCallError as err:
        f = Finding("crash", err.summary, {"traceback": err.traceback})
    status = "pass" if f is None else ("error" if f.prop == "crash" and prop != "crash" else "fail")
    return CheckResult(
        name=name,
        family=name.partition(".")[0],
        status=status,
        metrics={"failing_examples": 0 if f is None else 1},
        thresholds={"failing_examples": 0},
        worst_case={
            **case,
            "recipe": chosen.name,
            "kernel": loaded.name,
            "replayed": True,
            **({"detail": {k: v for k, v in f.detail.items() if k != "traceback"}} if f else {}),
            **traceback_of(f),
        },
        message=f"replayed {prop} on {c.describe()}: " + ("passes" if f is None else f.message),
        duration_s=time.perf_counter() - t0,
    )
