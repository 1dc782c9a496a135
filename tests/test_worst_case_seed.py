"""The seed printed next to a worst case is the one that rebuilds it, in every report, and what a report
prints rebuilds the same case.

The reported defect: report.md said "run seed 0, case seed 0" above a worst case whose JSON said
"seed": 11 (a check's worst case nests its case under "case"; the case seed was looked up at the top
level and fell back to the run seed), and a case rebuilt from the printed seed was another case.
"""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from flamia_verify.cli import main
from flamia_verify.properties.cases import Case, make_inputs
from flamia_verify.reports import load_report
from flamia_verify.reports.wording import case_seed
from flamia_verify.results import CheckResult, Report

LEAKY = '''"""FLAMIA MXFP8 without its diagonal fallback: V blocks straddle the causal diagonal."""
from dataclasses import replace

from flamia_verify.kernels.designs import DESIGNS
from flamia_verify.kernels.emulation import make_kernel

attention = make_kernel(replace(DESIGNS["flamia-mxfp8"], name="no-fallback", diagonal_fallback=False))
attention.recipe = "mxfp8"
'''

RUN_SEED = 5


def _check(tmp_path: Path, out: str, extra: list[str]) -> int:
    return main(["check", "--device", "cpu", "--out", str(tmp_path / out), *extra])


@pytest.fixture
def leaky_run(tmp_path, monkeypatch, capsys):
    """A failing causal.forward run (run seed 5) with a config file that shrinks the causal documents:
    its suite setting shapes the cases, so a re-run must read it too."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "leaky.py").write_text(LEAKY)
    (tmp_path / "small.toml").write_text("[tool.flamia-verify.thresholds.suite]\ncausal_len = 48\n")
    args = ["--kernel", "leaky.py:attention", "--seed", str(RUN_SEED), "--only", "causal.forward"]
    assert _check(tmp_path, "first", [*args, "--config", "small.toml"]) == 1
    return tmp_path, capsys.readouterr().out


def test_the_printed_case_seed_rebuilds_the_worst_case(leaky_run, capsys):
    tmp_path, terminal = leaky_run
    first = tmp_path / "first"
    worst = json.loads((first / "report.json").read_text())["checks"][0]["worst_case"]
    markdown = (first / "report.md").read_text()
    block = re.search(r"<summary><b>causal\.forward</b>.*?</details>", markdown, re.S).group(0)

    # what report.md prints: the seeds, the worst case, the command
    seeds = re.search(r"\*\*Reproduce:\*\* run seed (\d+) \(.*?\), case seed (\d+) \(", block)
    printed_run, printed_case = int(seeds.group(1)), int(seeds.group(2))
    printed_worst = json.loads(re.search(r"^```json\n(.*?)\n```$", block, re.S | re.M).group(1))
    command = shlex.split(re.search(r"^```sh\n(.*?)\n```$", block, re.S | re.M).group(1))
    assert printed_worst == worst

    # the printed case seed is the worst case's own, not the run's
    assert printed_run == RUN_SEED
    assert printed_case == worst["case"]["seed"] != RUN_SEED
    # and it is the same seed everywhere the worst case is shown
    assert f"causal.forward case seed {printed_case} (run seed {RUN_SEED};" in terminal
    page = (first / "report.html").read_text()
    assert re.search(rf'<dt>Case seed</dt><dd><span class="mono">{printed_case}</span>', page)
    assert f"case seed {printed_case} (the worst case's own seed)" in (first / "junit.xml").read_text()

    # rebuilt from what is printed: the case and its tensors; the run seed would build another case
    case = Case.from_dict(printed_worst["case"])
    assert case.seed == printed_case
    rebuilt = make_inputs(case, "cpu")
    again = make_inputs(Case.from_dict(json.loads(json.dumps(case.to_dict()))), "cpu")
    assert all(torch.equal(getattr(rebuilt, t), getattr(again, t)) for t in ("q", "k", "v", "do"))
    assert not torch.equal(make_inputs(replace(case, seed=printed_run), "cpu").q, rebuilt.q)

    # re-run with the printed command: the same worst case, bit for bit (case, position, mismatch)
    assert command[:2] == ["flamia-verify", "check"]
    assert command[command.index("--seed") + 1] == str(RUN_SEED)
    assert command[command.index("--config") + 1] == "small.toml"  # its suite setting shapes the cases
    assert command[command.index("--dtype") + 1] == "bf16"
    assert _check(tmp_path, "again", command[2:]) == 1
    capsys.readouterr()
    rerun = load_report(tmp_path / "again" / "report.json").check("causal.forward")
    assert rerun.worst_case == worst
    assert case_seed(load_report(tmp_path / "again" / "report.json"), rerun) == printed_case


def test_replay_of_a_check_worst_case_says_how_to_rerun_it(leaky_run, capsys):
    tmp_path, _ = leaky_run
    worst = json.loads((tmp_path / "first" / "report.json").read_text())["checks"][0]["worst_case"]
    (tmp_path / "case.json").write_text(json.dumps(worst))
    code = main(["fuzz", "--kernel", "leaky.py:attention", "--replay", "case.json", "--out", str(tmp_path / "r")])
    err = capsys.readouterr().err
    assert code == 2 and len(err.splitlines()) == 1, err
    assert f"case seed {worst['case']['seed']}" in err and "--seed RUN_SEED --only FAMILY" in err


def _report(worst_case: dict) -> Report:
    check = CheckResult("causal.forward", "causal", "fail", {"leaked_elements": 3}, {"leaked_elements": 0}, worst_case)
    return Report("k", "mxfp8", "quick", 0, {}, [check])


def test_case_seed_reads_every_shape_of_worst_case():
    case = Case((32,), seed=11).to_dict()
    # a check's worst case (case_record): the case nested under "case"
    nested = _report({"case": case, "t": 0})
    assert case_seed(nested, nested.checks[0]) == 11
    # a fuzz reproducer: the case's fields at the top level
    flat = _report({**case, "property": "causal"})
    assert case_seed(flat, flat.checks[0]) == 11
    # no case recorded: no case seed, never the run's seed standing in for one
    bare = _report({"problem": "no usable backward"})
    assert case_seed(bare, bare.checks[0]) is None
    from flamia_verify.reports import render_markdown

    assert "**Reproduce:** run seed 0 (--seed of the re-run below); the worst case records no case seed." in (
        render_markdown(bare)
    )
