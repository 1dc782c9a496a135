"""The registry of checks: names, families, descriptions, suites, default thresholds.

A check is a function ``fn(ctx) -> CheckResult`` registered with :func:`register`. This module only
records registrations and imports no check: :mod:`flamia_verify.properties.catalog` imports the check
modules (which registers them) and answers ``all_specs()`` and the lookups by name. Its spec says
which suites run it, whether it needs the kernel's backward (gradient-only checks are skipped with
the reason for a forward-only kernel), its default thresholds (a function of the recipe and the
input dtype, derived in docs/checks.md), which of those a user may override (``adjustable``: the
tolerances), and its options (switches that are not thresholds).

A threshold key that is not adjustable is the check's contract: a count of bitwise changes, rigorous
bound violations or convention breaches where any finding fails the check whatever the number
(``causal.forward`` allows no leaked element). Its value is shown in the reports but an override is
refused when the thresholds are validated (a ConfigError naming the key and the check's adjustable
keys), so that no accepted key is ever ignored.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from flamia_verify.recipes import Recipe
from flamia_verify.results import FAMILIES, VERDICTS
from flamia_verify.settings import SUITES

__all__ = ["CheckSpec", "register", "registered"]


@dataclass(frozen=True)
class CheckSpec:
    """What a check is: ``name`` (``family.check``), ``family``, a one-line ``description``, the
    ``suites`` that run it, and whether it ``needs_backward`` (skipped for forward-only kernels)."""

    name: str
    family: str
    description: str
    suites: tuple[str, ...] = SUITES
    needs_backward: bool = False
    cost: float = 1.0  # relative run time, for the progress estimate
    fn: Callable | None = field(default=None, repr=False, compare=False)
    defaults: Callable | None = field(default=None, repr=False, compare=False)  # (recipe, dtype) -> dict
    options: dict = field(default_factory=dict, compare=False)  # switch -> default (bool)
    #: threshold keys a user may override (tolerances the verdict is judged against); the others are
    #: the check's contract, fixed at their default
    adjustable: tuple[str, ...] = field(default=(), compare=False)
    #: the verdict the check belongs to (results.VERDICTS): gating, reproducibility or robustness
    verdict: str = "gating"

    def default_thresholds(self, recipe: Recipe, dtype) -> dict:
        return dict(self.defaults(recipe, dtype)) if self.defaults is not None else {}


_REGISTRY: dict[str, CheckSpec] = {}


def register(
    name: str,
    description: str,
    *,
    suites: tuple[str, ...] = SUITES,
    needs_backward: bool = False,
    cost: float = 1.0,
    defaults: Callable | None = None,
    options: dict | None = None,
    adjustable: tuple[str, ...] = (),
    verdict: str = "gating",
):
    """Register ``fn(ctx) -> CheckResult`` as check ``name`` (see :class:`CheckSpec` for the fields).
    ``adjustable`` names the threshold keys of ``defaults`` a user may override; every other key is
    the check's contract, fixed (a threshold a finding fails regardless of its value). ``verdict`` says
    which verdict the check belongs to (``results.VERDICTS``; docs/checks.md says why each is where)."""
    family = name.partition(".")[0]
    if family not in FAMILIES:
        raise ValueError(f"check {name!r}: family {family!r} is not one of {FAMILIES}")
    if verdict not in VERDICTS:
        raise ValueError(f"check {name!r}: verdict {verdict!r} is not one of {VERDICTS}")

    def deco(fn):
        _REGISTRY[name] = CheckSpec(
            name,
            family,
            description,
            tuple(suites),
            needs_backward,
            cost,
            fn,
            defaults,
            dict(options or {}),
            tuple(adjustable),
            verdict,
        )
        return fn

    return deco


def registered() -> list[CheckSpec]:
    """The checks registered so far, in registration order (the catalog registers them all)."""
    return list(_REGISTRY.values())
