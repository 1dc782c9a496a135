"""``flamia-verify compare``: the regression gate between two report.json files."""

from __future__ import annotations

import argparse
from typing import Any

from flamia_verify.commands.common import console, load_config

__all__ = ["add_parser", "run"]


def add_parser(sub: Any) -> None:
    cmp_ = sub.add_parser("compare", help="regression gate between two report.json files")
    cmp_.add_argument("base", help="report.json of the accepted run (the baseline)")
    cmp_.add_argument("new", help="report.json of the run to judge against it")
    cmp_.add_argument(
        "--factor",
        type=float,
        default=None,
        help="a metric regresses when worse by more than this factor (default 1.5) "
        "and by at least half the headroom to its threshold",
    )
    cmp_.add_argument("--config", help="TOML file with [tool.flamia-verify] settings (compare_factor)")
    cmp_.add_argument(
        "--allow-missing",
        action="store_true",
        help="do not fail when a check of BASE is missing from NEW (a deliberately narrower run)",
    )


def run(args: argparse.Namespace) -> int:
    from flamia_verify.reports import compare_reports, load_report, render_comparison
    from flamia_verify.settings import compare_factor

    cfg = load_config(args.config)
    factor = compare_factor(args.factor if args.factor is not None else cfg.compare_factor, "--factor")
    base, new = load_report(args.base), load_report(args.new)
    cmp = compare_reports(base, new, factor=factor, allow_missing=args.allow_missing)
    render_comparison(cmp, console())
    return cmp.exit_code
