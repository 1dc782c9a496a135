"""Properties: the checks that low-precision attention breaks, the engine that runs them, and the
hypothesis strategies and fuzzer that feed them.

    report = run_checks("flamia-mxfp8", suite="quick")          # -> flamia_verify.reports.Report
    result = fuzz("my_pkg.attn:flash_varlen", recipe="mxfp8")   # -> FuzzResult (reproducer on failure)
    check  = replay_case("my_pkg.attn:flash_varlen", result.reproducer, recipe="mxfp8")

Check names are ``family.check``; ``list_checks(suite)`` lists them with their descriptions and
``default_thresholds(recipe)`` their thresholds. docs/checks.md derives every threshold.
"""

from __future__ import annotations

from flamia_verify.properties.engine import ProgressEvent, list_checks, run_checks
from flamia_verify.properties.fuzz import FuzzResult, fuzz, replay_case
from flamia_verify.properties.registry import CheckSpec
from flamia_verify.properties.thresholds import default_thresholds
from flamia_verify.settings import SUITES

__all__ = [
    "CheckSpec",
    "FuzzResult",
    "ProgressEvent",
    "SUITES",
    "default_thresholds",
    "fuzz",
    "list_checks",
    "replay_case",
    "run_checks",
]
