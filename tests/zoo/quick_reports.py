"""Quick-suite reports shared by the test modules that read the same runs (a correct kernel at seeds 0
and 1: the false-alarm tests and compare's seed-to-seed noise tests). Both modules are in the
``quick-reports`` xdist group (``--dist loadgroup`` in the Makefile), so one worker runs them and
each report is computed once per run of the suite instead of once per module."""

from __future__ import annotations

import functools

from flamia_verify.properties import run_checks

__all__ = ["quick_report", "GROUP"]

GROUP = "quick-reports"


def quick_report(kernel, seed: int = 0, recipe: str | None = None):
    """The quick suite's report of ``kernel`` at ``seed``, computed once per process whichever way
    the arguments are spelled (``quick_report(k, 0)`` and ``quick_report(k, 0, None)`` share it)."""
    return _quick_report(kernel, int(seed), recipe or getattr(kernel, "recipe", None))


@functools.cache
def _quick_report(kernel, seed: int, recipe: str | None):
    return run_checks(kernel, recipe=recipe, suite="quick", seed=seed, device="cpu")
