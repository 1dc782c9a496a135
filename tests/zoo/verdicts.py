"""The assertion every planted-bug test makes: the kernel fails the checks it ``catches`` (saying
why and where) and passes the checks of its ``quiet`` families, which its bug cannot reach."""

from __future__ import annotations

__all__ = ["ACCURACY_JUDGES", "assert_caught_and_quiet", "matches", "quiet_for_recipe"]

#: checks of an information-flow family that judge accuracy (the gating half of a structural check:
#: the layout pack against the float64 reference): any bug that computes wrong numbers reaches them, so
#: a family named quiet ("isolation") does not cover them; a quiet list names them to mean them
ACCURACY_JUDGES = ("isolation.layout",)


def matches(name: str, selector: str) -> bool:
    """A check name against a selector: the check itself or its family (the family without its
    accuracy judges, ``ACCURACY_JUDGES``)."""
    return name == selector or (name.startswith(selector + ".") and name not in ACCURACY_JUDGES)


def assert_caught_and_quiet(name: str, kernel, report) -> None:
    for check in kernel.catches:
        res = report.check(check)
        assert res.status == "fail", f"{name}: {check} says {res.status}: {res.message}"
        assert res.message and res.worst_case, f"{name}: {check} failed without saying why or where"
    # quiet checks pass, or skip because the kernel's recipe gives them nothing to check (bound.rounding
    # on a recipe without MXFP8 operands): neither is a finding
    loud = [
        f"{c.name}: {c.status}: {c.message}"
        for c in report.checks
        if c.name not in kernel.catches
        and any(matches(c.name, q) for q in kernel.quiet)
        and c.status not in ("pass", "skip")
    ]
    assert not loud, f"{name} trips checks its bug cannot reach:\n" + "\n".join(loud)


def quiet_for_recipe(report, check) -> bool:
    """A correct kernel's check: passed, or bound.rounding skipped because the report's recipe rounds
    no operand as MXFP8 (bf16, fp8), so there is nothing for it to probe, or interface.lse skipped
    because the kernel returns no log-sum-exp, or state.history skipped because the kernel declares no
    amax history (a stateless kernel has nothing for it to forget)."""
    if check.status == "pass":
        return True
    if check.name == "interface.lse" and check.status == "skip":
        return "returns no log-sum-exp" in check.message
    if check.name == "state.history" and check.status == "skip":
        return "declares no amax history" in check.message
    from flamia_verify.properties.checks.bound.rounding import mx_sites
    from flamia_verify.recipes import get_recipe
    from flamia_verify.settings import DTYPES

    dtype = DTYPES.get(report.environment.get("dtype", "bf16"), DTYPES["bf16"])
    return check.name == "bound.rounding" and check.status == "skip" and not mx_sites(get_recipe(report.recipe), dtype)
