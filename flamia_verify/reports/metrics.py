"""How the renderers read a check's numbers: the key metric, which direction is better, how values print.

Every renderer (terminal, Markdown, HTML, JUnit) and `compare_reports` use these rules, so a check shows
the same headline number everywhere.

Values and the direction rule
    `as_number` (a metric value as a float), `higher_is_better` (which direction is better) and
    `threshold_verdict` (a value against its threshold) are the result model's rules, defined in
    `flamia_verify.results` (the checks use them too) and re-exported here for the renderers.

Key metric rule (`key_metric`)
    - A check with thresholds shows a threshold key: for a failed check the first threshold that its
      same-named metric violates, otherwise the first threshold key. The value shown is the metric of the
      same name, or the check's first metric when no metric has that name.
    - A check without thresholds shows its first metric and no threshold.
    - A check without metrics or thresholds shows nothing.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any

from flamia_verify.reports.text import printable
from flamia_verify.results import CheckResult, as_number, higher_is_better, jsonable, threshold_verdict

__all__ = [
    "KeyMetric",
    "as_number",
    "format_seconds",
    "format_threshold",
    "format_value",
    "higher_is_better",
    "key_metric",
    "threshold_verdict",
    "safe_json",
]

#: Shown where a value is absent (no metric, no threshold).
ABSENT = "—"


def format_value(value: Any) -> str:
    """A short, stable text for a metric or threshold value: 4 significant digits for floats; text with its
    control characters made visible."""
    if value is None:
        return ABSENT
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return f"{value:.4g}"
    number = as_number(value)
    if number is not None and not isinstance(value, str):
        return format_value(number)
    return printable(value)


def format_seconds(value: Any) -> str:
    """A duration for a person: ``0.05 s``, ``1.2 s``, ``2 min 05 s``; the absent mark for a missing or
    non-numeric one."""
    seconds = as_number(value) if not isinstance(value, bool) else None
    if seconds is None or not math.isfinite(seconds) or seconds < 0:
        return ABSENT if seconds is None else format_value(value)
    if seconds < 0.005:
        return "< 0.01 s" if seconds > 0 else "0 s"
    if seconds < 1:
        return f"{seconds:.2f} s"
    if seconds < 59.95:
        return f"{seconds:.1f} s"
    minutes, rest = divmod(round(seconds), 60)
    return f"{minutes} min {rest:02d} s"


def format_threshold(metric: str, threshold: Any) -> str:
    """A threshold with its direction: ``≤ 4`` (lower-is-better), ``≥ 0.999`` (higher-is-better), ``= true``
    (a boolean or text that must match), or the absent mark."""
    if threshold is None:
        return ABSENT
    if as_number(threshold) is None:
        return f"= {format_value(threshold)}"
    return f"{'≥' if higher_is_better(metric) else '≤'} {format_value(threshold)}"


@dataclass(frozen=True)
class KeyMetric:
    """The headline number of a check (see the key metric rule in the module docstring)."""

    name: str  # the threshold key, or the metric's name when the check has no thresholds
    metric: str | None  # name of the metric whose value is shown (None: the check has no metrics)
    value: Any
    threshold: Any  # None when the check has no thresholds
    within: bool | None  # threshold_verdict(name, value, threshold)

    @property
    def label(self) -> str:
        """``name`` or, when the value comes from another metric, ``name (metric)``."""
        if self.metric is None or self.metric == self.name:
            return self.name
        return f"{self.name} ({self.metric})"


def key_metric(check: CheckResult) -> KeyMetric | None:
    """The key metric of `check`, or None when it has neither metrics nor thresholds."""
    metrics, thresholds = check.metrics or {}, check.thresholds or {}
    if thresholds:
        keys = list(thresholds)
        chosen = keys[0]
        if check.status == "fail":
            for key in keys:
                if key in metrics and threshold_verdict(key, metrics[key], thresholds[key]) is False:
                    chosen = key
                    break
        if chosen in metrics:
            metric: str | None = chosen
        else:
            metric = next(iter(metrics), None)
        value = metrics[metric] if metric is not None else None
        threshold = thresholds[chosen]
        within = threshold_verdict(chosen, value, threshold) if metric == chosen else None
        return KeyMetric(chosen, metric, value, threshold, within)
    if metrics:
        first = next(iter(metrics))
        return KeyMetric(first, first, metrics[first], None, None)
    return None


def safe_json(value: Any, *, indent: int | None = 2) -> str:
    """JSON text of `value` that is safe to embed in HTML, Markdown and XML and still parses to the same data.

    ``<``, ``>`` and ``&`` are written as ``\\u003c``, ``\\u003e``, ``\\u0026``, control characters and lone
    surrogates as their ``\\uXXXX`` escapes (so the text encodes as UTF-8); NaN and infinities as strings;
    anything else unserialisable as its ``str``. With an `indent`, objects are spread one key per line while
    lists of scalars that fit in `_INLINE_WIDTH` characters stay on one line (shapes, cu_seqlens, indices).
    """
    data = jsonable(value)
    if indent is None:
        text = json.dumps(data, ensure_ascii=False, allow_nan=False, default=str)
    else:
        text = _pretty(data, indent, 0)
    text = text.replace("&", "\\u0026").replace("<", "\\u003c").replace(">", "\\u003e")
    return _JSON_ESCAPED.sub(lambda m: f"\\u{ord(m.group(0)):04x}", text)


# Characters json.dumps leaves raw that no reader should get raw: DEL and C1 controls, lone surrogates
# (not encodable as UTF-8), line and paragraph separators. They only occur inside JSON strings, where
# their \uXXXX escape means the same character.
_JSON_ESCAPED = re.compile("[\x7f-\x9f\ud800-\udfff\u2028\u2029]")


#: Longest list of scalars `safe_json` keeps on one line.
_INLINE_WIDTH = 72


def _pretty(value: Any, indent: int, depth: int) -> str:
    flat = json.dumps(value, ensure_ascii=False, allow_nan=False, default=str)
    if isinstance(value, dict):
        if not value:
            return "{}"
        pad, inner = " " * (indent * depth), " " * (indent * (depth + 1))
        items = [
            f"{inner}{json.dumps(str(k), ensure_ascii=False)}: {_pretty(v, indent, depth + 1)}"
            for k, v in value.items()
        ]
        return "{\n" + ",\n".join(items) + "\n" + pad + "}"
    if isinstance(value, list):
        if all(not isinstance(v, (dict, list)) for v in value) and len(flat) <= _INLINE_WIDTH:
            return flat
        if not value:
            return "[]"
        pad, inner = " " * (indent * depth), " " * (indent * (depth + 1))
        return "[\n" + ",\n".join(inner + _pretty(v, indent, depth + 1) for v in value) + "\n" + pad + "]"
    return flat
