"""RunSpec: a run's options resolved once, at the boundary; everything below reads the frozen record."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from flamia_verify.errors import ConfigError
from flamia_verify.properties import RunSpec, list_checks, run_checks, run_spec
from flamia_verify.properties.thresholds import resolve_thresholds
from flamia_verify.settings import suite_settings


def test_resolve_turns_what_a_user_writes_into_resolved_values():
    spec = RunSpec.resolve("bf16", device="auto", dtype="fp16", only=["causal"], require="reproducibility")
    assert spec.device == "cpu"  # no GPU here: auto is the CPU
    assert spec.dtype is torch.float16
    assert spec.recipe.name == "bf16" and spec.kernel.name == "bf16"
    assert spec.checks and {c.family for c in spec.checks} == {"causal"}
    assert [c.name for c in spec.checks] == [c.name for c in list_checks("quick") if c.family == "causal"]
    assert spec.require == ("reproducibility",)
    assert spec.settings == suite_settings("quick")
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.seed = 3  # type: ignore[misc]


def test_threshold_overrides_are_merged_once_and_the_callers_dict_is_not_shared():
    overrides = {"error.out": {"normalized_error": 0.5}, "suite": {"seeds": 1}}
    spec = RunSpec.resolve("bf16", thresholds=overrides)
    th, opts, suite = resolve_thresholds(spec.recipe, spec.dtype, overrides)
    assert spec.thresholds["error.out"]["normalized_error"] == 0.5 == th["error.out"]["normalized_error"]
    assert dict(spec.options) == opts and spec.settings.seeds == 1 == suite["seeds"]
    overrides["error.out"]["normalized_error"] = 9.0  # the caller's later edit does not reach the run
    assert spec.overrides is not None and spec.overrides["error.out"]["normalized_error"] == 0.5


@pytest.mark.parametrize(
    ("options", "words"),
    [
        ({"seed": -1}, "seed must be a non-negative integer"),
        ({"seed": True}, "seed must be a non-negative integer"),
        ({"case_timeout_s": float("inf")}, "case_timeout_s must be a positive finite number"),
        ({"case_timeout_s": 0}, "case_timeout_s must be a positive finite number"),
        ({"threads": 0}, "threads must be a positive integer"),
        ({"suite": "huge"}, "unknown suite 'huge'"),
        ({"only": ["nonsense"]}, "unknown check or family 'nonsense'"),
        ({"require": ["speed"]}, "require: unknown verdict 'speed'"),
        ({"dtype": "fp64"}, "fp64"),
        ({"thresholds": {"error.out": {"no_such_key": 1}}}, "no_such_key"),
        ({"recipe": "mxfp9"}, "mxfp9"),
    ],
)
def test_every_bad_option_is_a_config_error_naming_it_before_the_kernel_runs(options, words):
    calls = []

    def kernel(*args, **kwargs):  # never called: resolution fails first
        calls.append(1)
        raise AssertionError("called")

    kernel.recipe = "bf16"  # type: ignore[attr-defined]
    with pytest.raises(ConfigError, match=words.replace("(", r"\(")):
        RunSpec.resolve(kernel, **options)
    assert not calls


def test_a_kernel_that_declares_itself_forward_only_is_resolved_so():
    def fwd_only(q, k, v, *args, **kwargs):
        raise AssertionError("not called by resolve")

    fwd_only.forward_only = True  # type: ignore[attr-defined]
    assert RunSpec.resolve(fwd_only, recipe="bf16").forward_only is True
    assert RunSpec.resolve("bf16").forward_only is False


def test_run_checks_is_resolve_then_run_spec():
    """The keyword front door and the resolved record give the same verdicts on the same run."""
    options = {"only": ["interface.backward", "causal.forward"], "seed": 2}
    by_keywords = run_checks("bf16", **options)
    by_spec = run_spec(RunSpec.resolve("bf16", **options))
    assert [(c.name, c.status, c.metrics) for c in by_keywords.checks] == [
        (c.name, c.status, c.metrics) for c in by_spec.checks
    ]
