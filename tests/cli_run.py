"""Helpers of the command-line tests: write a file, run `flamia-verify` in-process."""

from __future__ import annotations

from pathlib import Path

from flamia_verify.cli import main


def _write(tmp_path: Path, name: str, text: str) -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def run_cli(args, capsys):
    code = main([str(a) for a in args])
    cap = capsys.readouterr()
    return code, cap.out, cap.err
