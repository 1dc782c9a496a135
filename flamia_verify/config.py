"""Configuration: ``[tool.flamia-verify]`` in pyproject.toml or a TOML file given with ``--config``.

    [tool.flamia-verify]
    kernel = "mypkg.attn:flash_varlen"   # kernel spec (command-line --kernel wins)
    recipe = "mxfp8"
    suite = "standard"                   # quick | standard | full
    device = "auto"                      # auto | cpu | cuda | cuda:N
    dtype = "bf16"                       # bf16 | fp16
    seed = 0
    out = "flamia-report"
    only = ["causal", "isolation"]       # families or check names
    case_timeout_s = 300                 # a kernel call running longer is stopped and reported as an error
    forward_only = true                  # the kernel has no backward: gradient checks skip (say so deliberately)
    require = ["reproducibility"]        # gate on these verdicts too (reproducibility, robustness); always reported
    compare_factor = 1.5                 # `compare`: a metric must get worse by more than this factor (> 1)

    [tool.flamia-verify.thresholds."error.out"]
    normalized_error = 1.5               # a threshold: a number (inf switches it off)

    [tool.flamia-verify.thresholds."determinism.repeat"]
    warn_only = true                     # an option of a check: true or false

    [tool.flamia-verify.thresholds.suite]
    seeds = 3                            # a suite setting (flamia_verify.settings)

A file given with ``--config`` may hold the same keys either under ``[tool.flamia-verify]`` or at its
top level. An unknown key or a value of the wrong type is a configuration error (exit 2) that names it
and the file; threshold tables are checked against the registered checks when the file is read
(`flamia_verify.properties.thresholds.validate_overrides`, by the rules of
`flamia_verify.settings.validate_thresholds`). A threshold key that is a check's contract rather than a
tolerance (``causal.forward`` ``leaked_elements``: any leak fails) cannot be set: the file is refused
naming the key and the check's adjustable thresholds, so no accepted key is ignored. Every accepted
override is recorded in the reports with its default and this file as its source. `flamia-verify
list` shows every check; docs/checks.md its threshold keys ("Which threshold keys a config may set")
and options.

`check` reads every key but train_parity and compare_factor; `fuzz` reads kernel, recipe, device,
dtype, seed, out and forward_only (its examples are judged against the rigorous bound and bitwise, so
suite, only, thresholds and case_timeout_s do not apply to it); `compare` reads compare_factor;
`train-parity` its own table. A command-line flag wins over the file.

This module is the reader: TOML to a :class:`Config`, each key's type and value checked by the rules
of :mod:`flamia_verify.settings`. It sits on the bottom floor of the package and knows neither the
registered checks nor the training presets: the two checks that need them (the threshold tables, the
train_parity preset) are passed in by the caller (``check_thresholds``, ``check_preset``);
:func:`flamia_verify.commands.common.load_config` is the command line's reader, which passes both.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flamia_verify.errors import ConfigError
from flamia_verify.results import OPTIONAL_VERDICTS
from flamia_verify.settings import (
    CLI_DTYPES,
    DEVICES,
    SUITES,
    check_device,
    compare_factor,
    read_toml,
    train_parity_limit,
)

__all__ = ["Config", "TRAIN_PARITY_TYPES", "ThresholdCheck", "PresetCheck", "read_config"]

#: validates a [thresholds] table (``table``, ``where`` the file and table for messages) and returns it
#: as the run takes it; raises ConfigError naming the problem
ThresholdCheck = Callable[[dict[str, Any], str], dict[str, Any]]
#: validates the train_parity preset name (``value``, ``where``); raises ConfigError when unknown
PresetCheck = Callable[[str, str], None]

_TYPES: dict[str, tuple[type, ...]] = {
    "kernel": (str,),
    "recipe": (str,),
    "suite": (str,),
    "device": (str,),
    "dtype": (str,),
    "seed": (int,),
    "out": (str,),
    "only": (list,),
    "case_timeout_s": (int, float),
    "compare_factor": (int, float),
    "forward_only": (bool,),
    "require": (list,),
    "thresholds": (dict,),
    "train_parity": (dict,),
}
#: keys of the [tool.flamia-verify.train_parity] table (train-parity's defaults; flags override them)
TRAIN_PARITY_TYPES: dict[str, tuple[type, ...]] = {
    "preset": (str,),
    "steps": (int,),
    "tokens": (int,),
    "seeds": (int,),
    "seed": (int,),
    "tolerance": (int, float),
    "level": (float,),
    "floors": (bool,),
    "ladder": (bool,),
    "kernels": (list,),
}
#: keys of earlier versions of the table, and what replaced them
_TRAIN_PARITY_RENAMED = {
    "bf16_seeds": "seeds (every kernel and BF16 now train at each seed: the gap is a paired difference)",
    "max_gap": "tolerance (in nats; the gate is the confidence interval of the paired gap, not BF16's spread)",
}
_CHOICES = {"suite": SUITES, "dtype": CLI_DTYPES}


@dataclass
class Config:
    kernel: str | None = None
    recipe: str | None = None
    suite: str = "quick"
    device: str = "auto"
    dtype: str = "bf16"
    seed: int = 0
    out: str = "flamia-report"
    only: list[str] | None = None
    # a kernel call (forward or backward of one case) running longer is stopped and reported as an error;
    # generous because a fused kernel's first call on a fresh machine includes its compilation
    case_timeout_s: float | None = 600.0
    compare_factor: float = 1.5
    # declared forward-only: without it a kernel whose backward is missing or raises fails the run
    forward_only: bool = False
    # the non-gating verdicts (reproducibility, robustness) that gate as well; always reported
    require: list[str] = field(default_factory=list)
    thresholds: dict[str, dict[str, Any]] = field(default_factory=dict)
    train_parity: dict[str, Any] = field(default_factory=dict)
    source: str | None = None  # the file the values came from, for messages


def _check_type(key: str, value: Any, types: tuple[type, ...], where: str) -> None:
    """``value`` is one of ``types``; a TOML boolean counts only where bool is named (not as an int)."""
    if isinstance(value, bool) != (bool in types) or not isinstance(value, types):
        want = " or ".join(t.__name__ for t in types)
        raise ConfigError(f"{where}: {key} must be {want}, got {value!r}")


def _validate(
    table: dict[str, Any], where: str, check_thresholds: ThresholdCheck | None, check_preset: PresetCheck | None
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in table.items():
        if key not in _TYPES:
            raise ConfigError(f"{where}: unknown key {key!r}; known keys: {', '.join(sorted(_TYPES))}")
        _check_type(key, value, _TYPES[key], where)
        if key in _CHOICES and value not in _CHOICES[key]:
            raise ConfigError(f"{where}: {key} = {value!r} is not one of {', '.join(_CHOICES[key])}")
        if key == "device":
            try:
                check_device(value)
            except ConfigError:
                raise ConfigError(f"{where}: device = {value!r} is not one of {', '.join(DEVICES)}") from None
        if key == "only" and not all(isinstance(v, str) for v in value):
            raise ConfigError(f"{where}: only must be a list of family or check names, got {value!r}")
        if key == "require" and not all(isinstance(v, str) and v in ("gating", *OPTIONAL_VERDICTS) for v in value):
            raise ConfigError(
                f"{where}: require must be a list of verdicts from {', '.join(OPTIONAL_VERDICTS)}, got {value!r}"
            )
        if key == "case_timeout_s" and not (0 < value < math.inf):
            raise ConfigError(f"{where}: {key} must be a positive finite number, got {value!r}")
        if key == "compare_factor":
            compare_factor(value, f"{where}: {key}")
        if key == "thresholds" and check_thresholds is not None:
            value = check_thresholds(value, where)
        if key == "train_parity":
            value = _validate_train_parity(value, f"{where} train_parity", check_preset)
        out[key] = value
    return out


def _validate_train_parity(table: dict[str, Any], where: str, check_preset: PresetCheck | None) -> dict[str, Any]:
    for key, value in table.items():
        if key in _TRAIN_PARITY_RENAMED:
            raise ConfigError(f"{where}: {key!r} was replaced by {_TRAIN_PARITY_RENAMED[key]}")
        if key not in TRAIN_PARITY_TYPES:
            raise ConfigError(f"{where}: unknown key {key!r}; known keys: {', '.join(sorted(TRAIN_PARITY_TYPES))}")
        _check_type(key, value, TRAIN_PARITY_TYPES[key], where)
        if key == "preset" and check_preset is not None:
            check_preset(value, where)
        train_parity_limit(key, value, f"{where}: {key}")
        if key == "kernels" and not all(isinstance(v, str) for v in value):
            raise ConfigError(f"{where}: kernels must be a list of kernel specs, got {value!r}")
    return dict(table)


def read_config(
    path: str | Path | None = None,
    *,
    search_dir: str | Path = ".",
    check_thresholds: ThresholdCheck | None = None,
    check_preset: PresetCheck | None = None,
) -> Config:
    """Read ``path`` (``--config``) or, without one, ``pyproject.toml`` in ``search_dir`` if it has our table.

    ``check_thresholds`` and ``check_preset`` validate what this floor cannot (the threshold tables
    against the registered checks, the train_parity preset against the presets); each is called, where
    given, when the reader meets its key, so that the first problem in the file's order is the one
    reported. Without them those two are only type-checked."""
    if path is not None:
        path = Path(path)
        data = read_toml(path)
        table = data.get("tool", {}).get("flamia-verify") if isinstance(data.get("tool"), dict) else None
        if table is None:
            table = data
        where = str(path)
    else:
        candidate = Path(search_dir) / "pyproject.toml"
        if not candidate.is_file():
            return Config()
        data = read_toml(candidate)
        table = data.get("tool", {}).get("flamia-verify")
        if table is None:
            return Config()
        where = f"{candidate} [tool.flamia-verify]"
        path = candidate
    if not isinstance(table, dict):
        raise ConfigError(f"{where}: expected a table of settings")
    values = _validate(table, where, check_thresholds, check_preset)
    return Config(source=str(path), **values)
