"""What the commands share: exit codes, the console, the output directory, the config reader, the
run options of check and fuzz, the kernel tracebacks of --traceback, and the sweep backends' options.

Nothing here imports torch at module level (flamia_verify.settings does): the command line imports
the commands before it parses, and a Ctrl-C while torch imports must reach ``main()`` as any
interruption (one line, exit 1), not as a traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from flamia_verify.errors import ConfigError, UsageError

if TYPE_CHECKING:
    from flamia_verify.config import Config
    from flamia_verify.results import SweepResult

__all__ = [
    "EXIT_PASS",
    "EXIT_FAIL",
    "EXIT_USAGE",
    "EXIT_KERNEL",
    "EXIT_BROKEN_PIPE",
    "DEFAULT_KERNEL",
    "TRACEBACK_HELP",
    "device_metavar",
    "device_arg",
    "kernel_choices",
    "console",
    "plain",
    "fail",
    "Interrupted",
    "must_exit",
    "prepare_out",
    "remove_unused_out",
    "created_out",
    "write_problem",
    "remove_stale",
    "report_names",
    "print_tracebacks",
    "load_config",
    "RunOptions",
    "run_options",
    "add_backend_arguments",
    "case_progress_printer",
]

EXIT_PASS, EXIT_FAIL, EXIT_USAGE, EXIT_KERNEL = 0, 1, 2, 3
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE: what a shell reports for a writer whose reader closed the pipe
DEFAULT_KERNEL = "flamia-mxfp8"

TRACEBACK_HELP = (
    "print the full traceback of each exception the kernel raised to stderr (report.json keeps it "
    "in the worst case of the check either way)"
)


# ---------------------------------------------------------------------------------------------- options


def device_metavar() -> str:
    """How --device shows its values in --help."""
    from flamia_verify.settings import DEVICES

    return "{" + ",".join(DEVICES) + "}"


def device_arg(text: str) -> str:
    """argparse type of ``--device``: a name of :data:`flamia_verify.settings.DEVICES`, checked here
    (exit 2 naming the accepted values) and resolved against the machine's devices when the command runs."""
    from flamia_verify.settings import check_device

    try:
        return check_device(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def kernel_choices() -> tuple[str, str]:
    """The built-in kernels and the recipes as the registry has them (comma-separated), so that --help
    never drifts from it."""
    from flamia_verify.kernels import builtin_kernels
    from flamia_verify.recipes import RECIPES

    return ", ".join(builtin_kernels()), ", ".join(RECIPES)


# ---------------------------------------------------------------------------------------------- output


def console(stderr: bool = False) -> Any:
    """A rich console whose broken pipe (``| head``) ends the command with EXIT_BROKEN_PIPE (see main())."""
    from rich.console import Console

    class _CliConsole(Console):
        def on_broken_pipe(self) -> None:
            raise BrokenPipeError

    return _CliConsole(stderr=stderr, highlight=False)


def plain(console: Any) -> bool:
    """Plain, unwrapped lines for a console that is not an interactive terminal (a CI log, a pipe)."""
    from flamia_verify.reports.terminal import is_plain

    return is_plain(console)


def fail(message: str, code: int) -> int:
    """One line on stderr; returns ``code``."""
    sys.stderr.write(f"flamia-verify: {message}\n")
    return code


class Interrupted(Exception):
    """A command interrupted mid-run (SIGINT, SIGTERM) that has written what it could and said so on
    stderr: ``code`` is its exit code. main() ends the process with os._exit (see :func:`must_exit`)."""

    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.code = code


def must_exit(interrupted: bool) -> bool:
    """Whether main() must end the process with os._exit (its exit code, stdout and stderr flushed)
    instead of returning: a run ``interrupted`` mid-kernel, or kernel calls still running after their
    time limit (case_timeout_s), whose threads Python can neither kill nor safely shut down beside (said
    in one line on stderr). Asked once, when the command has ended and its reports are written."""
    left = _calls_left_running()
    return interrupted or left > 0


def _calls_left_running() -> int:
    # the harness is loaded only once a command called a kernel: no need to import torch to know
    harness = sys.modules.get("flamia_verify.properties.harness")
    left = harness.calls_left_running() if harness is not None else 0
    if left:
        sys.stderr.write(
            f"flamia-verify: {left} kernel call(s) still running after their time limit; "
            "exiting without waiting for them\n"
        )
    return int(left)


# ---------------------------------------------------------------------------------------------- --out

#: the directories prepare_out created, outermost first: main() removes those still empty when the
#: command ends (remove_unused_out), so that a usage error found after --out was prepared (an unknown
#: --only name, a kernel without a recipe) leaves nothing behind
_CREATED_OUT: list[Path] = []


def prepare_out(out: str) -> Path:
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


def write_problem(exc: OSError, out: Any) -> str:
    """One line for a file that could not be written (a full disk): the file, else ``out``."""
    return f"cannot write {exc.filename or out}: {exc.strerror or exc}"


def created_out() -> list[str]:
    """The directories prepare_out created, outermost first."""
    return [str(d) for d in _CREATED_OUT]


def remove_unused_out() -> None:
    """Remove the directories prepare_out created that are still empty."""
    while _CREATED_OUT:
        try:
            _CREATED_OUT.pop().rmdir()  # deepest first; a directory the run wrote into is not empty and stays
        except OSError:
            pass


def remove_stale(out: Path, names: Any) -> None:
    """Remove files an earlier run left in ``out`` that this run did not replace."""
    for name in names:
        try:
            (out / name).unlink(missing_ok=True)
        except OSError as exc:
            raise UsageError(f"cannot remove the stale {str(out / name)!r}: {exc.strerror or exc}") from None


def report_names() -> tuple[str, ...]:
    """The file names of the reports check and fuzz write."""
    from flamia_verify.reports.store import REPORT_FILES

    return tuple(REPORT_FILES.values())


def print_tracebacks(args: argparse.Namespace, checks: Any = (), crash: BaseException | None = None) -> None:
    """--traceback: print to stderr the full traceback of each exception the kernel raised, as the
    checks' worst cases keep it, and of the one behind a crash. One block per place in the kernel that
    raised (the same frames), naming every check that met it; where those checks' messages differ
    (e.g. the shape in the text), the first is printed in full and the others' last lines follow."""
    if not getattr(args, "traceback", False):
        return
    places: dict[tuple[str, ...], list[tuple[str, str]]] = {}
    for check in checks:
        trace = (check.worst_case or {}).get("traceback")
        if isinstance(trace, str) and trace:
            places.setdefault(_frames(trace), []).append((check.name, trace))
    cause = crash.__cause__ if crash is not None else None
    if cause is not None:
        trace = getattr(cause, "traceback", None) or "".join(traceback.format_exception(cause))
        places.setdefault(_frames(trace), []).append(("the crash", trace))
    for met in places.values():
        names = list(dict.fromkeys(name for name, _ in met))
        first = met[0][1]
        sys.stderr.write(f"flamia-verify: the kernel's exception in {', '.join(names)}:\n{first}")
        if not first.endswith("\n"):
            sys.stderr.write("\n")
        for name, trace in met[1:]:
            if trace != first:
                last = trace.rstrip("\n").rpartition("\n")[2]
                sys.stderr.write(f"  (in {name}, the same place raised: {last})\n")


def _frames(trace: str) -> tuple[str, ...]:
    """The frame lines of a traceback text (file, line, function): where it was raised, without the
    exception's message."""
    return tuple(line for line in trace.splitlines() if line.startswith("  File ")) or (trace,)


# ---------------------------------------------------------------------------------------------- config


def load_config(path: str | Path | None = None, *, search_dir: str | Path = ".") -> Config:
    """The command line's config reader: :func:`flamia_verify.config.read_config`, with the threshold
    tables checked against the registered checks and the train_parity preset against the presets (a
    problem in either is a configuration error, exit 2, whichever command reads the file)."""
    from flamia_verify.config import read_config

    return read_config(path, search_dir=search_dir, check_thresholds=_check_thresholds, check_preset=_check_preset)


def _check_thresholds(table: dict[str, Any], where: str) -> dict[str, Any]:
    # check names, keys and kinds (numbers; true/false for options) against the registered checks
    from flamia_verify.properties.thresholds import validate_overrides

    return validate_overrides(table, where)


def _check_preset(value: str, where: str) -> None:
    from flamia_verify.training.parity import PRESETS

    if value not in PRESETS:
        raise ConfigError(f"{where}: preset = {value!r} is not one of {', '.join(PRESETS)}")


class RunOptions(NamedTuple):
    """What check and fuzz both take from a flag, or else from the config file, as written there: the
    run resolves them once (:class:`flamia_verify.properties.run_spec.RunSpec`)."""

    recipe: str | None
    device: str
    dtype: Any
    seed: int
    forward_only: bool
    out: str


def run_options(args: argparse.Namespace, cfg: Config) -> RunOptions:
    return RunOptions(
        recipe=args.recipe or cfg.recipe,
        device=args.device or cfg.device,
        dtype=args.dtype or cfg.dtype,
        seed=args.seed if args.seed is not None else cfg.seed,
        forward_only=bool(args.forward_only or cfg.forward_only),
        out=cfg.out if args.out is None else args.out,
    )


def add_threads_argument(p: argparse.ArgumentParser) -> None:
    """``--threads N``: torch's intra-op CPU threads of the run (check, fuzz)."""
    from flamia_verify.settings import DEFAULT_THREADS

    p.add_argument(
        "--threads",
        type=positive_int,
        default=DEFAULT_THREADS,
        metavar="N",
        help=f"torch's CPU threads for the run (default {DEFAULT_THREADS}: the cases are small, and more threads "
        "are several times slower on a machine other jobs share; the report records the count)",
    )


def positive_int(text: str) -> int:
    """An argparse type: an integer of at least 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


# ---------------------------------------------------------------------------------------------- sweep backends


def add_backend_arguments(s: argparse.ArgumentParser, what: str, default_timeout: str) -> None:
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


def case_progress_printer() -> tuple[Any, Any]:
    """sweep's and survey's progress: one line per finished case on stderr (a terminal or a CI log alike)."""

    def on_start(total: int, reused: int, to_run: int) -> None:
        print(f"sweep: {total} case(s), {reused} already in the store, {to_run} to run", file=sys.stderr, flush=True)

    def on_result(result: SweepResult, done: int, to_run: int) -> None:
        from flamia_verify.reports.survey import case_label

        status = result.status.upper()
        extra = f": {result.error}" if result.error else ""
        print(
            f"[{done}/{to_run}] {status:<10} {case_label(result.case)} ({result.elapsed_s or 0:.1f} s){extra}",
            file=sys.stderr,
            flush=True,
        )

    return on_start, on_result
