"""``flamia-verify fuzz``: fuzz a kernel over odd variable-length packings, or replay one reproducer."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from flamia_verify.commands.common import (
    EXIT_FAIL,
    EXIT_PASS,
    TRACEBACK_HELP,
    RunOptions,
    add_threads_argument,
    console,
    device_arg,
    device_metavar,
    kernel_choices,
    load_config,
    plain,
    prepare_out,
    print_tracebacks,
    remove_stale,
    report_names,
    run_options,
)
from flamia_verify.errors import FlamiaVerifyError, KernelCrashError, UsageError

__all__ = ["add_parser", "run"]


def add_parser(sub: Any) -> None:
    from flamia_verify.settings import CLI_DTYPES

    builtins, recipes = kernel_choices()
    f = sub.add_parser("fuzz", help="fuzz a kernel over odd variable-length packings")
    f.add_argument(
        "--kernel",
        help=f"built-in name ({builtins}), module:function or file.py:function (required here or as kernel "
        "in the config)",
    )
    f.add_argument(
        "--recipe", help=f"the precision recipe the kernel claims ({recipes}); built-in kernels carry their own"
    )
    f.add_argument("--examples", type=int, default=100, help="how many packings to draw (default 100)")
    f.add_argument("--seed", type=int, help="seed of the search; the same seed draws the same packings (default 0)")
    f.add_argument(
        "--out", help="directory for the reports and fuzz-case.json, the minimal failing case (default ./flamia-report)"
    )
    f.add_argument(
        "--device",
        type=device_arg,
        metavar=device_metavar(),
        help="where the kernel runs: cuda:N is GPU N (default auto: cuda when a GPU is present)",
    )
    f.add_argument("--dtype", choices=CLI_DTYPES, help="dtype of q, k, v and dO (default bf16)")
    f.add_argument(
        "--config",
        help="TOML file with [tool.flamia-verify] settings; fuzz reads kernel, recipe, device, "
        "dtype, seed, out and forward_only from it, the flags win (default: "
        "pyproject.toml here, if it has that table)",
    )
    f.add_argument("--replay", metavar="CASE.json", help="rerun one reproducer written by an earlier fuzz run")
    f.add_argument(
        "--forward-only",
        action="store_true",
        default=None,
        help="the kernel has no backward: fuzz the forward and say that gradients were not checked "
        "(config: forward_only = true; without it, a missing or raising backward fails the run)",
    )
    add_threads_argument(f)
    f.add_argument("--traceback", action="store_true", help=TRACEBACK_HELP)


def run(args: argparse.Namespace) -> int:
    """Fuzz (or replay one reproducer). The config's kernel, recipe, device, dtype, seed, out and
    forward_only apply as in check, the flags winning, and so does case_timeout_s (a call past it is a
    crash finding, and the kernel is not called again); its suite, only and thresholds are check's (fuzz
    judges every example against the rigorous bound and bitwise comparisons)."""
    from flamia_verify.kernels import load_kernel
    from flamia_verify.properties import fuzz
    from flamia_verify.reports import render_terminal, write_reports

    cfg = load_config(args.config)
    spec = args.kernel or cfg.kernel
    if not spec:
        raise UsageError('fuzz needs a kernel: --kernel SPEC (or kernel = "SPEC" in [tool.flamia-verify])')
    options = run_options(args, cfg)
    kernel = load_kernel(spec)
    cons = console()
    if args.replay:
        return _replay(args, kernel, cfg.recipe, options, cons)
    if args.examples < 1:
        raise UsageError(f"--examples must be at least 1, got {args.examples}")
    out = prepare_out(options.out)
    try:
        result = fuzz(
            kernel,
            recipe=options.recipe,
            examples=args.examples,
            seed=options.seed,
            device=options.device,
            dtype=options.dtype,
            forward_only=options.forward_only,
            case_timeout_s=cfg.case_timeout_s,
            threads=args.threads,
        )
    except KernelCrashError:
        remove_stale(out, report_names() + ("fuzz-case.json",))
        raise
    paths = write_reports(result.report, out)
    if not getattr(result, "reproducer", None):  # a passing run leaves no earlier run's reproducer behind
        remove_stale(out, ("fuzz-case.json",))
    render_terminal(result.report, cons, plain=plain(cons))
    if getattr(result, "reproducer", None):
        case_path = out / "fuzz-case.json"
        tmp = case_path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(result.reproducer, indent=2, sort_keys=True))
        tmp.replace(case_path)
        cons.print(f"minimal failing case: {case_path}", markup=False, soft_wrap=True)
        cons.print(
            f"rerun it with: flamia-verify fuzz --kernel {spec} --replay {case_path}", markup=False, soft_wrap=True
        )
    for kind, path in paths.items():
        cons.print(f"  {kind:<8} {path}", markup=False, soft_wrap=True)
    print_tracebacks(args, result.report.checks)
    return EXIT_PASS if result.report.passed else EXIT_FAIL


def _replay(
    args: argparse.Namespace, kernel: Any, configured_recipe: str | None, options: RunOptions, cons: Any
) -> int:
    """--replay: rerun the reproducer an earlier fuzz run wrote, and report it as suite fuzz-replay."""
    from flamia_verify.properties import replay_case
    from flamia_verify.reports import render_terminal, write_reports
    from flamia_verify.results import Report

    case = _read_reproducer(args.replay)
    out = prepare_out(options.out)
    # the recipe: --recipe, else the one the reproducer ran with, else the config's, else the kernel's
    replay_recipe = args.recipe or (None if case.get("recipe") else configured_recipe)
    _warn_other_replay(args.replay, case, kernel.name, replay_recipe or case.get("recipe") or kernel.recipe)
    try:
        replayed = replay_case(kernel, case, recipe=replay_recipe, device=options.device)
    except FlamiaVerifyError:
        raise
    except (ValueError, TypeError, KeyError, OverflowError) as exc:
        # kernel failures are caught inside; what escapes comes from the reproducer's fields
        raise UsageError(
            f"replay file {args.replay!r} is not a valid fuzz reproducer: {type(exc).__name__}: {exc}"
        ) from None
    report = Report(
        kernel=kernel.name,
        recipe=replayed.worst_case["recipe"],
        suite="fuzz-replay",
        seed=int(case.get("seed", 0)),
        checks=[replayed],
    )
    paths = write_reports(report, out)
    render_terminal(report, cons, plain=plain(cons))
    cons.print(f"replayed {args.replay} with recipe {report.recipe}; reports:", markup=False, soft_wrap=True)
    for kind, path in paths.items():
        cons.print(f"  {kind:<8} {path}", markup=False, soft_wrap=True)
    print_tracebacks(args, report.checks)
    return EXIT_PASS if report.passed else EXIT_FAIL


def _read_reproducer(path: str) -> dict[str, Any]:
    try:
        case = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise UsageError(f"replay file {path!r} does not exist") from None
    except OSError as exc:
        raise UsageError(f"cannot read replay file {path!r}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise UsageError(f"replay file {path!r} is not UTF-8 text") from None
    except json.JSONDecodeError as exc:
        raise UsageError(f"replay file {path!r} is not JSON: {exc}") from None
    if not isinstance(case, dict):
        raise UsageError(f"replay file {path!r} must hold one JSON object (a fuzz reproducer)")
    return case


def _warn_other_replay(path: str, case: dict, kernel: str, recipe: str | None) -> None:
    """One line on stderr when a reproducer recorded for another kernel or recipe is replayed (allowed:
    replaying a failing case on a fixed kernel is how a fix is checked, but it should not go unnoticed)."""
    recorded_kernel, recorded_recipe = case.get("kernel"), case.get("recipe")
    other_kernel = isinstance(recorded_kernel, str) and not _same_kernel(recorded_kernel, kernel)
    other_recipe = isinstance(recorded_recipe, str) and recipe is not None and recipe != recorded_recipe
    if other_kernel or other_recipe:
        sys.stderr.write(
            f"flamia-verify: warning: {path} was recorded for kernel {recorded_kernel or '?'} with recipe "
            f"{recorded_recipe or '?'}; replaying it on kernel {kernel} with recipe {recipe or '?'}\n"
        )


def _same_kernel(a: str, b: str) -> bool:
    """Two kernel specs name the same kernel: equal, or the same file.py:function by another path."""
    if a == b:
        return True
    (path_a, _, fn_a), (path_b, _, fn_b) = a.rpartition(":"), b.rpartition(":")
    if not (fn_a == fn_b and path_a.endswith(".py") and path_b.endswith(".py")):
        return False
    try:
        return Path(path_a).resolve() == Path(path_b).resolve()
    except (OSError, RuntimeError):
        return False
