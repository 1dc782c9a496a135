"""Running the checks: ``run_checks`` resolves the kernel, recipe, suite and thresholds, probes the
kernel, runs every selected check and returns the :class:`~flamia_verify.results.Report`.

Failure handling:

* the kernel cannot run the smallest case -> :class:`KernelCrashError` (nothing else could run);
* the kernel raises or hangs on one case -> that check is ``error`` (the exception type and text in
  its message, the case and the exception's full traceback in ``worst_case``), and the other checks
  still run;
* a kernel declared forward-only (``forward_only=True``) -> its backward is never called; every
  gradient-only check is ``skip`` and the report says that gradients were not checked;
* an undeclared kernel whose backward is missing (no grad_fn) or raises on the smallest case ->
  ``interface.backward`` fails with the reason and every gradient-only check is ``error``: a backward
  that cannot run is a finding, not a forward-only kernel;
* a forward that writes into its inputs in place, which autograd rejects on leaf inputs that require
  grad -> the forward is run on detached inputs, ``interface.inputs_unmodified`` fails naming the
  tensor, ``interface.backward`` fails, and the gradient-only checks are ``skip`` with that reason;
* every kernel call is audited for in-place writes (``KernelHarness.modifications``);
  ``interface.inputs_unmodified`` is judged again at the end of the run over every call made;
* a run that stops early (KeyboardInterrupt, a signal turned into one, an error from a callback such
  as a full disk) -> the exception carries the report of the finished checks as ``partial_report``,
  marked ``complete = False`` with the reason. While the run is going, ``on_report`` receives the
  report so far, marked incomplete as well, so that a file written from it never reads as a verdict.
"""

from __future__ import annotations

import importlib.metadata
import platform
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from flamia_verify._version import __version__
from flamia_verify.errors import ConfigError, FlamiaVerifyError
from flamia_verify.kernels.metadata import kernel_paths
from flamia_verify.kernels.state import can_snapshot, declared_state, is_factory, snapshot_state
from flamia_verify.properties.cases import Case, capture_environment, make_inputs
from flamia_verify.properties.catalog import get_spec
from flamia_verify.properties.checks.interface.contract import (
    INPUTS_UNMODIFIED,
    PROCESS_STATE,
    judge_modifications,
    judge_process_state,
)
from flamia_verify.properties.context import CheckContext
from flamia_verify.properties.harness import KernelCallError, KernelHarness, KernelHungError, StatePin
from flamia_verify.properties.registry import CheckSpec
from flamia_verify.properties.run_spec import RunSpec, list_checks, resolve_kernel, resolve_require, select_checks
from flamia_verify.properties.thresholds import override_records
from flamia_verify.recipes import Recipe
from flamia_verify.results import CheckResult, Report, attach_partial
from flamia_verify.settings import dtype_name, torch_threads

__all__ = [
    "run_checks",
    "list_checks",
    "ProgressEvent",
    "environment",
    "kernel_state",
    "resolve_kernel",
    "select_checks",
    "resolve_require",
    "run_spec",
    "RunSpec",
    "build_context",
]


@dataclass(frozen=True)
class ProgressEvent:
    """Where a run stands, for a progress bar.

    check: the running check's name; index: its 0-based position among ``total`` selected checks;
    fraction: how much of that check is done (0..1); elapsed_s: seconds since the run started;
    estimated_s: estimated total seconds of the run (None until one check has finished);
    overall: fraction of the whole run done (by the checks' relative costs).
    """

    check: str
    index: int
    total: int
    fraction: float
    elapsed_s: float
    estimated_s: float | None
    overall: float


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def environment(device: str, kernel_fn=None) -> dict:
    """Where the run happened: versions, device, threads; for an adapter, the versions of the
    libraries it wraps (``kernel_libraries``)."""
    if device.startswith("cuda") and torch.cuda.is_available():
        dev_name = torch.cuda.get_device_name(torch.device(device))
    else:
        dev_name = platform.processor() or platform.machine() or "cpu"
    env: dict[str, Any] = {
        "flamia_verify": __version__,
        "torch": torch.__version__,
        "triton": _version("triton"),
        "cuda": torch.version.cuda,
        "device": device,
        "device_name": dev_name,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "torch_threads": torch.get_num_threads(),
    }
    libraries = getattr(kernel_fn, "libraries", None)
    if libraries:
        env["kernel_libraries"] = dict(libraries)
    return env


def build_context(spec: RunSpec) -> CheckContext:
    """The context the checks of ``spec`` run in: the kernel's harness, probed on the smallest case."""
    loaded, settings, dtype, device = spec.kernel, spec.settings, spec.dtype, spec.device
    harness = KernelHarness(loaded.fn, timeout_s=spec.case_timeout_s)
    smallest = Case(
        (16,), heads=2, heads_k=2, headdim=settings.headdim, causal=True, seed=spec.seed, dtype=dtype_name(dtype)
    )
    # a stateful kernel whose state can be put back: its state before any call, from which every later
    # call runs at the state one call on its own case leaves (harness.StatePin), so that each check
    # judges one pure function; the state family judges how the state moves (properties.checks.state)
    fresh = snapshot_state(loaded.fn) if can_snapshot(loaded.fn) else None
    _, support = harness.probe(make_inputs(smallest, device), forward_only=spec.forward_only)
    if can_snapshot(loaded.fn):
        harness.pin = StatePin(loaded.fn, fresh, backward=support.available)
    return CheckContext(
        loaded.name,
        spec.recipe,
        harness,
        settings,
        spec.seed,
        device,
        dtype,
        support,
        {name: dict(values) for name, values in spec.thresholds.items()},
        {name: dict(values) for name, values in spec.options.items()},
    )


def kernel_state(fn) -> dict:
    """What report.json's ``environment.kernel_state`` says about a kernel's state: its declaration
    (``state_policy``), whether it is a factory and whether the checks pin its state. A malformed
    declaration is a configuration error naming the attribute."""
    try:
        policy = declared_state(fn)
    except ValueError as exc:
        raise ConfigError(f"the kernel's state_policy attribute is not a state policy: {exc}") from None
    return {
        "declared": None if policy is None else policy.to_dict(),
        "description": "no state declared" if policy is None else policy.describe(),
        "factory": is_factory(fn),
        "pinned": can_snapshot(fn),
    }


def run_one(ctx: CheckContext, spec: CheckSpec) -> CheckResult:
    ctx.spec = spec
    t0 = time.perf_counter()
    try:
        if spec.needs_backward and not ctx.has_backward:
            result = _without_gradients(ctx)
        else:
            result = spec.fn(ctx)  # type: ignore[misc]  # registered checks have their function
    except KernelCallError as err:
        result = ctx.result(
            "error",
            {},
            message=f"the kernel failed ({err.where}): {err.summary}",
            worst_case={
                "case": err.case.to_dict(),
                "stage": err.where,
                "exception": err.summary,
                "traceback": err.traceback,
            },
        )
    except KernelHungError as err:  # an earlier call hung: this check would call the kernel again
        result = ctx.result("error", {}, message=str(err))
    except FlamiaVerifyError:
        raise
    except Exception as exc:  # the check could not be evaluated (e.g. the kernel returned a wrong shape)
        result = ctx.result("error", {}, message=f"check could not be evaluated: {type(exc).__name__}: {exc}")
    result.duration_s = time.perf_counter() - t0
    result.verdict = spec.verdict  # the spec's, whoever built the result
    return result


def _without_gradients(ctx: CheckContext) -> CheckResult:
    """A gradient-only check on a run without gradients: skip when declared (or when an in-place write
    that fails the run is why), else error: an undeclared backward that cannot run fails the run."""
    b = ctx.backward
    if b.declared:
        return ctx.skip(
            "gradients not checked: the kernel is declared forward-only (--forward-only, "
            "forward_only = true); this check needs gradients"
        )
    if b.cause == "inplace":
        return ctx.skip(f"gradients not checked: {b.reason}; interface.inputs_unmodified reports the write")
    return ctx.result(
        "error",
        {},
        message=f"gradients not checked: {b.reason} on the smallest case; a kernel without a working backward "
        "fails unless declared forward-only (--forward-only, forward_only = true)",
        worst_case=(
            {"case": b.case.to_dict(), "stage": "backward", "exception": b.reason}
            | ({"traceback": b.traceback} if b.traceback else {})
            if b.case
            else {}
        ),
    )


def _stop_reason(exc: BaseException) -> str:
    if isinstance(exc, KeyboardInterrupt):
        return f"interrupted ({str(exc) or 'SIGINT'})"
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


#: the checks that judge every call of a run (the harness audits each), with their judges
RUN_WIDE = {INPUTS_UNMODIFIED: judge_modifications, PROCESS_STATE: judge_process_state}


def _rejudge_run_wide(ctx: CheckContext, report: Report, audited_at: dict[str, int]) -> None:
    """The run-wide checks again over every call of the run, when calls came after each ran."""
    for name, at in audited_at.items():
        if ctx.harness.calls == at:
            continue
        for i, old in enumerate(report.checks):
            if old.name != name:
                continue
            ctx.spec = get_spec(name)
            new = RUN_WIDE[name](ctx)
            if old.status == "error" and new.status == "pass":
                break  # its own calls failed; nothing seen elsewhere either
            if old.status == "error":
                new.message += f" (its own calls: {old.message})"
            new.duration_s = old.duration_s
            report.checks[i] = new
            break


def run_checks(
    kernel,
    *,
    recipe: str | Recipe | None = None,
    suite: str = "quick",
    device: str = "cpu",
    dtype: torch.dtype | str = torch.bfloat16,
    seed: int = 0,
    only: list[str] | None = None,
    thresholds: dict | None = None,
    on_progress: Callable[[ProgressEvent], None] | None = None,
    on_result: Callable[[CheckResult], None] | None = None,
    case_timeout_s: float | None = None,
    forward_only: bool = False,
    on_report: Callable[[Report], None] | None = None,
    threshold_source: str | None = None,
    require: tuple[str, ...] | list[str] = (),
    threads: int | None = None,
    inputs: str | Path | None = None,
    on_start: Callable[[Report, list[CheckSpec]], None] | None = None,
) -> Report:
    """Check ``kernel`` (a spec string, a callable or a LoadedKernel) and return the report.

    recipe: the kernel's own recipe when it declares one, else required. suite: quick, standard
    or full. device: auto, cpu, cuda or cuda:N; dtype: bf16, fp16 or fp32 (a name or a torch dtype;
    :func:`flamia_verify.settings.resolve_dtype`). only: families (``["causal", "error"]``) or full check names. thresholds: overrides
    ``{check_name: {key: value}}`` (and ``"suite": {setting: value}``). on_progress receives
    :class:`ProgressEvent`s; on_result each finished :class:`CheckResult`. case_timeout_s bounds
    each kernel call (a hung call makes its check ``error``). forward_only declares a kernel without
    a backward (its gradient checks skip; undeclared, a backward that cannot run fails the run); a
    kernel function with the attribute ``forward_only = True`` declares it itself.
    on_report receives the report after each finished check, marked incomplete (``complete`` False)
    until the run ends. A run that stops early raises with ``partial_report`` set on the exception.
    threshold_source names where ``thresholds`` came from (the config file; default: the Python API);
    every override is recorded in the report's ``threshold_overrides`` with its default and source.
    require: the non-gating verdicts (``reproducibility``, ``robustness``) that gate this run as well;
    their checks always run and are always reported (see :mod:`flamia_verify.results`).
    threads: torch's intra-op CPU threads during the run (restored after it; None leaves torch's
    setting); the report's environment records the count that ran (``torch_threads``).
    inputs: a capture directory (:mod:`flamia_verify.capture`): the checks run on its recorded calls
    instead of the suite's cases, and only the checks of ``checks.common.captured.CAPTURED_CHECKS`` (error,
    bound, consistency, causal and isolation on every call; ``only`` selects among them); a bad
    capture raises CaptureError before the kernel is called.
    on_start receives the report (no checks yet, marked incomplete) and the selected checks in running
    order once the kernel has passed its probe, before the first check runs.
    """
    spec = RunSpec.resolve(
        kernel,
        recipe=recipe,
        suite=suite,
        device=device,
        dtype=dtype,
        seed=seed,
        only=only,
        thresholds=thresholds,
        threshold_source=threshold_source,
        case_timeout_s=case_timeout_s,
        forward_only=forward_only,
        require=require,
        threads=threads,
        inputs=inputs,
    )
    return run_spec(spec, on_progress=on_progress, on_result=on_result, on_report=on_report, on_start=on_start)


def run_spec(
    spec: RunSpec,
    *,
    on_progress: Callable[[ProgressEvent], None] | None = None,
    on_result: Callable[[CheckResult], None] | None = None,
    on_report: Callable[[Report], None] | None = None,
    on_start: Callable[[Report, list[CheckSpec]], None] | None = None,
) -> Report:
    """Run the checks of a resolved :class:`RunSpec` (:func:`run_checks` resolves one, then runs it);
    the callbacks as for :func:`run_checks`."""
    with torch_threads(spec.threads):
        return _run(spec, on_progress, on_result, on_report, on_start)


def _run(spec: RunSpec, on_progress, on_result, on_report, on_start) -> Report:
    """The body of :func:`run_checks`, under its thread count."""
    loaded, dtype, device = spec.kernel, spec.dtype, spec.device
    paths_before = dict(kernel_paths(loaded.fn) or {})
    state_env = kernel_state(loaded.fn)  # before any call: a malformed declaration is a usage error
    specs = list(spec.checks)
    ctx = build_context(spec)
    ctx.captured = spec.captured
    report = Report(
        kernel=loaded.name,
        recipe=spec.recipe.name,
        suite=spec.suite,
        seed=spec.seed,
        environment=environment(device, loaded.fn),
    )
    if spec.inputs is not None:
        report.environment.update(capture_environment(spec.inputs))
    report.require = list(spec.require)
    report.threshold_overrides = override_records(
        spec.recipe, dtype, spec.suite, None if spec.overrides is None else dict(spec.overrides), spec.threshold_source
    )
    report.environment.update(
        dtype=dtype_name(dtype),
        backward=ctx.has_backward,
        backward_reason=ctx.backward.reason,
        forward_only=ctx.backward.declared,
        case_timeout_s=spec.case_timeout_s,
        kernel_source=loaded.source,
        kernel_state=state_env,
    )
    start = time.perf_counter()
    costs = [s.cost for s in specs]
    total_cost = sum(costs) or 1.0
    done_cost = 0.0

    def emit(i: int, fraction: float) -> None:
        if on_progress is None:
            return
        elapsed = time.perf_counter() - start
        overall = (done_cost + costs[i] * fraction) / total_cost
        estimate = elapsed / overall if overall > 0.02 else None
        on_progress(ProgressEvent(specs[i].name, i, len(specs), fraction, elapsed, estimate, overall))

    report.complete = False
    report.incomplete_reason = f"the run had not finished when this report was written: 0 of {len(specs)} checks done"
    audited_at: dict[str, int] = {}  # harness calls when each run-wide check ran
    if on_start is not None:
        on_start(report, specs)
    try:
        for i, check in enumerate(specs):
            ctx.on_fraction = lambda f, i=i: emit(i, f)
            emit(i, 0.0)
            result = run_one(ctx, check)
            if check.name in RUN_WIDE:
                audited_at[check.name] = ctx.harness.calls
            report.checks.append(result)
            report.incomplete_reason = (
                f"the run had not finished when this report was written: {i + 1} of {len(specs)} checks done"
            )
            emit(i, 1.0)
            done_cost += costs[i]
            if on_result is not None:
                on_result(result)
            if on_report is not None:
                on_report(report)
        _rejudge_run_wide(ctx, report, audited_at)
    except BaseException as exc:
        try:
            _rejudge_run_wide(ctx, report, audited_at)
        except Exception:  # the partial report is still worth having without it
            pass
        report.incomplete_reason = (
            f"the run stopped after {len(report.checks)} of {len(specs)} checks: {_stop_reason(exc)}"
        )
        attach_partial(exc, report)
        raise
    report.complete = True
    report.incomplete_reason = None
    paths = kernel_paths(loaded.fn)
    if paths is not None:  # a built-in kernel: which implementation ran, call by call
        report.environment["kernel_paths"] = {
            path: n - paths_before.get(path, 0) for path, n in sorted(paths.items()) if n > paths_before.get(path, 0)
        }
    report.environment["kernel_calls"] = ctx.harness.calls
    report.environment["kernel_seconds"] = round(ctx.harness.seconds, 3)
    report.environment["total_seconds"] = round(time.perf_counter() - start, 3)
    return report
