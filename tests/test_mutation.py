"""Mutation testing: the mutant table builds, every mutant is observable, the original emulation is
untouched, the quick suite kills a fixed sample of bugs and raises no alarm on the correct designs.

The kill-rate gate (``test_quick_kills_the_ci_sample``) is the CI form of ``flamia-verify mutate
--suite quick --sample 12``; docs/checks.md has the full table's figures.
"""

from __future__ import annotations

import json

import pytest
import torch

from flamia_verify.cli import main
from flamia_verify.kernels.loader import load_kernel
from flamia_verify.known_bad.edits import Edit, Mutant, MutationError, apply_edits, mutant_kernel, mutated_module
from flamia_verify.known_bad.table import BUGS, CORRECT, MUTANTS, ci_sample
from flamia_verify.mutation.report import verdict
from flamia_verify.mutation.runner import MutantResult, distinguishes, run_mutant, summarize
from flamia_verify.properties.cases import Case, make_inputs

#: the quick suite must kill at least this share of the CI sample (the issue's target for quick)
QUICK_KILL_TARGET = 0.90
CI_SAMPLE = 12


def _out(kernel, inp):
    q, k, v = (t.clone().requires_grad_() for t in (inp.q, inp.k, inp.v))
    out = kernel(q, k, v, inp.cu_q, inp.cu_k, inp.max_q, inp.max_k, softmax_scale=inp.case.scale, causal=True)
    return [out.detach(), *torch.autograd.grad(out, (q, k, v), inp.do)]


def test_table_is_large_and_spans_every_family():
    fams = {m.family for m in BUGS}
    assert {
        "mask",
        "fallback",
        "blocks",
        "cu",
        "heads",
        "format",
        "rounding",
        "normalisation",
        "reduction",
        "inplace",
    } <= fams
    assert len(BUGS) >= 100 and len(CORRECT) >= 5
    assert len({m.name for m in MUTANTS}) == len(MUTANTS)


def test_an_edit_must_match_once_in_its_scope():
    src = "def f():\n    x = 1\n    x = 1\n\ndef g():\n    x = 1\n"
    with pytest.raises(MutationError, match="matches 2 times in function f"):
        apply_edits(src, (Edit("f", "x = 1", "x = 2"),))
    with pytest.raises(MutationError, match="matches 0 times"):
        apply_edits(src, (Edit("g", "y = 1", "y = 2"),))
    assert apply_edits(src, (Edit("g", "x = 1", "x = 3"),)).endswith("def g():\n    x = 3\n")


def test_unknown_design_field_is_refused():
    with pytest.raises(MutationError, match="unknown design field"):
        mutant_kernel(Mutant("x.bad-field", "x", "", design=(("no_such_operand", None),)))


@pytest.mark.parametrize("mutant", MUTANTS, ids=lambda m: m.name)
def test_every_mutant_is_observable(mutant):
    """A mutant that changes nothing would inflate the kill rate's denominator with a bug that is not
    there: each one must change an output, a gradient or an input on the probe calls, or make two
    runs differ."""
    assert distinguishes(mutant) is not None, f"{mutant.name} is equivalent to the original on every probe"


def test_building_mutants_leaves_the_emulation_untouched():
    case = Case((37, 60), heads=4, heads_k=2, seed=5)
    inp = make_inputs(case)
    original = load_kernel("flamia-mxfp8").fn
    before = _out(original, inp)
    for m in MUTANTS[:20]:
        mutated_module(m)
    after = _out(original, inp)
    assert all(torch.equal(a, b) for a, b in zip(before, after))


def test_summary_and_verdict():
    rs = [
        MutantResult("a.x", "a", False, "killed", ["causal.forward"]),
        MutantResult("a.y", "a", False, "survived"),
        MutantResult("b.x", "b", False, "crashed", ["(kernel crashed)"]),
        MutantResult("c.ok", "c", True, "passed"),
        MutantResult("c.bad", "c", True, "false-alarm", ["error.out"]),
    ]
    s = summarize(rs)
    assert s["mutants"] == 3 and s["killed"] == 2 and s["survivors"] == ["a.y"]
    assert s["families"]["a"]["kill_rate"] == 0.5 and s["families"]["b"]["crashed"] == 1
    assert s["false_alarms"] == [{"name": "c.bad", "failing": ["error.out"]}]
    assert any("correct design" in p for p in verdict(s, None))
    s["false_alarms"] = []
    assert verdict(s, 0.7) and "below" in verdict(s, 0.7)[0]  # 2 of 3 killed: 0.667
    assert verdict(s, 0.6) == []


def test_quick_kills_the_ci_sample():
    """The CI gate: the quick suite kills at least 90 % of a fixed, spread sample of the table."""
    sample = ci_sample(CI_SAMPLE)
    assert len({m.family for m in sample}) >= 6
    results = [run_mutant(m, suite="quick") for m in sample]
    s = summarize(results)
    assert s["kill_rate"] >= QUICK_KILL_TARGET, f"survivors: {s['survivors']}"


@pytest.mark.parametrize("mutant", CORRECT, ids=lambda m: m.name)
def test_quick_raises_no_alarm_on_a_correct_design(mutant):
    r = run_mutant(mutant, suite="quick")
    assert r.outcome == "passed", f"{mutant.name} failed {r.failing}"


def test_mutate_command_writes_reports(tmp_path, capsys):
    code = main(["mutate", "--mutant", "mask.forward+1", "heads.dk-group-sum-reversed", "--out", str(tmp_path)])
    assert code == 0
    data = json.loads((tmp_path / "mutation.json").read_text())
    assert data["summary"]["killed"] == 1 and data["summary"]["false_alarms"] == []
    md = (tmp_path / "mutation.md").read_text()
    assert "| mask | 1 | 1 |" in md
    assert "[  2/2]" in capsys.readouterr().out


def test_mutate_command_usage_errors(capsys):
    assert main(["mutate", "--mutant", "no.such"]) == 2
    assert main(["mutate", "--family", "nope", "--list"]) == 2
    assert main(["mutate", "--family", "cu", "--list"]) == 0
    assert "cu.forward-keys-from-cu_q" in capsys.readouterr().out
