"""The result model and the verdict rule: what a run found, in the shape of report.json (schema flamia-verify/report/v1).

    {"schema": "flamia-verify/report/v1", "kernel": ..., "recipe": ..., "suite": ..., "seed": ...,
     "threshold_overrides": [{"scope", "key", "kind", "value", "default", "source"}, ...],
     "environment": {...},
     "checks": [{"name", "family", "status", "metrics", "thresholds", "worst_case", ...}],
     "summary": {...}}

`name` is always ``family.check`` (e.g. ``causal.forward``). `status` is one of pass, fail, error, skip.
`verdict` names the verdict the check belongs to (added within v1; absent in older reports, read as
``gating``):

* ``gating``: accuracy within the recipe (error, bound, bias, consistency), information flow (a value
  perturbation of future tokens, other documents, other heads or NaN where a query cannot see must not
  change a bit of what must not depend on it), the calling convention and the process state. A
  failure here means "this kernel computes something other than its recipe promises, or lets
  information flow where it must not": do not adopt it.
* ``reproducibility``: bitwise equality under structural changes that move no value: repeated runs,
  the order, number and lengths of the other documents, the offset in the pack, max_seqlen, autocast.
  Reported always; gates only when required (non-deterministic backwards and pad-to-max designs
  train correctly).
* ``robustness``: inputs no training run produces (NaN already in q, softmax_scale = 0, a pack
  without queries). Reported always; gates only when required. Refusing such an input with an
  exception is allowed.

`require` (added within v1; absent read as none) lists the non-gating verdicts the run was asked to
gate on. A check *gates* when its verdict is ``gating`` or required; `passed` and the exit code read
only the checks that gate; `summary.verdicts` gives each verdict's status and its failed checks.
Metrics and thresholds are flat dicts of JSON numbers, strings or booleans; `worst_case` carries enough
to reproduce a finding (seed, packing, shapes, location, values). Extra fields per check: `message`
(one line a person reads), `duration_s`, `details` (free-form data for plots, e.g. error per position).
`seed` is the run's seed, from which every case seed is derived; a worst case carries its own case seed
(``worst_case["case"]["seed"]``, or ``worst_case["seed"]`` in a fuzz reproducer).

`threshold_overrides` (added within v1; absent in older reports, read as none) lists every threshold,
option and suite setting the run did not take at its default: the check (or ``"suite"``) as `scope`,
the `key`, its `kind` (threshold, option or suite), the `value` used, the `default` it replaced and the
`source` (the config file, or the Python API). Every renderer shows them beside the verdict.

A run that did not finish (interrupted, crashed mid-run, reports written while it was still going) is
``complete = False`` with an ``incomplete_reason``; it never passes. The summary carries
``complete``, ``status`` (pass, fail or incomplete), ``incomplete_reason`` when incomplete, and
``gradients_checked`` / ``forward_only`` (from the environment: whether the backward was checked,
whether the kernel was declared forward-only), and ``notes``, the sentences every renderer shows next
to the verdict, when there are any (`run_notes`).

Values
    Metrics and thresholds are JSON scalars. Non-finite floats are stored as the strings ``"nan"``,
    ``"inf"`` and ``"-inf"`` (`jsonable`); `as_number` reads them back as floats. Booleans are never
    numbers here.

Direction rule (`higher_is_better`)
    A metric whose name ends in ``_min`` or starts with ``sqnr`` or ``cos`` is higher-is-better (a signal to
    noise ratio, a cosine similarity, a lower limit); every other metric is lower-is-better (an error, a
    ratio to the BF16 error, a count of violations, a leak). A threshold is checked against the metric of
    the same name in that direction: lower-is-better passes when ``value <= threshold``, higher-is-better
    when ``value >= threshold``; NaN never passes; a boolean or string threshold passes only on equality
    (`threshold_verdict`). The check's own status, set by the check engine, is always authoritative.

This module sits low in the package: the checks build these results and the renderers read them, so it
imports nothing of the package but its errors.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, cast

from flamia_verify.errors import ReportSchemaError

__all__ = [
    "API_SOURCE",
    "SCHEMA",
    "STATUSES",
    "FAMILIES",
    "OPTIONAL_VERDICTS",
    "VERDICTS",
    "CheckResult",
    "Report",
    "SWEEP_STATUSES",
    "SweepResult",
    "as_number",
    "higher_is_better",
    "json_number",
    "jsonable",
    "run_notes",
    "NOT_RUN",
    "incomplete_note",
    "attach_partial",
    "partial_report",
    "threshold_verdict",
]

SCHEMA = "flamia-verify/report/v1"
#: the ``source`` of a threshold override passed to the Python API rather than read from a config file
API_SOURCE = "the thresholds argument (Python API)"
STATUSES = ("pass", "fail", "error", "skip")
#: the verdicts a check belongs to (see the module docstring); the first always gates
VERDICTS = ("gating", "reproducibility", "robustness")
#: the verdicts a user may require (``require = [...]``, ``--require``)
OPTIONAL_VERDICTS = VERDICTS[1:]
FAMILIES = (
    "error",
    "bound",
    "bias",
    "consistency",
    "causal",
    "isolation",
    "special",
    "determinism",
    "interface",
    "state",
)


def json_number(value: Any) -> float | str:
    """A number as report.json holds it: a float, or "nan", "inf", "-inf" for the non-finite ones."""
    number = float(value)
    if math.isnan(number):
        return "nan"
    if math.isinf(number):
        return "inf" if number > 0 else "-inf"
    return number


def jsonable(value: Any) -> Any:
    """Make floats JSON-safe: NaN and +-Inf become strings "nan", "inf", "-inf"."""
    if isinstance(value, float):
        return json_number(value)
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if hasattr(value, "item") and callable(value.item):  # numpy / torch scalars
        return jsonable(value.item())
    return value


_NONFINITE = {"nan": math.nan, "inf": math.inf, "+inf": math.inf, "-inf": -math.inf}


def as_number(value: Any) -> float | None:
    """The float a metric value stands for, or None when it is not a number (bool, text, None)."""
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        return _NONFINITE.get(value.strip().lower())
    if hasattr(value, "item") and callable(value.item):  # numpy / torch scalars
        try:
            return as_number(value.item())
        except (TypeError, ValueError, RuntimeError):
            return None
    return None


def higher_is_better(metric: str) -> bool:
    """The direction rule: names ending in ``_min`` or starting with ``sqnr``/``cos`` are higher-is-better."""
    name = metric.lower()
    return name.endswith("_min") or name.startswith(("sqnr", "cos"))


def threshold_verdict(metric: str, value: Any, threshold: Any) -> bool | None:
    """True when `value` satisfies `threshold` under the direction rule, False when it violates it,
    None when they cannot be compared (a value or threshold missing, or of different kinds)."""
    if value is None or threshold is None:
        return None
    if isinstance(threshold, (bool, str)) and as_number(threshold) is None:
        same: bool = value == threshold
        return same
    v, t = as_number(value), as_number(threshold)
    if v is None or t is None:
        return None
    if math.isnan(v):
        return False
    if math.isnan(t):
        return None
    return v >= t if higher_is_better(metric) else v <= t


@dataclass
class CheckResult:
    name: str
    family: str
    status: str
    metrics: dict[str, Any] = field(default_factory=dict)
    thresholds: dict[str, Any] = field(default_factory=dict)
    worst_case: dict[str, Any] = field(default_factory=dict)
    message: str = ""
    duration_s: float = 0.0
    details: dict[str, Any] = field(default_factory=dict)
    #: the verdict the check belongs to: gating, reproducibility or robustness
    verdict: str = "gating"

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"status must be one of {STATUSES}, got {self.status!r}")
        if self.verdict not in VERDICTS:
            raise ValueError(f"verdict must be one of {VERDICTS}, got {self.verdict!r}")
        if self.family not in FAMILIES:
            raise ValueError(f"family must be one of {FAMILIES}, got {self.family!r}")
        if not self.name.startswith(self.family + "."):
            raise ValueError(f"check name {self.name!r} must start with its family {self.family + '.'!r}")

    def to_dict(self) -> dict[str, Any]:
        return cast(dict[str, Any], jsonable(asdict(self)))

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CheckResult:
        missing = [k for k in ("name", "family", "status", "metrics", "thresholds", "worst_case") if k not in data]
        if missing:
            raise ReportSchemaError(f"check {data.get('name', '?')!r} lacks field(s) {', '.join(missing)}")
        known = {f for f in cls.__dataclass_fields__}
        try:
            return cls(**{k: v for k, v in data.items() if k in known})
        except (TypeError, ValueError) as exc:
            raise ReportSchemaError(f"check {data.get('name', '?')!r}: {exc}") from exc


@dataclass
class Report:
    kernel: str
    recipe: str
    suite: str
    seed: int
    environment: dict[str, Any] = field(default_factory=dict)
    checks: list[CheckResult] = field(default_factory=list)
    schema: str = SCHEMA
    complete: bool = True
    incomplete_reason: str | None = None
    #: every override of a default threshold, option or suite setting (see the module docstring)
    threshold_overrides: list[dict[str, Any]] = field(default_factory=list)
    #: the non-gating verdicts this run gates on as well (reproducibility, robustness)
    require: list[str] = field(default_factory=list)

    def gates(self, check: CheckResult) -> bool:
        """Whether ``check`` counts toward the verdict: its verdict is gating or required."""
        return check.verdict == "gating" or check.verdict in self.require

    @property
    def gating_checks(self) -> list[CheckResult]:
        return [c for c in self.checks if self.gates(c)]

    @property
    def passed(self) -> bool:
        """True when the run finished and no check that gates failed or errored (skips do not fail a
        run; a reproducibility or robustness finding fails it only when that verdict is required)."""
        return self.complete and all(c.status in ("pass", "skip") for c in self.gating_checks)

    def verdicts(self) -> dict[str, dict[str, Any]]:
        """Each verdict that has checks: its ``status`` (pass, fail or incomplete), whether it
        ``gates`` this run, its number of ``checks`` and its ``failed`` and ``errored`` checks."""
        out: dict[str, dict[str, Any]] = {}
        for name in VERDICTS:
            mine = [c for c in self.checks if c.verdict == name]
            if not mine:
                continue
            failed = [c.name for c in mine if c.status == "fail"]
            errored = [c.name for c in mine if c.status == "error"]
            status = "fail" if failed or errored else "pass" if self.complete else "incomplete"
            out[name] = {
                "status": status,
                "gates": name == "gating" or name in self.require,
                "checks": len(mine),
                "failed": failed,
                "errored": errored,
            }
        return out

    @property
    def status(self) -> str:
        """``incomplete`` for a run that did not finish, else ``pass`` or ``fail``."""
        if not self.complete:
            return "incomplete"
        return "pass" if self.passed else "fail"

    @property
    def gradients_checked(self) -> bool:
        """False when the run had no working backward to check (declared forward-only or not)."""
        return (self.environment or {}).get("backward", True) is not False

    def counts(self) -> dict[str, int]:
        out = {s: 0 for s in STATUSES}
        for c in self.checks:
            out[c.status] += 1
        return out

    def summary(self) -> dict[str, Any]:
        counts = self.counts()
        out = {
            "total": len(self.checks),
            **counts,
            "passed": self.passed,
            # a check that gates and failed its property, apart from one that could not be evaluated
            # (error); the other verdicts' findings are in "verdicts"
            "failed_checks": [c.name for c in self.gating_checks if c.status == "fail"],
            "errored_checks": [c.name for c in self.gating_checks if c.status == "error"],
            "complete": self.complete,
            "status": self.status,
            "require": list(self.require),
            "verdicts": self.verdicts(),
        }
        if not self.complete:
            out["incomplete_reason"] = self.incomplete_reason or "the run did not finish"
        out["gradients_checked"] = self.gradients_checked
        out["forward_only"] = bool((self.environment or {}).get("forward_only", False))
        notes = run_notes(self)
        if notes:  # what a reader must not miss: an incomplete run, gradients not checked
            out["notes"] = notes
        return out

    def check(self, name: str) -> CheckResult:
        for c in self.checks:
            if c.name == name:
                return c
        raise KeyError(name)

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": self.schema,
            "kernel": self.kernel,
            "recipe": self.recipe,
            "suite": self.suite,
            "seed": self.seed,
            "threshold_overrides": jsonable(self.threshold_overrides),
            "require": list(self.require),
            "environment": jsonable(self.environment),
            "checks": [c.to_dict() for c in self.checks],
            "summary": self.summary(),
        }

    @classmethod
    def from_dict(cls, data: Any) -> Report:
        if not isinstance(data, dict):
            raise ReportSchemaError(f"a report must be a JSON object, got {type(data).__name__}")
        if data.get("schema") != SCHEMA:
            raise ReportSchemaError(f"unknown report schema {data.get('schema')!r}; expected {SCHEMA!r}")
        missing = [k for k in ("kernel", "recipe", "suite", "seed", "environment", "checks") if k not in data]
        if missing:
            raise ReportSchemaError(f"report lacks field(s) {', '.join(missing)}")
        if not isinstance(data["checks"], list):
            raise ReportSchemaError("report field 'checks' must be a list")
        summary: dict[str, Any] = data["summary"] if isinstance(data.get("summary"), dict) else {}
        complete = summary.get("complete", True)
        if not isinstance(complete, bool):
            raise ReportSchemaError(f"report field 'summary.complete' must be a boolean, got {complete!r}")
        reason = summary.get("incomplete_reason")
        overrides = data.get("threshold_overrides", [])
        if not isinstance(overrides, list) or not all(isinstance(o, dict) for o in overrides):
            raise ReportSchemaError("report field 'threshold_overrides' must be a list of objects")
        require = data.get("require", [])
        if not isinstance(require, list) or any(r not in OPTIONAL_VERDICTS for r in require):
            raise ReportSchemaError(f"report field 'require' must be a list of {OPTIONAL_VERDICTS}, got {require!r}")
        return cls(
            require=list(require),
            threshold_overrides=[dict(o) for o in overrides],
            complete=complete,
            incomplete_reason=None if complete else (str(reason) if reason is not None else None),
            kernel=str(data["kernel"]),
            recipe=str(data["recipe"]),
            suite=str(data["suite"]),
            seed=int(data["seed"]),
            environment=dict(data["environment"]),
            checks=[CheckResult.from_dict(c) for c in data["checks"]],
        )


#: how the message of a check that did not run starts: a SKIP row of an incomplete report, written when
#: the process running the kernel ended before that check (``flamia-verify check``'s supervisor)
NOT_RUN = "not run: "


def incomplete_note(report: Report) -> str:
    """The sentence that follows an incomplete run's reason: which of the listed checks ran."""
    if any(c.status == "skip" and c.message.startswith(NOT_RUN) for c in report.checks):
        return "The checks marked 'not run' did not run; this is no verdict on the kernel."
    return "Only the checks listed ran; this is no verdict on the kernel."


def attach_partial(exc: BaseException, report: Report) -> None:
    """Hand the report of a run's finished checks (marked incomplete) to whoever catches ``exc``, the
    exception that stopped it, as its ``partial_report`` attribute (the documented API)."""
    try:
        exc.partial_report = report  # type: ignore[attr-defined]
    except AttributeError:  # an exception type that takes no attributes: nothing to hand on
        pass


def partial_report(exc: BaseException) -> Report | None:
    """The finished checks of the run that ``exc`` stopped (:func:`attach_partial`), or None."""
    report = getattr(exc, "partial_report", None)
    return report if isinstance(report, Report) else None


def run_notes(report: Report) -> list[str]:
    """Sentences every renderer puts next to the verdict, and report.json's ``summary.notes``: an
    incomplete run, gradients not checked."""
    notes = []
    if not getattr(report, "complete", True):
        notes.append(
            f"INCOMPLETE run: {report.incomplete_reason or 'the run did not finish'}. {incomplete_note(report)}"
        )
    env = report.environment or {}
    if env.get("backward") is False:
        if env.get("forward_only"):
            notes.append(
                "Gradients were not checked: the kernel was declared forward-only, so dQ, dK and dV were "
                "never compared with the reference."
            )
        else:
            why = env.get("backward_reason") or "the backward did not run"
            notes.append(f"Gradients were not checked: {why}.")
    return notes


#: what a sweep case can end as: a report's verdict, ``error`` (no verdict: the kernel did not load, the
#: worker crashed, hung or lost its node), ``measured`` (a speed-only case)
SWEEP_STATUSES = ("pass", "fail", "error", "incomplete", "measured")
_SWEEP_FIELDS = ("key", "case", "status", "report", "recipe", "error", "elapsed_s", "host", "device", "speed")


@dataclass(frozen=True)
class SweepResult:
    """One case of a sweep or a survey, as a worker returns it, the store keeps it (``OUT/cases/<key>.json``)
    and sweep.json lists it: the case's key and its matrix entry (``case``, a ``SweepCase.to_dict()``), the
    status, report.json's object (None without a verdict), the recipe the checks ran under (or the one a
    kernel declared before it failed), the reason in one line when there is no verdict, when, where and
    how fast it ran, and the speed of a timed case (``bench.measure_speed``'s row, or ``{"error": ...}``)."""

    key: str
    case: dict[str, Any]
    status: str
    report: dict[str, Any] | None = None
    recipe: str | None = None
    error: str | None = None
    elapsed_s: float = 0.0
    host: str = ""
    device: str | None = None
    speed: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if self.status not in SWEEP_STATUSES:
            raise ValueError(f"a sweep result's status is one of {', '.join(SWEEP_STATUSES)}, not {self.status!r}")

    @property
    def kernel(self) -> str:
        return str(self.case.get("kernel", ""))

    def to_dict(self) -> dict[str, Any]:
        """The JSON object (``speed`` only for a timed case)."""
        out = {name: getattr(self, name) for name in _SWEEP_FIELDS}
        if self.speed is None:
            del out["speed"]
        return out

    @classmethod
    def from_dict(cls, data: Any) -> SweepResult:
        """A result from its JSON object; ValueError naming what is wrong with a malformed one."""
        if not isinstance(data, dict):
            raise ValueError(f"a sweep result is a JSON object, not {type(data).__name__}")
        missing = [k for k in ("key", "case", "status") if k not in data]
        if missing:
            raise ValueError(f"a sweep result without {', '.join(missing)}")
        unknown = sorted(set(data) - set(_SWEEP_FIELDS))
        if unknown:
            raise ValueError(f"a sweep result with unknown fields: {', '.join(unknown)}")
        if not isinstance(data["case"], dict) or not isinstance(data["key"], str):
            raise ValueError("a sweep result's key is a string and its case an object")
        report = data.get("report")
        if report is not None and not isinstance(report, dict):
            raise ValueError("a sweep result's report is report.json's object or null")
        return cls(**{k: data[k] for k in _SWEEP_FIELDS if k in data})
