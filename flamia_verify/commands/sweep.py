"""``flamia-verify sweep``: a matrix of checks over the GPUs of this machine or a Ray cluster.

    flamia-verify sweep SWEEP.toml [--out DIR] [--backend local|ray] [--workers N] [--address ADDR]
                                   [--shard I/N] [--timeout SECONDS]
    flamia-verify sweep merge DIR [DIR ...] --out DIR

Exit 0 every case passed; 1 a case failed; 3 no case failed but one gave no verdict (its kernel did not
load, its worker crashed or timed out); 2 bad usage, or (merge) cases of the matrix that no directory has.
"""

from __future__ import annotations

import argparse
from typing import Any

from flamia_verify.commands.common import add_backend_arguments, case_progress_printer
from flamia_verify.errors import ConfigError, UsageError

__all__ = ["add_parser", "run"]

DESCRIPTION = """\
Run every case of a sweep file (kernels x suites x only-lists x dtypes x settings x seeds; see
docs/sweep.md) and write one result per case to DIR/cases/, each case's full report to
DIR/reports/<key>/, then DIR/sweep.json, sweep.md and sweep.html (the verdict matrix, each row linking
its case's report). Cases already in DIR with an unchanged kernel and flamia-verify are
read back, not run: an interrupted sweep resumes. The local backend runs one worker per visible GPU
(or per CPU core on a CPU sweep), a crashed or hung worker replaced; --backend ray runs one Ray task per
case (pip install 'flamia-verify[ray]'). `sweep merge DIR... --out DIR` joins the shards of one matrix."""


def add_parser(sub: Any) -> None:
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
    add_backend_arguments(s, "a case", "(default: the file's timeout_s)")


def run(args: argparse.Namespace) -> int:
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
        on_start, on_result = case_progress_printer()
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
        summary = f"INCOMPLETE, {len(outcome.missing)} missing (no directory has them; listed in sweep.md), " + summary
    print(
        f"sweep: {len(outcome.results)} case(s): {summary or 'none'}; reports in {outcome.out}/sweep.html", flush=True
    )
    return exit_code(outcome)
