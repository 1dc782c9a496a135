"""The ``flamia-verify`` command.

    flamia-verify check  [--kernel SPEC] [--recipe NAME] [--suite quick|standard|full] [--device auto|cpu|cuda]
                         [--dtype bf16|fp16] [--seed N] [--out DIR] [--config FILE] [--only FAMILY ...]
                         [--traceback]
    flamia-verify fuzz   --kernel SPEC [--recipe NAME] [--examples N] [--seed N] [--out DIR] [--replay CASE.json]
                         [--device auto|cpu|cuda] [--dtype bf16|fp16] [--config FILE] [--traceback]
    flamia-verify bench  [--kernel SPEC ...] [--device cuda]
    flamia-verify compare BASE.json NEW.json
    flamia-verify report REPORT.json [--html FILE] [--md FILE] [--junit FILE]
    flamia-verify list
    flamia-verify mutate [--suite NAME] [--family F ...] [--mutant NAME ...] [--sample N] [--jobs N]
    flamia-verify train-parity --kernel SPEC [SPEC ...] [--preset tiny|small] [--steps N] [--out DIR]
    flamia-verify sweep SWEEP.toml [--out DIR] [--backend local|ray] [--shard I/N]   (docs/sweep.md)
    flamia-verify survey [--kernel SPEC ...] [--suite NAME] [--device auto|cpu|cuda] [--out DIR]   (docs/survey.md)

``--device`` also takes ``cuda:N`` (GPU N). check and fuzz read ``[tool.flamia-verify]`` (pyproject.toml
here or ``--config FILE``); a flag wins over the file (flamia_verify.config says which keys each reads).

Exit codes: 0 every check passed; 1 at least one check failed or errored, or the run did not complete
(interrupted by SIGINT or SIGTERM, or its reports could not be written); 2 bad usage or configuration;
3 the kernel could not be loaded or crashed. Errors print one line to stderr (--traceback adds the
kernel's own tracebacks). The reports of a run that did not complete say INCOMPLETE (report.json:
summary.complete false, summary.status "incomplete"). ``report`` exits 0 once it has rendered, whatever
the verdict of the report it renders.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any, NamedTuple

from flamia_verify._version import __version__
from flamia_verify.errors import (
    ConfigError,
    FlamiaVerifyError,
    KernelCrashError,
    KernelLoadError,
    UsageError,
)

# flamia_verify.settings imports torch: read where needed, so that a Ctrl-C while torch imports (seconds,
# on a cold start) is caught by main() as any interruption (one line, exit 1), not a traceback

__all__ = ["main", "build_parser", "device_arg", "DEVICE_METAVAR"]  # noqa: F822 (DEVICE_METAVAR: __getattr__)

EXIT_PASS, EXIT_FAIL, EXIT_USAGE, EXIT_KERNEL = 0, 1, 2, 3
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE: what a shell reports for a writer whose reader closed the pipe
DEFAULT_KERNEL = "flamia-mxfp8"


CHECK_DESCRIPTION = """\
Run the checks on a kernel beside a float64 reference and write report.json, report.md,
report.html and junit.xml.

suites (they differ in the cases; standard and full add a bounded fuzz pass, isolation.fuzz):
  quick:    3 base packings x 2 seeds (one GQA 4:2 with Lq != Lk, one scales dO by 2^-20, one
            passes a non-default softmax_scale), causal documents of 96 tokens probed at every
            32-block boundary, Lq < Lk and Lq > Lk, head_dim 64 and 128, one 512-key document;
            10-20 s for an emulated kernel on a 2-core CPU
  standard: 7 base packings x 2 seeds: many tiny documents, lengths around 32, 64 and 128, 512
            tokens at headdim 128, GQA 4:1, Lq != Lk; longer causal documents; about a minute
            for a fused kernel on an H200 with an empty Triton cache, 20 s with its kernels compiled
  full:     10 base packings x 4 seeds, up to 2048 tokens a call, 4 heads, head_dim 256 too;
            many minutes on a CPU

A kernel whose backward is missing or raises fails the run (interface.backward fails, the
gradient checks report error) unless it is declared with --forward-only."""

CHECK_EPILOG = """\
exit codes: 0 every check passed; 1 a check failed or errored, or the run is incomplete
(interrupted by SIGINT/SIGTERM, or the reports could not be written: one line names the file);
2 bad usage or configuration; 3 the kernel could not be loaded or crashed. The reports of an
incomplete run say INCOMPLETE and keep the checks that finished."""


TRACEBACK_HELP = (
    "print the full traceback of each exception the kernel raised to stderr (report.json keeps it "
    "in the worst case of the check either way)"
)


class _Terminated(KeyboardInterrupt):
    """SIGTERM, turned into an interruption so that the finished checks are written, marked incomplete."""


def _on_sigterm(signum, frame):
    raise _Terminated("SIGTERM")


def _device_metavar() -> str:
    """How --device shows its values in --help (``DEVICE_METAVAR``)."""
    from flamia_verify.settings import DEVICES

    return "{" + ",".join(DEVICES) + "}"


def __getattr__(name: str) -> str:
    if name == "DEVICE_METAVAR":
        return _device_metavar()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def device_arg(text: str) -> str:
    """argparse type of ``--device``: a name of :data:`flamia_verify.settings.DEVICES`, checked here
    (exit 2 naming the accepted values) and resolved against the machine's devices when the command runs."""
    from flamia_verify.settings import check_device

    try:
        return check_device(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line on stderr, exit 2
        self.exit(EXIT_USAGE, f"flamia-verify: error: {message} (see `{self.prog} --help`)\n")


def build_parser() -> argparse.ArgumentParser:
    from flamia_verify.kernels import RECIPES, builtin_kernels
    from flamia_verify.settings import CLI_DTYPES, SUITES

    DEVICE_METAVAR = _device_metavar()
    # the built-in kernels and recipes as the registry has them, so that --help never drifts from it
    builtins, recipes = ", ".join(builtin_kernels()), ", ".join(RECIPES)
    p = _Parser(prog="flamia-verify", description="Verify low-precision attention kernels against a float64 reference.")
    p.add_argument("--version", action="version", version=f"flamia-verify {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

    c = sub.add_parser(
        "check",
        help="run the checks on a kernel and write reports",
        description=CHECK_DESCRIPTION,
        epilog=CHECK_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    c.add_argument(
        "--kernel",
        help=f"built-in name ({builtins}), module:function or file.py:function (default {DEFAULT_KERNEL})",
    )
    c.add_argument(
        "--recipe",
        help=f"the precision recipe the kernel claims ({recipes}); built-in kernels carry their own",
    )
    c.add_argument("--suite", choices=SUITES, help="how many and how large the cases are (see above; default quick)")
    c.add_argument(
        "--device",
        type=device_arg,
        metavar=DEVICE_METAVAR,
        help="where the kernel and its inputs live: cuda:N is GPU N (default auto: cuda when a GPU is present)",
    )
    c.add_argument("--dtype", choices=CLI_DTYPES, help="dtype of q, k, v and dO (default bf16)")
    c.add_argument(
        "--seed", type=int, help="seed every case is drawn from; the same seed gives the same cases (default 0)"
    )
    c.add_argument(
        "--out", help="directory for report.json, report.md, report.html, junit.xml (default ./flamia-report)"
    )
    c.add_argument(
        "--config",
        help="TOML file with [tool.flamia-verify] settings and thresholds "
        "(default: pyproject.toml here, if it has that table)",
    )
    c.add_argument("--only", nargs="+", metavar="FAMILY", help="only these families or checks (e.g. causal isolation)")
    c.add_argument(
        "--forward-only",
        action="store_true",
        default=None,
        help="declare a kernel without a backward: its backward is never called, the gradient checks "
        "skip and the reports say gradients were not checked (config: forward_only = true). "
        "Without it, a kernel whose backward is missing or raises fails",
    )
    c.add_argument("--traceback", action="store_true", help=TRACEBACK_HELP)

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
        metavar=DEVICE_METAVAR,
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
    f.add_argument("--traceback", action="store_true", help=TRACEBACK_HELP)

    b = sub.add_parser("bench", help="speed of kernels beside torch SDPA (needs CUDA)")
    b.add_argument(
        "--kernel",
        nargs="+",
        default=None,
        help="built-in names (their fused kernels) or module:function / file.py:function specs",
    )
    b.add_argument("--device", choices=("cuda",), default="cuda", help="the GPU to time on (only cuda)")
    b.add_argument(
        "--seqlens",
        nargs="+",
        type=int,
        default=[2048, 8192, 16384],
        help="tokens per document S; each row packs B = 32768 // S documents",
    )
    b.add_argument(
        "--causal",
        choices=("both", "true", "false"),
        default="both",
        help="time causal attention, non-causal, or both (default both)",
    )
    b.add_argument("--rep-ms", type=int, default=100, help="timing budget per measurement (triton do_bench)")
    b.add_argument("--md", help="also write the table as Markdown to this file")
    b.add_argument("--json", help="also write the rows as JSON to this file")

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

    r = sub.add_parser(
        "report",
        help="render a report.json again",
        description="Render a report.json again. Exit 0 once rendered, whatever the report's verdict "
        "(the run that wrote it gave that exit code); 2 when the file cannot be read or written.",
    )
    r.add_argument("report", help="the report.json to read (validated against the report schema)")
    r.add_argument("--html", help="write the HTML report to this file (instead of printing the summary)")
    r.add_argument("--md", help="write the Markdown report to this file (instead of printing the summary)")
    r.add_argument("--junit", help="write the JUnit XML report to this file (instead of printing the summary)")

    p_list = sub.add_parser("list", help="built-in kernels, recipes and checks")
    p_list.add_argument(
        "--coverage",
        action="store_true",
        help="the coverage model instead: every input dimension and invariance, and the checks that exercise it",
    )

    from flamia_verify.mutation.cli import add_parser as add_mutate_parser

    add_mutate_parser(sub)
    from flamia_verify.training.cli import add_parser as add_train_parity_parser

    add_train_parity_parser(sub)
    from flamia_verify.sweep.cli import add_parser as add_sweep_parser
    from flamia_verify.sweep.cli import add_survey_parser

    add_sweep_parser(sub)
    add_survey_parser(sub)
    return p


# ----------------------------------------------------------------------------------------------


def _console(stderr: bool = False):
    from rich.console import Console

    class _CliConsole(Console):
        def on_broken_pipe(self) -> None:  # let main() end the command with EXIT_BROKEN_PIPE
            raise BrokenPipeError

    return _CliConsole(stderr=stderr, highlight=False)


def _plain(console) -> bool:
    """Plain, unwrapped lines for a console that is not an interactive terminal (a CI log, a pipe)."""
    from flamia_verify.reports.terminal import is_plain

    return is_plain(console)


def _fail(message: str, code: int) -> int:
    sys.stderr.write(f"flamia-verify: {message}\n")
    return code


#: the directories _prepare_out created, outermost first: main() removes those still empty when the
#: command ends, so that a usage error found after --out was prepared (an unknown --only name, a
#: kernel without a recipe) leaves nothing behind
_CREATED_OUT: list[Path] = []


def _remove_unused_out() -> None:
    while _CREATED_OUT:
        try:
            _CREATED_OUT.pop().rmdir()  # deepest first; a directory the run wrote into is not empty and stays
        except OSError:
            pass


def _print_tracebacks(args, checks=(), crash: BaseException | None = None) -> None:
    """--traceback: print to stderr the full traceback of each exception the kernel raised, as the
    checks' worst cases keep it (once per distinct traceback, naming the checks that met it), and of
    the one behind a crash."""
    if not getattr(args, "traceback", False):
        return
    where: dict[str, list[str]] = {}
    for check in checks:
        trace = (check.worst_case or {}).get("traceback")
        if isinstance(trace, str) and trace:
            where.setdefault(trace, []).append(check.name)
    cause = crash.__cause__ if crash is not None else None
    if cause is not None:
        trace = getattr(cause, "traceback", None) or "".join(traceback.format_exception(cause))
        where.setdefault(trace, []).append("the crash")
    for trace, names in where.items():
        sys.stderr.write(f"flamia-verify: the kernel's exception in {', '.join(names)}:\n{trace}")
        if not trace.endswith("\n"):
            sys.stderr.write("\n")


class _RunOptions(NamedTuple):
    """What check and fuzz both take from a flag, or else from the config file."""

    recipe: str | None
    device: str
    dtype: Any
    seed: int
    forward_only: bool
    out: str


def _run_options(args: argparse.Namespace, cfg: Any) -> _RunOptions:
    from flamia_verify.settings import resolve_device, resolve_dtype

    return _RunOptions(
        recipe=args.recipe or cfg.recipe,
        device=resolve_device(args.device or cfg.device),
        dtype=resolve_dtype(args.dtype or cfg.dtype),
        seed=args.seed if args.seed is not None else cfg.seed,
        forward_only=bool(args.forward_only or cfg.forward_only),
        out=cfg.out if args.out is None else args.out,
    )


def _prepare_out(out: str) -> Path:
    """Make ``out`` a writable directory before any kernel runs (a bad --out is a usage error, found
    before the checks spend their time, not after)."""
    if not out.strip():
        raise UsageError("--out must name a directory, got an empty string")
    directory = Path(out)
    if directory.exists() and not directory.is_dir():
        raise UsageError(f"--out {str(directory)!r} is a file, not a directory")
    missing = [d for d in (directory, *directory.parents) if not d.exists()]
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"cannot create --out directory {str(directory)!r}: {exc.strerror or exc}") from None
    finally:
        _CREATED_OUT.extend(reversed(missing))
    if not os.access(directory, os.W_OK | os.X_OK):
        raise UsageError(f"--out directory {str(directory)!r} is not writable")
    return directory


def _remove_stale(out: Path, names) -> None:
    """Remove files an earlier run left in ``out`` that this run did not replace."""
    for name in names:
        try:
            (out / name).unlink(missing_ok=True)
        except OSError as exc:
            raise UsageError(f"cannot remove the stale {str(out / name)!r}: {exc.strerror or exc}") from None


def _report_names() -> tuple[str, ...]:
    from flamia_verify.reports.store import REPORT_FILES

    return tuple(REPORT_FILES.values())


def _kernel_spec(flag: str | None, configured: str | None) -> str:
    """The kernel a check runs: --kernel, else the config's, else the built-in example. An empty name
    (``--kernel "$KERNEL"`` with the variable unset, ``kernel = ""``) is a usage error, never the
    built-in: a CI job must not go green on the wrong kernel."""
    for value, where in ((flag, "--kernel"), (configured, "kernel in the config")):
        if value is not None and not value.strip():
            raise UsageError(f"{where} is empty; name a kernel (built-in name, module:function or file.py:function)")
    return flag or configured or DEFAULT_KERNEL


def _cmd_check(args) -> int:
    from flamia_verify.config import load_config
    from flamia_verify.kernels import load_kernel
    from flamia_verify.properties import list_checks, run_checks
    from flamia_verify.reports import render_terminal, write_reports

    cfg = load_config(args.config)
    spec = _kernel_spec(args.kernel, cfg.kernel)
    if not (args.kernel or cfg.kernel) and os.environ.get("CI"):
        print(
            f"flamia-verify: note: no kernel named (--kernel or kernel = in the config): checking the built-in "
            f"example {DEFAULT_KERNEL}",
            file=sys.stderr,
        )
    suite = args.suite or cfg.suite
    recipe, device, dtype, seed, forward_only, out_dir = _run_options(args, cfg)
    only = args.only or cfg.only
    kernel = load_kernel(spec)
    out = _prepare_out(out_dir)

    from flamia_verify.reports.terminal import Heartbeat, check_line
    from flamia_verify.reports.wording import printable

    console = _console()
    plain = _plain(console)  # a CI log or a pipe: a line per finished check instead of a progress bar
    finished = []
    shown_recipe = recipe or kernel.recipe or "?"
    selected = {"total": None}

    def on_result(result):
        finished.append(result)
        if plain:
            line = check_line(result, len(finished), selected["total"], time.monotonic() - started)
            console.print(line, soft_wrap=True, crop=False)

    writes: dict[str, Any] = {"last": None, "cost": 0.0}

    def on_report(report_so_far):
        # marked incomplete: a run killed now leaves no verdict behind. Rendering grows with the checks
        # (the HTML plots): after the first write, the next comes once 4x its cost has passed, which keeps
        # the writes under a fifth of the run
        now = time.monotonic()
        if writes["last"] is not None and now - writes["last"] < 4 * writes["cost"]:
            return
        write_reports(report_so_far, out)
        writes["last"] = time.monotonic()
        writes["cost"] = writes["last"] - now

    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    total_checks = None
    try:
        total_checks = len([c for c in list_checks(suite)])
    except Exception:  # the list is only used for the progress bar
        total_checks = None
    progress = Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        TextColumn("{task.completed:.0f}/{task.total:.0f} checks"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=console,
        transient=True,
        disable=plain,
    )
    task = progress.add_task(f"{kernel.name}: starting", total=total_checks or 1)
    heartbeat = Heartbeat(console)

    def on_progress(event):
        name = getattr(event, "check", None) or getattr(event, "name", "")
        index = getattr(event, "index", 0) or 0
        total = getattr(event, "total", None) or total_checks or 1
        if plain and selected["total"] is None:  # the log says what runs before the first check finishes
            console.print(
                f"checking {printable(kernel.name)}  recipe {printable(shown_recipe)}  suite {suite}  seed {seed}  "
                f"device {device}: {getattr(event, 'total', None) or total_checks} checks",
                markup=False,
                soft_wrap=True,
                crop=False,
            )
        selected["total"] = getattr(event, "total", None) or selected["total"]
        heartbeat.update(event)
        done = event.overall * total if getattr(event, "overall", None) is not None else index + event.fraction
        progress.update(task, description=f"{kernel.name}: {name}", completed=min(done, total), total=total)

    def write_partial(partial) -> str | None:
        """Write the finished checks (marked incomplete); the one-line problem if that fails."""
        if partial is None:  # nothing finished: reports of an earlier run must not stand in for this one
            _remove_stale(out, _report_names())
            return None
        try:
            write_reports(partial, out)
        except OSError as werr:
            return _write_problem(werr, out)
        return None

    started = time.monotonic()
    _remove_stale(out, _report_names())  # an earlier run's reports must not stand in for this one, even if killed
    previous_term = _install(_on_sigterm)
    try:
        with progress, heartbeat if plain else contextlib.nullcontext():  # a log: a line at least every 30 s
            report = run_checks(
                kernel,
                recipe=recipe,
                suite=suite,
                device=device,
                dtype=dtype,
                seed=seed,
                only=only,
                thresholds=cfg.thresholds or None,
                threshold_source=cfg.source,
                on_progress=on_progress,
                on_result=on_result,
                on_report=on_report,
                case_timeout_s=cfg.case_timeout_s,
                forward_only=forward_only,
            )
        paths = write_reports(report, out)
    except KeyboardInterrupt as exc:  # SIGINT, or SIGTERM through _on_sigterm
        _INTERRUPTED[0] = True
        partial = getattr(exc, "partial_report", None)
        what = f"interrupted ({str(exc) or 'SIGINT'})"
        problem = write_partial(partial)
        if problem:
            return _fail(f"{what}; {problem}", EXIT_FAIL)
        if partial is None:
            return _fail(
                f"{what} before any check finished; the run is incomplete and no reports were written", EXIT_FAIL
            )
        render_terminal(partial, console, plain=plain)
        return _fail(
            f"{what} after {len(partial.checks)} checks; the run is incomplete: the reports in {out} say INCOMPLETE",
            EXIT_FAIL,
        )
    except KernelCrashError as exc:
        partial = getattr(exc, "partial_report", None)
        problem = write_partial(partial)
        where = (
            f" ({problem})"
            if problem
            else " (no check finished; no reports written)"
            if partial is None
            else f" (the {len(partial.checks)} finished checks written to {out}, marked INCOMPLETE)"
        )
        _print_tracebacks(args, partial.checks if partial is not None else (), crash=exc)
        return _fail(f"kernel {kernel.name!r} crashed: {exc}{where}", EXIT_KERNEL)
    except OSError as exc:  # a report file could not be written (a full disk): the run is incomplete
        return _fail(_write_problem(exc, out) + "; the run is incomplete", EXIT_FAIL)
    except BaseException as exc:
        write_partial(getattr(exc, "partial_report", None))
        raise
    finally:
        _install(previous_term)
    render_terminal(report, console, plain=plain)
    console.print(f"checked in {time.monotonic() - started:.1f} s; reports:", markup=False)
    for kind, path in paths.items():
        console.print(f"  {kind:<8} {path}", markup=False, soft_wrap=True)
    _print_tracebacks(args, report.checks)
    return EXIT_PASS if report.passed else EXIT_FAIL


def _install(handler):
    """Set the SIGTERM handler (None: leave it); returns the previous one. Only the main thread can."""
    import signal

    if handler is None:
        return None
    try:
        return signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread (e.g. called from a worker): keep the default
        return None


def _write_problem(exc: OSError, out: Path) -> str:
    path = exc.filename or out
    return f"cannot write {path}: {exc.strerror or exc}"


def _cmd_fuzz(args) -> int:
    """Fuzz (or replay one reproducer). The config's kernel, recipe, device, dtype, seed, out and
    forward_only apply as in check, the flags winning; its suite, only, thresholds and case_timeout_s
    are check's (fuzz judges every example against the rigorous bound and bitwise comparisons)."""
    from flamia_verify.config import load_config
    from flamia_verify.kernels import load_kernel
    from flamia_verify.properties import fuzz, replay_case
    from flamia_verify.reports import render_terminal, write_reports
    from flamia_verify.results import Report

    cfg = load_config(args.config)
    spec = args.kernel or cfg.kernel
    if not spec:
        raise UsageError('fuzz needs a kernel: --kernel SPEC (or kernel = "SPEC" in [tool.flamia-verify])')
    recipe, device, dtype, seed, forward_only, out_dir = _run_options(args, cfg)
    kernel = load_kernel(spec)
    console = _console()
    if args.replay:
        try:
            case = json.loads(Path(args.replay).read_text())
        except FileNotFoundError:
            raise UsageError(f"replay file {args.replay!r} does not exist") from None
        except OSError as exc:
            raise UsageError(f"cannot read replay file {args.replay!r}: {exc.strerror or exc}") from None
        except UnicodeDecodeError:
            raise UsageError(f"replay file {args.replay!r} is not UTF-8 text") from None
        except json.JSONDecodeError as exc:
            raise UsageError(f"replay file {args.replay!r} is not JSON: {exc}") from None
        if not isinstance(case, dict):
            raise UsageError(f"replay file {args.replay!r} must hold one JSON object (a fuzz reproducer)")
        out = _prepare_out(out_dir)
        # the recipe: --recipe, else the one the reproducer ran with, else the config's, else the kernel's
        replay_recipe = args.recipe or (None if case.get("recipe") else cfg.recipe)
        _warn_other_replay(args.replay, case, kernel.name, replay_recipe or case.get("recipe") or kernel.recipe)
        try:
            replayed = replay_case(kernel, case, recipe=replay_recipe, device=device)
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
        render_terminal(report, console, plain=_plain(console))
        console.print(f"replayed {args.replay} with recipe {report.recipe}; reports:", markup=False, soft_wrap=True)
        for kind, path in paths.items():
            console.print(f"  {kind:<8} {path}", markup=False, soft_wrap=True)
        _print_tracebacks(args, report.checks)
        return EXIT_PASS if report.passed else EXIT_FAIL
    if args.examples < 1:
        raise UsageError(f"--examples must be at least 1, got {args.examples}")
    out = _prepare_out(out_dir)
    try:
        result = fuzz(
            kernel,
            recipe=recipe,
            examples=args.examples,
            seed=seed,
            device=device,
            dtype=dtype,
            forward_only=forward_only,
        )
    except KernelCrashError:
        _remove_stale(out, _report_names() + ("fuzz-case.json",))
        raise
    paths = write_reports(result.report, out)
    if not getattr(result, "reproducer", None):  # a passing run leaves no earlier run's reproducer behind
        _remove_stale(out, ("fuzz-case.json",))
    render_terminal(result.report, console, plain=_plain(console))
    if getattr(result, "reproducer", None):
        case_path = out / "fuzz-case.json"
        tmp = case_path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(result.reproducer, indent=2, sort_keys=True))
        tmp.replace(case_path)
        console.print(f"minimal failing case: {case_path}", markup=False, soft_wrap=True)
        console.print(
            f"rerun it with: flamia-verify fuzz --kernel {spec} --replay {case_path}", markup=False, soft_wrap=True
        )
    for kind, path in paths.items():
        console.print(f"  {kind:<8} {path}", markup=False, soft_wrap=True)
    _print_tracebacks(args, result.report.checks)
    return EXIT_PASS if result.report.passed else EXIT_FAIL


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


def _cmd_bench(args) -> int:
    import torch

    if not torch.cuda.is_available():
        raise ConfigError("bench measures GPU speed and needs a CUDA device; none is available here")
    if any(n <= 0 for n in args.seqlens) or args.rep_ms <= 0:
        raise UsageError("--seqlens and --rep-ms take positive numbers")
    for path in (args.md, args.json):  # a bad output path ends the command before minutes of timing
        if path and not Path(path).resolve().parent.is_dir():
            raise UsageError(f"cannot write {path!r}: its directory does not exist")
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from flamia_verify.bench import bench_table, format_table, resolve_kernel
    from flamia_verify.reports.terminal import print_table
    from flamia_verify.results import jsonable

    # each spec is loaded once, here: one that does not load ends the command before any timing (exit 3)
    kernels = [resolve_kernel(spec) for spec in (args.kernel or ["bf16", "fp8", "flamia-mxfp8", "flamia-nvfp4"])]
    console = _console()
    progress = Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        TextColumn("{task.completed:.0f}/{task.total:.0f} measurements"),
        TimeElapsedColumn(),
        console=console,
        transient=True,
        disable=not console.is_terminal,
    )
    task = progress.add_task("bench", total=1)
    causal = {"both": (True, False), "true": (True,), "false": (False,)}[args.causal]
    with progress:
        rows = bench_table(
            kernels,
            device=args.device,
            seqlens=tuple(args.seqlens),
            causal=causal,
            rep_ms=args.rep_ms,
            progress=lambda done, total, label: progress.update(task, description=label, completed=done, total=total),
        )
    print_table(
        console,
        "attention speed (TFLOP/s; ratio: to the fastest BF16 SDPA baseline, ratio_bf16: to the fused bf16 kernel)",
        [str(col) for col in (rows[0] if rows else [])],
        [[f"{v:.3g}" if isinstance(v, float) else str(v) for v in row.values()] for row in rows],
    )
    tokens = sorted({r["batch"] * r["seqlen"] for r in rows})
    header = (
        f"{torch.cuda.get_device_name()}, torch {torch.__version__}, B*S = "
        f"{' or '.join(map(str, tokens))} tokens, H = 16, D = 128, bf16"
    )
    if args.md:
        Path(args.md).write_text(header + "\n\n" + format_table(rows) + "\n")
    if args.json:
        # strict JSON, non-finite numbers as "nan"/"inf" strings, as in report.json
        Path(args.json).write_text(
            json.dumps(jsonable({"header": header, "rows": rows}), indent=1, allow_nan=False, default=str)
        )
    return EXIT_PASS


def _cmd_compare(args) -> int:
    from flamia_verify.config import load_config
    from flamia_verify.reports import compare_reports, load_report, render_comparison

    cfg = load_config(args.config)
    factor = args.factor if args.factor is not None else cfg.compare_factor
    from flamia_verify.settings import compare_factor

    factor = compare_factor(factor, "--factor")
    base, new = load_report(args.base), load_report(args.new)
    cmp = compare_reports(base, new, factor=factor, allow_missing=args.allow_missing)
    render_comparison(cmp, _console())
    return cmp.exit_code


def _cmd_report(args) -> int:
    """Render a report.json again: exit 0 once rendered. A re-render is not a verdict; the run that
    wrote the report gave that exit code (and ``compare`` gates one report against another)."""
    from flamia_verify.reports import load_report, render_html, render_junit, render_markdown, render_terminal
    from flamia_verify.reports.store import atomic_write_text

    report = load_report(args.report)
    if not args.html and not args.md and not args.junit:
        console = _console()
        render_terminal(report, console, plain=_plain(console))
    for target, render in ((args.html, render_html), (args.md, render_markdown), (args.junit, render_junit)):
        if not target:
            continue
        if Path(target).is_dir():
            raise UsageError(f"{target!r} is a directory; give a file name")
        try:
            atomic_write_text(Path(target), render(report))
        except OSError as exc:
            raise UsageError(f"cannot write {target!r}: {exc.strerror or exc}") from None
    return EXIT_PASS


def _cuda_path(kernel) -> str:
    """What a built-in kernel runs on CUDA bf16/fp16 inputs: its fused Triton kernels (up to which
    head_dim) or its PyTorch emulation (and why)."""
    from flamia_verify.kernels.metadata import kernel_design
    from flamia_verify.kernels.triton.config import config_for, head_dim_limit, unsupported_reason

    design = kernel_design(kernel.fn)
    if design is None:
        return ""
    why = unsupported_reason(design)
    if why is not None:
        return f"emulation ({why})"
    return f"fused Triton, head_dim 32-{head_dim_limit(config_for(design))}"


def _cmd_list(args) -> int:
    from flamia_verify.kernels import RECIPES, builtin_kernels
    from flamia_verify.kernels.adapters import ADAPTERS
    from flamia_verify.kernels.loader import entry_point_kernels
    from flamia_verify.properties import list_checks
    from flamia_verify.reports.terminal import print_table

    console = _console()  # a rich table on a terminal; plain, full lines in a log or a pipe
    if getattr(args, "coverage", False):
        return _print_coverage(console)
    kernels = [
        [name, k.recipe or "", "built-in", _cuda_path(k), k.description] for name, k in builtin_kernels().items()
    ]
    kernels += [[name, "", "entry point", "", ""] for name in sorted(entry_point_kernels())]
    print_table(console, "kernels", ["name", "recipe", "source", "on CUDA", "description"], kernels)
    adapters = [[a.name, a.recipe, a.unavailable() or "available", a.runs_on, a.description] for a in ADAPTERS.values()]
    print_table(console, "adapters (library kernels)", ["name", "recipe", "here", "runs on", "description"], adapters)
    print_table(console, "recipes", ["name", "description"], [[name, rec.description] for name, rec in RECIPES.items()])
    checks = [
        [spec.name, ",".join(getattr(spec, "suites", ()) or ()), spec.description] for spec in list_checks("full")
    ]
    print_table(console, "checks (suite: full)", ["check", "suites", "question"], checks)
    return EXIT_PASS


def _print_coverage(console) -> int:
    from flamia_verify.properties import list_checks
    from flamia_verify.properties.coverage import INVARIANCES, MODEL
    from flamia_verify.reports.terminal import print_table

    suites = {spec.name: spec.suites for spec in list_checks("full")}

    def where(checks) -> str:
        return ", ".join(f"{c} ({'/'.join(s[0] for s in suites.get(c, ()))})" for c in checks)

    rows = [[r.dimension, r.value, r.meaning, where(r.checks)] for r in MODEL]
    print_table(
        console,
        "input dimensions (checks: q quick, s standard, f full)",
        ["dimension", "value", "meaning", "exercised by"],
        rows,
    )
    rows = [[r.value, r.meaning, where(r.checks)] for r in INVARIANCES]
    print_table(console, "invariances", ["invariance", "statement", "stated by"], rows)
    return EXIT_PASS


def _cmd_mutate(args) -> int:
    from flamia_verify.mutation.cli import run

    return run(args)


def _cmd_train_parity(args) -> int:
    from flamia_verify.training.cli import run

    return run(args)


def _cmd_sweep(args) -> int:
    from flamia_verify.sweep.cli import run

    return run(args)


def _cmd_survey(args) -> int:
    from flamia_verify.sweep.cli import run_survey_command

    return run_survey_command(args)


_COMMANDS = {
    "check": _cmd_check,
    "fuzz": _cmd_fuzz,
    "bench": _cmd_bench,
    "compare": _cmd_compare,
    "report": _cmd_report,
    "list": _cmd_list,
    "mutate": _cmd_mutate,
    "train-parity": _cmd_train_parity,
    "sweep": _cmd_sweep,
    "survey": _cmd_survey,
}


#: set when a run was interrupted mid-kernel (SIGINT/SIGTERM): see main()
_INTERRUPTED = [False]


def main(argv: list[str] | None = None) -> int:
    """Run the command; ``argv`` None means the process's own arguments (the console script).

    A run interrupted inside a kernel call can leave native threads of the kernel's libraries (torch's
    autograd engine, a CUDA context) mid-operation; tearing the interpreter down then may abort the
    process ("terminate called without an active exception", exit -6) after the reports are written
    and the exit code is decided. As a program, an interrupted run therefore ends with os._exit and
    its own exit code once stdout and stderr are flushed; called from Python (``argv`` given), it
    returns the code as usual.
    """
    try:
        code = _main(argv)
    except KeyboardInterrupt:  # before the command ran (Ctrl-C while torch imports): as any interruption
        _INTERRUPTED[0] = True
        code = _fail("interrupted", EXIT_FAIL)
    finally:
        _remove_unused_out()
    if argv is None and _INTERRUPTED[0]:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def _main(argv: list[str] | None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    try:
        return _COMMANDS[args.command](args)
    except KernelLoadError as exc:
        return _fail(str(exc), EXIT_KERNEL)
    except KernelCrashError as exc:
        _print_tracebacks(args, crash=exc)
        return _fail(f"kernel crashed: {exc}", EXIT_KERNEL)
    except FlamiaVerifyError as exc:
        return _fail(str(exc), exc.exit_code)
    except KeyboardInterrupt:  # an interrupted run: one line, exit 1 (the documented contract)
        _INTERRUPTED[0] = True
        return _fail("interrupted", EXIT_FAIL)
    except BrokenPipeError:  # the reader of stdout went away (`| head`): stop quietly, as a shell tool does
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # Python's final flush of stdout must not raise again
        return EXIT_BROKEN_PIPE
    except OSError as exc:  # a file the command reads or writes (reports, --out): not the kernel's failure
        where = f" {exc.filename!r}" if exc.filename else ""
        return _fail(f"cannot access{where}: {exc.strerror or exc}", EXIT_USAGE)


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
