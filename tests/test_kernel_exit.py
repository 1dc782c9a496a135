"""A kernel that ends its process (os._exit, a segfault, abort) does not take the command's report with
it: `flamia-verify check` runs the checks in a child process, and when that process ends without
finishing, the command writes the reports of the finished checks (INCOMPLETE; the running check an
ERROR naming the exit code or signal, the others "not run"), says in one line what happened and where,
and exits 3 (the kernel crashed). Interruptions still behave as in one process: SIGTERM or Ctrl-C
write the finished checks and exit 1, a second one stops the run at once, and a command killed with
SIGKILL leaves no child running the kernel.

Each test runs the command as a program on the built-in bf16 kernel wrapped to misbehave on one call:
the probe makes calls 1 and 2, interface.output calls 3 to 5, interface.backward starts at call 6.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
ONLY = ("interface.output", "interface.backward", "causal.forward")
FIRST_BACKWARD_CALL = 6

KERNEL = """
import ctypes, os, signal, subprocess, time
from flamia_verify.kernels import builtin_kernels

_k = builtin_kernels()["bf16"]
_n = [0]

def _command():
    # the process of the command, which started the one running this kernel; never the test's own
    # (where the checks run in the command's process, this kernel ends it instead)
    parent = os.getppid()
    return parent if parent != TEST_PID else os._exit(99)

def attn(q, k, v, cu_q, cu_k, mq, mk, softmax_scale=None, causal=False):
    _n[0] += 1
    if _n[0] == AT:
        ACTION
    return _k(q, k, v, cu_q, cu_k, mq, mk, softmax_scale=softmax_scale, causal=causal)
"""


def _kernel(tmp_path: Path, action: str, at: int) -> str:
    path = tmp_path / "bad_kernel.py"
    path.write_text(KERNEL.replace("TEST_PID", str(os.getpid())).replace("AT", str(at)).replace("ACTION", action))
    return f"{path.name}:attn"  # the command runs in tmp_path


def _check(tmp_path: Path, kernel: str, *extra: str, new_session: bool = False, env=None, only=ONLY):
    out = tmp_path / "out"
    argv = ["check", "--kernel", kernel, "--recipe", "bf16", "--device", "cpu", "--out", str(out), "--only", *only]
    proc = subprocess.run(
        [sys.executable, "-m", "flamia_verify.cli", *argv, *extra],
        cwd=tmp_path,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "TERM": "dumb", **(env or {})},
        capture_output=True,
        text=True,
        timeout=300,
        start_new_session=new_session,  # its own process group, for a kernel that signals the group
    )
    return proc, out


def _report(out: Path) -> tuple[dict, dict]:
    data = json.loads((out / "report.json").read_text())
    return data, {c["name"]: c for c in data["checks"]}


def _assert_incomplete_files(out: Path) -> None:
    assert "INCOMPLETE" in (out / "report.md").read_text()
    assert "INCOMPLETE" in (out / "report.html").read_text()
    junit = (out / "junit.xml").read_text()
    assert 'type="incomplete"' in junit and "<skipped" in junit


def test_os_exit_mid_run_is_exit_3_naming_the_code_and_check_with_an_incomplete_report(tmp_path):
    proc, out = _check(tmp_path, _kernel(tmp_path, "os._exit(7)", FIRST_BACKWARD_CALL))
    assert proc.returncode == 3, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("flamia-verify: kernel 'bad_kernel.py:attn' crashed: its process ended with exit code 7")
    assert "during check interface.backward (2 of 3)" in lines[0] and "INCOMPLETE" in lines[0]
    assert "INCOMPLETE" in proc.stdout and "interface.backward" in proc.stdout  # the table, as an interrupted run
    data, checks = _report(out)
    summary = data["summary"]
    assert summary["complete"] is False and summary["status"] == "incomplete" and summary["passed"] is False
    assert "exit code 7" in summary["incomplete_reason"] and "interface.backward" in summary["incomplete_reason"]
    assert list(checks) == list(ONLY)  # in running order
    assert checks["interface.output"]["status"] == "pass"  # what finished keeps its result
    crashed = checks["interface.backward"]
    assert crashed["status"] == "error" and "exit code 7" in crashed["message"]
    assert crashed["worst_case"]["exit_code"] == 7
    assert checks["causal.forward"]["status"] == "skip"
    assert checks["causal.forward"]["message"] == "not run: the run stopped during interface.backward"
    _assert_incomplete_files(out)


@pytest.mark.parametrize(
    "action, signal_name",
    [("ctypes.string_at(0)", "SIGSEGV"), ("os.abort()", "SIGABRT")],
    ids=["segfault", "abort"],
)
def test_a_fatal_signal_is_named_and_its_traceback_kept(tmp_path, action, signal_name):
    proc, out = _check(tmp_path, _kernel(tmp_path, action, FIRST_BACKWARD_CALL), "--traceback")
    assert proc.returncode == 3, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert f"its process was killed by signal {signal_name}" in last and "interface.backward" in last
    _, checks = _report(out)
    crashed = checks["interface.backward"]
    assert crashed["status"] == "error" and crashed["worst_case"]["signal"] == signal_name
    # faulthandler's traceback: where in the kernel the process died, in report.json and (--traceback) on stderr
    assert "bad_kernel.py" in crashed["worst_case"]["traceback"]
    assert "bad_kernel.py" in proc.stderr
    assert checks["interface.output"]["status"] == "pass" and checks["causal.forward"]["status"] == "skip"


def test_an_exit_on_the_smallest_case_writes_no_reports_and_leaves_no_out_directory(tmp_path):
    proc, out = _check(tmp_path, _kernel(tmp_path, "os._exit(7)", 1))
    assert proc.returncode == 3, proc.stderr
    assert "exit code 7" in proc.stderr and "smallest case" in proc.stderr and "no reports written" in proc.stderr
    assert not out.exists()


def test_sigterm_to_the_command_alone_reaches_the_run(tmp_path):
    """`kill PID` (a job's runner, docker stop) signals the command's process: the checks stop as in one
    process, the finished ones written, exit 1."""
    proc, out = _check(tmp_path, _kernel(tmp_path, "os.kill(_command(), signal.SIGTERM)", FIRST_BACKWARD_CALL))
    assert proc.returncode == 1, proc.stderr
    assert "interrupted (SIGTERM)" in proc.stderr and "crashed" not in proc.stderr
    data, checks = _report(out)
    assert data["summary"]["status"] == "incomplete" and "SIGTERM" in data["summary"]["incomplete_reason"]
    assert checks["interface.output"]["status"] == "pass"


def test_ctrl_c_reaches_both_processes_and_interrupts_once(tmp_path):
    """A terminal's Ctrl-C signals the whole process group: one interruption, one line, no traceback."""
    action = "os.killpg(os.getpgid(0), signal.SIGINT)"
    proc, out = _check(tmp_path, _kernel(tmp_path, action, FIRST_BACKWARD_CALL), new_session=True)
    assert proc.returncode == 1, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "interrupted" in proc.stderr, proc.stderr
    assert _report(out)[0]["summary"]["status"] == "incomplete"


@pytest.mark.skipif(sys.platform == "win32", reason="no C library to call through ctypes")
def test_a_second_interruption_stops_a_run_that_does_not_answer_the_first(tmp_path):
    # the kernel holds the GIL (as an extension that never releases it): the run cannot act on the first
    # SIGTERM; the second one makes the command kill it and write the finished checks itself
    action = (
        "subprocess.Popen(['sh', '-c', f'kill -TERM {_command()}; sleep 1; kill -TERM {_command()}'])\n"
        "        ctypes.PyDLL(None).sleep(120)"
    )
    proc, out = _check(tmp_path, _kernel(tmp_path, action, FIRST_BACKWARD_CALL))
    assert proc.returncode == 1, proc.stderr
    assert "interrupted (SIGTERM, then SIGTERM): the second one stopped the run at once" in proc.stderr
    data, checks = _report(out)
    assert data["summary"]["status"] == "incomplete"
    assert checks["interface.output"]["status"] == "pass" and checks["interface.backward"]["status"] == "error"


def test_a_killed_command_leaves_no_child_running_the_kernel(tmp_path):
    """SIGKILL to the command (not its process group): the child sees its supervisor go and stops as on
    SIGTERM, writing its finished checks."""
    proc, out = _check(tmp_path, _kernel(tmp_path, "os.kill(_command(), signal.SIGKILL)", FIRST_BACKWARD_CALL))
    # subprocess.run returns once stdout and stderr close: the child, which holds them too, has ended
    assert proc.returncode == -9
    assert "interrupted (SIGTERM)" in proc.stderr
    data, checks = _report(out)
    assert data["summary"]["status"] == "incomplete" and checks["interface.output"]["status"] == "pass"


def _masked(text: str) -> str:
    return re.sub(r"\d+(\.\d+)?", "N", text)


def test_a_normal_run_prints_and_exits_as_in_one_process(tmp_path):
    fine = _kernel(tmp_path, "pass", 10**9)
    child, out = _check(tmp_path, fine, only=ONLY[:2])
    report_child = _report(out)[0]
    alone, out = _check(tmp_path, fine, env={"FLAMIA_VERIFY_IN_PROCESS": "1"}, only=ONLY[:2])
    assert child.returncode == alone.returncode == 0, (child.stderr, alone.stderr)
    assert _masked(child.stdout) == _masked(alone.stdout) and child.stderr == alone.stderr == ""
    report_alone = _report(out)[0]
    assert [(c["name"], c["status"]) for c in report_child["checks"]] == [
        (c["name"], c["status"]) for c in report_alone["checks"]
    ]
    assert report_child["summary"]["complete"] is True


def _heard(*messages: dict):
    """The supervisor's state after the child's messages (one JSON line each)."""
    from flamia_verify.commands.supervise import _State

    state = _State()
    for message in messages:
        state.take(json.dumps(message).encode())
    return state


def test_the_supervisor_places_the_end_between_two_checks_and_names_every_check():
    from flamia_verify.commands.supervise import _end, _report, _where
    from flamia_verify.results import CheckResult, Report

    header = Report(kernel="k", recipe="bf16", suite="quick", seed=0)
    header.complete, header.incomplete_reason = False, "the run had not finished"
    names = [["interface.output", "gating"], ["determinism.repeat", "reproducibility"], ["causal.forward", "gating"]]
    first = CheckResult("interface.output", "interface", "pass").to_dict()
    base = [
        {"phase": "started"},
        {"phase": "load", "kernel": "k.py:attn"},
        {"phase": "probe", "kernel": "k", "out": "/nowhere", "out_shown": "out", "created": [], "traceback": False},
        {"phase": "checks", "report": header.to_dict(), "checks": names},
        {"running": "interface.output"},
        {"result": first},
    ]
    # ended after a check's result, before the next one started (writing the partial reports)
    state = _heard(*base)
    assert _where(state) == "after check interface.output (1 of 3), before the next one"
    report = _report(state, _end(state, -11, 0.0))
    assert [(c.name, c.status, c.verdict) for c in report.checks] == [
        ("interface.output", "pass", "gating"),
        ("determinism.repeat", "skip", "reproducibility"),
        ("causal.forward", "skip", "gating"),
    ]
    assert report.checks[1].message == "not run: the run stopped after interface.output"
    assert not report.complete and "killed by signal SIGSEGV" in report.incomplete_reason
    assert "2 checks did not run" in report.incomplete_reason
    # ended during the second check: that one is the ERROR, with the verdict it belongs to
    state = _heard(*base, {"running": "determinism.repeat"})
    assert _where(state) == "during check determinism.repeat (2 of 3)"
    report = _report(state, _end(state, 7, 0.0))
    crashed = report.check("determinism.repeat")
    assert crashed.status == "error" and crashed.verdict == "reproducibility"
    assert crashed.worst_case == {"exception": "exit code 7", "exit_code": 7}
    assert report.check("causal.forward").message == "not run: the run stopped during determinism.repeat"
    # a run that had not reached its checks has no report to write
    assert _report(_heard(*base[:3]), _end(state, 7, 0.0)) is None
