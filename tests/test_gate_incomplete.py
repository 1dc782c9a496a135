"""A run that does not finish (SIGINT, SIGTERM, killed, disk full) never leaves reports that say
PASS: partial reports say INCOMPLETE in every format, and the command exits non-zero."""

from __future__ import annotations

import errno
import json
import os
import pathlib
import signal
import subprocess
import sys

import pytest

from flamia_verify.cli import main
from flamia_verify.reports import load_report, render_markdown, write_reports
from flamia_verify.reports.junit import render_junit
from flamia_verify.results import CheckResult, Report

ROOT = pathlib.Path(__file__).resolve().parent.parent

# a correct kernel (the built-in bf16) that sends a signal on its CALLS-th call: to its own process, or
# with `group` to its whole process group (the command and the child process that runs the checks)
SIGNALLING_KERNEL = """
import os, signal
from flamia_verify.kernels import builtin_kernels
_k = builtin_kernels()["bf16"]
_n = [0]
def attn(q, k, v, cu_q, cu_k, mq, mk, *, softmax_scale, causal):
    _n[0] += 1
    if _n[0] == CALLS:
        SEND
    return _k(q, k, v, cu_q, cu_k, mq, mk, softmax_scale=softmax_scale, causal=causal)
"""


def _kernel(tmp_path, sig: str, calls: int, group: bool = False) -> str:
    path = tmp_path / f"k_{sig}.py"
    send = f"os.killpg(os.getpgid(0), signal.{sig})" if group else f"os.kill(os.getpid(), signal.{sig})"
    path.write_text(SIGNALLING_KERNEL.replace("SEND", send).replace("CALLS", str(calls)))
    return f"{path}:attn"


def _assert_incomplete(out: pathlib.Path):
    data = json.loads((out / "report.json").read_text())
    assert data["summary"]["complete"] is False and data["summary"]["status"] == "incomplete", data["summary"]
    assert data["summary"]["passed"] is False
    assert data["checks"], "the finished checks are kept"
    assert all(c["status"] == "pass" for c in data["checks"])  # what ran passed; the run still is no PASS
    md = (out / "report.md").read_text()
    assert "INCOMPLETE" in md and "**PASS**" not in md
    junit = (out / "junit.xml").read_text()
    assert "incomplete" in junit and "<error" in junit
    assert "INCOMPLETE" in (out / "report.html").read_text()
    assert not load_report(out / "report.json").passed
    return data


@pytest.fixture
def sigint_raises():
    """Ctrl-C raises KeyboardInterrupt here even when pytest was started with SIGINT ignored (a shell's
    background job inherits SIG_IGN, and Python keeps it)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def test_sigint_mid_run_leaves_incomplete_reports_and_exit_1(capsys, tmp_path, sigint_raises):
    out = tmp_path / "rep"
    code = main(["check", "--kernel", _kernel(tmp_path, "SIGINT", 12), "--recipe", "bf16", "--out", str(out)])
    cap = capsys.readouterr()
    assert code == 1, cap.err
    assert "interrupted" in cap.err and "incomplete" in cap.err.lower() and len(cap.err.strip().splitlines()) == 1
    assert "INCOMPLETE" in cap.out
    data = _assert_incomplete(out)
    assert "interrupted" in data["summary"]["incomplete_reason"]


def _subprocess_check(tmp_path, spec: str, out: pathlib.Path, new_session: bool = False):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    return subprocess.run(
        [sys.executable, "-m", "flamia_verify.cli", "check", "--kernel", spec, "--recipe", "bf16", "--out", str(out)],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=300,
        start_new_session=new_session,  # its own process group, for a kernel that signals the group
    )


def test_sigterm_mid_run_leaves_incomplete_reports_and_exit_1(tmp_path):
    out = tmp_path / "rep"
    proc = _subprocess_check(tmp_path, _kernel(tmp_path, "SIGTERM", 12), out)
    assert proc.returncode == 1, proc.stderr
    assert "SIGTERM" in proc.stderr
    data = _assert_incomplete(out)
    assert "SIGTERM" in data["summary"]["incomplete_reason"]


def test_a_killed_run_leaves_reports_that_say_incomplete(tmp_path):
    """SIGKILL cannot be caught: the reports written after each check already say the run had not finished.
    (The command and the child process that runs the checks are killed together, as a CI job's process
    group is; a kernel that kills only its own process is a crash: tests/test_kernel_exit.py.)"""
    out = tmp_path / "rep"
    proc = _subprocess_check(tmp_path, _kernel(tmp_path, "SIGKILL", 12, group=True), out, new_session=True)
    assert proc.returncode == -9
    data = _assert_incomplete(out)
    assert "had not finished" in data["summary"]["incomplete_reason"]


def test_disk_full_while_writing_reports_is_one_line_naming_the_path(capsys, tmp_path, monkeypatch):
    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    out = tmp_path / "rep"
    code = main(["check", "--kernel", "bf16", "--only", "interface", "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 1
    assert len(err.strip().splitlines()) == 1, err
    assert str(out / "report.json") in err and "No space left on device" in err
    assert not list(out.glob(".*.tmp")), "no temporary file is left behind"


def _report(complete: bool) -> Report:
    rep = Report(
        kernel="k", recipe="mxfp8", suite="quick", seed=0, checks=[CheckResult("interface.output", "interface", "pass")]
    )
    if not complete:
        rep.complete = False
        rep.incomplete_reason = "interrupted (SIGINT) after 1 of 31 checks"
    return rep


def test_the_model_round_trips_an_incomplete_report(tmp_path):
    rep = _report(False)
    assert not rep.passed
    s = rep.summary()
    assert s["complete"] is False and s["status"] == "incomplete" and s["incomplete_reason"].startswith("interrupted")
    write_reports(rep, tmp_path)
    back = load_report(tmp_path / "report.json")
    assert back == rep and not back.passed
    done = _report(True)
    assert done.passed and done.summary()["status"] == "pass" and done.summary()["complete"] is True
    assert "INCOMPLETE" in render_markdown(rep) and "INCOMPLETE" not in render_markdown(done)
    assert 'errors="1"' in render_junit(rep) and 'errors="0"' in render_junit(done)


@pytest.mark.parametrize("bad", [{"complete": "no"}, {"complete": 0}])
def test_a_malformed_complete_field_is_a_schema_error(tmp_path, bad):
    from flamia_verify.reports.store import validate_report_data

    data = _report(True).to_dict()
    data["summary"].update(bad)
    assert any("summary.complete" in p for p in validate_report_data(data))
