"""Default thresholds per recipe, derived from the formats; validation of a user's overrides.

Every default is derived (docs/checks.md gives each derivation):

* from a unit roundoff: the first-order RMS error model :func:`predicted_rel_rmse` (each rounded
  GEMM operand contributes a relative error of RMS u/sqrt(3), independent of the others), and the
  worst-case normalization mismatch of the BF16 baseline (P rounded to the input dtype while the
  row sum is fp32: |sum_j A_ij - 1| <= u_in);
* from the BF16 baseline measured on the same inputs (``ratio_to_bf16``);
* from a rigorous bound (no violation allowed: threshold 0);
* from the null distribution of a statistic (bias z-scores).

Overrides have the shape ``{check_name: {key: value}}`` plus an optional ``"suite"`` entry with
suite settings (see :mod:`flamia_verify.settings`). A key is an adjustable threshold (a number; inf
switches it off) or a check's option (``causal.nan`` ``require_nan_keys``, ``determinism.repeat``
``warn_only``: true or false). Unknown names, keys and values of the wrong kind raise
:class:`ConfigError` naming them (and the file they came from, when the config loader validates a
file's thresholds with :func:`validate_overrides`). So does a fixed key (:func:`fixed_keys`): a
threshold that is the check's contract (no leaked element, no bound violation, no bitwise
mismatch: any finding fails the check), shown in the reports but never read from an override.
Every accepted override is recorded in the report (:func:`override_records`).

The unit roundoffs, the error model and the bias z-score live in
:mod:`flamia_verify.properties.tolerances`, below the check modules that derive their defaults from
them (this module sits above the catalog of checks); they are re-exported here.
"""

from __future__ import annotations

import torch

from flamia_verify.properties.catalog import all_specs, specs_by_name
from flamia_verify.properties.tolerances import (
    BIAS_Z,
    ERROR_MODEL_FACTOR,
    conservation_tolerance,
    input_unit_roundoff,
    predicted_rel_rmse,
)
from flamia_verify.recipes import RECIPES, Recipe, get_recipe
from flamia_verify.settings import suite_settings, validate_thresholds

__all__ = [
    "default_thresholds",
    "predicted_rel_rmse",
    "resolve_thresholds",
    "validate_overrides",
    "fixed_keys",
    "override_records",
    "ERROR_MODEL_FACTOR",
    "BIAS_Z",
    "input_unit_roundoff",
    "conservation_tolerance",
]


def default_thresholds(recipe: str | Recipe, dtype: torch.dtype = torch.bfloat16) -> dict[str, dict[str, float]]:
    """``{check_name: {threshold_key: value}}`` for every check, derived for ``recipe`` (a name or a
    :class:`~flamia_verify.recipes.Recipe`)."""
    chosen = get_recipe(recipe)
    return {s.name: s.default_thresholds(chosen, dtype) for s in all_specs()}


def _known_keys(specs) -> tuple[dict[str, dict], dict[str, dict], dict[str, list[str]]]:
    """Every check's threshold keys and options with the kind of their defaults, and its fixed keys (the
    threshold keys that are its contract, not ``adjustable``). The keys are the same for every recipe
    and dtype (only the values differ), so any recipe serves to list them."""
    thresholds = {n: s.default_thresholds(RECIPES["bf16"], torch.bfloat16) for n, s in specs.items()}
    options = {n: dict(s.options) for n, s in specs.items()}
    fixed = {n: [k for k in thresholds[n] if k not in s.adjustable] for n, s in specs.items()}
    return thresholds, options, fixed


def fixed_keys() -> dict[str, list[str]]:
    """``{check_name: [threshold keys that cannot be overridden]}``: each check's contract (docs/checks.md)."""
    return _known_keys(specs_by_name())[2]


def validate_overrides(overrides, where: str | None = None) -> dict:
    """Check ``overrides`` against the registered checks without a recipe: check names, keys, kinds of
    value, fixed keys (refused) and suite settings. Returns them with numbers as floats. ``where`` (a
    file and table) starts every message; without it the messages name the mapping."""
    thresholds, options, fixed = _known_keys(specs_by_name())
    return validate_thresholds(overrides, thresholds, options, where, fixed=fixed)


def override_records(recipe: Recipe, dtype: torch.dtype, suite: str, overrides: dict | None, source: str) -> list[dict]:
    """One record per overridden key, for report.json's ``threshold_overrides`` and every renderer:
    ``{"scope": check name or "suite", "key", "kind": threshold | option | suite, "value", "default",
    "source"}``. The default is what the run would have used without the override (the recipe's and
    dtype's derived threshold, the option's default, the suite's setting); ``source`` names where the
    override came from (a config file, or the Python API)."""
    if not overrides:
        return []
    specs = specs_by_name()
    base = suite_settings(suite)
    records = []
    for scope, entries in validate_overrides(overrides).items():
        for key, value in entries.items():
            if scope == "suite":
                kind, default = "suite", getattr(base, key)
            elif key in specs[scope].options:
                kind, default = "option", specs[scope].options[key]
            else:
                kind, default = "threshold", specs[scope].default_thresholds(recipe, dtype)[key]
            records.append(
                {"scope": scope, "key": key, "kind": kind, "value": value, "default": default, "source": source}
            )
    return records


def resolve_thresholds(
    recipe: Recipe, dtype: torch.dtype, overrides: dict | None
) -> tuple[dict[str, dict], dict[str, dict], dict]:
    """Defaults merged with ``overrides``: (thresholds per check, options per check, suite settings)."""
    specs = specs_by_name()
    thresholds = {n: s.default_thresholds(recipe, dtype) for n, s in specs.items()}
    options = {n: dict(s.options) for n, s in specs.items()}
    suite: dict = {}
    if overrides is None:
        return thresholds, options, suite
    for name, entries in validate_overrides(overrides).items():
        if name == "suite":
            suite.update(entries)
            continue
        for key, value in entries.items():
            (thresholds if key in thresholds[name] else options)[name][key] = value
    return thresholds, options, suite
