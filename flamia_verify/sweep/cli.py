"""``flamia-verify sweep``: a matrix of checks over the GPUs of this machine or a Ray cluster.

    flamia-verify sweep SWEEP.toml [--out DIR] [--backend local|ray] [--workers N] [--address ADDR]
                                   [--shard I/N] [--timeout SECONDS]
    flamia-verify sweep merge DIR [DIR ...] --out DIR

Exit 0 every case passed; 1 a case failed; 3 no case failed but one gave no verdict (its kernel did not
load, its worker crashed or timed out); 2 bad usage, or (merge) cases of the matrix that no directory has.
"""

from __future__ import annotations

import sys

__all__ = ["add_parser", "run"]

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
    s.add_argument("--backend", default="local", choices=["local", "ray"], help="local worker pool (default) or Ray")
    s.add_argument("--workers", type=int, help="workers to use (default: every visible GPU, or every CPU core)")
    s.add_argument("--address", help="Ray cluster address (default: start a local Ray instance)")
    s.add_argument("--shard", metavar="I/N", help="run only the I-th of N deterministic slices of the matrix")
    s.add_argument(
        "--timeout", type=float, metavar="SECONDS", help="stop a case running longer (default: the file's timeout_s)"
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
        )
    counts = outcome.counts()
    summary = ", ".join(f"{n} {k}" for k, n in counts.items() if n)
    if outcome.missing:
        summary += f", {len(outcome.missing)} missing (no directory has them)"
    print(
        f"sweep: {len(outcome.results)} case(s): {summary or 'none'}; reports in {outcome.out}/sweep.html", flush=True
    )
    return exit_code(outcome)
