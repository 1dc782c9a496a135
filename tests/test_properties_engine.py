"""The check engine's contract with the CLI: API names, suites, thresholds and their validation,
progress and result callbacks, kernel failures (raise, hang, crash), forward-only kernels, and a
report that serializes and says what reproduces each finding."""

from __future__ import annotations

import json
import math

import pytest
import torch
from zoo import kernels as Z

import flamia_verify.properties as P
from flamia_verify.errors import ConfigError, KernelCrashError
from flamia_verify.kernels import RECIPES, load_kernel
from flamia_verify.properties import (
    SUITES,
    CheckSpec,
    ProgressEvent,
    default_thresholds,
    list_checks,
    run_checks,
)
from flamia_verify.results import FAMILIES, Report


def test_public_api_names():
    assert set(P.__all__) == {
        "run_checks",
        "run_spec",
        "RunSpec",
        "list_checks",
        "fuzz",
        "replay_case",
        "default_thresholds",
        "SUITES",
        "CheckSpec",
        "ProgressEvent",
        "FuzzResult",
    }
    assert SUITES == ("quick", "standard", "full")


def test_list_checks_covers_every_family_with_unique_names():
    specs = list_checks("quick")
    assert all(isinstance(s, CheckSpec) for s in specs)
    names = [s.name for s in specs]
    assert len(names) == len(set(names))
    assert {s.family for s in specs} == set(FAMILIES)
    for s in specs:
        assert s.name.startswith(s.family + ".") and s.description and "quick" in s.suites
    # every quick check runs in the larger suites; only the bounded fuzz pass is left out of quick
    assert set(names) <= {s.name for s in list_checks("standard")} == {s.name for s in list_checks("full")}
    assert {s.name for s in list_checks("full")} - set(names) == {"isolation.fuzz"}
    with pytest.raises(ConfigError, match="unknown suite 'fast'"):
        list_checks("fast")


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_default_thresholds_are_derived_and_sane(recipe):
    th = default_thresholds(recipe)
    from flamia_verify.properties.catalog import all_specs

    # every check, those of a run on a capture (in no suite) included: a config may set their thresholds
    assert set(th) == {s.name for s in all_specs()} >= {s.name for s in list_checks("full")}
    for name, entries in th.items():
        for key, value in entries.items():
            assert isinstance(value, (int, float)) and not isinstance(value, bool), (name, key, value)
            assert value >= 0 and not math.isnan(value), (name, key, value)
    # leaks and bound violations: zero tolerance
    for name in ("causal.forward", "causal.dq", "causal.dk_dv", "isolation.neighbours", "determinism.repeat"):
        assert all(v == 0 for v in th[name].values()), (name, th[name])
    assert th["bound.out"] == {"violations": 0}
    # errors are normalized by the recipe's rounding model on the same inputs: one factor for all
    assert all(th[f"error.{t}"] == {"normalized_error": 2.0} for t in ("out", "dq", "dk", "dv"))
    with pytest.raises(ConfigError, match="unknown recipe"):
        default_thresholds("mxfp6")


def test_thresholds_derived_from_unit_roundoffs():
    # bias: a quarter of the coarsest unit roundoff reaching the tensor (truncation gives ~0.72 u)
    assert default_thresholds("mxfp8")["bias.gain"]["gain_error_out"] == pytest.approx(2**-6)
    assert default_thresholds("nvfp4")["bias.gain"]["gain_error_dv"] == pytest.approx(2**-4)
    assert default_thresholds("bf16")["bias.gain"]["gain_error_out"] == pytest.approx(2**-10)
    # conservation: 2 u + u^2 with u = 2^-8 for bf16 inputs and 2^-11 for fp16
    assert default_thresholds("mxfp8")["consistency.conservation_forward"]["max_rel_dev"] == pytest.approx(
        2**-7 + 2**-16
    )
    fp16 = default_thresholds("mxfp8", torch.float16)
    assert fp16["consistency.conservation_forward"]["max_rel_dev"] == pytest.approx(2**-10 + 2**-22)


@pytest.mark.parametrize(
    "overrides, match",
    [
        ({"causal.nowhere": {"leaked_elements": 1}}, "unknown check 'causal.nowhere'"),
        ({"error.out": {"rel_rmsee": 0.1}}, "unknown key 'rel_rmsee' for check 'error.out'"),
        ({"error.out": {"normalized_error": "big"}}, "'normalized_error' must be a number"),
        ({"error.out": {"normalized_error": -1}}, "must be a non-negative number"),
        ({"determinism.repeat": {"warn_only": 1}}, "'warn_only' must be true or false"),
        ({"suite": {"seeds": 0}}, "suite setting 'seeds' must be a positive integer"),
        ({"suite": {"tokens": 3}}, "unknown suite setting 'tokens'"),
        ({"error.out": 3}, "must be a mapping"),
    ],
)
def test_threshold_overrides_are_validated(overrides, match):
    with pytest.raises(ConfigError, match=match):
        run_checks("bf16", only=["interface.output"], thresholds=overrides)


def test_overrides_change_the_verdict_and_are_reported():
    strict = {"error.out": {"normalized_error": 0.1}}
    res = run_checks("flamia-mxfp8", only=["error.out"], thresholds=strict).check("error.out")
    assert res.status == "fail" and res.thresholds["normalized_error"] == 0.1
    assert "normalized_error" in res.message
    res = run_checks("flamia-mxfp8", only=["error.out"], thresholds={"suite": {"seeds": 1}}).check("error.out")
    # the four base packings at one seed, and the quick suite's four dimension cases (always one seed)
    assert res.status == "pass" and res.metrics["cases"] == 4 + 4


def test_recipe_is_required_for_a_kernel_without_one_and_validated():
    def plain(q, k, v, cu_q, cu_k, mq, mk, *, softmax_scale, causal):
        return load_kernel("bf16").fn(q, k, v, cu_q, cu_k, mq, mk, softmax_scale=softmax_scale, causal=causal)

    with pytest.raises(ConfigError, match="declares no recipe; name one of: bf16, fp8"):
        run_checks(plain, only=["interface"])
    with pytest.raises(ConfigError, match="unknown recipe 'mxfp9'"):
        run_checks(plain, recipe="mxfp9", only=["interface"])
    report = run_checks(plain, recipe="bf16", only=["interface"])
    assert report.recipe == "bf16" and report.passed
    plain.recipe = "mxfp88"  # a typo in the kernel's own attribute: the message says where it came from
    with pytest.raises(ConfigError, match=r"declares recipe 'mxfp88' \(its `recipe` attribute\).*--recipe"):
        run_checks(plain, only=["interface"])
    assert run_checks(plain, recipe="bf16", only=["interface.output"]).passed  # --recipe still overrides it


def test_only_selects_families_and_checks():
    report = run_checks("bf16", only=["interface", "causal.forward"])
    assert [c.name for c in report.checks] == [
        "interface.output",
        "interface.inputs_unmodified",
        "interface.process_state",
        "interface.backward",
        "interface.arguments",
        "interface.arguments_bitwise",
        "interface.lse",
        "causal.forward",
    ]
    with pytest.raises(ConfigError, match="unknown check or family 'causality'"):
        run_checks("bf16", only=["causality"])


def test_progress_and_result_callbacks():
    events, results = [], []
    report = run_checks(
        "bf16", only=["interface", "error.out", "causal.forward"], on_progress=events.append, on_result=results.append
    )
    assert [r.name for r in results] == [c.name for c in report.checks]
    assert all(isinstance(e, ProgressEvent) for e in events)
    assert {e.check for e in events} == {c.name for c in report.checks}
    assert all(e.total == 9 and 0 <= e.fraction <= 1 and 0 <= e.overall <= 1 + 1e-9 for e in events)
    assert any(0 < e.fraction < 1 for e in events), "no progress within a check"
    overall = [e.overall for e in events]
    assert overall == sorted(overall) and overall[-1] == pytest.approx(1.0)
    assert events[-1].estimated_s is not None and events[-1].elapsed_s >= 0


def test_report_environment_and_json():
    report = run_checks("flamia-mxfp8", only=["interface", "bound.out"])
    env = report.environment
    for key in ("torch", "triton", "device", "device_name", "python", "platform", "flamia_verify", "dtype"):
        assert key in env, key
    assert env["torch"] == torch.__version__ and env["device"] == "cpu" and env["backward"] is True
    data = json.loads(json.dumps(report.to_dict()))
    again = Report.from_dict(data)
    assert [c.name for c in again.checks] == [c.name for c in report.checks]
    assert data["summary"]["passed"] is True


def test_a_kernel_that_raises_on_some_cases_marks_only_those_checks_error():
    report = run_checks(Z.raises_on_gqa, only=["interface.output", "causal.forward", "isolation.offset", "error.out"])
    out = report.check("interface.output")
    assert out.status == "error"
    assert "NotImplementedError: GQA is not supported" in out.message
    assert out.worst_case["case"]["heads_k"] != out.worst_case["case"]["heads"]
    assert report.check("causal.forward").status == "error"  # its document uses GQA
    assert report.check("isolation.offset").status == "error"
    assert report.check("error.out").status == "error"


def test_a_hanging_kernel_times_out_and_the_run_goes_on():
    try:
        report = run_checks(Z.hangs_on_long, only=["interface.output", "error.out"], case_timeout_s=2.0)
    finally:
        Z._HANG.set()  # let the abandoned thread finish instead of waiting out its 30 s
    assert report.check("interface.output").status == "pass"  # small cases
    res = report.check("error.out")
    assert res.status == "error" and "did not return within 2 s" in res.message
    assert "cannot be killed" in res.message


def test_a_kernel_that_cannot_run_the_smallest_case_raises_crash():
    with pytest.raises(KernelCrashError, match="cannot run the smallest case.*illegal memory access"):
        run_checks(Z.always_crashes, only=["interface"])


def test_forward_only_kernel_skips_gradient_checks_with_the_reason():
    report = run_checks(Z.forward_only, suite="quick", forward_only=True)
    assert report.environment["backward"] is False and report.environment["forward_only"] is True
    by = {c.name: c for c in report.checks}
    for name in (
        "interface.backward",
        "error.dq",
        "error.dk",
        "error.dv",
        "bound.grad",
        "causal.dq",
        "causal.dk_dv",
        "consistency.weights",
        "consistency.shift_invariance",
    ):
        assert by[name].status == "skip", (name, by[name].status, by[name].message)
        assert "forward-only" in by[name].message
    for name in (
        "interface.output",
        "error.out",
        "bound.out",
        "causal.forward",
        "causal.nan",
        "isolation.neighbours",
        "consistency.conservation_forward",
        "special.short_documents",
        "bias.gain",
        "determinism.repeat",
    ):
        assert by[name].status == "pass", (name, by[name].status, by[name].message)
    assert report.passed  # skips do not fail a run


def test_in_place_writes_are_findings():
    res = run_checks(Z.inplace_scale, only=["interface.inputs_unmodified"]).check("interface.inputs_unmodified")
    assert res.status == "fail" and res.worst_case["tensor"] == "q"
    assert res.worst_case["mismatch"]["mismatched"] > 0


def test_tuple_output_is_read_by_its_first_item():
    def as_tuple(*args, **kwargs):
        out = load_kernel("bf16").fn(*args, **kwargs)
        return out, None

    res = run_checks(as_tuple, recipe="bf16", only=["interface.output", "error.out"])
    assert res.check("interface.output").metrics["tuple_output"] is True
    assert res.passed


def test_runs_are_deterministic_in_the_seed():
    a = run_checks("fp8", only=["error.out", "bias.gain"], seed=3)
    b = run_checks("fp8", only=["error.out", "bias.gain"], seed=3)
    c = run_checks("fp8", only=["error.out"], seed=4)
    assert a.check("error.out").metrics == b.check("error.out").metrics
    assert a.check("bias.gain").metrics == b.check("bias.gain").metrics
    assert a.check("error.out").metrics["rel_rmse"] != c.check("error.out").metrics["rel_rmse"]


def test_fp16_inputs():
    report = run_checks(
        "flamia-mxfp8", dtype=torch.float16, only=["interface", "error", "consistency", "causal.forward"]
    )
    assert report.environment["dtype"] == "fp16"
    assert report.passed, [(c.name, c.message) for c in report.checks if c.status != "pass"]


def test_error_check_details_follow_the_plot_conventions():
    from flamia_verify.reports.plots import plots_of

    res = run_checks("flamia-mxfp8", only=["error.out", "causal.forward"])
    for check in res.checks:
        plots = plots_of(check.details)
        assert plots, check.name
    err = res.check("error.out")
    series = err.details["series"][0]
    assert set(series["ys"]) == {"kernel", "bf16"} and len(series["ys"]["kernel"]) > 0
    hist = err.details["histograms"][0]
    assert len(hist["bin_edges"]) == len(hist["counts"]["kernel"]) + 1


def test_the_report_says_which_implementation_of_a_builtin_kernel_ran():
    """environment.kernel_paths counts this run's calls per implementation (a second run in the same
    process counts only its own), and report.md's run line shows it; user kernels have none."""
    from flamia_verify.reports.markdown import render_markdown

    first = run_checks("flamia-mxfp8", only=["interface.output"])
    again = run_checks("flamia-mxfp8", only=["interface.output"])
    assert first.environment["kernel_paths"] == {"PyTorch emulation": first.environment["kernel_calls"]}
    assert again.environment["kernel_paths"] == first.environment["kernel_paths"]
    assert "ran PyTorch emulation (" in render_markdown(first) and "cpu (" in render_markdown(first)
    from flamia_verify.kernels import builtin_kernels
    from flamia_verify.kernels.metadata import emulated_twin

    plain = emulated_twin(builtin_kernels()["bf16"].fn)  # an emulated kernel passed as a user callable
    user = run_checks(lambda *a, **kw: plain(*a, **kw), recipe="bf16", only=["interface.output"])
    assert "kernel_paths" not in user.environment


def test_a_kernel_that_declares_itself_forward_only_is_treated_as_declared():
    def declared(*args, **kwargs):
        return Z.forward_only(*args, **kwargs)

    declared.forward_only = True  # as the sage adapter declares it
    report = run_checks(declared, recipe="mxfp8", suite="quick", only=["error.dq", "error.out"])
    assert report.environment["forward_only"] is True
    assert {c.name: c.status for c in report.checks} == {"error.out": "pass", "error.dq": "skip"}
    undeclared = run_checks(Z.forward_only, suite="quick", only=["error.dq"])
    assert undeclared.checks[0].status != "skip"  # without the declaration a missing backward is no skip
