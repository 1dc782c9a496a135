"""Running a suite on every mutant: kill rate per family, false alarms on the correct designs.

A bug mutant is *killed* when the suite reports at least one check ``fail`` or ``error`` (a kernel
that crashes is caught too: ``crashed``, counted as killed and shown apart). A correct design must
pass every check; any failing check on it is a *false alarm*.

Every mutant in the table is shown to be observable (:func:`distinguishes`): on a fixed set of probe
calls its outputs, gradients or inputs differ from the original's, or two of its runs differ. So a
survivor is a bug the suite does not see, never a mutant that changes nothing.

Every mutant is a known-bad record (:class:`~flamia_verify.known_bad.KnownBad`, tag ``mutant``) of one
of two families, which run here alike: the source-edit table's (edits of the emulation's arithmetic)
and the wrapper family's (bugs of the code around a correct kernel); :func:`summarize` reports the
kill rate of each kind apart. A table entry (:class:`~flamia_verify.known_bad.edits.Mutant`) is taken
as its record.
"""

from __future__ import annotations

import concurrent.futures
import multiprocessing
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field

import torch

from flamia_verify.known_bad import KnownBad, base_kernel
from flamia_verify.known_bad.edits import Mutant
from flamia_verify.known_bad.table import record_of
from flamia_verify.mutation.report import kind_of
from flamia_verify.properties.cases import Case, make_inputs
from flamia_verify.properties.harness import same_bits

__all__ = [
    "AnyMutant",
    "MutantResult",
    "FAMILY_ORDER",
    "kernel_of",
    "run_mutant",
    "run_mutants",
    "distinguishes",
    "PROBES",
    "summarize",
]

#: a known-bad record, or an entry of the source-edit table (taken as its record)
AnyMutant = KnownBad | Mutant


def _record(mutant: AnyMutant) -> KnownBad:
    return record_of(mutant) if isinstance(mutant, Mutant) else mutant


def kernel_of(mutant: AnyMutant):
    """The mutant as a kernel in the varlen calling convention, built on its base."""
    return _record(mutant).kernel()


#: the probe calls: off-grid packed documents, Lq != Lk both ways, GQA 4:2 and 6:2 at head_dim 64
#: and 128, rows longer than 256 keys, causal and not
PROBES = (
    Case((37, 100, 20), heads=4, heads_k=2, headdim=64, causal=True, seed=1),
    Case((50, 20, 9), (30, 90, 9), heads=6, heads_k=2, headdim=128, causal=True, seed=2),
    Case((300,), heads=2, heads_k=1, headdim=64, causal=True, seed=3, distribution="shifted"),
    Case((33, 290), heads=4, heads_k=2, headdim=64, causal=False, seed=4, distribution="heavy_tail"),
)

#: magnitudes drawn as 2^U(-SPREAD, SPREAD): per token row (every block maximum and document
#: boundary then matters) and per element (wide exponent ranges inside a block: subnormals, inexact
#: fp32 sums)
SPREAD = 10.0


def _probe_inputs(case: Case, device: str):
    """The probe's three versions of one case: as sampled, with per-row and per-element magnitudes."""
    base = make_inputs(case, device)
    yield "", base
    g = torch.Generator().manual_seed(case.seed + 7919)
    for how in ("per-row", "per-element"):
        new = {}
        for name in ("q", "k", "v", "do"):
            x = getattr(base, name)
            shape = (x.shape[0], 1, 1) if how == "per-row" else x.shape
            mag = torch.exp2((torch.rand(shape, generator=g) * 2 - 1) * SPREAD)
            new[name] = (x.float().cpu() * mag).to(x.dtype).to(device)
        yield f" ({how} magnitudes)", base.replace(**new)


@dataclass
class MutantResult:
    name: str
    family: str
    correct: bool
    outcome: str  # bugs: "killed" | "crashed" | "survived"; correct designs: "passed" | "false-alarm"
    failing: list[str] = field(default_factory=list)  # checks that failed or errored
    seconds: float = 0.0
    why: str = ""

    def to_dict(self) -> dict:
        return asdict(self)


def _call(kernel, inp, *, backward: bool = True):
    q, k, v = (t.clone().requires_grad_(backward) for t in (inp.q, inp.k, inp.v))
    before = [t.detach().clone() for t in (q, k, v)]
    out = kernel(
        q, k, v, inp.cu_q, inp.cu_k, inp.max_q, inp.max_k, softmax_scale=inp.case.scale, causal=inp.case.causal
    )
    out = out[0] if isinstance(out, (tuple, list)) else out
    grads = torch.autograd.grad(out, (q, k, v), inp.do) if backward else ()
    inputs_changed = any(not torch.equal(a, b.detach()) for a, b in zip(before, (q, k, v)))
    return [out.detach()] + [g.detach() for g in grads], inputs_changed


def distinguishes(mutant: AnyMutant, device: str = "cpu") -> str | None:
    """How the mutant shows on the probe calls (a one-line description), or None if it never does.
    A wrapper mutant is probed on the wrapper family's own calls (:mod:`flamia_verify.known_bad.wrapper`)."""
    record = _record(mutant)
    if record.has("wrapper"):
        from flamia_verify.known_bad.wrapper import distinguishes as wrapper_distinguishes

        return wrapper_distinguishes(record, device)

    original = base_kernel(record.base)
    kernel = record.kernel(base_kernel(record.base))
    names = ("out", "dq", "dk", "dv")
    for case in PROBES:
        for how, inp in _probe_inputs(case, device):
            where = case.describe() + how
            try:
                mine, changed = _call(kernel, inp)
            except Exception as exc:  # a crash is a visible difference
                return f"raises {type(exc).__name__} on {where}"
            if changed:
                return f"modifies its inputs on {where}"
            ref, _ = _call(original, inp)
            for n, a, b in zip(names, mine, ref):
                if not same_bits(a, b):
                    return f"{n} differs on {where}"
            again, _ = _call(kernel, inp)
            for n, a, b in zip(names, mine, again):
                if not same_bits(a, b):
                    return f"{n} differs between two runs on {where}"
    return None


#: the order in which a bug's families run when the first failing family ends the run (cheap and
#: broad first; the causal and isolation perturbation sweeps last)
FAMILY_ORDER = ("interface", "error", "bound", "consistency", "bias", "special", "determinism", "isolation", "causal")


def run_mutant(
    mutant: AnyMutant, *, suite: str = "quick", seed: int = 0, device: str = "cpu", first_kill: bool = True
) -> MutantResult:
    """Run ``suite`` on one mutant and classify the outcome.

    A bug runs family by family (:data:`FAMILY_ORDER`) and stops at the first family with a failing
    check when ``first_kill`` (the usual economy of mutation testing: one failing check is a kill);
    ``failing`` then lists that family's failing checks. A correct design always runs every check.
    """
    from flamia_verify.errors import KernelCrashError
    from flamia_verify.properties import run_checks

    start = time.perf_counter()
    mutant = _record(mutant)
    kernel = kernel_of(mutant)
    groups = [list(FAMILY_ORDER)] if (mutant.correct or not first_kill) else [[f] for f in FAMILY_ORDER]
    failing: list[str] = []
    crashed = False
    for only in groups:
        try:
            report = run_checks(kernel, recipe=kernel.recipe, suite=suite, device=device, seed=seed, only=only)
        except KernelCrashError as exc:
            failing, crashed = [f"(kernel crashed: {str(exc).splitlines()[0][:120]})"], True
            break
        failing += [c.name for c in report.checks if c.status in ("fail", "error")]
        if failing:
            break
    if mutant.correct:
        outcome = "false-alarm" if failing else "passed"
    else:
        outcome = "crashed" if crashed else ("killed" if failing else "survived")
    return MutantResult(
        mutant.name, mutant.family, mutant.correct, outcome, failing, round(time.perf_counter() - start, 2), mutant.why
    )


def _worker(mutant: AnyMutant, suite: str, seed: int, device: str, first_kill: bool) -> MutantResult:
    torch.set_num_threads(1)
    return run_mutant(mutant, suite=suite, seed=seed, device=device, first_kill=first_kill)


def run_mutants(
    mutants: Iterable[AnyMutant],
    *,
    suite: str = "quick",
    seed: int = 0,
    device: str = "cpu",
    jobs: int = 1,
    on_result: Callable[[MutantResult], None] | None = None,
    first_kill: bool = True,
) -> list[MutantResult]:
    """Run ``suite`` on every mutant (``jobs`` processes; results in table order)."""
    mutants = list(mutants)
    results: dict[str, MutantResult] = {}
    if jobs <= 1:
        for m in mutants:
            r = run_mutant(m, suite=suite, seed=seed, device=device, first_kill=first_kill)
            results[m.name] = r
            if on_result:
                on_result(r)
    else:
        ctx = multiprocessing.get_context("spawn")
        with concurrent.futures.ProcessPoolExecutor(max_workers=jobs, mp_context=ctx) as pool:
            futures = {pool.submit(_worker, m, suite, seed, device, first_kill): m for m in mutants}
            for fut in concurrent.futures.as_completed(futures):
                r = fut.result()
                results[r.name] = r
                if on_result:
                    on_result(r)
    return [results[m.name] for m in mutants]


def summarize(results: list[MutantResult]) -> dict:
    """Kill rate overall, per kind (``arithmetic``, ``wrapper``) and per family; false alarms;
    survivors by name."""
    bugs = [r for r in results if not r.correct]
    correct = [r for r in results if r.correct]
    fams: dict[str, dict] = {}
    for r in bugs:
        f = fams.setdefault(r.family, {"mutants": 0, "killed": 0, "crashed": 0, "survived": []})
        f["mutants"] += 1
        if r.outcome in ("killed", "crashed"):
            f["killed"] += 1
        if r.outcome == "crashed":
            f["crashed"] += 1
        if r.outcome == "survived":
            f["survived"].append(r.name)
    for f in fams.values():
        f["kill_rate"] = f["killed"] / f["mutants"]
    killed = sum(f["killed"] for f in fams.values())
    kinds: dict[str, dict] = {}
    for r in results:
        k = kinds.setdefault(
            kind_of(r.family), {"mutants": 0, "killed": 0, "survivors": [], "correct_designs": 0, "false_alarms": []}
        )
        if r.correct:
            k["correct_designs"] += 1
            if r.outcome == "false-alarm":
                k["false_alarms"].append(r.name)
            continue
        k["mutants"] += 1
        k["killed"] += r.outcome in ("killed", "crashed")
        if r.outcome == "survived":
            k["survivors"].append(r.name)
    for k in kinds.values():
        k["kill_rate"] = k["killed"] / k["mutants"] if k["mutants"] else 1.0
    return {
        "mutants": len(bugs),
        "killed": killed,
        "kill_rate": killed / len(bugs) if bugs else 1.0,
        "families": fams,
        "kinds": kinds,
        "survivors": [r.name for r in bugs if r.outcome == "survived"],
        "correct_designs": len(correct),
        "false_alarms": [{"name": r.name, "failing": r.failing} for r in correct if r.outcome == "false-alarm"],
    }
