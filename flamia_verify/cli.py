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

This module parses the command line and dispatches; each command lives in its own module of
:mod:`flamia_verify.commands` (its arguments and its run), what they share in
:mod:`flamia_verify.commands.common`.

Exit codes: 0 every check passed; 1 at least one check failed or errored, or the run did not complete
(interrupted by SIGINT or SIGTERM, or its reports could not be written); 2 bad usage or configuration;
3 the kernel could not be loaded or crashed (also by ending its process: ``check`` runs in a child
process, :mod:`flamia_verify.commands.supervise`). Errors print one line to stderr (--traceback adds the
kernel's own tracebacks). The reports of a run that did not complete say INCOMPLETE (report.json:
summary.complete false, summary.status "incomplete"). ``report`` exits 0 once it has rendered, whatever
the verdict of the report it renders.
"""

from __future__ import annotations

import argparse
import errno
import os
import sys
from types import ModuleType

from flamia_verify._version import __version__
from flamia_verify.commands.common import (
    EXIT_BROKEN_PIPE,
    EXIT_FAIL,
    EXIT_KERNEL,
    EXIT_USAGE,
    Interrupted,
    device_arg,
    device_metavar,
    fail,
    must_exit,
    print_tracebacks,
    remove_unused_out,
    write_problem,
)
from flamia_verify.commands.supervise import child_done, process_end, start_child, supervise, wanted
from flamia_verify.errors import FlamiaVerifyError, KernelCrashError, KernelLoadError

# flamia_verify.settings imports torch: the commands read it where needed, so that a Ctrl-C while torch
# imports (seconds, on a cold start) is caught by main() as any interruption (one line, exit 1), not a
# traceback

__all__ = ["main", "child_main", "build_parser", "device_arg", "DEVICE_METAVAR"]  # noqa: F822 (DEVICE_METAVAR: __getattr__)


def __getattr__(name: str) -> str:
    if name == "DEVICE_METAVAR":  # how --device shows its values in --help
        return device_metavar()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _commands() -> dict[str, ModuleType]:
    """The subcommands in the order --help lists them, each the module of flamia_verify.commands that
    adds its arguments (``add_parser(sub)``) and runs it (``run(args)``, the exit code)."""
    from flamia_verify.commands import bench, check, compare, fuzz, mutate, report, survey, sweep, train_parity
    from flamia_verify.commands import list as list_

    return {
        "check": check,
        "fuzz": fuzz,
        "bench": bench,
        "compare": compare,
        "report": report,
        "list": list_,
        "mutate": mutate,
        "train-parity": train_parity,
        "sweep": sweep,
        "survey": survey,
    }


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line on stderr, exit 2
        self.exit(EXIT_USAGE, f"flamia-verify: error: {message} (see `{self.prog} --help`)\n")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="flamia-verify", description="Verify low-precision attention kernels against a float64 reference.")
    p.add_argument("--version", action="version", version=f"flamia-verify {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for command in _commands().values():
        command.add_parser(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    """Run the command; ``argv`` None means the process's own arguments (the console script).

    A run interrupted inside a kernel call can leave native threads of the kernel's libraries (torch's
    autograd engine, a CUDA context) mid-operation; tearing the interpreter down then may abort the
    process ("terminate called without an active exception", exit -6) after the reports are written
    and the exit code is decided. As a program, an interrupted run therefore ends with os._exit and
    its own exit code once stdout and stderr are flushed; called from Python (``argv`` given), it
    returns the code as usual.

    As a program, ``check`` runs in a child process (:mod:`flamia_verify.commands.supervise`), so that
    a kernel that ends its process (``os._exit``, a segfault) still leaves the reports of the finished
    checks and one line saying how it ended; called from Python it runs here.
    """
    if argv is None and wanted(sys.argv[1:]):
        supervised = supervise(sys.argv[1:])
        if supervised is not None:
            return supervised
    try:
        code, stopped = _main(argv)
    except KeyboardInterrupt:  # before the command ran (Ctrl-C while torch imports): as any interruption
        code, stopped = fail("interrupted", EXIT_FAIL), True
    finally:
        remove_unused_out()
    if argv is None and must_exit(stopped):
        sys.stdout.flush()
        sys.stderr.flush()
        child_done(code)
        os._exit(code)
    return code


def child_main() -> int:
    """The program of the child process that runs ``check`` for the supervisor
    (:mod:`flamia_verify.commands.supervise`): the command line as usual, its exit code told to the
    supervisor, which takes an end without it for a crash."""
    start_child()
    code = 1  # an exception no command caught: Python prints it and exits 1
    try:
        code = main()
    except SystemExit as exc:  # argparse: --help, a usage error
        code = process_end(exc)
        raise
    finally:
        child_done(code)
    return code


def _main(argv: list[str] | None) -> tuple[int, bool]:
    """The command's exit code, and whether it was interrupted mid-run."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help(sys.stderr)
        return EXIT_USAGE, False
    try:
        return _commands()[args.command].run(args), False
    except Interrupted as exc:  # it wrote what it could and said so
        return exc.code, True
    except KeyboardInterrupt:  # an interrupted run: one line, exit 1 (the documented contract)
        return fail("interrupted", EXIT_FAIL), True
    except KernelLoadError as exc:
        return fail(str(exc), EXIT_KERNEL), False
    except KernelCrashError as exc:
        print_tracebacks(args, crash=exc)
        return fail(f"kernel crashed: {exc}", EXIT_KERNEL), False
    except FlamiaVerifyError as exc:
        return fail(str(exc), exc.exit_code), False
    except BrokenPipeError:  # the reader of stdout went away (`| head`): stop quietly, as a shell tool does
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # Python's final flush of stdout must not raise again
        return EXIT_BROKEN_PIPE, False
    except OSError as exc:  # a file the command reads or writes (reports, --out): not the kernel's failure
        if exc.errno in _DISK_FULL:  # the run could not be recorded: incomplete, as check says
            out = getattr(args, "out", None) or "the output directory"
            return fail(write_problem(exc, out) + "; the run is incomplete", EXIT_FAIL), False
        where = f" {exc.filename!r}" if exc.filename else ""
        return fail(f"cannot access{where}: {exc.strerror or exc}", EXIT_USAGE), False


#: errno values of a write that ran out of room: the run is incomplete (exit 1), the paths were right
_DISK_FULL = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
