"""Properties: the checks that low-precision attention breaks, the engine that runs them, and the
hypothesis strategies and fuzzer that feed them.

Each check is a property of attention that the kernel must have: its output within the recipe's
error model and a-priori bound, no dependence on a position causal masking hides or on another
packed document, a backward that differentiates the forward that ran, bitwise repeatable results,
the calling convention honoured. A check tests its property on inputs chosen to expose the kernels
that break it, and a failure names the reason and a worst case that reproduces it.

    report = run_checks("flamia-mxfp8", suite="quick")          # -> flamia_verify.reports.Report
    report = run_spec(RunSpec.resolve("flamia-mxfp8", device="auto"))  # the same, resolved first
    result = fuzz("my_pkg.attn:flash_varlen", recipe="mxfp8")   # -> FuzzResult (reproducer on failure)
    check  = replay_case("my_pkg.attn:flash_varlen", result.reproducer, recipe="mxfp8")

Check names are ``family.check``; ``list_checks(suite)`` lists them with their descriptions and
``default_thresholds(recipe)`` their thresholds. docs/checks.md derives every threshold.

The modules form layers (pyproject.toml's import-linter contract "properties layers"; no module
imports one above it, at module level or inside a function): ``fuzz`` and ``coverage`` over
``engine``, over ``thresholds``, over ``catalog`` (which imports the check families, registering
them), over ``checks`` (one package per family, independent of each other, and ``checks.common``,
what several families share, the verdict of a check among it), over ``search`` (the fuzzer's
hypothesis search), over ``perturb`` and ``bounds`` (what the checks share with the search),
``context`` (what a running check sees) and ``strategies``, over ``harness``, over ``registry``
(``register``, ``CheckSpec``), ``tolerances``, ``metrics`` and ``compare``, over ``cases``.
"""

from __future__ import annotations

from flamia_verify.properties.engine import ProgressEvent, RunSpec, list_checks, run_checks, run_spec
from flamia_verify.properties.fuzz import FuzzResult, fuzz, replay_case
from flamia_verify.properties.registry import CheckSpec
from flamia_verify.properties.thresholds import default_thresholds
from flamia_verify.settings import SUITES

__all__ = [
    "CheckSpec",
    "FuzzResult",
    "ProgressEvent",
    "RunSpec",
    "SUITES",
    "default_thresholds",
    "fuzz",
    "list_checks",
    "replay_case",
    "run_checks",
    "run_spec",
]
