"""A log (stdout not a terminal) gets a line at least every HEARTBEAT_S seconds while a long check runs:
bound.shapes and isolation.layout each ran about 50 s of the standard suite with nothing printed (up to
134 s in the full suite on a loaded machine), which reads as a hung job."""

from __future__ import annotations

import io
import re
from dataclasses import dataclass

from rich.console import Console

from flamia_verify.cli import main
from flamia_verify.reports import terminal
from flamia_verify.reports.terminal import HEARTBEAT_S, Heartbeat


@dataclass
class _Event:
    check: str
    index: int
    total: int
    fraction: float


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_interval_is_at_most_thirty_seconds():
    assert 0 < HEARTBEAT_S <= 30


def test_a_silent_check_gets_a_line_every_interval():
    buffer = io.StringIO()
    clock = _Clock()
    beat = Heartbeat(Console(file=buffer, width=80, color_system=None), interval=30, clock=clock)
    assert not beat.poll()  # nothing started yet
    beat.update(_Event("bound.shapes", 11, 41, 0.0))
    clock.now += 29
    assert not beat.poll()
    clock.now += 1.5
    beat.update(_Event("bound.shapes", 11, 41, 0.45))
    assert beat.poll()
    clock.now += 10
    assert not beat.poll()  # the line just printed resets the silence
    clock.now += 20
    assert beat.poll()
    lines = buffer.getvalue().splitlines()
    assert len(lines) == 2
    assert re.fullmatch(
        r"\[12/41\] \.\.\.   bound\.shapes +still running: 30 s in this check, 45% done  \(run 30\.5 s\)", lines[0]
    ), lines[0]
    assert "60 s in this check" in lines[1]
    # a new check: its predecessor's line was printed when it finished
    beat.update(_Event("bound.rounding", 12, 41, 0.0))
    clock.now += 29
    assert not beat.poll()
    beat.printed()
    clock.now += 29
    assert not beat.poll()


def test_check_prints_still_running_lines_into_a_log(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(terminal, "HEARTBEAT_S", 0.3)
    slow = tmp_path / "slow.py"
    slow.write_text(
        "import time\n"
        "from flamia_verify.kernels import load_kernel\n"
        "_bf16 = load_kernel('bf16').fn\n"
        "def attn(*args, **kwargs):\n"
        "    time.sleep(0.4)\n"
        "    return _bf16(*args, **kwargs)\n"
        "attn.recipe = 'bf16'\n"
    )
    code = main(["check", "--kernel", f"{slow}:attn", "--only", "interface.output", "--out", str(tmp_path / "out")])
    assert code == 0
    out = capsys.readouterr().out
    beats = [line for line in out.splitlines() if "still running" in line]
    assert beats, out
    assert all(re.match(r"\[1/1\] \.\.\.   interface\.output +still running: \d+ s in this check", b) for b in beats)
    assert out.index(beats[0]) < out.index("[1/1] PASS")
