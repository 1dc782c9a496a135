"""Threshold overrides: every key a check declares either gates its verdict or is refused when the
config is read, and every accepted override is recorded in the reports (report.json, report.md,
report.html, junit.xml, the terminal summary).

The reported defects: ``causal.forward`` ``leaked_elements = 1e9`` was accepted and ignored (the check
still failed, printing "188239 (<= 1e+09)"), and a loosened gate (``normalized_error = inf``) showed
only as "<= inf" in one cell of the table.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch
from zoo import correct as C
from zoo import kernels as Z

from flamia_verify.cli import main
from flamia_verify.commands.common import load_config
from flamia_verify.errors import ConfigError
from flamia_verify.properties.cases import captured_cases
from flamia_verify.properties.catalog import all_specs
from flamia_verify.properties.engine import RunSpec, build_context, run_one
from flamia_verify.properties.thresholds import fixed_keys, resolve_thresholds
from flamia_verify.recipes import RECIPES
from flamia_verify.reports import load_report, render_markdown

pytestmark = pytest.mark.xdist_group("threshold-overrides")

#: where every adjustable threshold's metric is above 0 on the quick suite (one seed per packing):
#: E4M3 with one scale per tensor, P unscaled; a threshold that gates can be shown to bite there
ADJUSTABLE_KERNEL = "fp8-tensor"
#: the kernel on which each option changes the verdict (as in test_config_readme.py)
OPTION_KERNELS = {
    ("causal.nan", "require_nan_keys"): (C.sdpa_bf16, "bf16"),  # adds the mask: NaN keys reach earlier rows
    ("determinism.repeat", "warn_only"): (Z.nondeterministic, "mxfp8"),
}
#: small cases for the options: the point is the verdict's dependence on a key, not the suite's coverage
SMALL = {"seeds": 1, "causal_len": 48, "layout_docs": 4, "layout_long": 64, "long_len": 64}


def _toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and math.isinf(value):
        return "inf"
    return repr(value)


def _load(tmp_path, check: str, entries: dict) -> dict:
    """The thresholds of a config file holding ``entries`` for ``check`` (ConfigError when refused)."""
    path = tmp_path / "flamia.toml"
    lines = [f'[tool.flamia-verify.thresholds."{check}"]'] + [f"{k} = {_toml_value(v)}" for k, v in entries.items()]
    path.write_text("\n".join(lines) + "\n")
    return load_config(path).thresholds


def _context(kernel, recipe=None, suite=None):
    return build_context(RunSpec.resolve(kernel, recipe=recipe, thresholds={"suite": suite or SMALL}))


def _judge(ctx, spec, overrides: dict):
    """The check's result with ``overrides`` (read from a config file) in force; the context's kernel
    runs are cached, so only the verdict is computed again."""
    ctx.thresholds, ctx.options, _ = resolve_thresholds(ctx.recipe, ctx.dtype, overrides)
    return run_one(ctx, spec)


def _listed_thresholds(message: str, check: str) -> list[str]:
    listed = re.search(rf"the thresholds of {re.escape(check)} are: ([^;]*)", message)
    assert listed, message
    return [] if listed.group(1) == "(none)" else listed.group(1).split(", ")


def test_every_threshold_key_gates_the_verdict_or_is_refused(tmp_path):
    """Each key each check declares (threshold or option) is set from a config file: it is refused
    at load time (one line naming it and the check's settable thresholds), or it changes the verdict."""
    specs = all_specs()
    plain = _context(ADJUSTABLE_KERNEL, suite={"seeds": 1})  # bias.mean needs the 512-key document to bite
    # the checks of a run on a capture (in no suite) are judged on the shipped capture's calls
    captured = _context(ADJUSTABLE_KERNEL, suite={"seeds": 1})
    captured.captured = tuple(captured_cases(Path(__file__).resolve().parent / "data" / "capture_tiny"))
    gated, refused, switched = [], [], []
    for spec in specs:
        keys = spec.default_thresholds(RECIPES["bf16"], torch.bfloat16)
        accepted = []
        for key, default in keys.items():
            loosened = 0.0 if key.endswith("_min") else math.inf
            try:
                _load(tmp_path, spec.name, {key: loosened})
            except ConfigError as exc:
                message = str(exc)
                assert "\n" not in message and f"'{key}' cannot be overridden" in message, message
                assert f"contract of {spec.name}, fixed at {default!r}" in message, message
                refused.append((spec.name, key, message))
                continue
            accepted.append(key)
        for _, _, message in [r for r in refused if r[0] == spec.name]:
            # the refusal lists exactly the keys of the check that a config may set
            assert _listed_thresholds(message, spec.name) == accepted, message
            for option in spec.options:
                assert option in message.partition("its options: ")[2], message
        if accepted:
            assert "quick" in spec.suites or not spec.suites, spec.name
            ctx = captured if not spec.suites else plain
            open_all = {k: math.inf for k in accepted}
            res = _judge(ctx, spec, _load(tmp_path, spec.name, open_all))
            assert res.status == "pass", (
                f"{spec.name} fails on {ADJUSTABLE_KERNEL} with every threshold off: {res.message}"
            )
            for key in accepted:
                measured = res.metrics[key]
                assert isinstance(measured, (int, float)) and 0 < measured < math.inf, (
                    f"{spec.name}.{key} is {measured!r} on {ADJUSTABLE_KERNEL}: pick a kernel where it bites"
                )
                at_limit = _judge(ctx, spec, _load(tmp_path, spec.name, {**open_all, key: measured}))
                below = _judge(ctx, spec, _load(tmp_path, spec.name, {**open_all, key: measured / 2}))
                assert at_limit.status == "pass", (spec.name, key, at_limit.message)
                assert at_limit.thresholds[key] == measured
                assert below.status == "fail", (spec.name, key, below.message)
                assert below.thresholds[key] == measured / 2  # the limit the check used, reported
                gated.append((spec.name, key))
        for option, default in spec.options.items():
            kernel, recipe = OPTION_KERNELS[(spec.name, option)]
            octx = _context(kernel, recipe)
            statuses = {
                value: _judge(octx, spec, _load(tmp_path, spec.name, {option: value})).status for value in (False, True)
            }
            assert statuses[False] != statuses[True], (spec.name, option, statuses)
            switched.append((spec.name, option))
    declared = sum(len(s.default_thresholds(RECIPES["bf16"], torch.bfloat16)) + len(s.options) for s in specs)
    assert len(gated) + len(refused) + len(switched) == declared
    # the refused keys are exactly the fixed ones the registry declares
    assert sorted((n, k) for n, k, _ in refused) == sorted((n, k) for n, ks in fixed_keys().items() for k in ks)
    assert ("causal.forward", "leaked_elements") in {(n, k) for n, k, _ in refused}
    assert ("error.out", "normalized_error") in gated and ("isolation.offset_bitwise", "bitwise_mismatches") in gated


def test_the_reported_leak_override_is_refused_on_one_line(tmp_path, capsys):
    config = tmp_path / "flamia.toml"
    config.write_text('[tool.flamia-verify.thresholds."causal.forward"]\nleaked_elements = 1e9\n')
    code = main(["check", "--config", str(config), "--kernel", "bf16", "--device", "cpu", "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert code == 2 and len(err.splitlines()) == 1, err
    assert str(config) in err and "'leaked_elements' cannot be overridden" in err
    assert "the thresholds of causal.forward are: (none)" in err
    # a check with a tolerance beside its contract names the tolerance
    config.write_text('[tool.flamia-verify.thresholds."bound.shapes"]\nviolations = 3\n')
    with pytest.raises(ConfigError, match=r"the thresholds of bound\.shapes are: normalized_error$"):
        load_config(config)
    config.write_text('[tool.flamia-verify.thresholds."determinism.repeat"]\nmismatched_elements = 10\n')
    with pytest.raises(ConfigError, match=r"are: \(none\); its options: warn_only$"):
        load_config(config)
    # the Python API refuses it alike
    from flamia_verify.properties import run_checks

    with pytest.raises(ConfigError, match="'leaked_elements' cannot be overridden"):
        run_checks("bf16", only=["causal.forward"], thresholds={"causal.forward": {"leaked_elements": 1e9}})


def test_every_override_is_recorded_in_every_report(tmp_path, capsys):
    config = tmp_path / "loose.toml"
    config.write_text(
        '[tool.flamia-verify.thresholds."error.out"]\nnormalized_error = inf\n'
        '[tool.flamia-verify.thresholds."determinism.repeat"]\nwarn_only = true\n'
        "[tool.flamia-verify.thresholds.suite]\nseeds = 1\n"
    )
    out = tmp_path / "rep"
    args = ["check", "--config", str(config), "--kernel", "flamia-mxfp8", "--device", "cpu", "--only", "error.out"]
    assert main([*args, "--out", str(out)]) == 0
    terminal = capsys.readouterr().out
    data = json.loads((out / "report.json").read_text())
    source = str(config)
    assert data["threshold_overrides"] == [
        {
            "scope": "error.out",
            "key": "normalized_error",
            "kind": "threshold",
            "value": "inf",
            "default": 2.0,
            "source": source,
        },
        {
            "scope": "determinism.repeat",
            "key": "warn_only",
            "kind": "option",
            "value": True,
            "default": False,
            "source": source,
        },
        {"scope": "suite", "key": "seeds", "kind": "suite", "value": 1, "default": 2, "source": source},
    ]
    # schema v1 unchanged otherwise: the existing fields are all there
    assert {"schema", "kernel", "recipe", "suite", "seed", "environment", "checks", "summary"} < set(data)
    lines = [
        f"error.out normalized_error = inf (default 2) from {source}",
        f"determinism.repeat warn_only = true (default false) from {source}",
        f"suite seeds = 1 (default 2) from {source}",
    ]
    assert "3 threshold overrides: the checks were judged against these values, not the defaults" in terminal
    for line in lines:
        assert f"  {line}" in terminal
    markdown = (out / "report.md").read_text()
    header = markdown.split("| Check |")[0]  # above the table of checks
    assert "> **3 threshold overrides:**" in header
    for line in lines:
        assert "> - " + line.replace("_", "\\_") in header
    page = (out / "report.html").read_text()
    top = page.split("<h2>Checks</h2>")[0]  # beside the verdict, above the table of checks
    assert 'id="threshold-overrides"' in top
    for line in lines:
        assert f'<li class="mono">{line}</li>' in top
    junit = (out / "junit.xml").read_text()
    assert (
        f'<property name="threshold_override.error.out.normalized_error" value="inf (default 2) from {source}" />'
        in junit
    )
    assert f'<property name="threshold_override.suite.seeds" value="1 (default 2) from {source}" />' in junit
    # `flamia-verify report` renders them again from report.json
    assert render_markdown(load_report(out / "report.json")) == markdown
    # a run with the defaults says nothing about overrides, and records none
    plain = tmp_path / "plain"
    assert (
        main(["check", "--kernel", "flamia-mxfp8", "--device", "cpu", "--only", "error.out", "--out", str(plain)]) == 0
    )
    assert "threshold override" not in capsys.readouterr().out
    assert json.loads((plain / "report.json").read_text())["threshold_overrides"] == []
    assert "threshold override" not in (plain / "report.md").read_text()


def test_compare_notes_an_override_only_one_run_had():
    from flamia_verify.reports import compare_reports
    from flamia_verify.results import CheckResult, Report

    def report(overrides):
        check = CheckResult("error.out", "error", "pass", {"normalized_error": 0.6}, {"normalized_error": 2.0}, {})
        return Report("k", "mxfp8", "quick", 0, {}, [check], threshold_overrides=overrides)

    loose = {"scope": "error.out", "key": "normalized_error", "kind": "threshold", "value": "inf", "default": 2.0}
    cmp = compare_reports(report([]), report([{**loose, "source": "ci.toml"}]))
    assert "threshold override only in new: error.out normalized_error = inf (default 2) from ci.toml" in (
        cmp.context_notes
    )
    # the same setting read from another file is the same setting
    same = compare_reports(report([{**loose, "source": "a/ci.toml"}]), report([{**loose, "source": "b/ci.toml"}]))
    assert not [n for n in same.context_notes if "override" in n]
