"""The wrapper mutant family (flamia_verify.known_bad.wrapper): bugs of the calling convention around a
correct kernel. Every bug is observable on the family's own probe calls; the ones that touch only
their own dimension leave the correct kernel's numbers bitwise alone on a plain call; the command
runs the family end to end and reports it beside the arithmetic table."""

from __future__ import annotations

import json
import math

import pytest
import torch

from flamia_verify.cli import main
from flamia_verify.known_bad import base_kernel
from flamia_verify.known_bad.table import MUTANTS
from flamia_verify.known_bad.wrapper import (
    PLAIN,
    PROBES,
    WRAPPER_BUGS,
    WRAPPER_CORRECT,
    WRAPPER_MUTANTS,
    plain_matches,
    probe_call,
)
from flamia_verify.mutation.report import kind_of
from flamia_verify.mutation.runner import MutantResult, distinguishes, summarize


def test_names_are_unique_and_carry_their_family():
    names = [m.name for m in MUTANTS] + [m.name for m in WRAPPER_MUTANTS]
    assert len(names) == len(set(names))
    for m in WRAPPER_MUTANTS:
        assert m.family.startswith("wrapper.") and m.name.startswith(m.family + ".")
        assert kind_of(m.family) == "wrapper"
    assert all(kind_of(m.family) == "arithmetic" for m in MUTANTS)
    assert 25 <= len(WRAPPER_BUGS) <= 40 and WRAPPER_CORRECT
    assert {m.base for m in WRAPPER_MUTANTS} == {"flamia-mxfp8", "bf16"}


def test_probes_exercise_the_wrapper_dimensions():
    ratios = {(p.heads // p.heads_k, p.heads % p.heads_k) for p in PROBES}
    assert {(3, 0), (5, 0), (7, 0)} <= ratios and any((p.heads, p.heads_k) == (6, 2) for p in PROBES)
    assert {80, 96, 192, 256} <= {p.headdim for p in PROBES}
    assert {"fused", "head-major", "channels-last"} <= {p.layout for p in PROBES}
    assert any(p.scale is None for p in PROBES) and any(p.dtype == torch.float16 for p in PROBES)
    assert any(p.extra_max > 0 for p in PROBES) and any(p.max_is_total for p in PROBES)
    assert any(max(p.lens_q) > 512 for p in PROBES) and any(p.nan for p in PROBES)
    empties = {
        where
        for p in PROBES
        for i, n in enumerate(p.lens_q)
        if n == 0
        for where in [("start" if i == 0 else "end" if i == len(p.lens_q) - 1 else "middle")]
    }
    assert empties == {"start", "middle", "end"}


@pytest.mark.parametrize("mutant", WRAPPER_BUGS, ids=lambda m: m.name)
def test_every_wrapper_bug_is_observable(mutant):
    torch.manual_seed(0)
    assert distinguishes(mutant) is not None, f"{mutant.name} never differs from the correct kernel"


@pytest.mark.parametrize("mutant", [m for m in WRAPPER_MUTANTS if m.has("plain")], ids=lambda m: m.name)
def test_a_plain_call_goes_straight_through(mutant):
    """Contiguous bf16, scale passed, two equal documents, GQA 2:1, head_dim 64: the correct kernel's bits."""
    assert plain_matches(mutant)


def test_the_correct_lse_tuple_is_natural_log_heads_first():
    """The lse the correct tuple returns (and the lse mutants distort) against a float64 logsumexp."""
    (lse_mutant,) = [m for m in WRAPPER_CORRECT if m.name == "wrapper.lse.correct"]
    out, lse, _, _ = probe_call(lse_mutant.kernel(), PLAIN)
    assert lse is not None and lse.shape == (PLAIN.heads, sum(PLAIN.lens_q))
    ref_out, _, _, _ = probe_call(base_kernel("flamia-mxfp8"), PLAIN)
    assert torch.equal(out, ref_out)
    g = torch.Generator().manual_seed(PLAIN.seed)  # the probe's own draw, in the same order
    q, k = (torch.randn(*s, generator=g).to(PLAIN.dtype).double() for s in ((128, 2, 64), (128, 1, 64)))
    doc = slice(64, 128)  # the second document, causal: row i sees keys 0..i
    s = torch.einsum("ihd,jd->hij", q[doc], k[doc, 0]) * PLAIN.scale
    s = s.masked_fill(torch.ones(64, 64, dtype=torch.bool).triu(1), -math.inf)
    assert torch.allclose(lse[:, doc].double(), torch.logsumexp(s, dim=-1), atol=0.1)


def test_summary_reports_each_kind_apart():
    rs = [
        MutantResult("mask.x", "mask", False, "killed"),
        MutantResult("wrapper.gqa.a", "wrapper.gqa", False, "killed"),
        MutantResult("wrapper.gqa.b", "wrapper.gqa", False, "survived"),
        MutantResult("wrapper.gqa.c", "wrapper.gqa", True, "passed"),
    ]
    s = summarize(rs)
    assert s["kinds"]["arithmetic"]["kill_rate"] == 1.0
    assert s["kinds"]["wrapper"] == {
        "mutants": 2,
        "killed": 1,
        "kill_rate": 0.5,
        "survivors": ["wrapper.gqa.b"],
        "correct_designs": 1,
        "false_alarms": [],
    }


def test_family_selection(capsys):
    assert main(["mutate", "--family", "wrapper", "--list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == len(WRAPPER_MUTANTS) and all(x.startswith("wrapper.") for x in lines)
    assert main(["mutate", "--family", "arithmetic", "--list"]) == 0
    assert "wrapper." not in capsys.readouterr().out
    assert main(["mutate", "--family", "wrapper.gqa", "mask", "--list"]) == 0
    out = capsys.readouterr().out
    assert "wrapper.gqa.modulo" in out and "mask.forward+1" in out and "wrapper.cu." not in out


def test_mutate_family_wrapper_end_to_end(tmp_path, capsys):
    names = ["wrapper.gqa.modulo", "wrapper.nan.out-to-num"]
    code = main(["mutate", "--family", "wrapper", "--mutant", *names, "--out", str(tmp_path)])
    assert code in (0, 1)
    data = json.loads((tmp_path / "mutation.json").read_text())
    assert [r["name"] for r in data["results"]] == names
    assert all(r["outcome"] in ("killed", "crashed", "survived") for r in data["results"])
    assert data["summary"]["kinds"]["wrapper"]["mutants"] == 2 and "arithmetic" not in data["summary"]["kinds"]
    md = (tmp_path / "mutation.md").read_text()
    assert "## Wrapper mutants" in md and "| wrapper.gqa | 1 |" in md and "| wrapper.nan | 1 |" in md
    assert "[  2/2]" in capsys.readouterr().out
