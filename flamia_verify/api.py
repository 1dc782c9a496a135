"""The Python API mirror of the command line, for notebooks and pytest.

>>> import flamia_verify
>>> report = flamia_verify.check("flamia-mxfp8", suite="quick")
>>> report.passed, [c.name for c in report.checks if c.status == "fail"]

# in a test suite, for your own kernel:
>>> report = flamia_verify.check(my_varlen_attention, recipe="mxfp8", only=["causal", "isolation"])
>>> assert report.passed, (report.summary()["failed_checks"], report.summary()["errored_checks"])
"""

from __future__ import annotations

from pathlib import Path

from flamia_verify.results import partial_report
from flamia_verify.settings import DEFAULT_THREADS

__all__ = ["check", "fuzz"]


def check(
    kernel="flamia-mxfp8",
    *,
    recipe: str | None = None,
    suite: str = "quick",
    device: str = "auto",
    dtype="bf16",
    seed: int = 0,
    only: list[str] | None = None,
    thresholds: dict | None = None,
    case_timeout_s: float | None = None,
    forward_only: bool = False,
    out: str | Path | None = None,
    require: tuple[str, ...] | list[str] = (),
    threads: int | None = DEFAULT_THREADS,
    inputs: str | Path | None = None,
):
    """Check ``kernel`` (a spec string, a callable in the varlen convention, or a LoadedKernel).

    Returns a :class:`flamia_verify.Report`; with ``out`` the reports are also written there.
    device: auto, cpu, cuda or cuda:N; dtype: bf16, fp16 or fp32, their torch names or torch dtypes
    (:mod:`flamia_verify.settings`).
    forward_only declares a kernel without a backward: its gradient checks skip and the report says
    that gradients were not checked. Undeclared, a kernel whose backward is missing or raises fails.
    require names the non-gating verdicts that gate as well (``["reproducibility"]``,
    ``["robustness"]``): their checks always run and are reported in ``report.verdicts()``; only
    required ones count toward ``report.passed``.
    A kernel call past ``case_timeout_s`` is an ``error`` row of the returned report; its thread cannot
    be killed and is left running (a daemon thread), so the caller's process decides when to end.
    A run that stops early (KeyboardInterrupt, a kernel crash mid-run) writes the finished checks to
    ``out``, marked incomplete, and raises again; the exception's ``partial_report`` holds them.
    The checks run in the caller's process: a kernel that ends it (``os._exit``, a segfault) ends the
    caller, and nothing is written. ``flamia-verify check`` runs them in a child process and reports
    such an end (exit 3, the finished checks written, marked incomplete).
    threads: torch's intra-op CPU threads during the run, restored after it (default one, as the CLI;
    None leaves torch's setting); the report records the count (``environment.torch_threads``).
    inputs: a capture directory (:mod:`flamia_verify.capture`): the checks run on its recorded calls
    (error, bound, consistency, causal and isolation on every call) instead of the suite's cases; a
    bad capture raises CaptureError.
    """
    from flamia_verify.properties import run_checks
    from flamia_verify.reports import write_reports

    try:
        report = run_checks(
            kernel,
            recipe=recipe,
            suite=suite,
            device=device,
            dtype=dtype,
            seed=seed,
            only=only,
            thresholds=thresholds,
            case_timeout_s=case_timeout_s,
            forward_only=forward_only,
            require=require,
            threads=threads,
            inputs=inputs,
        )
    except BaseException as exc:
        partial = partial_report(exc)
        if out is not None and partial is not None and not isinstance(exc, OSError):
            write_reports(partial, Path(out))
        raise
    if out is not None:
        write_reports(report, Path(out))
    return report


def fuzz(
    kernel,
    *,
    recipe: str | None = None,
    examples: int = 100,
    seed: int = 0,
    device: str = "auto",
    dtype="bf16",
    forward_only: bool = False,
    threads: int | None = DEFAULT_THREADS,
    case_timeout_s: float | None = None,
):
    """Fuzz ``kernel`` over odd variable-length packings; returns a FuzzResult with a reproducer on failure.

    A missing or raising backward fails the result unless ``forward_only`` declares it. ``threads`` and
    ``case_timeout_s`` as for :func:`check`."""
    from flamia_verify.properties import fuzz as _fuzz

    return _fuzz(
        kernel,
        recipe=recipe,
        examples=examples,
        seed=seed,
        device=device,
        dtype=dtype,
        forward_only=forward_only,
        case_timeout_s=case_timeout_s,
        threads=threads,
    )
