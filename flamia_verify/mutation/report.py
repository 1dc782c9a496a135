"""The outcome of a mutation run as mutation.md, and its gate (:func:`verdict`).

Two families of mutants are reported side by side (:data:`KINDS`): ``arithmetic`` (the emulation's
own steps edited, :mod:`flamia_verify.known_bad.table`) and ``wrapper`` (bugs of the code around a
correct kernel in the varlen calling convention, :mod:`flamia_verify.known_bad.wrapper`).
"""

from __future__ import annotations

__all__ = ["KINDS", "kind_of", "render_markdown", "verdict"]

KINDS = ("arithmetic", "wrapper")


def kind_of(family: str) -> str:
    """``wrapper`` for a wrapper mutant's family (``wrapper.<dimension>``), ``arithmetic`` for any other."""
    return "wrapper" if family == "wrapper" or family.startswith("wrapper.") else "arithmetic"


_KIND_TITLES = {
    "arithmetic": "Arithmetic mutants (the emulation's own steps)",
    "wrapper": "Wrapper mutants (the calling convention around a correct kernel)",
}


def render_markdown(summary: dict, results: list[dict], *, suite: str) -> str:
    lines = [f"# Mutation testing: suite `{suite}`", ""]
    lines.append(
        f"**{summary['killed']} of {summary['mutants']} bugs killed ({100 * summary['kill_rate']:.1f} %)**; "
        f"false alarms on correct designs: {len(summary['false_alarms'])} of {summary['correct_designs']}."
    )
    kinds = summary.get("kinds", {})
    if kinds:
        names = [k for k in KINDS if k in kinds]
        lines += ["", "| | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]
        for label, cell in (
            ("bugs", lambda k: str(k["mutants"])),
            ("killed", lambda k: str(k["killed"])),
            ("kill rate", lambda k: f"{100 * k['kill_rate']:.1f} %" if k["mutants"] else "-"),
            ("false alarms", lambda k: f"{len(k['false_alarms'])} of {k['correct_designs']}"),
        ):
            lines.append(f"| {label} | " + " | ".join(cell(kinds[n]) for n in names) + " |")
    for kind in KINDS:
        fams = {n: f for n, f in summary["families"].items() if kind_of(n) == kind}
        if not fams:
            continue
        lines += ["", f"## {_KIND_TITLES[kind]}", ""]
        lines += ["| family | bugs | killed | crashed | kill rate | survivors |", "|---|---:|---:|---:|---:|---|"]
        for fam, f in fams.items():
            surv = ", ".join(f"`{n}`" for n in f["survived"]) or "-"
            lines.append(
                f"| {fam} | {f['mutants']} | {f['killed']} | {f['crashed']} | {100 * f['kill_rate']:.0f} % | {surv} |"
            )
    if summary["false_alarms"]:
        lines += ["", "## False alarms", ""]
        lines += [f"- `{a['name']}`: {', '.join(a['failing'])}" for a in summary["false_alarms"]]
    survivors = [r for r in results if r["outcome"] == "survived"]
    if survivors:
        lines += ["", "## Survivors (bugs no check of the suite caught)", ""]
        lines += [f"- `{r['name']}`: {r['why']}" for r in survivors]
    lines += [
        "",
        "## Every mutant",
        "",
        "A bug runs family by family and stops at the first family with a failing check (`--every-check`"
        " runs them all); a correct design runs every check.",
        "",
        "| mutant | outcome | checks that failed | s |",
        "|---|---|---|---:|",
    ]
    for r in results:
        failing = ", ".join(r["failing"][:6]) + (" ..." if len(r["failing"]) > 6 else "")
        lines.append(
            f"| `{r['name']}`{' (correct)' if r['correct'] else ''} | {r['outcome']} | {failing or '-'} | {r['seconds']:.1f} |"
        )
    return "\n".join(lines) + "\n"


def verdict(summary: dict, min_kill_rate: float | None) -> list[str]:
    """Why a mutation run fails its gate (empty: it passes): any false alarm; a kill rate below the minimum."""
    problems = []
    if summary["false_alarms"]:
        names = ", ".join(a["name"] for a in summary["false_alarms"])
        problems.append(f"correct design(s) failed a check: {names}")
    if min_kill_rate is not None and summary["mutants"] and summary["kill_rate"] < min_kill_rate:
        problems.append(f"kill rate {summary['kill_rate']:.3f} is below --min-kill-rate {min_kill_rate}")
    return problems
