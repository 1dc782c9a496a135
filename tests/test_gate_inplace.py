"""In-place writes into the kernel's inputs: caught on every call the harness makes (forward and
backward, causal and non-causal, every case), and a write that autograd rejects on leaf inputs ends
in a report, not in exit 3."""

from __future__ import annotations

import json
import pathlib

import pytest
from zoo import gate_bugs as G

from flamia_verify.cli import main
from flamia_verify.properties import run_checks

ROOT = pathlib.Path(__file__).resolve().parent.parent


@pytest.mark.parametrize(
    "name, tensor, stage",
    [
        ("noncausal_q_inplace", "q", "forward"),
        ("backward_q_inplace", "q", "backward"),
        ("long_v_inplace", "v", "forward"),
    ],
)
def test_every_in_place_write_fails_inputs_unmodified_in_the_quick_suite(name, tensor, stage):
    report = run_checks(G.GATE_BUGS[name], suite="quick")
    res = report.check("interface.inputs_unmodified")
    assert res.status == "fail", res.message
    assert res.worst_case["tensor"] == tensor and res.worst_case["stage"] == stage
    assert f"wrote into {tensor}" in res.message
    assert res.metrics["modified_inputs"] == 1 and res.metrics["audited_calls"] > 50
    assert not report.passed


def test_a_write_on_the_long_base_cases_only_is_caught_after_the_interface_check_ran():
    """long_v_inplace writes only on calls of more than 64 tokens: the interface check's own cases are
    shorter, so the finding comes from the base cases that run after it."""
    alone = run_checks(G.long_v_inplace, only=["interface.inputs_unmodified"]).check("interface.inputs_unmodified")
    assert alone.status == "pass"
    both = run_checks(G.long_v_inplace, only=["interface.inputs_unmodified", "error.out"])
    assert both.check("interface.inputs_unmodified").status == "fail"


def test_a_rejected_in_place_write_on_leaf_inputs_is_reported_not_a_crash():
    report = run_checks(G.smooth_k_inplace, suite="quick")
    res = report.check("interface.inputs_unmodified")
    assert res.status == "fail" and res.worst_case["tensor"] == "k", res.message
    bwd = report.check("interface.backward")
    assert bwd.status == "fail" and "in place" in bwd.message and "leaf Variable" in bwd.message
    for name in ("error.dq", "causal.dq", "bound.grad"):
        c = report.check(name)
        assert c.status == "skip" and "in place" in c.message, (name, c.status, c.message)
    assert report.check("error.out").status == "pass"  # the forward itself runs (on detached inputs)
    assert report.summary()["gradients_checked"] is False


def test_cli_in_place_kernel_is_exit_1_with_reports(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    code = main(
        ["check", "--kernel", "tests/zoo/gate_bugs.py:smooth_k_inplace", "--only", "interface", "--out", str(tmp_path)]
    )
    err = capsys.readouterr().err
    assert code == 1, err
    data = json.loads((tmp_path / "report.json").read_text())
    assert "interface.inputs_unmodified" in data["summary"]["failed_checks"]


@pytest.mark.parametrize("kernel", ["bf16", "fp8", "flamia-mxfp8", "flamia-nvfp4"])
def test_correct_kernels_leave_their_inputs_alone_on_every_call(kernel):
    report = run_checks(kernel, suite="quick", only=["interface", "error", "causal"])
    res = report.check("interface.inputs_unmodified")
    assert res.status == "pass", res.message
    assert res.metrics["audited_calls"] == report.environment["kernel_calls"]
