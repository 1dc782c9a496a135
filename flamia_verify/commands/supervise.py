"""``flamia-verify check`` in a child process, so that a kernel that ends its process still leaves a
report and a clear message.

A kernel is the user's code and runs in the checking process: ``os._exit(7)``, a segfault in an
extension, ``abort()`` or the out-of-memory killer ends that process with no Python code left to run,
so it cannot write its reports or say what happened. The command line therefore runs ``check``, as a
program (the ``flamia-verify`` script, ``python -m flamia_verify.cli``), in two processes:

* the **supervisor** (:func:`supervise`), the process the user started: it imports neither torch nor
  the checks (about 0.1 s), starts the child with the same interpreter, flags, ``sys.path`` and
  arguments, reads what the child tells it and waits for it. The child inherits stdin, stdout and
  stderr, its terminal and its process group, so everything the run prints (progress lines, the
  table, the one-line errors) and its exit code are those of a run in one process;
* the **child** (:func:`start_child`, then ``cli.main``), which runs the command as before and tells
  the supervisor, over a pipe of JSON lines (:class:`Channel`), what it is doing: loading the
  kernel, probing it, the run's report header and the checks it selected, the check now running,
  each finished check's result, and finally its exit code; and, in a shared page, when the stuck-call
  watchdog will fire (a memory write per kernel call, no system call).

When the child ends without saying its exit code, the supervisor writes the reports itself (in
``--out``, marked INCOMPLETE: the finished checks with their results, the check that was running as
ERROR naming the exit code or the signal, the checks that did not run as SKIP with "not run"), shows
them as an interrupted run does and exits 3 (the kernel crashed), or 1 when the process was ended
by the stuck-call watchdog (a call holding the GIL past ``case_timeout_s``) or by a second SIGINT or
SIGTERM. The child enables :mod:`faulthandler` on a file the supervisor reads: a fatal signal's
Python traceback (where in the kernel the crash happened) goes to the ERROR row's
``worst_case["traceback"]``, and to stderr with ``--traceback``.

Signals: SIGINT and SIGTERM sent to the supervisor alone are passed on to the child; a terminal's
Ctrl-C reaches both (one process group). The child takes the first one as the interruption (its
finished checks written, exit 1) and ignores the others; the supervisor takes a second one it
receives itself as "stop now": it kills the child and writes the reports of the finished checks.
A supervisor that dies (SIGKILL) closes the lifeline pipe the child watches: the child interrupts
itself as for SIGTERM, so no orphan goes on running the kernel.

``FLAMIA_VERIFY_IN_PROCESS=1`` runs ``check`` in one process (a profiler, a debugger that follows no
child); a kernel that ends the process then ends the command with it. The Python API and the pytest
plugin always run in the caller's process.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import struct
import sys
import threading
import time
from typing import Any

from flamia_verify.commands.common import EXIT_FAIL, EXIT_KERNEL, console, fail, plain, print_tracebacks

__all__ = [
    "ENV_IN_PROCESS",
    "Channel",
    "channel",
    "child_done",
    "start_child",
    "supervise",
    "wanted",
    "process_end",
]

#: set (non-empty) to run ``check`` in the command's own process
ENV_IN_PROCESS = "FLAMIA_VERIFY_IN_PROCESS"
#: the child's file descriptors: "channel,lifeline,crash,watch" (popped by start_child)
_ENV_CHILD = "FLAMIA_VERIFY_CHILD"
#: the supervisor's sys.path, JSON (popped by the child's first line)
_ENV_PATH = "FLAMIA_VERIFY_CHILD_PATH"
#: the child's program: the supervisor's sys.path, then the command line as a child
_BOOT = (
    "import json, os, sys; sys.path[:] = json.loads(os.environ.pop('FLAMIA_VERIFY_CHILD_PATH')); "
    "from flamia_verify.cli import child_main; sys.exit(child_main())"
)
#: seconds of slack when telling the watchdog's exit from a kernel's own exit with code 1
_WATCHDOG_SLACK_S = 1.0

# ------------------------------------------------------------------------------------------- the child


class Channel:
    """The child's side of the pipe to its supervisor: one JSON object per line. A supervisor that went
    away makes sending a no-op (the lifeline interrupts the run)."""

    def __init__(self, fd: int, watch: Any = None) -> None:
        self.fd = fd
        self.lock = threading.Lock()
        self.running: str | None = None
        self.watch = watch  # the shared page of the watchdog's deadline (an mmap), or None

    def send(self, **message: Any) -> None:
        data = (json.dumps(message, separators=(",", ":"), default=str) + "\n").encode()
        with self.lock:
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(self.fd, view) :]
            except OSError:
                pass

    # what check.run and the engine hand over
    def on_start(self, report: Any, specs: list[Any]) -> None:
        self.send(phase="checks", report=report.to_dict(), checks=[[s.name, s.verdict] for s in specs])

    def on_progress(self, event: Any) -> None:
        name = getattr(event, "check", None)
        if name and name != self.running:
            self.running = name
            self.send(running=name)

    def on_result(self, result: Any) -> None:
        self.send(result=result.to_dict())

    def on_watchdog(self, seconds: float | None) -> None:
        """The watchdog was armed (it ends the process in ``seconds``) or cancelled (None): its deadline
        on the monotonic clock, which the supervisor shares, or 0."""
        if self.watch is not None:
            struct.pack_into("d", self.watch, 0, 0.0 if seconds is None else time.monotonic() + seconds)


_CHILD: list[Channel | None] = [None]
_DONE = [False]


def channel() -> Channel | None:
    """The pipe to the supervisor when this process is a supervised child, else None."""
    return _CHILD[0]


def start_child() -> None:
    """Set this process up as a supervised child (the first thing its program does): the channel, the
    lifeline that interrupts the run when the supervisor dies, SIGINT and SIGTERM taken once, and
    faulthandler writing a fatal signal's traceback where the supervisor reads it."""
    fds = os.environ.pop(_ENV_CHILD, "")
    os.environ.pop(_ENV_PATH, None)
    try:
        out_fd, life_fd, crash_fd, watch_fd = (int(x) for x in fds.split(","))
    except ValueError:
        return  # not started by a supervisor: an ordinary process
    for fd in (out_fd, life_fd, crash_fd, watch_fd):
        os.set_inheritable(fd, False)  # the kernel's own subprocesses must not hold the pipes open
    import mmap

    try:
        watch: Any = mmap.mmap(watch_fd, 8)
    except (OSError, ValueError):
        watch = None
    chan = _CHILD[0] = Channel(out_fd, watch)
    chan.send(phase="started")
    threading.Thread(target=_watch_lifeline, args=(life_fd,), name="flamia-verify-lifeline", daemon=True).start()
    taken = _Once()
    if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:  # ignored by the supervisor: ignored here too
        signal.signal(signal.SIGINT, taken)
    signal.signal(signal.SIGTERM, taken)
    import faulthandler

    if not faulthandler.is_enabled():  # PYTHONFAULTHANDLER / -X faulthandler: the user's stderr wins
        faulthandler.enable(file=crash_fd, all_threads=True)


class _Once:
    """The child's SIGINT and SIGTERM handler: the first one interrupts the run (KeyboardInterrupt,
    "SIGTERM" for that signal, as the in-process handler says), later ones are ignored: Ctrl-C reaches
    both processes and the supervisor passes its own on, and a second interruption must not break the
    writing of the finished checks."""

    def __init__(self) -> None:
        self.fired = False

    def __call__(self, signum: int, frame: Any) -> None:
        if self.fired:
            return
        self.fired = True
        raise KeyboardInterrupt("SIGTERM") if signum == signal.SIGTERM else KeyboardInterrupt


def _watch_lifeline(fd: int) -> None:
    """Block until the supervisor's end of the lifeline closes (it died), then interrupt the run."""
    try:
        while os.read(fd, 1024):
            pass
    except OSError:
        pass
    if not _DONE[0]:
        os.kill(os.getpid(), signal.SIGTERM)


def child_done(code: Any) -> None:
    """Tell the supervisor the exit code this process chose (a no-op outside a supervised child): an
    end without it is a crash."""
    chan = _CHILD[0]
    if chan is None or _DONE[0]:
        return
    _DONE[0] = True
    chan.send(exit=code)


def process_end(exc: SystemExit) -> int:
    """The exit code Python gives a SystemExit."""
    code = exc.code
    if code is None:
        return 0
    return code if isinstance(code, int) else 1


# ------------------------------------------------------------------------------------- the supervisor


def wanted(args: list[str]) -> bool:
    """Whether this command line runs in a child process: ``check``, on a POSIX system, not asked to
    stay in one process, not already the child."""
    return (
        args[:1] == ["check"]
        and os.name == "posix"
        and not os.environ.get(ENV_IN_PROCESS)
        and _CHILD[0] is None
        and bool(sys.executable)
        and not getattr(sys, "frozen", False)  # a frozen application's executable runs no -c
    )


class _State:
    """What the supervisor has heard from the child."""

    def __init__(self) -> None:
        self.phase = "start"
        self.kernel: str | None = None
        self.out: str | None = None  # absolute: the kernel may change the directory
        self.out_shown: str | None = None  # as the user gave it
        self.created: list[str] = []  # the --out directories the child created, outermost first
        self.traceback = False
        self.header: dict[str, Any] | None = None
        self.checks: list[list[str]] = []
        self.running: str | None = None  # the check that started and has not finished
        self.results: list[dict[str, Any]] = []
        self.exit: int | None = None
        self.signals: list[int] = []
        self.killed = False  # the supervisor killed the child (a second signal)
        self.proc: Any = None

    def take(self, line: bytes) -> None:
        try:
            msg = json.loads(line)
        except ValueError:
            return
        if not isinstance(msg, dict):
            return
        if "phase" in msg:
            self.phase = msg["phase"]
            self.kernel = msg.get("kernel", self.kernel)
            if msg["phase"] == "probe":
                self.out, self.out_shown = msg.get("out"), msg.get("out_shown")
                self.created = list(msg.get("created", []))
                self.traceback = bool(msg.get("traceback"))
            elif msg["phase"] == "checks":
                self.header, self.checks = msg["report"], msg["checks"]
        elif "running" in msg:
            self.running = msg["running"]
        elif "result" in msg:
            self.results.append(msg["result"])
            self.running = None
        elif "exit" in msg:
            self.exit = int(msg["exit"])

    def on_signal(self, signum: int, frame: Any) -> None:
        self.signals.append(signum)
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return
        try:
            if len(self.signals) == 1:
                proc.send_signal(signum)  # the child writes its finished checks and exits 1
            elif not self.killed:
                self.killed = True
                proc.kill()  # a second one: stop now
        except OSError:
            pass


def _interpreter_flags() -> list[str]:
    import subprocess

    flags = getattr(subprocess, "_args_from_interpreter_flags", None)
    try:
        return list(flags()) if flags is not None else []
    except Exception:
        return []


def supervise(args: list[str]) -> int | None:
    """Run ``flamia-verify ARGS`` in a child process and return its exit code, or the code of its
    crash once the reports of its finished checks are written; None when no child can be started (the
    caller runs the command itself)."""
    import subprocess
    import tempfile

    state = _State()
    with tempfile.TemporaryFile() as crash, tempfile.TemporaryFile() as watch:
        # crash: faulthandler's traceback; watch: the watchdog's deadline on the monotonic clock (0: not armed)
        watch.write(struct.pack("d", 0.0))
        watch.flush()
        read_fd, write_fd = os.pipe()
        life_r, life_w = os.pipe()
        passed = (write_fd, life_r, crash.fileno(), watch.fileno())
        env = {**os.environ, _ENV_CHILD: ",".join(map(str, passed)), _ENV_PATH: json.dumps(sys.path)}
        # SIGINT ignored (a background job of a script) stays ignored, here and in the child
        taken = [signal.SIGTERM] + ([signal.SIGINT] if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN else [])
        previous = {sig: signal.signal(sig, state.on_signal) for sig in taken}
        try:
            try:
                state.proc = subprocess.Popen(
                    [sys.executable, *_interpreter_flags(), "-P", "-c", _BOOT, *args], env=env, pass_fds=passed
                )
            except OSError:
                return None
            finally:
                os.close(write_fd)
                os.close(life_r)
            if state.signals:  # one came while the child started
                state.proc.send_signal(state.signals[0])
            _listen(state, read_fd)
            code = state.proc.wait()
            if state.exit is not None:
                return state.exit
            if state.phase == "start" and not state.signals:  # its Python could not even start the command
                what = _end(state, code, 0.0).cause.replace("the kernel's process", "its Python")
                sys.stderr.write(
                    f"flamia-verify: note: the checks could not run in a child process ({what} before it "
                    "started); running them in this process\n"
                )
                return None
            return _after_abnormal_end(state, code, _read_crash(crash), _read_deadline(watch))
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            os.close(read_fd)
            os.close(life_w)  # only now: the child watches it


def _listen(state: _State, fd: int) -> None:
    """Take the child's messages until its end of the pipe closes, or it has ended (a process it
    started may hold the pipe open)."""
    import selectors

    pending = b""
    with selectors.DefaultSelector() as sel:
        sel.register(fd, selectors.EVENT_READ)
        ended = False
        while True:
            if not sel.select(timeout=0 if ended else 1.0):
                if ended:
                    return
                ended = state.proc.poll() is not None  # drain what is there, then stop
                continue
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                return
            pending += chunk
            *lines, pending = pending.split(b"\n")
            for line in lines:
                state.take(line)


def _read_deadline(watch: Any) -> float:
    """When the child's stuck-call watchdog was to fire (0.0: not armed)."""
    try:
        return float(struct.unpack("d", os.pread(watch.fileno(), 8, 0))[0])
    except (OSError, struct.error):
        return 0.0


def _read_crash(crash: Any) -> str:
    """What faulthandler wrote when the child died of a fatal signal ('' if nothing)."""
    try:
        return os.pread(crash.fileno(), 1 << 20, 0).decode(errors="replace").strip()
    except OSError:
        return ""


_SIGNAL_HINTS = {
    "SIGSEGV": "a crash in native code",
    "SIGBUS": "a crash in native code",
    "SIGILL": "a crash in native code",
    "SIGFPE": "a crash in native code",
    "SIGABRT": "abort(), e.g. a failed assertion in native code",
    "SIGKILL": "sent by the out-of-memory killer, among others",
}


class _End:
    """How the child ended. ``cause``: a clause that a place follows ("the kernel's process ended with
    exit code 7"); ``hint``: words for parentheses or ''; ``head``: the start of the command's one line
    (the place follows it); ``fields``: the running check's ``worst_case``; ``exit_code``: the command's."""

    def __init__(self, cause: str, hint: str, head: str, fields: dict[str, Any], exit_code: int) -> None:
        self.cause, self.hint, self.head, self.fields, self.exit_code = cause, hint, head, fields, exit_code


def _end(state: _State, code: int, deadline: float) -> _End:
    if state.killed:
        names = ", then ".join(_signal_name(s) for s in state.signals[:2])
        cause = f"a second interruption ({names}) stopped the run at once"
        head = f"interrupted ({names}): the second one stopped the run at once"
        return _End(cause, "", head, {"exception": "interrupted"}, EXIT_FAIL)
    if state.signals:  # interrupted before the child could take it (while it started): not a crash
        cause = f"interrupted ({_signal_name(state.signals[0])})"
        return _End(cause, "", cause, {"exception": "interrupted"}, EXIT_FAIL)
    if code == 1 and deadline and time.monotonic() >= deadline - _WATCHDOG_SLACK_S:
        cause = "a kernel call held the GIL past its time limit (case_timeout_s) and its process was ended"
        stuck = {"exception": "held the GIL past case_timeout_s"}
        return _End(cause, "every thread's traceback is on stderr", cause, stuck, EXIT_FAIL)
    kernel = repr(state.kernel) if state.kernel else "the kernel"
    fields: dict[str, Any]
    if code < 0:
        name = _signal_name(-code)
        how, hint = f"was killed by signal {name}", _SIGNAL_HINTS.get(name, "")
        fields = {"exception": f"killed by signal {name}", "signal": name}
    else:
        how = f"ended with exit code {code}"
        hint = "os._exit(), or exit() in native code" if code else "it exited without finishing the run"
        fields = {"exception": f"exit code {code}", "exit_code": code}
    head = f"kernel {kernel} crashed: its process {how}" + (f" ({hint})" if hint else "")
    return _End(f"the kernel's process {how}", hint, head, fields, EXIT_KERNEL)


def _after_abnormal_end(state: _State, code: int, crash_text: str, deadline: float) -> int:
    """The child ended without its exit code: write the reports of what it finished, show them, say in
    one line what happened; returns the exit code."""
    end = _end(state, code, deadline)
    if crash_text:
        end.fields["traceback"] = crash_text
    report = _report(state, end)
    problem = _write(state, report)
    _restore_terminal()
    if report is not None and problem is None:
        shown = console()
        from flamia_verify.reports import render_terminal

        render_terminal(report, shown, plain=plain(shown))
    if report is not None:
        print_tracebacks(argparse.Namespace(traceback=state.traceback), report.checks)
    elif crash_text and state.traceback:
        sys.stderr.write(f"flamia-verify: the kernel's process at its end:\n{crash_text}\n")
    return fail(f"{end.head} {_where(state)}{_files_said(state, report, problem)}", end.exit_code)


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def _where(state: _State) -> str:
    """Where the run was when the child ended."""
    if state.phase in ("start", "started", "load"):
        return "while loading the kernel"
    if state.phase == "probe":
        return "while running the kernel on the smallest case, before any check"
    if state.phase == "finish":
        return "after the last check, while finishing the run"
    done, total = len(state.results), len(state.checks)
    if state.running is not None:
        return f"during check {state.running} ({done + 1} of {total})"
    if done:
        return f"after check {state.results[-1].get('name')} ({done} of {total}), before the next one"
    return "before the first check"


def _report(state: _State, end: _End) -> Any:
    """The incomplete report: the finished checks, the running one as ERROR, the rest SKIP "not run";
    None before the checks started."""
    if state.header is None:
        return None
    from flamia_verify.results import NOT_RUN, CheckResult, Report

    report = Report.from_dict(state.header)
    report.checks = [CheckResult.from_dict(r) for r in state.results]
    done = {c.name for c in report.checks}
    running = state.running if state.phase == "checks" else None
    stopped = f"during {running}" if running else f"after {report.checks[-1].name}" if report.checks else "before it"
    hint = f" ({end.hint})" if end.hint else ""
    not_run = 0
    for name, verdict in state.checks:
        if name in done:
            continue
        family = name.split(".", 1)[0]
        if name == running:
            message = f"{end.cause} during this check{hint}; the run stopped here"
            report.checks.append(CheckResult(name, family, "error", message=message, worst_case=dict(end.fields)))
        else:
            message = f"{NOT_RUN}the run stopped {stopped}"
            report.checks.append(CheckResult(name, family, "skip", message=message))
            not_run += 1
        report.checks[-1].verdict = verdict
    report.complete = False
    report.incomplete_reason = (
        f"the run stopped after {len(state.results)} of {len(state.checks)} checks: {end.cause} {_where(state)}"
        + (f"; {not_run} check{'' if not_run == 1 else 's'} did not run" if not_run else "")
    )
    return report


def _write(state: _State, report: Any) -> str | None:
    """Write the reports (or, without any, remove the --out directories the child created and left
    empty); the one-line problem if writing fails."""
    if report is None:
        for directory in reversed(state.created):
            try:
                os.rmdir(directory)
            except OSError:
                pass
        return None
    from flamia_verify.reports import write_reports

    assert state.out is not None
    try:
        write_reports(report, state.out)
    except OSError as exc:
        return f"cannot write {exc.filename or state.out}: {exc.strerror or exc}"
    return None


def _files_said(state: _State, report: Any, problem: str | None) -> str:
    if problem:
        return f"; {problem}"
    if report is None:
        return "; no check ran, no reports written"
    done = len(state.results)
    finished = "no check" if not done else f"{done} check{'' if done == 1 else 's'}"
    return f"; the reports in {state.out_shown or state.out} say INCOMPLETE ({finished} finished)"


def _restore_terminal() -> None:
    """A child that died under its progress bar left the bar drawn and the cursor hidden: clear the
    bar's line (as the bar does when it ends) and show the cursor."""
    try:
        if sys.stdout.isatty():
            sys.stdout.write("\r\x1b[2K\x1b[?25h")
            sys.stdout.flush()
    except (OSError, ValueError):
        pass
