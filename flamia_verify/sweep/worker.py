"""One sweep case, run where a backend puts it: in a worker process of the local pool (``python -m
flamia_verify.sweep.worker``: one request per line on stdin, each result on one stdout line that
starts with :data:`RESULT_MARK`, so that whatever a kernel prints cannot be mistaken for one; the
process serves cases until stdin closes) or inside a Ray task (:func:`run_case`). The result is a
JSON object:

    {"key", "case", "status": pass | fail | error | incomplete, "report": report.json's object or null,
     "recipe": the recipe the checks ran under or null, "error": one line or null, "elapsed_s", "host",
     "device", "speed" (a timed case only)}

``status`` ``error`` with no report means the case produced no verdict (the kernel could not be loaded,
the worker crashed, hung past the sweep's timeout or lost its node); the backends write those, too.
Such a result still names its recipe where it is known: a worker announces the recipe on a line that
starts with :data:`RECIPE_MARK` once the kernel has loaded, before the kernel's first call, so a
kernel that then hangs or crashes keeps the recipe it declared; without that line (the kernel never
loaded, a Ray task), the case's own recipe or, for a built-in kernel or an adapter, the one it claims.
"""

from __future__ import annotations

import json
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from flamia_verify.results import SweepResult, partial_report
from flamia_verify.sweep.matrix import SweepCase, case_key

__all__ = ["RECIPE_MARK", "RESULT_MARK", "run_case", "error_result", "main"]

#: the prefix of a result line on a worker's stdout
RESULT_MARK = "\x1eflamia-sweep-result "
#: the prefix of the line on a worker's stdout that names the running case's recipe
RECIPE_MARK = "\x1eflamia-sweep-recipe "


def _result(
    case: SweepCase,
    key: str | None,
    elapsed_s: float,
    status: str,
    *,
    report: dict[str, Any] | None = None,
    error: str | None = None,
    device: str | None = None,
    speed: dict[str, Any] | None = None,
    recipe: str | None = None,
) -> SweepResult:
    """A result (the module docstring has its fields); ``speed`` only when the case was timed."""
    return SweepResult(
        key=key or case_key(case),
        case=case.to_dict(),
        status=status,
        report=report,
        recipe=(report or {}).get("recipe") or recipe or case.recipe or _claimed_recipe(case.kernel),
        error=error,
        elapsed_s=round(elapsed_s, 3),
        host=socket.gethostname(),
        device=device,
        speed=speed,
    )


def _claimed_recipe(spec: str) -> str | None:
    """The recipe a built-in kernel or an adapter claims (known without loading it), else None."""
    from flamia_verify.kernels.adapters import ADAPTERS
    from flamia_verify.kernels.designs import DESIGNS

    if spec in DESIGNS:
        return DESIGNS[spec].recipe.name
    adapter = ADAPTERS.get(spec)
    return adapter.recipe if adapter is not None else None


def error_result(
    case: SweepCase, reason: str, elapsed_s: float = 0.0, key: str | None = None, recipe: str | None = None
) -> SweepResult:
    """The result of a case that produced no verdict, with the reason in one line; ``recipe``: the one
    its worker announced (default: the case's, or the one its built-in kernel or adapter claims)."""
    return _result(case, key, elapsed_s, "error", error=" ".join(str(reason).split())[:2000], recipe=recipe)


def run_case(
    case_data: dict[str, Any], key: str | None = None, on_recipe: Callable[[str], None] | None = None
) -> SweepResult:
    """Run one case in this process and return its result object (never raises for a kernel's fault).
    ``on_recipe`` receives the recipe of the checks once the kernel has loaded, before its first call."""
    from flamia_verify.errors import FlamiaVerifyError
    from flamia_verify.properties import RunSpec, run_spec
    from flamia_verify.settings import DEFAULT_THREADS

    case = SweepCase.from_dict(case_data)
    start = time.perf_counter()
    if case.speed_only:
        return _speed_result(case, key, start)
    try:
        spec = RunSpec.resolve(case.kernel, threads=DEFAULT_THREADS, **case.check_kwargs())  # resolved once
        if on_recipe is not None:
            on_recipe(spec.recipe.name)
        report = run_spec(spec)
    except FlamiaVerifyError as exc:  # a kernel that does not load, a configuration the checks refuse
        return error_result(case, f"{type(exc).__name__}: {exc}", time.perf_counter() - start, key)
    except Exception as exc:  # a crash mid-run keeps the finished checks, like `check` does
        partial = partial_report(exc)
        if partial is None:
            return error_result(case, f"{type(exc).__name__}: {exc}", time.perf_counter() - start, key)
        report = partial
    data = report.to_dict()
    elapsed = time.perf_counter() - start
    env = data.get("environment", {})
    speed = _speed(case, env.get("device", "")) if case.speed is not None else None
    device = env.get("device_name") or env.get("device")
    return _result(case, key, elapsed, data["summary"]["status"], report=data, device=device, speed=speed)


def _speed_result(case: SweepCase, key: str | None, start: float) -> SweepResult:
    """The result of a speed-only case: status ``measured``, or ``error`` with the reason."""
    import torch

    speed = _speed(case, "cuda" if case.device != "cpu" and torch.cuda.is_available() else "cpu")
    failed = bool(speed.get("error")) and speed.get("fwd_tflops") is None
    return _result(
        case,
        key,
        time.perf_counter() - start,
        "error" if failed else "measured",
        error=speed.get("error") if failed else None,
        device=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        speed=speed,
    )


def _speed(case: SweepCase, device: str) -> dict[str, Any]:
    """The kernel's speed at the case's shape, after its checks, in the same process (a row of
    :func:`flamia_verify.bench.measure_speed`), or ``{"error": why not}``."""
    import torch

    from flamia_verify.bench import SpeedShape, measure_speed

    if not str(device).startswith("cuda") or not torch.cuda.is_available():
        return {"error": "not measured: speed is measured on a CUDA device only"}
    torch.cuda.empty_cache()
    try:
        row = measure_speed(case.kernel, SpeedShape(**(case.speed or {})), device)
    except Exception as exc:  # a kernel that does not load for timing: its row says so
        return {"error": f"{type(exc).__name__}: {exc}"}
    finally:
        torch.cuda.empty_cache()
    return {k: (None if isinstance(v, float) and v != v else v) for k, v in row.items()}


def _write_report(folder: Path, report: dict[str, Any]) -> None:
    """The case's full report into ``folder``, here where it ran (the workers render in parallel); a
    failure leaves it to the sweep, which writes every report still missing after its cases."""
    from flamia_verify.sweep.store import write_case_report

    try:
        write_case_report(folder, report)
    except Exception as exc:  # the result matters more than its pages
        print(f"flamia-verify sweep worker: the report of {folder.name} was not written: {exc}", file=sys.stderr)


def _announce(recipe: str) -> None:
    """Tell the parent the running case's recipe (its line survives the worker's kill)."""
    sys.stdout.write("\n" + RECIPE_MARK + json.dumps(recipe) + "\n")
    sys.stdout.flush()


def main() -> int:
    """``python -m flamia_verify.sweep.worker``: serve the cases of stdin's lines until it closes."""
    for line in sys.stdin:
        if not line.strip():
            continue
        request = json.loads(line)
        result = run_case(request["case"], request.get("key"), on_recipe=_announce)
        if request.get("reports") and result.report is not None:
            _write_report(Path(request["reports"]) / result.key, result.report)
        sys.stdout.write("\n" + RESULT_MARK + json.dumps(result.to_dict(), separators=(",", ":")) + "\n")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
