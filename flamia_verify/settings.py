"""Settings every layer reads: the suites (names, cases, seeds and sizes), the device and dtype a run
may ask for, and the rules a threshold override must follow.

Suites: how many cases, seeds and sizes each check runs.

    quick     small sizes (at most 256 tokens per call but one document of long_len = 512 keys), two
              seeds per packing, every block-boundary residue of the causal documents: sized for
              an emulated kernel on a CPU (its run times: benchmarks/RESULTS.md)
    standard  more packings (many tiny documents, one long one, lengths around 32/64/128, GQA 4:1,
              headdim 128), two seeds per packing, longer causal documents, a bounded fuzz pass:
              sized for a fused kernel on a GPU
    full      everything, larger: four seeds, documents up to 2048 tokens, four heads

Packings are written ``(lens_q, lens_k, heads, heads_k, headdim, causal, distribution, softmax_scale,
do_log2)``; in every suite one base packing passes a softmax_scale other than the default headdim^-0.5,
one scales the upstream gradient dO by 2^-20, and one draws the values of a trained model (``realistic``:
rotary q and k, massive-activation tokens, heavy-tailed dO; properties/cases.py).

Devices (``--device``, ``device =``, ``device=``): ``auto`` (CUDA when a GPU is present, else the CPU),
``cpu``, ``cuda`` or ``cuda:N`` (GPU number N); :func:`resolve_device` turns one into the device a
run uses. Dtypes of q, k, v and dO: ``bf16`` and ``fp16`` on the command line and in the config
(:data:`CLI_DTYPES`); the Python API also takes ``fp32`` (the checks handle float32 inputs), the
long names ``bfloat16``, ``float16``, ``float32`` and the torch dtypes; :func:`resolve_dtype`.

Threshold overrides have the shape ``{check_name: {key: value}}`` plus an optional ``"suite"`` entry
of suite settings (:data:`SETTING_KEYS`); :func:`validate_thresholds` holds their rules, given the
keys and options the registered checks know (``flamia_verify.properties.thresholds.validate_overrides``
supplies those), and which threshold keys are a check's contract (fixed: an override is refused).
"""

from __future__ import annotations

import contextlib
import math
import re
import tomllib
from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from flamia_verify.errors import ConfigError

__all__ = [
    "DEFAULT_THREADS",
    "torch_threads",
    "check_threads",
    "read_toml",
    "SUITES",
    "SuiteSettings",
    "suite_settings",
    "Packing",
    "SETTING_KEYS",
    "DEVICES",
    "DTYPES",
    "CLI_DTYPES",
    "check_device",
    "resolve_device",
    "resolve_dtype",
    "dtype_name",
    "compare_factor",
    "train_parity_limit",
    "validate_suite_overrides",
    "validate_thresholds",
    "threshold_value",
]

#: the suites of `flamia-verify check`, in increasing size
SUITES = ("quick", "standard", "full")

#: the device names a run accepts (``cuda:N`` stands for ``cuda:0``, ``cuda:1``, ...)
DEVICES = ("auto", "cpu", "cuda", "cuda:N")
_DEVICE = re.compile(r"auto|cpu|cuda(:[0-9]+)?")

#: the input dtypes a run accepts, by name (the names a case and a fuzz reproducer record)
DTYPES: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
_DTYPE_ALIASES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}
#: the dtypes the command line (``--dtype``) and the config (``dtype =``) offer
CLI_DTYPES = ("bf16", "fp16")


def read_toml(path: Path, what: str = "config file") -> dict[str, Any]:
    """The TOML document at ``path``; a missing, unreadable or invalid file is a ConfigError naming it
    as ``what`` ("config file", "sweep file")."""
    try:
        with open(path, "rb") as fh:
            return tomllib.load(fh)
    except FileNotFoundError:
        raise ConfigError(f"{what} {str(path)!r} does not exist") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read {what} {str(path)!r}: {exc}") from None


def check_device(text: Any) -> str:
    """``text`` names a device of :data:`DEVICES` (``auto``, ``cpu``, ``cuda``, ``cuda:N``); returned as a
    string, without looking at which devices are present. Anything else is a :class:`ConfigError`."""
    name = str(text) if isinstance(text, torch.device) else text
    if not isinstance(name, str) or not _DEVICE.fullmatch(name):
        raise ConfigError(f"unknown device {name!r}; use one of: {', '.join(DEVICES)}")
    return name


def resolve_device(text: Any) -> str:
    """The device a run uses for ``text`` (see :func:`check_device`): ``auto`` picks ``cuda`` when a GPU
    is present, else ``cpu``; asking for CUDA, or for a GPU number, that is not there is a ConfigError."""
    name = check_device(text)
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cpu":
        return name
    if not torch.cuda.is_available():
        raise ConfigError(f"device {name!r} was asked for but no CUDA device is available; use cpu or auto")
    index = name.partition(":")[2]
    if index and int(index) >= torch.cuda.device_count():
        count = torch.cuda.device_count()
        raise ConfigError(
            f"device {name!r} was asked for but this machine has {count} CUDA device"
            f"{'s' if count != 1 else ''} (cuda:0 to cuda:{count - 1})"
        )
    return name


#: torch's intra-op CPU threads of a check or fuzz run unless --threads says otherwise: one (measured on
#: a 2-core machine: the quick suite's cases are small, so more threads gain little when the machine
#: is idle and lose several times over when other jobs share it; benchmarks/RESULTS.md)
DEFAULT_THREADS = 1


def check_threads(threads: int | None) -> int | None:
    """``threads`` when it is a positive integer or None (torch's own setting); else a ConfigError."""
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
        raise ConfigError(f"threads must be a positive integer, got {threads!r}")
    return threads


@contextlib.contextmanager
def torch_threads(threads: int | None) -> Iterator[None]:
    """torch's intra-op CPU threads set to ``threads`` inside the block, restored after it (None: left
    as they are)."""
    check_threads(threads)
    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def resolve_dtype(value: Any) -> torch.dtype:
    """The torch dtype of q, k, v and dO for ``value``: a name of :data:`DTYPES` (``bf16``, ``fp16``,
    ``fp32``), a long name (``bfloat16``, ``float16``, ``float32``) or one of those torch dtypes."""
    if isinstance(value, torch.dtype):
        if value in DTYPES.values():
            return value
    elif isinstance(value, str):
        name = _DTYPE_ALIASES.get(value, value)
        if name in DTYPES:
            return DTYPES[name]
    raise ConfigError(f"unknown dtype {value!r}; use one of: {', '.join(DTYPES)} (or {', '.join(_DTYPE_ALIASES)})")


def dtype_name(dtype: torch.dtype) -> str:
    """The short name (``bf16``, ``fp16``, ``fp32``) of a dtype :func:`resolve_dtype` accepts."""
    resolved = resolve_dtype(dtype)
    return next(name for name, d in DTYPES.items() if d == resolved)


def compare_factor(value: Any, where: str = "compare factor") -> float:
    """The factor `compare` gates on (a metric regresses when it gets worse by more than it): a finite
    number greater than 1, from the CLI, the config file or the API alike."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (1 < value < math.inf):
        raise ConfigError(f"{where} must be a finite number greater than 1, got {value!r}")
    return float(value)


#: the least value of each counted train-parity setting (two seeds give the smallest interval)
_TRAIN_PARITY_LEAST = {"steps": 1, "tokens": 1, "seeds": 2}


def train_parity_limit(key: str, value: Any, where: str) -> None:
    """The rule of a train-parity setting (``steps``, ``tokens``, ``seeds``: counts with a least
    value; ``tolerance``: a finite number of nats >= 0; ``level``: a confidence level in (0, 1)), for
    the CLI's flags and the config's ``[tool.flamia-verify.train_parity]`` alike; other keys have no
    rule here."""
    if key in _TRAIN_PARITY_LEAST and value < _TRAIN_PARITY_LEAST[key]:
        raise ConfigError(f"{where} must be >= {_TRAIN_PARITY_LEAST[key]}, got {value!r}")
    if key == "tolerance" and not (0 <= value < math.inf):
        raise ConfigError(f"{where} must be a finite number of nats >= 0, got {value!r}")
    if key == "level" and not (0 < value < 1):
        raise ConfigError(f"{where} must be a confidence level between 0 and 1 (e.g. 0.95), got {value!r}")


@dataclass(frozen=True)
class Packing:
    lens_q: tuple[int, ...]
    lens_k: tuple[int, ...] | None = None
    heads: int = 2
    heads_k: int | None = None
    headdim: int = 64
    causal: bool = True
    distribution: str = "gaussian"
    softmax_scale: float | None = None  # None: headdim^-0.5, the default of the convention
    do_log2: int = 0  # the upstream gradient dO x 2^do_log2 (kept inside the dtype's range)


#: the upstream gradient of a base packing, as small as in training (loss / tokens, loss scaling): a
#: power of two, so the reference gradients scale exactly; a gradient operand cast to FP8 without a
#: scale flushes to 0 there
SMALL_DO_LOG2 = -20

#: a non-default softmax_scale for a base packing (1/sqrt(128) at headdim 64, 0.71x the default, not a
#: power of two): a kernel that ignores the argument, or scales by the default, fails error and bound
OFF_DEFAULT_SCALE = 0.0883


@dataclass(frozen=True)
class SuiteSettings:
    name: str
    seeds: int  # seeds per base packing
    base: tuple[Packing, ...]  # error, bound, bias, determinism and consistency.grad_forward_ratio
    causal_len: int  # length of the documents the causal checks perturb
    causal_positions: tuple[int, ...]  # positions t probed in every causal document (huge and tiny values)
    causal_neighbours: bool  # also Lq < Lk, Lq > Lk and a document packed off the block grid
    causal_headdims: tuple[int, ...]  # head_dims of the single causal document (a code path per head_dim)
    causal_block: int  # the sequence-block grid whose boundaries are probed
    causal_residues: tuple[int, ...]  # offsets from every block boundary probed: block ends and starts
    isolation_len: int
    isolation_layouts: tuple[tuple[int, int], ...]  # (tokens before, tokens after) the target document
    special_len: int
    repeats: int  # runs compared by determinism.repeat
    heads: int = 2
    headdim: int = 64
    special_cases: int = 99  # at most this many cases per special check (the first ones)
    #: keys of the long document that determinism, bound and bias add to their cases (longer than the
    #: 256 keys where a kernel's tile loop, split-K or atomics typically start to matter)
    long_len: int = 512
    #: draws of every MX rounding probe (bound.rounding; each draw is one 64-token call per probe)
    rounding_seeds: int = 1
    #: documents of isolation.layout's pack (0 to 96 queries each, plus empty ones and one long one);
    #: the pack is also repeated by determinism.repeat. Past 64 documents (quick) and 128 (standard):
    #: the batch sizes at which launch grids and per-batch metadata buffers are commonly cut
    layout_docs: int = 70
    #: queries and keys of the pack's long document (longer than every tile of the built-in kernels)
    layout_long: int = 640
    #: the longest of the pack's other documents (33 in quick: the block edges 31/32/33 and below)
    layout_max_len: int = 33


_QUICK = SuiteSettings(
    name="quick",
    seeds=2,
    base=(
        Packing((64, 130, 62), heads=2, heads_k=1, do_log2=SMALL_DO_LOG2),
        # GQA with 1 < heads_k < heads: only here do repeat and repeat_interleave of the kv heads differ
        Packing((50, 1, 77), (64, 3, 40), heads=4, heads_k=2, distribution="shifted"),
        Packing((33, 96), causal=False, distribution="heavy_tail", softmax_scale=OFF_DEFAULT_SCALE),
        # a trained model's inputs: rotary q and k, v channels of unequal RMS, massive-activation tokens
        # (the first and a delimiter-like key of each document), heavy-tailed dO (cases.py)
        Packing((96, 61), heads=2, heads_k=1, distribution="realistic"),
    ),
    causal_len=96,
    causal_positions=(0, 5, 31, 40, 63),
    causal_neighbours=True,
    causal_headdims=(64, 128),
    causal_block=32,
    causal_residues=(-2, -1, 0, 1),
    isolation_len=45,
    isolation_layouts=((13, 30), (32, 7), (1, 0)),
    special_len=96,
    repeats=2,
    long_len=512,
)

_STANDARD = SuiteSettings(
    name="standard",
    seeds=2,
    base=(
        Packing((64, 130, 62), heads=2, heads_k=1, do_log2=SMALL_DO_LOG2),
        Packing((50, 1, 77), (64, 3, 40), distribution="shifted"),
        Packing((33, 96), causal=False, distribution="heavy_tail", softmax_scale=OFF_DEFAULT_SCALE),
        Packing((1, 2, 3, 5, 8, 13, 1, 1, 21, 0, 34), heads=4, heads_k=1),
        Packing((31, 32, 33, 63, 64, 65, 127, 128, 129), distribution="outliers"),
        Packing((512,), heads=2, headdim=128, distribution="peaked"),
        Packing((100, 20), (60, 150), heads=4, heads_k=2, causal=True, distribution="low_rank"),
        Packing((96, 61), heads=2, heads_k=1, distribution="realistic"),
    ),
    causal_len=160,
    causal_positions=(0, 1, 5, 31, 32, 40, 63, 64, 100, 127, 128),
    causal_neighbours=True,
    causal_headdims=(64, 128),
    causal_block=32,
    causal_residues=(-2, -1, 0, 1),
    isolation_len=77,
    isolation_layouts=((13, 30), (32, 7), (1, 0), (0, 64), (100, 100)),
    special_len=160,
    repeats=3,
    long_len=1024,
    rounding_seeds=2,
    layout_docs=136,
    layout_long=1700,
    layout_max_len=96,
)

_FULL = SuiteSettings(
    name="full",
    seeds=4,
    base=_STANDARD.base
    + (
        Packing((1024, 1000), heads=4, heads_k=2, headdim=128),
        Packing((2048,), heads=2, headdim=64, distribution="sink"),
        Packing(tuple([17] * 40), heads=4, heads_k=4, causal=False),
    ),
    causal_len=320,
    causal_positions=(0, 1, 5, 31, 32, 33, 40, 63, 64, 65, 100, 127, 128, 129, 200, 255, 256, 300),
    causal_neighbours=True,
    causal_headdims=(64, 128, 256),
    causal_block=32,
    causal_residues=(-2, -1, 0, 1),
    isolation_len=129,
    isolation_layouts=((13, 30), (32, 7), (1, 0), (0, 64), (100, 100), (255, 3), (7, 300)),
    special_len=320,
    repeats=4,
    heads=4,
    long_len=2048,
    rounding_seeds=4,
    layout_docs=272,
    layout_long=2048,
    layout_max_len=96,
)

_BY_NAME = {s.name: s for s in (_QUICK, _STANDARD, _FULL)}

#: suite settings a user may override (thresholds={"suite": {...}})
SETTING_KEYS = {
    "seeds": int,
    "repeats": int,
    "causal_len": int,
    "isolation_len": int,
    "special_len": int,
    "special_cases": int,
    "long_len": int,
    "rounding_seeds": int,
    "layout_docs": int,
    "layout_long": int,
    "layout_max_len": int,
}


def suite_settings(name: str, overrides: Mapping[str, Any] | None = None) -> SuiteSettings:
    if name not in _BY_NAME:
        raise ConfigError(f"unknown suite {name!r}; choose one of: {', '.join(SUITES)}")
    s = _BY_NAME[name]
    if overrides:
        s = replace(s, **validate_suite_overrides(overrides))  # type: ignore[arg-type]  # keys: the int fields
    return s


def _prefix(where: str | None) -> Callable[[str], str]:
    return (lambda part: f"{where}: {part}") if where else (lambda part: part)


def validate_suite_overrides(entries: Any, where: str | None = None) -> dict[str, int]:
    """Suite settings a user overrides (``thresholds={"suite": {...}}``): keys of :data:`SETTING_KEYS`,
    each a positive integer. ``where`` (a file and table) starts every message."""
    at = _prefix(where)
    if not isinstance(entries, Mapping):
        raise ConfigError(at("thresholds['suite'] must be a mapping of suite settings"))
    for key, value in entries.items():
        if key not in SETTING_KEYS:
            raise ConfigError(at(f"unknown suite setting {key!r}; known: {', '.join(sorted(SETTING_KEYS))}"))
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(at(f"suite setting {key!r} must be a positive integer, got {value!r}"))
    return dict(entries)


def threshold_value(where: str, key: str, value: Any, default: Any) -> float | bool:
    """One override of a check: an option (its default is a bool) takes true or false; a threshold
    takes a non-negative number (inf switches it off), returned as a float."""
    if isinstance(default, bool):
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: {key!r} must be true or false, got {value!r}")
        switch: bool = value
        return switch
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{where}: {key!r} must be a number, got {value!r}")
    number = float(value)
    if math.isnan(number) or number < 0:
        raise ConfigError(f"{where}: {key!r} must be a non-negative number (inf allowed), got {number!r}")
    return number


def validate_thresholds(
    overrides: Any,
    thresholds: Mapping[str, Mapping[str, Any]],
    options: Mapping[str, Mapping[str, Any]],
    where: str | None = None,
    fixed: Mapping[str, Collection[str]] | None = None,
) -> dict[str, Any]:
    """Check ``overrides`` (``{check_name: {key: value}}`` and ``"suite"``) against the known checks:
    ``thresholds`` and ``options`` map every check name to its threshold keys and its options, each
    with a default of the kind its value must have. Returns the overrides with numbers as floats.
    ``where`` (a file and table) starts every message; without it the messages name the mapping.

    ``fixed`` maps a check name to its threshold keys that are its contract, not a tolerance (a count
    of leaked elements, bound violations, bitwise mismatches: any finding fails the check whatever the
    number). The check never reads an override of one, so setting one is refused: the message names
    the key and lists the keys of that check that can be set. No key is accepted and then ignored."""
    at = _prefix(where)
    if not isinstance(overrides, Mapping):
        raise ConfigError(
            at(f"thresholds must be a mapping {{check_name: {{key: value}}}}, got {type(overrides).__name__}")
        )
    out: dict[str, Any] = {}
    for name, entries in overrides.items():
        if name == "suite":
            out[name] = validate_suite_overrides(entries, where)
            continue
        if name not in thresholds:
            raise ConfigError(at(f"unknown check {name!r} in thresholds; known checks: {', '.join(thresholds)}"))
        if not isinstance(entries, Mapping):
            raise ConfigError(at(f"thresholds[{name!r}] must be a mapping of threshold keys to values"))
        checked = {}
        here = at(f"thresholds[{name!r}]")
        contract = set((fixed or {}).get(name, ()))
        settable = sorted([k for k in thresholds[name] if k not in contract] + list(options[name]))
        for key, value in entries.items():
            if key in contract:
                adjustable = [k for k in thresholds[name] if k not in contract]
                switches = f"; its options: {', '.join(options[name])}" if options[name] else ""
                raise ConfigError(
                    f"{here}: {key!r} cannot be overridden: it is the contract of {name}, fixed at "
                    f"{thresholds[name][key]!r} (any finding fails the check); the thresholds of {name} "
                    f"are: {', '.join(adjustable) if adjustable else '(none)'}{switches}"
                )
            if key in thresholds[name]:
                checked[key] = threshold_value(here, key, value, thresholds[name][key])
            elif key in options[name]:
                checked[key] = threshold_value(here, key, value, options[name][key])
            else:
                fixed_note = f"; fixed (not settable): {', '.join(sorted(contract))}" if contract else ""
                raise ConfigError(
                    at(
                        f"unknown key {key!r} for check {name!r}; known keys: "
                        f"{', '.join(settable) if settable else '(none)'}{fixed_note}"
                    )
                )
        out[name] = checked
    return out
