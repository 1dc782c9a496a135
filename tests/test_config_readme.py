"""Every configuration the README documents loads and takes effect; switches (true/false options) work
from TOML; a bad threshold key names the file it came from."""

from __future__ import annotations

import json
import re
import sys
import tomllib
from pathlib import Path

import pytest

from flamia_verify.cli import main
from flamia_verify.commands.common import load_config
from flamia_verify.errors import ConfigError
from flamia_verify.properties import run_checks

sys.path.insert(0, str(Path(__file__).parent))
from zoo import correct as C
from zoo import kernels as Z

README = Path(__file__).resolve().parent.parent / "README.md"


def _readme_toml_blocks() -> list[str]:
    """The config examples (a sweep file, ``[sweep]``, is tested by tests/test_sweep.py)."""
    blocks = re.findall(r"```toml\n(.*?)```", README.read_text(), flags=re.S)
    return [b for b in blocks if "[sweep]" not in b]


def test_readme_has_a_config_example():
    assert _readme_toml_blocks(), "README.md shows no ```toml block"


@pytest.mark.parametrize("block", _readme_toml_blocks())
def test_readme_config_block_loads_and_every_key_takes_effect(block, tmp_path, capsys):
    (tmp_path / "pyproject.toml").write_text(block)
    table = tomllib.loads(block)["tool"]["flamia-verify"]
    cfg = load_config(search_dir=tmp_path)  # as pyproject.toml
    assert load_config(tmp_path / "pyproject.toml") == cfg  # and as --config FILE
    for key, value in table.items():
        assert getattr(cfg, key) == value, key
    # a check with it: the documented kernel is a placeholder, so the command line names a built-in
    out = tmp_path / "rep"
    checks = sorted(table.get("thresholds", {}))
    code = main(
        [
            "check",
            "--config",
            str(tmp_path / "pyproject.toml"),
            "--kernel",
            "bf16",
            "--suite",
            "quick",
            "--device",
            "cpu",
            "--out",
            str(out),
            "--only",
            *checks,
        ]
    )
    capsys.readouterr()
    assert code == 0
    report = json.loads((out / "report.json").read_text())
    by_name = {c["name"]: c for c in report["checks"]}
    assert report["recipe"] == table.get("recipe", report["recipe"])
    for check, entries in table.get("thresholds", {}).items():
        for key, value in entries.items():
            if key in by_name[check]["thresholds"]:  # a threshold: reported as the limit the check used
                assert by_name[check]["thresholds"][key] == value, (check, key)


def _toml(tmp_path, text: str, name="flamia.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_warn_only_from_toml_turns_a_nondeterminism_failure_into_a_warning(tmp_path):
    strict = run_checks(Z.nondeterministic, recipe="mxfp8", suite="quick", device="cpu", only=["determinism"])
    assert strict.check("determinism.repeat").status == "fail"
    cfg = load_config(_toml(tmp_path, '[thresholds."determinism.repeat"]\nwarn_only = true\n'))
    lenient = run_checks(
        Z.nondeterministic, recipe="mxfp8", suite="quick", device="cpu", only=["determinism"], thresholds=cfg.thresholds
    )
    result = lenient.check("determinism.repeat")
    assert result.status == "pass" and result.message.startswith("warning:")
    assert result.metrics["mismatched_elements"] > 0


def test_require_nan_keys_from_toml_fails_a_kernel_that_adds_the_mask(tmp_path):
    # torch's CPU SDPA adds the mask to the scores: NaN in a masked key reaches dQ (docs/checks.md "causal")
    default = run_checks(C.sdpa_bf16, recipe="bf16", suite="quick", device="cpu", only=["causal.nan"])
    assert default.check("causal.nan").status == "pass"
    assert default.check("causal.nan").metrics["nan_keys_leaked_elements"] > 0
    cfg = load_config(_toml(tmp_path, '[tool.flamia-verify.thresholds."causal.nan"]\nrequire_nan_keys = true\n'))
    strict = run_checks(
        C.sdpa_bf16, recipe="bf16", suite="quick", device="cpu", only=["causal.nan"], thresholds=cfg.thresholds
    )
    assert strict.check("causal.nan").status == "fail"


def test_switches_load_from_pyproject(tmp_path):
    (tmp_path / "pyproject.toml").write_text(
        '[tool.flamia-verify.thresholds."causal.nan"]\nrequire_nan_keys = true\n'
        '[tool.flamia-verify.thresholds."determinism.repeat"]\nwarn_only = false\n'
    )
    cfg = load_config(search_dir=tmp_path)
    assert cfg.thresholds == {"causal.nan": {"require_nan_keys": True}, "determinism.repeat": {"warn_only": False}}


@pytest.mark.parametrize(
    "table, message",
    [
        (
            '[thresholds."error.out"]\nrel_rmse = 0.05',
            "unknown key 'rel_rmse' for check 'error.out'; known keys: normalized_error",
        ),
        ('[thresholds."error.outt"]\nnormalized_error = 1', "unknown check 'error.outt'"),
        ('[thresholds."error.out"]\nnormalized_error = true', "'normalized_error' must be a number"),
        ('[thresholds."error.out"]\nnormalized_error = -1', "'normalized_error' must be a non-negative number"),
        ('[thresholds."determinism.repeat"]\nwarn_only = 1', "'warn_only' must be true or false"),
        ("[thresholds.suite]\nseeds = 0", "suite setting 'seeds' must be a positive integer"),
        ("[thresholds.suite]\nsedes = 2", "unknown suite setting 'sedes'"),
        ('[thresholds]\n"error.out" = 2', "thresholds['error.out'] must be a mapping"),
        ("compare_factor = 1.0", "compare_factor must be a finite number greater than 1"),
    ],
)
def test_threshold_errors_name_the_file(tmp_path, capsys, table, message):
    path = _toml(tmp_path, table + "\n")
    with pytest.raises(ConfigError) as exc:
        load_config(path)
    assert str(exc.value).startswith(f"{path}:") and message in str(exc.value)
    code = main(["check", "--config", str(path), "--kernel", "bf16", "--out", str(tmp_path / "rep")])
    err = capsys.readouterr().err
    assert code == 2 and str(path) in err and message in err
    (tmp_path / "pyproject.toml").write_text(
        re.sub(r"^\[thresholds", "[tool.flamia-verify.thresholds", table, flags=re.M)
        if table.startswith("[")
        else "[tool.flamia-verify]\n" + table + "\n"
    )
    with pytest.raises(ConfigError, match=re.escape(str(tmp_path / "pyproject.toml"))):
        load_config(search_dir=tmp_path)
