"""Kill rate of one suite over the whole mutant table, for RESULTS.md and docs/checks.md.

    python benchmarks/mutation_kill.py --suite standard --jobs 16 --json out.json --md out.md

The same measurement as ``flamia-verify mutate`` without the command line, so that it also runs
against an older checkout of the package (PYTHONPATH=that/checkout, with flamia_verify/known_bad
and flamia_verify/mutation copied in) to measure a suite before a change.
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--suite", default="quick")
    p.add_argument("--jobs", type=int, default=1)
    p.add_argument("--device", default="cpu")
    p.add_argument("--json", required=True)
    p.add_argument("--md")
    args = p.parse_args()
    torch.set_num_threads(1)
    import flamia_verify
    from flamia_verify.known_bad.table import MUTANTS
    from flamia_verify.mutation.report import render_markdown
    from flamia_verify.mutation.runner import run_mutants, summarize

    start = time.perf_counter()
    n = [0]

    def show(r):
        n[0] += 1
        print(
            f"[{n[0]:>3}/{len(MUTANTS)}] {r.name:44s} {r.outcome:11s} {r.seconds:6.1f}s {', '.join(r.failing)[:160]}",
            flush=True,
        )

    results = run_mutants(MUTANTS, suite=args.suite, jobs=args.jobs, device=args.device, on_result=show)
    summary = summarize(results)
    summary.update(
        suite=args.suite,
        device=args.device,
        seconds=round(time.perf_counter() - start, 1),
        package=flamia_verify.__file__,
    )
    rows = [r.to_dict() for r in results]
    with open(args.json, "w") as fh:
        json.dump({"schema": "flamia-verify/mutation/v1", "summary": summary, "results": rows}, fh, indent=1)
    if args.md:
        with open(args.md, "w") as fh:
            fh.write(render_markdown(summary, rows, suite=args.suite))
    print(
        f"{args.suite}: killed {summary['killed']}/{summary['mutants']} ({100 * summary['kill_rate']:.1f} %), "
        f"false alarms {len(summary['false_alarms'])}/{summary['correct_designs']}, {summary['seconds']:.0f} s"
    )


if __name__ == "__main__":
    main()
