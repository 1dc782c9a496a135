"""``flamia-verify list``: the built-in kernels, adapters, recipes and checks, or the coverage model."""

from __future__ import annotations

import argparse
from typing import Any

from flamia_verify.commands.common import EXIT_PASS, console

__all__ = ["add_parser", "run", "cuda_path"]


def add_parser(sub: Any) -> None:
    p_list = sub.add_parser("list", help="built-in kernels, recipes and checks")
    p_list.add_argument(
        "--coverage",
        action="store_true",
        help="the coverage model instead: every input dimension and invariance, and the checks that exercise it",
    )


def cuda_path(kernel: Any) -> str:
    """What a built-in kernel runs on CUDA bf16/fp16 inputs: its fused Triton kernels (up to which
    head_dim) or its PyTorch emulation (and why)."""
    from flamia_verify.kernels.metadata import kernel_design
    from flamia_verify.kernels.triton.config import config_for, head_dim_limit, unsupported_reason

    design = kernel_design(kernel.fn)
    if design is None:  # a built-in without a design (fp8-delayed): its PyTorch specification everywhere
        return "PyTorch emulation"
    why = unsupported_reason(design)
    if why is not None:
        return f"emulation ({why})"
    return f"fused Triton, head_dim 32-{head_dim_limit(config_for(design))}"


def run(args: argparse.Namespace) -> int:
    from flamia_verify.kernels import builtin_kernels
    from flamia_verify.kernels.adapters import ADAPTERS
    from flamia_verify.kernels.loader import entry_point_kernels
    from flamia_verify.properties import list_checks
    from flamia_verify.recipes import RECIPES
    from flamia_verify.reports.terminal import print_table

    cons = console()  # a rich table on a terminal; plain, full lines in a log or a pipe
    if getattr(args, "coverage", False):
        return _print_coverage(cons)
    kernels = [[name, k.recipe or "", "built-in", cuda_path(k), k.description] for name, k in builtin_kernels().items()]
    kernels += [[name, "", "entry point", "", ""] for name in sorted(entry_point_kernels())]
    print_table(cons, "kernels", ["name", "recipe", "source", "on CUDA", "description"], kernels)
    adapters = [[a.name, a.recipe, a.unavailable() or "available", a.runs_on, a.description] for a in ADAPTERS.values()]
    print_table(cons, "adapters (library kernels)", ["name", "recipe", "here", "runs on", "description"], adapters)
    print_table(cons, "recipes", ["name", "description"], [[name, rec.description] for name, rec in RECIPES.items()])
    checks = [
        [spec.name, ",".join(getattr(spec, "suites", ()) or ()), spec.description] for spec in list_checks("full")
    ]
    print_table(cons, "checks (suite: full)", ["check", "suites", "question"], checks)
    return EXIT_PASS


def _print_coverage(cons: Any) -> int:
    from flamia_verify.properties import list_checks
    from flamia_verify.properties.coverage import INVARIANCES, MODEL
    from flamia_verify.reports.terminal import print_table

    suites = {spec.name: spec.suites for spec in list_checks("full")}

    def where(checks: Any) -> str:
        return ", ".join(f"{c} ({'/'.join(s[0] for s in suites.get(c, ()))})" for c in checks)

    rows = [[r.dimension, r.value, r.meaning, where(r.checks)] for r in MODEL]
    print_table(
        cons,
        "input dimensions (checks: q quick, s standard, f full)",
        ["dimension", "value", "meaning", "exercised by"],
        rows,
    )
    rows = [[r.value, r.meaning, where(r.checks)] for r in INVARIANCES]
    print_table(cons, "invariances", ["invariance", "statement", "stated by"], rows)
    return EXIT_PASS
