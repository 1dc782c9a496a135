"""``flamia-verify sweep``: a matrix of checks over the GPUs of this machine or a Ray cluster.

    flamia-verify sweep SWEEP.toml [--out DIR] [--backend local|ray] [--workers N] [--address ADDR]
                                   [--shard I/N] [--timeout SECONDS]
    flamia-verify sweep merge DIR [DIR ...] --out DIR

Exit 0 every case passed; 1 a case failed; 3 no case failed but one gave no verdict (its kernel did not
load, its worker crashed or timed out); 2 bad usage, or (merge) cases of the matrix that no directory has.
"""

from __future__ import annotations

import sys

__all__ = ["add_parser", "run", "add_survey_parser", "run_survey_command"]

DESCRIPTION = """\
Run every case of a sweep file (kernels x suites x only-lists x dtypes x settings x seeds; see
docs/sweep.md) and write one result per case to DIR/cases/, then DIR/sweep.json, sweep.md and
sweep.html (the verdict matrix). Cases already in DIR with an unchanged kernel and flamia-verify are
read back, not run: an interrupted sweep resumes. The local backend runs one worker per visible GPU
(or per CPU core on a CPU sweep), a crashed or hung worker replaced; --backend ray runs one Ray task per
case (pip install 'flamia-verify[ray]'). `sweep merge DIR... --out DIR` joins the shards of one matrix."""


def add_parser(sub) -> None:
    import argparse

    s = sub.add_parser(
        "sweep",
        help="a matrix of checks spread over local GPUs or a Ray cluster",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    s.add_argument(
        "target", nargs="+", metavar="SWEEP.toml | merge DIR ...", help="a sweep file, or merge and directories"
    )
    s.add_argument("--out", default="flamia-sweep", help="where results go (default ./flamia-sweep)")
    s.add_argument("--shard", metavar="I/N", help="run only the I-th of N deterministic slices of the matrix")
    _add_backend_arguments(s, "a case", "(default: the file's timeout_s)")


def _add_backend_arguments(s, what: str, default_timeout: str) -> None:
    """The backend options sweep and survey share."""
    s.add_argument("--backend", default="local", choices=["local", "ray"], help="local worker pool (default) or Ray")
    s.add_argument("--workers", type=int, help="workers to use (default: every visible GPU, or every CPU core)")
    s.add_argument("--address", help="Ray cluster address (default: start a local Ray instance)")
    s.add_argument(
        "--timeout",
        type=float,
        metavar="SECONDS",
        help=f"stop {what} running longer, its row an error {default_timeout}",
    )
    s.add_argument(
        "--workers-per-gpu",
        type=int,
        default=1,
        metavar="N",
        help="local backend: N workers share each GPU (default 1)",
    )


def _progress_printer():
    """One line per finished case on stderr (a terminal or a CI log alike)."""

    def on_start(total: int, reused: int, to_run: int) -> None:
        print(f"sweep: {total} case(s), {reused} already in the store, {to_run} to run", file=sys.stderr, flush=True)

    def on_result(result: dict, done: int, to_run: int) -> None:
        from flamia_verify.reports.survey import case_label

        status = result["status"].upper()
        extra = f": {result['error']}" if result.get("error") else ""
        print(
            f"[{done}/{to_run}] {status:<10} {case_label(result['case'])} ({result.get('elapsed_s', 0):.1f} s){extra}",
            file=sys.stderr,
            flush=True,
        )

    return on_start, on_result


def run(args) -> int:
    from flamia_verify.errors import ConfigError, UsageError
    from flamia_verify.sweep import exit_code, merge_sweeps, run_sweep

    if args.target[0] == "merge":
        if len(args.target) < 2:
            raise UsageError(
                "sweep merge needs the directories to join: flamia-verify sweep merge DIR [DIR ...] --out DIR"
            )
        outcome = merge_sweeps(args.target[1:], args.out)
    else:
        if len(args.target) != 1:
            raise UsageError("sweep takes one sweep file (or: sweep merge DIR [DIR ...])")
        if args.address and args.backend != "ray":
            raise ConfigError("--address is for --backend ray")
        on_start, on_result = _progress_printer()
        outcome = run_sweep(
            args.target[0],
            args.out,
            backend=args.backend,
            workers=args.workers,
            shard=args.shard,
            address=args.address,
            timeout_s=args.timeout,
            on_start=on_start,
            on_result=on_result,
            per_gpu=args.workers_per_gpu,
        )
    counts = outcome.counts()
    summary = ", ".join(f"{n} {k}" for k, n in counts.items() if n)
    if outcome.missing:
        summary += f", {len(outcome.missing)} missing (no directory has them)"
    print(
        f"sweep: {len(outcome.results)} case(s): {summary or 'none'}; reports in {outcome.out}/sweep.html", flush=True
    )
    return exit_code(outcome)


SURVEY_DESCRIPTION = """\
Run one suite over many kernels and write one comparison report: OUT/survey.html (a sortable
kernel x check-family table with each failure's reason, each kernel's error beside its recipe's model
and a BF16 run's, its speed, and a plot of error against speed), OUT/survey.md (for a PR comment),
OUT/survey.json (for machines) and each kernel's full report under OUT/kernels/. Default kernels:
every built-in and every adapter; one that cannot run here gets a row saying why. On CUDA each kernel
is also timed (forward, backward, forward+backward TFLOP/s) at one shape after its checks, in the same
worker. Runs on the sweep's backends; a rerun into the same --out reuses unchanged kernels' results.
Exit 0 every surveyed kernel passed, 1 one failed, 3 none failed but one gave no verdict, 2 bad usage."""


def add_survey_parser(sub) -> None:
    import argparse

    from flamia_verify.bench import SpeedShape
    from flamia_verify.settings import CLI_DTYPES, SUITES

    d = SpeedShape()
    s = sub.add_parser(
        "survey",
        help="one suite over many kernels, side by side (verdicts, error, speed)",
        description=SURVEY_DESCRIPTION,
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
    _add_backend_arguments(s, "a kernel's checks", "(default: no limit)")
    g = s.add_argument_group("speed (CUDA only; B = tokens // seqlen documents of seqlen tokens, BF16)")
    g.add_argument("--no-speed", action="store_true", help="do not time the kernels")
    g.add_argument("--seqlen", type=int, default=d.seqlen, help=f"tokens per document (default {d.seqlen})")
    g.add_argument("--tokens", type=int, default=d.tokens, help=f"tokens in all (default {d.tokens})")
    g.add_argument("--heads", type=int, default=d.heads, help=f"heads (default {d.heads})")
    g.add_argument("--head-dim", type=int, default=d.head_dim, help=f"head_dim (default {d.head_dim})")
    g.add_argument("--no-causal", action="store_true", help="time without the causal mask (default: causal)")
    g.add_argument("--rep-ms", type=int, default=d.rep_ms, help=f"timing budget per measurement (default {d.rep_ms})")


def run_survey_command(args) -> int:
    from flamia_verify.errors import ConfigError
    from flamia_verify.sweep.matrix import speed_shape
    from flamia_verify.sweep.survey import run_survey, survey_exit_code

    if args.address and args.backend != "ray":
        raise ConfigError("--address is for --backend ray")
    if args.seed < 0:
        raise ConfigError(f"--seed must be non-negative, got {args.seed}")
    if args.recipe:
        from flamia_verify.kernels.recipes import get_recipe

        get_recipe(args.recipe)  # an unknown recipe ends the command before any run
    speed = None
    if not args.no_speed:
        shape = {"seqlen": args.seqlen, "tokens": args.tokens, "heads": args.heads, "head_dim": args.head_dim}
        speed = speed_shape({**shape, "causal": not args.no_causal, "rep_ms": args.rep_ms}, "survey's speed options")
    if args.only:
        from flamia_verify.properties.engine import list_checks, select_checks

        select_checks(list_checks(args.suite), list(args.only))  # a bad name ends the command before any run
    on_start, on_result = _progress_printer()
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
