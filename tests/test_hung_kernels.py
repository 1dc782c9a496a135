"""No process dies with the kernel: a kernel call past its time limit (case_timeout_s) is an ERROR row
of a complete report, the run goes on with the next check, and the command exits with its documented
code in bounded time, whatever the abandoned thread is doing (sleeping in Python, looping over torch
ops in C++, blocked in a C call). Before, a thread returning from C++ while the interpreter shut down
aborted the process (exit 134, "terminate called without an active exception") after the reports.

After a call hangs the kernel is not called again: every later check that would call it is an
ERROR that says so. A kernel that holds the GIL in C for good stops even the wait for its time limit: the command line
ends such a process with exit 1 and every thread's traceback (faulthandler), its reports INCOMPLETE (the
command's supervising process writes them: the finished checks, and the stopped one as an ERROR).
The Python API never ends its caller's process: it returns the report and leaves the thread running.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

import flamia_verify
from flamia_verify.properties.harness import calls_left_running

TIMEOUT_S = 5  # case_timeout_s of these runs
BOUND_S = 60  # a run must end within this (the process starts in about 5 s, the checks take seconds)

# a correct kernel (the built-in bf16) whose HANG_AT-th call never returns: HANG is what it does then
KERNEL = """
import ctypes, time
import torch
from flamia_verify.kernels import builtin_kernels

_k = builtin_kernels()["bf16"]
_n = [0]

def attn(q, k, v, cu_q, cu_k, mq, mk, softmax_scale=None, causal=False):
    _n[0] += 1
    if _n[0] == HANG_AT:
        HANG
    return _k(q, k, v, cu_q, cu_k, mq, mk, softmax_scale=softmax_scale, causal=causal)
"""

HANGS = {
    # 20 minutes in Python (time.sleep releases the GIL)
    "sleep": "time.sleep(1200)",
    # a loop that never converges, torch ops back to back: C++ that releases the GIL and takes it back,
    # the thread that aborted the interpreter's shutdown
    "torch_ops": "a = torch.randn(256, 256)\n        while True:\n            a = torch.tanh(a @ a)",
    # a C call that never returns (ctypes releases the GIL around it)
    "c_call": "ctypes.CDLL(None).sleep(3600)",
}

# the run's checks: the probe makes calls 1 and 2, interface.output calls 3 to 5, then interface.backward
ONLY = ("interface.output", "interface.backward")
FIRST_OUTPUT_CALL, FIRST_BACKWARD_CALL = 3, 6


def _kernel(tmp_path: Path, hang: str, at: int) -> str:
    path = tmp_path / "hung_kernel.py"
    path.write_text(KERNEL.replace("HANG_AT", str(at)).replace("HANG", hang))
    return f"{path}:attn"


def _check(tmp_path: Path, kernel: str) -> tuple[subprocess.CompletedProcess, float, Path]:
    """Run `flamia-verify check` as a program (its own process, as CI runs it)."""
    config = tmp_path / "cfg.toml"
    config.write_text(f"[tool.flamia-verify]\ncase_timeout_s = {TIMEOUT_S}\n")
    out = tmp_path / "out"
    argv = ["check", "--kernel", kernel, "--recipe", "bf16", "--device", "cpu", "--config", config]
    argv += ["--out", out, "--only", *ONLY]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TERM": "dumb"}
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "flamia_verify.cli", *map(str, argv)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=2 * BOUND_S,
    )
    return proc, time.monotonic() - t0, out


def _can_call_libc() -> bool:
    if sys.platform == "win32":
        return False
    import ctypes

    try:
        return hasattr(ctypes.CDLL(None), "sleep")
    except OSError:
        return False


@pytest.mark.slow
@pytest.mark.parametrize("hang", list(HANGS))
def test_a_call_past_its_time_limit_is_an_error_row_of_a_complete_report_and_the_run_exits_1(tmp_path, hang):
    if hang == "c_call" and not _can_call_libc():
        pytest.skip("no C library to call through ctypes here")
    proc, seconds, out = _check(tmp_path, _kernel(tmp_path, HANGS[hang], FIRST_OUTPUT_CALL))
    assert proc.returncode == 1, (proc.returncode, proc.stderr[-3000:])
    assert seconds < BOUND_S, seconds
    assert "terminate called" not in proc.stderr and "Fatal Python error" not in proc.stderr
    assert "1 kernel call(s) still running after their time limit; exiting without waiting for them" in proc.stderr
    for name in ("report.json", "report.md", "report.html", "junit.xml"):
        assert (out / name).is_file(), name
    data = json.loads((out / "report.json").read_text())
    assert data["summary"]["complete"] is True and data["summary"]["status"] == "fail", data["summary"]
    assert data["summary"]["errored_checks"] == ["interface.output", "interface.backward"]
    checks = {c["name"]: c for c in data["checks"]}
    timed_out = checks["interface.output"]
    assert timed_out["status"] == "error"
    assert (
        f"did not return within {TIMEOUT_S} s, the time limit of one kernel call (case_timeout_s)"
        in (timed_out["message"])
    )
    assert timed_out["worst_case"]["exception"].startswith("KernelTimeoutError")
    # the next check is an error without a call: a hung kernel is not called again (each call would
    # wait out the limit and leave another thread behind)
    after = checks["interface.backward"]
    assert after["status"] == "error" and after["message"].startswith("not run: the kernel hung on an earlier call")
    assert "<error" in (out / "junit.xml").read_text()


@pytest.mark.slow
def test_a_hang_on_the_smallest_case_is_a_crash_exit_3_without_waiting_for_the_thread(tmp_path):
    proc, seconds, out = _check(tmp_path, _kernel(tmp_path, HANGS["torch_ops"], 1))
    assert proc.returncode == 3, (proc.returncode, proc.stderr[-3000:])
    assert seconds < BOUND_S, seconds
    assert "cannot run the smallest case" in proc.stderr and "case_timeout_s" in proc.stderr
    assert "1 kernel call(s) still running after their time limit" in proc.stderr
    assert not (out / "report.json").exists()


@pytest.mark.slow
def test_a_kernel_holding_the_gil_in_c_ends_the_run_with_exit_1_and_incomplete_reports(tmp_path):
    if not _can_call_libc():
        pytest.skip("no C library to call through ctypes here")
    # ctypes.PyDLL keeps the GIL through the call, as an extension that never releases it does: the
    # caller cannot even come back from its wait, so only the watchdog can end the process
    hang = "ctypes.PyDLL(None).sleep(3600)"
    proc, seconds, out = _check(tmp_path, _kernel(tmp_path, hang, FIRST_BACKWARD_CALL))
    assert proc.returncode == 1, (proc.returncode, proc.stderr[-3000:])
    assert seconds < BOUND_S, seconds
    assert "Timeout" in proc.stderr and "hung_kernel.py" in proc.stderr  # every thread's traceback, the kernel's too
    # the command's supervising process writes the finished checks and the one the watchdog stopped
    last = proc.stderr.splitlines()[-1]
    assert "a kernel call held the GIL past its time limit (case_timeout_s) and its process was ended" in last
    data = json.loads((out / "report.json").read_text())
    assert data["summary"]["complete"] is False and data["summary"]["status"] == "incomplete", data["summary"]
    statuses = {c["name"]: c["status"] for c in data["checks"]}
    assert statuses == {"interface.output": "pass", "interface.backward": "error"}
    assert "INCOMPLETE" in (out / "report.md").read_text()


@pytest.mark.slow
def test_the_python_api_returns_the_report_and_leaves_the_thread_running(tmp_path):
    release = threading.Event()
    calls = [0]
    bf16 = flamia_verify.load_kernel("bf16").fn

    def attn(q, k, v, cu_q, cu_k, mq, mk, softmax_scale=None, causal=False):
        calls[0] += 1
        if calls[0] == FIRST_OUTPUT_CALL:
            torch.set_default_dtype(torch.float64)  # a process setting the abandoned call holds
            try:
                release.wait(600)
            finally:
                torch.set_default_dtype(torch.float32)
        return bf16(q, k, v, cu_q, cu_k, mq, mk, softmax_scale=softmax_scale, causal=causal)

    before = calls_left_running()
    try:
        report = flamia_verify.check(
            attn, recipe="bf16", device="cpu", only=["interface.output"], case_timeout_s=5, out=tmp_path
        )
        assert report.complete and report.check("interface.output").status == "error"
        assert "time limit of one kernel call (case_timeout_s)" in report.check("interface.output").message
        assert calls_left_running() == before + 1  # still there: the API does not end its caller's process
        assert torch.get_default_dtype() == torch.float32  # the caller's setting, put back
        assert json.loads((tmp_path / "report.json").read_text())["summary"]["complete"] is True
    finally:
        release.set()
    deadline = time.monotonic() + 30
    while calls_left_running() > before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert calls_left_running() == before


@pytest.mark.slow
def test_fuzz_takes_the_call_limit_and_stops_calling_a_hung_kernel(tmp_path):
    """fuzz bounds each call by case_timeout_s as check does: the example whose call hangs is a crash
    finding, every later example is judged without a call, and the search ends in bounded time."""
    release = threading.Event()
    calls = [0]
    bf16 = flamia_verify.load_kernel("bf16").fn
    hang_at = 8

    def attn(q, k, v, cu_q, cu_k, mq, mk, softmax_scale=None, causal=False):
        calls[0] += 1
        if calls[0] == hang_at:
            release.wait(600)
        return bf16(q, k, v, cu_q, cu_k, mq, mk, softmax_scale=softmax_scale, causal=causal)

    before = calls_left_running()
    t0 = time.monotonic()
    try:
        result = flamia_verify.fuzz(attn, recipe="bf16", device="cpu", examples=20, case_timeout_s=3)
        seconds = time.monotonic() - t0
        crash = result.report.check("interface.fuzz")
        assert crash.status == "fail" and calls[0] == hang_at, (crash.message, calls[0])
        assert seconds < BOUND_S, seconds  # one wait of the limit, not one per example
    finally:
        release.set()
    deadline = time.monotonic() + 30  # the released call finishes before the test process ends
    while calls_left_running() > before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert calls_left_running() == before
