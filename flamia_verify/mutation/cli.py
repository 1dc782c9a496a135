"""Kept for scripts that import the mutation report from here (benchmarks/mutation_kill.py): the
``mutate`` command lives in :mod:`flamia_verify.commands.mutate`, mutation.md and the gate in
:mod:`flamia_verify.mutation.report`."""

from __future__ import annotations

from flamia_verify.mutation.report import KINDS, render_markdown, verdict

__all__ = ["KINDS", "render_markdown", "verdict"]
