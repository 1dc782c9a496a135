"""``flamia-verify survey``: one suite over many kernels, side by side (docs/survey.md)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from flamia_verify.commands.common import add_backend_arguments, case_progress_printer
from flamia_verify.errors import ConfigError

__all__ = ["add_parser", "run"]

DESCRIPTION = """\
Run one suite over many kernels and write one comparison report: OUT/survey.html (a sortable
kernel x check-family table with each failure's reason, each kernel's error beside its recipe's model
and a BF16 run's, its speed, and a plot of error against speed), OUT/survey.md (for a PR comment),
OUT/survey.json (for machines) and each kernel's full report under OUT/kernels/. Default kernels:
every built-in and every adapter; one that cannot run here gets a row saying why. On CUDA each kernel
is also timed (forward, backward, forward+backward TFLOP/s) at one shape after its checks, in the same
worker. Runs on the sweep's backends; a rerun into the same --out reuses unchanged kernels' results.
Exit 0 every surveyed kernel passed, 1 one failed, 3 none failed but one gave no verdict, 2 bad usage."""


def add_parser(sub: Any) -> None:
    from flamia_verify.bench import SpeedShape
    from flamia_verify.settings import CLI_DTYPES, SUITES

    d = SpeedShape()
    s = sub.add_parser(
        "survey",
        help="one suite over many kernels, side by side (verdicts, error, speed)",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    s.add_argument(
        "--kernel", nargs="+", metavar="SPEC", help="kernels to survey (default: every built-in and adapter)"
    )
    s.add_argument("--recipe", help="the recipe of the kernels that declare none (file.py:function specs)")
    s.add_argument("--suite", default="quick", choices=list(SUITES), help="the suite every kernel runs (default quick)")
    s.add_argument(
        "--device", default="auto", choices=["auto", "cpu", "cuda"], help="where the kernels run (default: CUDA if any)"
    )
    s.add_argument("--dtype", default="bf16", choices=list(CLI_DTYPES), help="input dtype of the checks (default bf16)")
    s.add_argument("--seed", type=int, default=0, help="run seed of every kernel's checks (default 0)")
    s.add_argument("--only", nargs="+", metavar="FAMILY", default=[], help="run only these families or checks")
    s.add_argument("--out", default="flamia-survey", help="where the reports go (default ./flamia-survey)")
    add_backend_arguments(s, "a kernel's checks", "(default: no limit)")
    g = s.add_argument_group("speed (CUDA only; B = tokens // seqlen documents of seqlen tokens, BF16)")
    g.add_argument("--no-speed", action="store_true", help="do not time the kernels")
    g.add_argument("--seqlen", type=int, default=d.seqlen, help=f"tokens per document (default {d.seqlen})")
    g.add_argument("--tokens", type=int, default=d.tokens, help=f"tokens in all (default {d.tokens})")
    g.add_argument("--heads", type=int, default=d.heads, help=f"heads (default {d.heads})")
    g.add_argument("--head-dim", type=int, default=d.head_dim, help=f"head_dim (default {d.head_dim})")
    g.add_argument("--no-causal", action="store_true", help="time without the causal mask (default: causal)")
    g.add_argument("--rep-ms", type=int, default=d.rep_ms, help=f"timing budget per measurement (default {d.rep_ms})")


def run(args: argparse.Namespace) -> int:
    from flamia_verify.sweep.matrix import speed_shape
    from flamia_verify.sweep.survey import run_survey, survey_exit_code

    if args.address and args.backend != "ray":
        raise ConfigError("--address is for --backend ray")
    if args.seed < 0:
        raise ConfigError(f"--seed must be non-negative, got {args.seed}")
    if args.recipe:
        from flamia_verify.recipes.recipe import get_recipe

        get_recipe(args.recipe)  # an unknown recipe ends the command before any run
    speed = None
    if not args.no_speed:
        shape = {"seqlen": args.seqlen, "tokens": args.tokens, "heads": args.heads, "head_dim": args.head_dim}
        speed = speed_shape({**shape, "causal": not args.no_causal, "rep_ms": args.rep_ms}, "survey's speed options")
    if args.only:
        from flamia_verify.properties.engine import list_checks, select_checks

        select_checks(list_checks(args.suite), list(args.only))  # a bad name ends the command before any run
    on_start, on_result = case_progress_printer()
    outcome = run_survey(
        args.kernel,
        args.out,
        suite=args.suite,
        device=args.device,
        dtype=args.dtype,
        seed=args.seed,
        only=args.only,
        speed=speed,
        backend=args.backend,
        workers=args.workers,
        address=args.address,
        timeout_s=args.timeout,
        per_gpu=args.workers_per_gpu,
        recipe=args.recipe,
        on_start=on_start,
        on_result=on_result,
    )
    for name, _, reason in outcome.unavailable:
        print(f"survey: {name}: not available here: {reason}", file=sys.stderr)
    counts: dict[str, int] = {}
    for r in outcome.rows:
        counts[r["status"]] = counts.get(r["status"], 0) + 1
    summary = ", ".join(f"{n} {k}" for k, n in sorted(counts.items()))
    print(f"survey: {len(outcome.rows)} kernel(s): {summary}; reports in {outcome.out}/survey.html", flush=True)
    return survey_exit_code(outcome)
