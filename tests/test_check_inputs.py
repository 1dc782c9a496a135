"""`check --inputs CAPTURE_DIR`: the value checks on the tensors a real model produced (the shipped
capture of the train-parity ``tiny`` model, tests/data/capture_tiny: 4 calls, 2 layers x 2 steps,
4 causal documents of 128 tokens each, with dO).

Each ``*.captured`` check passes correct kernels and fails a kernel with the bug it looks for; a bad
capture is one line and exit 2 before the kernel runs; the report has one row per captured call."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from zoo import fuzz_bugs as FB
from zoo import targeted as T
from zoo.correct import sdpa_bf16

from flamia_verify.cli import main
from flamia_verify.errors import CaptureError
from flamia_verify.properties import run_checks
from flamia_verify.properties.cases import captured_cases, make_inputs
from flamia_verify.properties.checks.common.captured import CAPTURED_CHECKS

CAPTURE = Path(__file__).resolve().parent / "data" / "capture_tiny"


def _scaled_output(q, k, v, cu_q, cu_k, mq, mk, *, softmax_scale, causal):
    """BF16 SDPA whose output is 1 % too large: outside every recipe's bound and error model."""
    return sdpa_bf16(q, k, v, cu_q, cu_k, mq, mk, softmax_scale=softmax_scale, causal=causal) * 1.01


_scaled_output.recipe = "bf16"  # type: ignore[attr-defined]


def test_captured_cases_are_the_recorded_calls():
    cases = captured_cases(CAPTURE)
    assert len(cases) == 4 and all(c.lens_q == (128,) * 4 and c.causal for c in cases)
    inp = make_inputs(cases[1])
    from flamia_verify.capture import load_capture

    call = load_capture(CAPTURE).calls[1]
    assert inp.q.equal(call.q) and inp.k.equal(call.k) and inp.v.equal(call.v) and inp.do.equal(call.dout)
    assert "captured call 1 of" in cases[1].describe()


@pytest.mark.parametrize("kernel", ["bf16", "flamia-mxfp8", sdpa_bf16], ids=["bf16", "flamia-mxfp8", "sdpa"])
def test_correct_kernels_pass_every_captured_check(kernel):
    report = run_checks(kernel, inputs=CAPTURE, recipe=None if isinstance(kernel, str) else "bf16")
    assert [c.name for c in report.checks] == list(CAPTURED_CHECKS)
    assert report.passed, [(c.name, c.message) for c in report.checks if c.status != "pass"]
    for check in report.checks:
        if check.name.endswith(".captured"):
            assert len(check.details["calls"]) == 4 and check.metrics["calls"] == 4
    assert report.environment["inputs"] == str(CAPTURE) and report.environment["captured_calls"] == 4


@pytest.mark.parametrize(
    "kernel, only, fails",
    [
        (_scaled_output, ["error", "bound"], {"error.captured", "bound.captured"}),
        ("mxfp8-naive", ["causal"], {"causal.captured"}),
        (FB.ignores_causal, ["causal"], {"causal.captured"}),
        (FB.attends_across_documents, ["isolation"], {"isolation.captured"}),
        (T.dv_saturating_do, ["consistency"], {"consistency.conservation_backward", "consistency.grad_forward_ratio"}),
        (T.ds_unscaled, ["consistency"], {"consistency.grad_forward_ratio"}),
    ],
    ids=[
        "scaled_output",
        "mxfp8-naive",
        "ignores_causal",
        "attends_across_documents",
        "dv_saturating_do",
        "ds_unscaled",
    ],
)
def test_each_captured_check_fails_the_bug_it_looks_for(kernel, only, fails):
    report = run_checks(kernel, inputs=CAPTURE, only=only)
    failed = {c.name for c in report.checks if c.status == "fail"}
    assert failed == fails, [(c.name, c.status, c.message) for c in report.checks]
    for name in fails:
        check = report.check(name)
        if name.endswith(".captured"):
            assert "call " in check.message and "(layer " in check.message, check.message  # names the call
            assert {"call", "layer", "step"} <= set(check.worst_case)
        else:  # a consistency check judging the calls as base cases: its worst case is a captured call
            assert check.worst_case["case"]["capture"].startswith(f"{CAPTURE}#"), check.worst_case


def test_the_command_writes_a_per_call_report_and_a_rerun_on_the_capture(tmp_path, capsys):
    out = tmp_path / "r"
    code = main(["check", "--kernel", "mxfp8-naive", "--inputs", str(CAPTURE), "--only", "causal", "--out", str(out)])
    assert code == 1
    data = json.loads((out / "report.json").read_text())
    (check,) = data["checks"]
    assert check["name"] == "causal.captured" and len(check["details"]["calls"]) == 4
    md = (out / "report.md").read_text()
    assert "Per captured call:" in md and f"--inputs {CAPTURE} --only causal.captured" in md
    assert "Per captured call" in (out / "report.html").read_text()


def _tampered(tmp_path) -> Path:
    copy = tmp_path / "capture"
    shutil.copytree(CAPTURE, copy)
    path = copy / "call-000002.safetensors"
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(bytes(data))
    return copy


@pytest.mark.parametrize("bad", ["missing", "tampered"])
def test_a_bad_capture_is_one_line_and_exit_2_before_anything_runs(tmp_path, capsys, bad):
    path = tmp_path / "nowhere" if bad == "missing" else _tampered(tmp_path)
    out = tmp_path / "r"
    code = main(["check", "--kernel", "bf16", "--inputs", str(path), "--out", str(out)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert str(path) in err[0]
    if bad == "tampered":
        assert "call-000002.safetensors" in err[0]
    assert not out.exists()
    with pytest.raises(CaptureError):
        run_checks("bf16", inputs=path)
