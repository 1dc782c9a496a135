"""``flamia-verify check``: run the checks on a kernel beside a float64 reference and write the reports."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from flamia_verify.commands.common import (
    DEFAULT_KERNEL,
    EXIT_FAIL,
    EXIT_KERNEL,
    EXIT_PASS,
    TRACEBACK_HELP,
    Interrupted,
    add_threads_argument,
    console,
    created_out,
    device_arg,
    device_metavar,
    fail,
    kernel_choices,
    load_config,
    plain,
    prepare_out,
    print_tracebacks,
    remove_stale,
    report_names,
    run_options,
    write_problem,
)
from flamia_verify.commands.supervise import channel as supervisor_channel
from flamia_verify.errors import KernelCrashError, UsageError
from flamia_verify.results import partial_report

__all__ = ["add_parser", "run", "CheckReporter", "PartialReports"]

DESCRIPTION = """\
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

EPILOG = """\
exit codes: 0 every gating check passed (and every check of a verdict named by --require); 1 such
a check failed or errored, or the run is incomplete
(interrupted by SIGINT/SIGTERM, or the reports could not be written: one line names the file);
2 bad usage or configuration; 3 the kernel could not be loaded or crashed, also by ending its
process (os._exit, a segfault, abort: the checks run in a child process, so the finished ones are
written and one line names the exit code or signal and the check). The reports of an incomplete run
say INCOMPLETE and keep the checks that finished.

environment: FLAMIA_VERIFY_IN_PROCESS=1 runs the checks in this process (a profiler, a debugger)."""


def add_parser(sub: Any) -> None:
    from flamia_verify.settings import CLI_DTYPES, SUITES

    builtins, recipes = kernel_choices()
    c = sub.add_parser(
        "check",
        help="run the checks on a kernel and write reports",
        description=DESCRIPTION,
        epilog=EPILOG,
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
        metavar=device_metavar(),
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
        "--inputs",
        metavar="CAPTURE_DIR",
        help="check on the attention calls a model recorded (flamia_verify.capture) instead of the suite's "
        "cases: error, bound, consistency, causal and isolation on every call; --only selects among them",
    )
    c.add_argument(
        "--forward-only",
        action="store_true",
        default=None,
        help="declare a kernel without a backward: its backward is never called, the gradient checks "
        "skip and the reports say gradients were not checked (config: forward_only = true). "
        "Without it, a kernel whose backward is missing or raises fails",
    )
    c.add_argument(
        "--require",
        nargs="+",
        metavar="VERDICT",
        choices=["reproducibility", "robustness"],
        help="gate on these verdicts too: reproducibility (bitwise under repeated runs, other layouts, "
        "max_seqlen, autocast), robustness (inputs no training run produces: NaN in q, softmax_scale=0, "
        "packs without queries). Both are always run and reported; without --require only the gating "
        "verdict sets the exit code (config: require = [...])",
    )
    add_threads_argument(c)
    c.add_argument("--traceback", action="store_true", help=TRACEBACK_HELP)


def kernel_spec(flag: str | None, configured: str | None, source: str | None = None) -> str:
    """The kernel a check runs: --kernel, else the config's (read from ``source``), else the built-in
    example. An empty name (``--kernel "$KERNEL"`` with the variable unset, ``kernel = ""``) is a usage
    error, never the built-in: a CI job must not go green on the wrong kernel."""
    in_config = f"kernel in {source}" if source else "kernel in the config"
    for value, where in ((flag, "--kernel"), (configured, in_config)):
        if value is not None and not value.strip():
            raise UsageError(f"{where} is empty; name a kernel (built-in name, module:function or file.py:function)")
    return flag or configured or DEFAULT_KERNEL


class CheckReporter:
    """What a running check shows on the console: a progress bar on a terminal; on a plain console (a
    CI log, a pipe) a header line before the first check finishes, a line per finished check and a
    ``still running`` heartbeat at least every 30 s; then the verdict and where the reports are.

    Hand :meth:`on_progress` and :meth:`on_result` to the engine and run it inside :meth:`live`."""

    def __init__(
        self, console: Any, *, kernel: str, recipe: str, suite: str, seed: int, device: str, total_checks: int | None
    ) -> None:
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

        from flamia_verify.reports.terminal import Heartbeat

        self.console = console
        self.plain = plain(console)  # a CI log or a pipe: a line per finished check instead of a progress bar
        self.kernel, self.recipe, self.suite, self.seed, self.device = kernel, recipe, suite, seed, device
        self.total_checks = total_checks
        self.require: list[str] = []  # the verdicts required beside gating, for each line's status
        self.finished: list[Any] = []
        self.selected: int | None = None  # the number of checks the run selected, once it says
        self.progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            TextColumn("{task.completed:.0f}/{task.total:.0f} checks"),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            console=console,
            transient=True,
            disable=self.plain,
        )
        self.task = self.progress.add_task(f"{kernel}: starting", total=total_checks or 1)
        self.heartbeat = Heartbeat(console)
        self.started = time.monotonic()

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    @contextlib.contextmanager
    def live(self) -> Iterator[None]:
        """The progress bar on a terminal; the heartbeat in a log (a line at least every 30 s)."""
        with self.progress, self.heartbeat if self.plain else contextlib.nullcontext():
            yield

    def on_progress(self, event: Any) -> None:
        from flamia_verify.reports.wording import printable

        name = getattr(event, "check", None) or getattr(event, "name", "")
        index = getattr(event, "index", 0) or 0
        total = getattr(event, "total", None) or self.total_checks or 1
        if self.plain and self.selected is None:  # the log says what runs before the first check finishes
            count = getattr(event, "total", None) or self.total_checks
            self.console.print(
                f"checking {printable(self.kernel)}  recipe {printable(self.recipe)}  suite {self.suite}  "
                f"seed {self.seed}  device {self.device}: {count} check{'' if count == 1 else 's'}",
                markup=False,
                soft_wrap=True,
                crop=False,
            )
        self.selected = getattr(event, "total", None) or self.selected
        self.heartbeat.update(event)
        done = event.overall * total if getattr(event, "overall", None) is not None else index + event.fraction
        self.progress.update(self.task, description=f"{self.kernel}: {name}", completed=min(done, total), total=total)

    def on_result(self, result: Any) -> None:
        from flamia_verify.reports.terminal import check_line

        self.finished.append(result)
        if self.plain:
            line = check_line(result, len(self.finished), self.selected, self.elapsed(), self.require)
            self.console.print(line, soft_wrap=True, crop=False)

    def show(self, report: Any) -> None:
        """The report's verdict and table."""
        from flamia_verify.reports import render_terminal

        render_terminal(report, self.console, plain=self.plain)

    def finish(self, report: Any, paths: dict[str, Path]) -> None:
        """The verdict, the run's time and where its reports are."""
        self.show(report)
        self.console.print(f"checked in {self.elapsed():.1f} s; reports:", markup=False)
        for kind, path in paths.items():
            self.console.print(f"  {kind:<8} {path}", markup=False, soft_wrap=True)


class PartialReports:
    """The reports of a run as it goes, in ``out``: marked incomplete, so that a run killed now leaves
    no verdict behind. Rendering grows with the checks (the HTML plots): after the first write, the
    next comes once 4x its cost has passed (:meth:`on_report`), which keeps the writes under a fifth of
    the run."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.last: float | None = None
        self.cost = 0.0

    def on_report(self, report_so_far: Any) -> None:
        from flamia_verify.reports import write_reports

        now = time.monotonic()
        if self.last is not None and now - self.last < 4 * self.cost:
            return
        write_reports(report_so_far, self.out)
        self.last = time.monotonic()
        self.cost = self.last - now

    def write(self, partial: Any) -> str | None:
        """Write the finished checks of a run that stopped (marked incomplete); the one-line problem if
        that fails."""
        from flamia_verify.reports import write_reports

        if partial is None:  # nothing finished: reports of an earlier run must not stand in for this one
            remove_stale(self.out, report_names())
            return None
        try:
            write_reports(partial, self.out)
        except OSError as werr:
            return write_problem(werr, self.out)
        return None


def run(args: argparse.Namespace) -> int:
    from flamia_verify.properties import RunSpec, run_spec
    from flamia_verify.properties.harness import exit_when_stuck, on_stuck_watchdog
    from flamia_verify.reports import write_reports

    cfg = load_config(args.config)
    spec = kernel_spec(args.kernel, cfg.kernel, cfg.source)
    if not (args.kernel or cfg.kernel) and os.environ.get("CI"):
        print(
            f"flamia-verify: note: no kernel named (--kernel or kernel = in the config): checking the built-in "
            f"example {DEFAULT_KERNEL}",
            file=sys.stderr,
        )
    recipe, device, dtype, seed, forward_only, out_dir = run_options(args, cfg)
    inputs = getattr(args, "inputs", None)
    captured = None
    if inputs is not None:  # a bad capture is one line and exit 2, before the kernel or --out is touched
        from flamia_verify.properties.cases import captured_cases

        captured = captured_cases(inputs)
    chan = supervisor_channel()  # a supervised child: tell the supervisor what runs (a crash is reported)
    if chan is not None:
        chan.send(phase="load", kernel=spec)
    plan = RunSpec.resolve(
        spec,
        recipe=recipe,
        suite=args.suite or cfg.suite,
        device=device,
        dtype=dtype,
        seed=seed,
        only=args.only or cfg.only,
        thresholds=cfg.thresholds or None,
        threshold_source=cfg.source,
        case_timeout_s=cfg.case_timeout_s,
        forward_only=forward_only,
        require=args.require if args.require is not None else cfg.require,
        threads=args.threads,
        inputs=inputs,
        captured=captured,
    )
    out = prepare_out(out_dir)
    reporter = CheckReporter(
        console(),
        kernel=plan.kernel.name,
        recipe=plan.recipe.name,
        suite=plan.suite,
        seed=plan.seed,
        device=plan.device,
        total_checks=len(plan.checks),
    )
    reporter.require = list(plan.require)
    partial_reports = PartialReports(out)
    remove_stale(out, report_names())  # an earlier run's reports must not stand in for this one, even if killed
    on_progress, on_result, on_start = reporter.on_progress, reporter.on_result, None
    if chan is not None:
        chan.send(
            phase="probe",
            kernel=plan.kernel.name,
            out=os.path.abspath(out),
            out_shown=str(out),
            created=created_out(),
            traceback=bool(args.traceback),
        )
        on_progress, on_result, on_start = (
            _both(chan.on_progress, on_progress),
            _both(chan.on_result, on_result),
            chan.on_start,
        )
    # a supervised child keeps the SIGTERM handler it started with (the first SIGINT or SIGTERM counts)
    previous_term = _install_sigterm(_on_sigterm if chan is None else None)
    previous_grace = exit_when_stuck(STUCK_GRACE_S)  # a kernel holding the GIL past its limit: exit 1
    previous_listener = on_stuck_watchdog(chan.on_watchdog) if chan is not None else None
    try:
        with reporter.live():
            report = run_spec(
                plan,
                on_progress=on_progress,
                on_result=on_result,
                on_report=partial_reports.on_report,
                on_start=on_start,
            )
        if chan is not None:
            chan.send(phase="finish")
        paths = write_reports(report, out)
    except KeyboardInterrupt as exc:  # SIGINT, or SIGTERM through _on_sigterm
        partial = partial_report(exc)
        what = f"interrupted ({str(exc) or 'SIGINT'})"
        problem = partial_reports.write(partial)
        if problem:
            said = f"{what}; {problem}"
        elif partial is None:
            said = f"{what} before any check finished; the run is incomplete and no reports were written"
        else:
            reporter.show(partial)
            said = (
                f"{what} after {len(partial.checks)} checks; the run is incomplete: the reports in {out} say INCOMPLETE"
            )
        raise Interrupted(fail(said, EXIT_FAIL)) from None
    except KernelCrashError as exc:
        partial = partial_report(exc)
        problem = partial_reports.write(partial)
        where = (
            f" ({problem})"
            if problem
            else " (no check finished; no reports written)"
            if partial is None
            else f" (the {len(partial.checks)} finished checks written to {out}, marked INCOMPLETE)"
        )
        print_tracebacks(args, partial.checks if partial is not None else (), crash=exc)
        return fail(f"kernel {plan.kernel.name!r} crashed: {exc}{where}", EXIT_KERNEL)
    except OSError as exc:  # a report file could not be written (a full disk): the run is incomplete
        return fail(write_problem(exc, out) + "; the run is incomplete", EXIT_FAIL)
    except BaseException as exc:
        partial_reports.write(partial_report(exc))
        raise
    finally:
        _install_sigterm(previous_term)
        exit_when_stuck(previous_grace)
        if chan is not None:
            on_stuck_watchdog(previous_listener)
    reporter.finish(report, paths)
    print_tracebacks(args, report.checks)
    return EXIT_PASS if report.passed else EXIT_FAIL


#: seconds past case_timeout_s after which a kernel call that holds the GIL (so that not even the
#: timeout can be acted on) ends the process: exit 1 with every thread's traceback on stderr, the
#: reports as last written (INCOMPLETE). A caller that only needs the GIL back gets it in milliseconds.
STUCK_GRACE_S = 10.0


class _Terminated(KeyboardInterrupt):
    """SIGTERM, turned into an interruption so that the finished checks are written, marked incomplete."""


def _on_sigterm(signum: int, frame: Any) -> None:
    raise _Terminated("SIGTERM")


def _both(first: Any, second: Any) -> Any:
    """A callback that calls ``first``, then ``second``."""

    def both(value: Any) -> None:
        first(value)
        second(value)

    return both


def _install_sigterm(handler: Any) -> Any:
    """Set the SIGTERM handler (None: leave it); returns the previous one. Only the main thread can."""
    import signal

    if handler is None:
        return None
    try:
        return signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread (e.g. called from a worker): keep the default
        return None
