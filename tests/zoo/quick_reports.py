"""Quick-suite reports shared by the test modules that read the same runs (a correct kernel at seeds 0
and 1: the false-alarm tests and compare's seed-to-seed noise tests). Both modules are in the
``quick-reports`` xdist group (``--dist loadgroup`` in the Makefile), so one worker runs them and
each report is computed once per run of the suite instead of once per module."""

from __future__ import annotations

import functools

from flamia_verify.properties import run_checks

__all__ = ["quick_report", "GROUP"]

GROUP = "quick-reports"


@functools.cache
def quick_report(kernel, seed: int = 0, recipe: str | None = None):
    recipe = recipe or getattr(kernel, "recipe", None)
    return run_checks(kernel, recipe=recipe, suite="quick", seed=seed, device="cpu")
