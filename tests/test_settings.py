"""flamia_verify.settings is the one home of the suite names, the device and dtype vocabulary and the
threshold rules: every command, the config, the Python API and the engine accept and reject the same
values with the same messages. One test per place where two copies used to disagree."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

import flamia_verify
from flamia_verify import settings
from flamia_verify.cli import build_parser, main
from flamia_verify.commands.common import load_config
from flamia_verify.errors import ConfigError
from flamia_verify.properties import SUITES, fuzz, run_checks
from flamia_verify.properties.catalog import all_specs
from flamia_verify.properties.thresholds import validate_overrides
from flamia_verify.recipes import RECIPES
from flamia_verify.reports.wording import rerun_command
from flamia_verify.results import CheckResult, Report


def _subparsers():
    for action in build_parser()._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices
    raise AssertionError("no subcommands")


def _option(command: str, flag: str) -> argparse.Action:
    return next(a for a in _subparsers()[command]._actions if flag in a.option_strings)


def _gpus(monkeypatch, count: int) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)


# ---------------------------------------------------------------------------------------------
# suite names: spelled once
# ---------------------------------------------------------------------------------------------


def test_every_place_names_the_same_suites(load_config_text):
    assert settings.SUITES == SUITES == ("quick", "standard", "full")
    assert tuple(_option("check", "--suite").choices) == settings.SUITES
    assert tuple(_option("mutate", "--suite").choices) == settings.SUITES
    assert {s for spec in all_specs() for s in spec.suites} <= set(settings.SUITES)
    with pytest.raises(ConfigError, match="suite = 'fast' is not one of quick, standard, full"):
        load_config_text('suite = "fast"\n')
    report = Report(kernel="bf16", recipe="bf16", suite="fuzz", seed=0)
    check = CheckResult(name="error.out", family="error", status="fail")
    assert rerun_command(report, check) is None  # not a suite of `check`
    report.suite = "standard"
    assert "--suite standard" in rerun_command(report, check)


@pytest.fixture
def load_config_text(tmp_path):
    def load(text: str):
        path = tmp_path / "flamia.toml"
        path.write_text(text)
        return load_config(path)

    return load


# ---------------------------------------------------------------------------------------------
# devices: the API rejected cuda:N, the engine took it (and anything starting with "cuda")
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("text", ["auto", "cpu", "cuda", "cuda:0", "cuda:12"])
def test_device_names_accepted_everywhere(text, load_config_text):
    assert settings.check_device(text) == text
    for command in ("check", "fuzz", "train-parity", "mutate"):
        args = build_parser().parse_args(
            [command, "--device", text] + (["--kernel", "bf16"] if command != "mutate" else [])
        )
        assert args.device == text, command
    assert load_config_text(f'device = "{text}"\n').device == text


@pytest.mark.parametrize("text", ["gpu", "cudafoo", "cuda:", "cuda:-1", "cuda:x", "CPU", ""])
def test_bad_device_names_are_rejected_everywhere_naming_the_accepted_ones(text, capsys, load_config_text):
    with pytest.raises(ConfigError, match=r"unknown device .*; use one of: auto, cpu, cuda, cuda:N"):
        settings.resolve_device(text)
    with pytest.raises(ConfigError, match=r"unknown device"):
        run_checks("bf16", device=text, only=["interface.output"])  # the engine took "cudafoo" before
    with pytest.raises(ConfigError, match=r"unknown device"):
        flamia_verify.check("bf16", device=text, only=["interface.output"])
    with pytest.raises(ConfigError, match=r"device = .* is not one of auto, cpu, cuda, cuda:N"):
        load_config_text(f'device = "{text}"\n')
    for command in ("check", "fuzz"):
        with pytest.raises(SystemExit) as exc:
            main([command, "--kernel", "bf16", "--device", text])
        assert exc.value.code == 2
        assert "use one of: auto, cpu, cuda, cuda:N" in capsys.readouterr().err


def test_cuda_n_resolves_against_the_gpus_present(monkeypatch):
    _gpus(monkeypatch, 2)
    assert settings.resolve_device("cuda:1") == "cuda:1"
    assert settings.resolve_device("auto") == "cuda"
    with pytest.raises(ConfigError, match=r"'cuda:2' was asked for but this machine has 2 CUDA devices"):
        settings.resolve_device("cuda:2")
    _gpus(monkeypatch, 0)
    assert settings.resolve_device("auto") == "cpu"
    for text in ("cuda", "cuda:0"):
        with pytest.raises(ConfigError, match=rf"device '{text}' was asked for but no CUDA device is available"):
            settings.resolve_device(text)


def test_api_and_engine_agree_on_cuda_n(monkeypatch):
    """flamia_verify.check rejected cuda:1 as an unknown device, run_checks took it: both take it now,
    and both say the same when no GPU is there."""
    _gpus(monkeypatch, 0)
    for run in (flamia_verify.check, run_checks, lambda k, **kw: flamia_verify.fuzz(k, examples=1, **kw)):
        with pytest.raises(ConfigError, match="device 'cuda:1' was asked for but no CUDA device is available"):
            run("bf16", device="cuda:1")


# ---------------------------------------------------------------------------------------------
# dtypes: the API took bf16/fp16 (and their long names), the engine and the cases fp32 too
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "value, want",
    [
        ("bf16", torch.bfloat16),
        ("fp16", torch.float16),
        ("fp32", torch.float32),
        ("bfloat16", torch.bfloat16),
        ("float16", torch.float16),
        ("float32", torch.float32),
        (torch.bfloat16, torch.bfloat16),
        (torch.float16, torch.float16),
        (torch.float32, torch.float32),
    ],
)
def test_one_dtype_vocabulary(value, want):
    assert settings.resolve_dtype(value) is want
    assert settings.DTYPES[settings.dtype_name(value)] is want


@pytest.mark.parametrize("value", ["fp8", "float64", "BF16", torch.float64, torch.int32, None, 16])
def test_bad_dtypes_name_the_accepted_ones(value):
    with pytest.raises(
        ConfigError, match=r"unknown dtype .*; use one of: bf16, fp16, fp32 \(or bfloat16, float16, float32\)"
    ):
        settings.resolve_dtype(value)
    with pytest.raises(ConfigError, match="unknown dtype"):
        run_checks("bf16", dtype=value, only=["interface.output"])
    with pytest.raises(ConfigError, match="unknown dtype"):
        flamia_verify.check("bf16", dtype=value, only=["interface.output"])


def test_api_takes_fp32_as_the_engine_does():
    """flamia_verify.check rejected fp32 while run_checks ran it (the checks handle float32 inputs):
    the API now takes what the engine takes, by name or torch dtype."""
    by_api = flamia_verify.check("bf16", dtype="fp32", device="cpu", only=["interface.output"])
    by_engine = run_checks("bf16", dtype=torch.float32, device="cpu", only=["interface.output"])
    by_name = run_checks("bf16", dtype="float32", device="cpu", only=["interface.output"])
    assert by_api.environment["dtype"] == by_engine.environment["dtype"] == by_name.environment["dtype"] == "fp32"
    assert by_api.check("interface.output").status == "pass"
    result = fuzz("bf16", examples=1, device="cpu", dtype="fp32")
    assert result.report.environment["dtype"] == "fp32"


def test_command_line_and_config_offer_the_documented_dtypes(capsys, load_config_text):
    assert tuple(_option("check", "--dtype").choices) == settings.CLI_DTYPES == ("bf16", "fp16")
    assert tuple(_option("fuzz", "--dtype").choices) == settings.CLI_DTYPES
    with pytest.raises(ConfigError, match="dtype = 'fp32' is not one of bf16, fp16"):
        load_config_text('dtype = "fp32"\n')
    with pytest.raises(SystemExit) as exc:
        main(["check", "--dtype", "fp32"])
    assert exc.value.code == 2
    capsys.readouterr()


# ---------------------------------------------------------------------------------------------
# thresholds: one set of rules
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "suite_overrides, message",
    [
        ({"seeds": 0}, "suite setting 'seeds' must be a positive integer, got 0"),
        ({"seeds": True}, "suite setting 'seeds' must be a positive integer, got True"),
        ({"sedes": 2}, "unknown suite setting 'sedes'"),
    ],
)
def test_suite_settings_and_threshold_overrides_follow_one_rule(suite_overrides, message, load_config_text):
    for validate in (
        lambda: settings.suite_settings("quick", suite_overrides),
        lambda: validate_overrides({"suite": suite_overrides}),
        lambda: run_checks("bf16", only=["interface.output"], thresholds={"suite": suite_overrides}),
    ):
        with pytest.raises(ConfigError, match=message):
            validate()
    with pytest.raises(ConfigError, match=rf"flamia.toml: {message}"):
        load_config_text(
            "[thresholds.suite]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in suite_overrides.items())
        )


def test_validate_overrides_is_validate_thresholds_over_the_registered_checks():
    specs = {s.name: s for s in all_specs()}
    thresholds = {n: s.default_thresholds(RECIPES["bf16"], torch.bfloat16) for n, s in specs.items()}
    options = {n: dict(s.options) for n, s in specs.items()}
    good = {"error.out": {"normalized_error": 3}, "determinism.repeat": {"warn_only": True}, "suite": {"seeds": 1}}
    assert validate_overrides(good) == settings.validate_thresholds(good, thresholds, options)
    assert validate_overrides(good)["error.out"]["normalized_error"] == 3.0
    for bad, message in [
        ({"error.out": {"normalized_error": float("nan")}}, "must be a non-negative number"),
        ({"determinism.repeat": {"warn_only": 1}}, "must be true or false"),
        ({"nope.check": {}}, "unknown check 'nope.check'"),
    ]:
        for validate in (
            lambda: validate_overrides(bad),  # noqa: B023 (called at once, inside the loop)
            lambda: settings.validate_thresholds(bad, thresholds, options),  # noqa: B023 (called at once, inside the loop)
        ):
            with pytest.raises(ConfigError, match=message):
                validate()


# ---------------------------------------------------------------------------------------------
# fuzz reads the config as check does
# ---------------------------------------------------------------------------------------------


def test_fuzz_reads_the_config_and_its_flags_win(tmp_path, capsys):
    out = tmp_path / "from-config"
    config = tmp_path / "flamia.toml"
    config.write_text(
        f'[tool.flamia-verify]\nkernel = "bf16"\ndevice = "cpu"\ndtype = "fp16"\nseed = 3\n'
        f'out = "{out}"\nsuite = "standard"\n[tool.flamia-verify.thresholds."error.out"]\n'
        "normalized_error = 1.5\n"
    )
    assert main(["fuzz", "--config", str(config), "--examples", "1"]) == 0
    report = json.loads((out / "report.json").read_text())
    assert (report["kernel"], report["seed"], report["environment"]["dtype"], report["environment"]["device"]) == (
        "bf16",
        3,
        "fp16",
        "cpu",
    )
    flags = tmp_path / "from-flags"
    assert (
        main(
            ["fuzz", "--config", str(config), "--examples", "1", "--seed", "5", "--dtype", "bf16", "--out", str(flags)]
        )
        == 0
    )
    report = json.loads((flags / "report.json").read_text())
    assert (report["seed"], report["environment"]["dtype"]) == (5, "bf16")
    capsys.readouterr()


def test_fuzz_reads_pyproject_and_rejects_a_bad_config(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "pyproject.toml").write_text('[tool.flamia-verify]\ndtype = "fp64"\n')
    assert main(["fuzz", "--kernel", "bf16", "--examples", "1"]) == 2
    assert "dtype = 'fp64' is not one of bf16, fp16" in capsys.readouterr().err
    (tmp_path / "pyproject.toml").write_text('[tool.flamia-verify]\nforward_only = true\ndevice = "cpu"\n')
    assert main(["fuzz", "--kernel", "bf16", "--examples", "1"]) == 0
    report = json.loads((tmp_path / "flamia-report" / "report.json").read_text())
    backward = next(c for c in report["checks"] if c["name"] == "interface.backward")
    assert backward["status"] == "skip" and "gradients were not checked" in backward["message"]
    capsys.readouterr()


def test_fuzz_without_a_kernel_is_a_usage_error(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["fuzz", "--examples", "1"]) == 2
    assert "fuzz needs a kernel: --kernel SPEC" in capsys.readouterr().err
