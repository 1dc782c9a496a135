"""The catalog of checks: every check family imported (which registers its checks), and the answers
about them: :func:`all_specs` in running order, :func:`get_spec` and :func:`specs_by_name`.

This is the module that imports :mod:`flamia_verify.properties.checks` to register the checks (each
family's package imports its modules in the order its checks run). The registry below it only
records registrations; the thresholds and the engine above it ask the catalog.
"""

from __future__ import annotations

from flamia_verify.properties import checks
from flamia_verify.properties.registry import CheckSpec, registered

__all__ = ["FAMILY_ORDER", "all_specs", "get_spec", "specs_by_name"]

del checks  # imported for its registrations

#: the order the families run in (interface first: it fails fast and cheaply; state last: a kernel whose
#: state the checks cannot put back keeps what the training-like sequence left in it)
FAMILY_ORDER = (
    "interface",
    "error",
    "bound",
    "bias",
    "consistency",
    "causal",
    "isolation",
    "special",
    "determinism",
    "state",
)


def all_specs() -> list[CheckSpec]:
    """Every registered check, in family order, and in registration order within a family."""
    specs = registered()
    rank = {f: i for i, f in enumerate(FAMILY_ORDER)}
    index = {s.name: i for i, s in enumerate(specs)}
    return sorted(specs, key=lambda s: (rank[s.family], index[s.name]))


def specs_by_name() -> dict[str, CheckSpec]:
    """``{check name: spec}`` of every check, in running order."""
    return {s.name: s for s in all_specs()}


def get_spec(name: str) -> CheckSpec:
    """The spec of check ``name`` (KeyError for an unknown name)."""
    return specs_by_name()[name]
