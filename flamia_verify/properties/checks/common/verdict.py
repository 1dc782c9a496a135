"""How every check records a case and ends: :func:`case_record` (what reproduces a case, with the
check's findings on it), :func:`verdict` (pass, or fail with its reasons) and :func:`violations` (the
thresholds its metrics break)."""

from __future__ import annotations

from flamia_verify.properties.cases import Case
from flamia_verify.results import CheckResult, higher_is_better, threshold_verdict

__all__ = ["case_record", "verdict", "violations"]


def case_record(case: Case, **extra) -> dict:
    """What reproduces a case: the case itself (seed, packing, shapes, distribution) plus extras."""
    rec = {"case": case.to_dict(), "cu_seqlens_q": _cu(case.lens_q), "cu_seqlens_k": _cu(case.lens_k)}
    rec.update(extra)
    return rec


def _cu(lens) -> list[int]:
    out = [0]
    for x in lens:
        out.append(out[-1] + x)
    return out


def verdict(
    ctx,
    metrics: dict,
    *,
    ok_message: str,
    first: dict | None = None,
    failures: list[str] | None = None,
    worst_case: dict | None = None,
    details: dict | None = None,
    thresholds: dict | None = None,
    judge_thresholds: bool = True,
) -> CheckResult:
    """The verdict of a check: ``fail`` with its reasons joined by "; ", else ``pass`` with ``ok_message``.

    The reasons are every threshold that a same-named metric breaks (``key = value breaks <= limit``),
    then the sentences of ``failures``; without ``failures``, the summary of ``first`` (the check's
    first finding, a :func:`case_record` with a ``summary``) when there is one. ``worst_case``
    defaults to ``first``. ``thresholds`` are those judged and reported (default: the check's);
    ``judge_thresholds=False`` for a check that judged them itself (its ``failures`` say why it
    fails): they are reported, not compared."""
    limits = ctx.th if thresholds is None else thresholds
    reasons = []
    if judge_thresholds:
        reasons = [
            f"{k} = {_fmt(metrics[k])} breaks {_direction(k)} {_fmt(limits[k])}" for k in violations(metrics, limits)
        ]
    if failures is None:
        failures = [first["summary"]] if first else []
    reasons += failures
    return ctx.result(
        "fail" if reasons else "pass",
        metrics,
        message="; ".join(reasons) if reasons else ok_message,
        worst_case=first if worst_case is None else worst_case,
        details=details,
        thresholds=thresholds,
    )


def violations(metrics: dict, thresholds: dict) -> list[str]:
    """Threshold keys whose same-named metric breaks them (the reports' direction rule)."""
    bad = []
    for key, limit in thresholds.items():
        if key in metrics and threshold_verdict(key, metrics[key], limit) is False:
            bad.append(key)
    return bad


def _direction(key: str) -> str:
    return ">=" if higher_is_better(key) else "<="


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)
