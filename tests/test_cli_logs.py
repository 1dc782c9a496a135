"""Output for logs: off a terminal (a CI log, ``| tee``) plain full-width lines and a line per finished check;
on a terminal the rich tables stay."""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from reports_examples import example_report
from rich.console import Console

from flamia_verify.kernels import builtin_kernels
from flamia_verify.reports import render_terminal
from flamia_verify.reports.metrics import key_metric
from flamia_verify.reports.terminal import check_line, is_plain, print_table

REPO = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TERM": "dumb", "COLUMNS": "80"}
ENV.pop("FORCE_COLOR", None)
ENV.pop("TTY_COMPATIBLE", None)


def _cli(*args: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "flamia_verify.cli", *args],
        cwd=REPO,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=300,
        **kwargs,
    )


def _plain_console(width: int = 80) -> tuple[Console, io.StringIO]:
    buffer = io.StringIO()
    return Console(file=buffer, width=width, color_system=None), buffer


def test_a_file_or_pipe_is_plain_and_a_terminal_is_not():
    console, _ = _plain_console()
    assert is_plain(console)
    assert not is_plain(Console(file=io.StringIO(), force_terminal=True))


def test_plain_summary_has_one_unwrapped_line_per_check():
    report = example_report()
    console, buffer = _plain_console(width=80)
    render_terminal(report, console, plain=True)
    lines = buffer.getvalue().splitlines()
    assert lines[0] == "flamia-verify  kernel mxfp8-naive  recipe mxfp8  suite quick  seed 1234"
    for check in report.checks:
        line = next(line for line in lines if re.match(rf"\S+ +{re.escape(check.name)} ", line))
        assert line.split()[0] == {"pass": "PASS", "fail": "FAIL", "error": "ERROR", "skip": "SKIP"}[check.status]
        key = key_metric(check)
        if key is not None:
            assert f" {key.label} " in line, (key.label, line)  # whole, not cut at the column edge
        assert line.endswith(check.message), line
    # header, checks, verdict, failed list, errored list, the case seeds of the worst cases
    assert len(lines) == 1 + len(report.checks) + 4
    assert lines[-1] == (
        "worst cases: error.backward case seed 1301, causal.forward case seed 1377, causal.backward case seed "
        f"{report.check('causal.backward').worst_case['seed']} (run seed 1234; each case in report.json)"
    )
    assert "FAIL  11 checks: 7 passed, 2 failed, 1 error, 1 skipped" in lines
    assert not any(ch in buffer.getvalue() for ch in "│┃━─…")


def test_plain_table_keeps_every_cell_whole():
    console, buffer = _plain_console(width=40)
    long = "a description much longer than the forty columns this console claims to have, kept whole"
    print_table(console, "kernels", ["name", "description"], [["a-rather-long-kernel-name", long], ["b", "short"]])
    lines = buffer.getvalue().splitlines()
    assert lines[:4] == [
        "kernels",
        "name                       description",
        f"a-rather-long-kernel-name  {long}",
        "b                          short",
    ]


def test_check_line_names_status_metric_and_time():
    check = example_report().check("error.backward")
    check.duration_s = 1.234
    text = check_line(check, 4, 11, elapsed=12.34).plain
    assert re.fullmatch(
        r"\[ 4/11\] FAIL  error\.backward +rel_err_vs_bf16_dK 9\.7 \(≤ 4\)  1\.23 s  \(run 12\.3 s\)", text
    ), text


def test_list_in_a_pipe_prints_whole_names_and_descriptions():
    result = _cli("list")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "…" not in out and "│" not in out
    lines = out.splitlines()
    for name, kernel in builtin_kernels().items():
        line = next((line for line in lines if line.startswith(name + " ")), None)
        assert line is not None, f"{name} not listed whole"
        assert line.split()[1] == kernel.recipe
        assert line.endswith(kernel.description), line


def test_listed_descriptions_name_each_builtin_s_scale_rule():
    from flamia_verify.kernels.designs import DESIGNS, scale_rules

    lines = _cli("list").stdout.splitlines()
    for name, design in DESIGNS.items():
        line = next(line for line in lines if line.startswith(name + " "))
        for rule in scale_rules(design):
            assert rule.name in line, (name, line)
    floor = next(line for line in lines if line.startswith("flamia-mxfp8-floor "))
    assert "RCEIL" not in floor


SLOW_KERNEL = """
import time
from flamia_verify.kernels import builtin_kernels
_k = builtin_kernels()["bf16"]
def attn(q, k, v, cu_q, cu_k, mq, mk, *, softmax_scale, causal):
    time.sleep(0.05)
    return _k(q, k, v, cu_q, cu_k, mq, mk, softmax_scale=softmax_scale, causal=causal)
attn.recipe = "bf16"
"""


def test_check_in_a_pipe_prints_each_check_as_it_finishes(tmp_path):
    kernel = tmp_path / "slow.py"
    kernel.write_text(SLOW_KERNEL)
    args = [
        sys.executable,
        "-m",
        "flamia_verify.cli",
        "check",
        "--kernel",
        f"{kernel}:attn",
        "--only",
        "interface.output",
        "interface.inputs_unmodified",
        "interface.backward",
        "determinism",
        "--out",
        str(tmp_path / "rep"),
    ]
    proc = subprocess.Popen(args, cwd=REPO, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        first = proc.stdout.readline()
        while first and not first.startswith("["):
            assert first.startswith("checking "), first
            first = proc.stdout.readline()
        running = proc.poll() is None
        arrived = time.monotonic()
        rest = proc.stdout.read()
        finished = time.monotonic()
        proc.wait(timeout=300)
    finally:
        proc.kill()
        proc.stdout.close()
        proc.stderr.close()
    assert proc.returncode == 0
    assert first.startswith("[1/4] PASS  interface.output "), first
    assert running and finished - arrived > 0.2, "the first line came only at the end of the run"
    progress = [first] + [line for line in rest.splitlines() if line.startswith("[")]
    assert [line.split()[2] for line in progress] == [
        "interface.output",
        "interface.inputs_unmodified",
        "interface.backward",
        "determinism.repeat",
    ]
    assert all(re.search(r"\d+\.\d\d s  \(run \d+\.\d s\)$", line.rstrip()) for line in progress), progress
    summary = rest.splitlines()
    assert "PASS  4 checks: 4 passed" in summary


def test_on_a_terminal_tables_stay_rich():
    buffer = io.StringIO()
    console = Console(file=buffer, width=100, force_terminal=True, color_system=None)
    print_table(console, "kernels", ["name", "description"], [["bf16", "the baseline"]])
    assert "┏" in buffer.getvalue() and "│ bf16" in buffer.getvalue()


def test_list_on_a_pseudo_terminal_draws_the_rich_table():
    import pty
    import select

    leader, follower = pty.openpty()
    proc = subprocess.Popen(
        [sys.executable, "-m", "flamia_verify.cli", "list"],
        cwd=REPO,
        env=ENV,
        stdout=follower,
        stderr=subprocess.DEVNULL,
    )
    os.close(follower)
    chunks = []
    deadline = time.monotonic() + 300
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([leader], [], [], 1.0)
            if ready:
                try:
                    chunk = os.read(leader, 65536)
                except OSError:  # every writer is gone
                    break
                if not chunk:
                    break
                chunks.append(chunk)
            elif proc.poll() is not None:
                break
        proc.wait(timeout=60)
    finally:
        proc.kill()
        os.close(leader)
    out = b"".join(chunks).decode("utf-8", "replace")
    assert proc.returncode == 0
    assert "┏" in out and "┃ name" in out
