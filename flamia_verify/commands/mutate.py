"""``flamia-verify mutate``: the kill rate of a suite over the mutant tables, and its false alarms.

The mutants are the known-bad registry's records tagged ``mutant`` (:mod:`flamia_verify.known_bad`),
of two families reported side by side: ``arithmetic`` (the emulation's own steps edited,
:mod:`flamia_verify.known_bad.table`) and ``wrapper`` (bugs of the code around a correct kernel in the
varlen calling convention, :mod:`flamia_verify.known_bad.wrapper`). ``--family`` takes either name, or
the name of a narrower family (``mask``, ``wrapper.gqa``, ...).

    flamia-verify mutate [--suite quick|standard|full] [--family F ...] [--mutant NAME ...]
                         [--sample N] [--jobs N] [--seed N] [--device cpu|cuda|cuda:N|auto]
                         [--min-kill-rate R] [--out DIR] [--list]

Writes DIR/mutation.json (every mutant's outcome and failing checks, the summary) and
DIR/mutation.md (the kill table per family, survivors, false alarms;
:mod:`flamia_verify.mutation.report`). Exit 0 when no correct design raised an alarm and the kill rate
reaches ``--min-kill-rate``; 1 otherwise; 2 bad usage.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from flamia_verify.commands.common import device_arg, device_metavar, prepare_out
from flamia_verify.errors import UsageError

__all__ = ["add_parser", "run"]


def add_parser(sub: Any) -> None:
    from flamia_verify.settings import SUITES

    m = sub.add_parser(
        "mutate",
        help="kill rate of a suite over systematic mutants of the FLAMIA MXFP8 emulation and of its wrapper",
        description="Run a suite on every mutant of two families and on their correct alternatives. "
        "arithmetic: the emulation with one realistic bug each (masks and block boundaries off by k, "
        "cu_seqlens swaps, GQA head layouts, operand formats and rounding, per-tile normalisation, "
        "nondeterministic reductions, in-place writes). wrapper: a correct kernel behind a wrapper with "
        "one bug of the calling convention (softmax_scale=None, GQA index arithmetic, cu_seqlens "
        "arithmetic, dispatch by size, reductions over the batch, NaN guards, the lse tuple, strides, "
        "dtypes, nondeterminism, heads, positions). A bug is killed when a check fails or errors; a "
        "correct design must pass every check.",
    )
    m.add_argument("--suite", choices=SUITES, default="quick", help="the suite to measure (default quick)")
    m.add_argument(
        "--family",
        nargs="+",
        metavar="FAMILY",
        help="only mutants of these families: arithmetic, wrapper, or a narrower one (see --list)",
    )
    m.add_argument("--mutant", nargs="+", metavar="NAME", help="only these mutants (see --list)")
    m.add_argument(
        "--sample",
        type=int,
        default=0,
        help="a fixed, spread sample of N bugs of each family (every k-th of its table) plus every correct "
        "design; 0 = all",
    )
    m.add_argument("--no-correct", action="store_true", help="skip the correct designs (no false-alarm measurement)")
    m.add_argument(
        "--every-check",
        action="store_true",
        help="run every check on every bug (default: stop at the first family with a failing check)",
    )
    m.add_argument("--jobs", type=int, default=1, help="processes to run mutants in (default 1)")
    m.add_argument("--seed", type=int, default=0, help="the suite's seed (default 0)")
    m.add_argument(
        "--device",
        type=device_arg,
        metavar=device_metavar(),
        default="cpu",
        help="where the mutated emulation runs: cuda:N is GPU N (default cpu)",
    )
    m.add_argument(
        "--min-kill-rate",
        type=float,
        default=None,
        metavar="R",
        help="exit 1 when the kill rate is below R (0..1); false alarms always exit 1",
    )
    m.add_argument(
        "--out", default="flamia-report", help="directory for mutation.json and mutation.md (default ./flamia-report)"
    )
    m.add_argument("--list", action="store_true", help="print the mutant table and exit")


def _select(args: argparse.Namespace) -> list[Any]:
    from flamia_verify.errors import ConfigError
    from flamia_verify.known_bad import KNOWN_BAD, mutants
    from flamia_verify.known_bad.table import ci_sample
    from flamia_verify.mutation.report import KINDS, kind_of

    table = list(mutants())  # the source-edit family, then the wrapper family, in registration order
    by_name = {m.name: m for m in table}
    if args.mutant:
        unknown = [n for n in args.mutant if n not in by_name]
        if unknown:
            raise ConfigError(f"unknown mutant {unknown[0]!r}; `flamia-verify mutate --list` shows them")
        chosen = [by_name[n] for n in args.mutant]
    else:
        if args.sample < 0:
            raise UsageError(f"--sample must be >= 0, got {args.sample}")
        bugs = [m for m in table if not m.correct]
        if args.sample:
            wrapper_bugs = [m for m in bugs if m.has("wrapper")]
            step = max(1, len(wrapper_bugs) // args.sample)
            bugs = [KNOWN_BAD.get(m.name) for m in ci_sample(args.sample)] + wrapper_bugs[::step][: args.sample]
        correct = [] if args.no_correct else [m for m in table if m.correct]
        wanted = {m.name for m in bugs + correct}
        chosen = [m for m in table if m.name in wanted]  # table order
    if args.family:
        known = KINDS + tuple(dict.fromkeys(m.family for m in table))
        unknown = sorted(set(args.family) - set(known))
        if unknown:
            raise UsageError(f"unknown mutant family {', '.join(unknown)}; families: {', '.join(known)}")
        chosen = [m for m in chosen if m.family in args.family or kind_of(m.family) in args.family]
    if not chosen:
        raise UsageError("no mutant selected")
    return chosen


def _print_table(mutants: list[Any]) -> None:
    for m in mutants:
        tag = "correct" if m.correct else "bug"
        print(f"{m.name:44s} {m.family:20s} {tag:8s} {m.why}")


def run(args: argparse.Namespace) -> int:
    from flamia_verify.mutation.report import render_markdown, verdict
    from flamia_verify.mutation.runner import run_mutants, summarize
    from flamia_verify.reports.store import atomic_write_text
    from flamia_verify.settings import resolve_device

    chosen = _select(args)
    if args.list:
        _print_table(chosen)
        return 0
    if args.jobs < 1:
        raise UsageError(f"--jobs must be >= 1, got {args.jobs}")
    if args.min_kill_rate is not None and not 0.0 <= args.min_kill_rate <= 1.0:
        raise UsageError(f"--min-kill-rate must lie in [0, 1], got {args.min_kill_rate}")
    device = resolve_device(args.device)
    out = prepare_out(args.out)  # a bad --out is a usage error before minutes of mutants, as in check
    total = len(chosen)
    done = [0]
    start = time.perf_counter()

    def show(r: Any) -> None:
        done[0] += 1
        failing = ", ".join(r.failing[:4]) + (" ..." if len(r.failing) > 4 else "")
        print(f"[{done[0]:>3}/{total}] {r.name:44s} {r.outcome:11s} {r.seconds:6.1f}s  {failing}", flush=True)

    print(f"mutate: {total} mutants, suite {args.suite}, {args.jobs} process(es), device {device}", flush=True)
    results = run_mutants(
        chosen,
        suite=args.suite,
        seed=args.seed,
        device=device,
        jobs=args.jobs,
        on_result=show,
        first_kill=not args.every_check,
    )
    summary = summarize(results)
    summary.update(suite=args.suite, seed=args.seed, device=device, seconds=round(time.perf_counter() - start, 1))
    rows = [r.to_dict() for r in results]
    atomic_write_text(
        out / "mutation.json",
        json.dumps({"schema": "flamia-verify/mutation/v1", "summary": summary, "results": rows}, indent=1) + "\n",
    )
    atomic_write_text(out / "mutation.md", render_markdown(summary, rows, suite=args.suite))
    for kind, k in summary["kinds"].items():
        if k["mutants"]:
            print(f"  {kind}: {k['killed']}/{k['mutants']} = {100 * k['kill_rate']:.1f} %", flush=True)
    print(
        f"kill rate {summary['killed']}/{summary['mutants']} = {100 * summary['kill_rate']:.1f} %; "
        f"false alarms {len(summary['false_alarms'])}/{summary['correct_designs']}; "
        f"{summary['seconds']:.0f} s; reports: {out / 'mutation.md'}, {out / 'mutation.json'}"
    )
    problems = verdict(summary, args.min_kill_rate)
    for p in problems:
        sys.stderr.write(f"flamia-verify: {p}\n")
    return 1 if problems else 0
