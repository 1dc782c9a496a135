"""A sweep's matrix: the TOML file, the cases it expands to, their keys and shards.

    [sweep]
    kernels = ["flamia-mxfp8", "bf16", {spec = "my_attn.py:attn", recipe = "mxfp8"}]
    suites = ["standard"]                     # default ["quick"]
    only = [["causal", "isolation"], []]      # each item one --only list; [] runs every family
    dtypes = ["bf16", "fp16"]                 # default ["bf16"]
    seeds = [0, 1, 2]                         # default [0]
    settings = [{}, {causal_len = 1024}]      # suite settings (sizes and shapes), one case each
    device = "auto"                           # auto | cpu | cuda: the kind of device each case runs on
    timeout_s = 1800                          # a case running longer is stopped and marked error
    forward_only = false
    speed = {seqlen = 8192, tokens = 32768}   # also time each kernel (CUDA; flamia_verify.bench.SpeedShape)

    [sweep.thresholds."error.out"]            # threshold overrides every case shares
    normalized_error = 1.5

The matrix is the product kernels x suites x only x dtypes x settings x seeds, in that order. Every
case is a plain JSON object (:class:`SweepCase`), and its result is a pure function of it and of the
code that runs it: :func:`case_key` hashes the case, the kernel's identity (the bytes of a kernel
file or module, or a package's version) and the checks' own source, so a rerun of an unchanged case
is read from the store and a change to the kernel or to flamia-verify runs it again.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import itertools
import json
from dataclasses import asdict, dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

from flamia_verify.errors import ConfigError
from flamia_verify.kernels.adapters import ADAPTERS
from flamia_verify.settings import CLI_DTYPES, SUITES, check_device, read_toml

__all__ = ["SweepCase", "Sweep", "load_sweep", "speed_shape", "case_key", "shard_of", "parse_shard", "kernel_identity"]

_SWEEP_KEYS: dict[str, tuple[type, ...]] = {
    "kernels": (list,),
    "suites": (list,),
    "only": (list,),
    "dtypes": (list,),
    "seeds": (list,),
    "settings": (list,),
    "device": (str,),
    "timeout_s": (int, float),
    "forward_only": (bool,),
    "thresholds": (dict,),
    "speed": (dict,),
}


@dataclass(frozen=True)
class SweepCase:
    """One `check` run: everything its result depends on but the code."""

    kernel: str
    recipe: str | None = None
    suite: str = "quick"
    only: tuple[str, ...] = ()
    dtype: str = "bf16"
    seed: int = 0
    settings: dict[str, Any] = field(default_factory=dict)
    thresholds: dict[str, Any] = field(default_factory=dict)
    device: str = "auto"
    forward_only: bool = False
    #: measure the kernel's speed after its checks, at this shape (the fields of
    #: :class:`flamia_verify.bench.SpeedShape`); None: no speed measurement
    speed: dict[str, Any] | None = None
    #: time the kernel only (no checks; ``speed`` is required): the survey's speed phase, run one
    #: worker per GPU so that nothing else shares the GPU while it is timed
    speed_only: bool = False

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["only"] = list(self.only)
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SweepCase:
        known = set(cls.__dataclass_fields__)
        extra = set(data) - known
        if extra:
            raise ConfigError(f"a sweep case has unknown field(s): {', '.join(sorted(extra))}")
        values = dict(data)
        values["only"] = tuple(values.get("only") or ())
        return cls(**values)

    def label(self) -> str:
        """A short human name (the one the sweep's reports print): kernel [recipe] suite dtype seed [only] [settings]."""
        from flamia_verify.reports.survey import case_label

        return case_label(self.to_dict())

    def check_kwargs(self) -> dict[str, Any]:
        """The keyword arguments of :func:`flamia_verify.api.check` (and of
        :meth:`~flamia_verify.properties.run_spec.RunSpec.resolve`) for this case."""
        thresholds = {k: dict(v) if isinstance(v, dict) else v for k, v in self.thresholds.items()}
        if self.settings:
            thresholds["suite"] = {**thresholds.get("suite", {}), **self.settings}
        return {
            "recipe": self.recipe,
            "suite": self.suite,
            "device": self.device,
            "dtype": self.dtype,
            "seed": self.seed,
            "only": list(self.only) or None,
            "thresholds": thresholds or None,
            "forward_only": self.forward_only,
        }


@dataclass(frozen=True)
class Sweep:
    cases: tuple[SweepCase, ...]
    timeout_s: float | None = None
    source: str = ""


def _as_list(table: dict, key: str, default: list, where: str) -> list:
    value = table.get(key, default)
    if not isinstance(value, list) or not value:
        raise ConfigError(f"{where}: sweep.{key} must be a non-empty list, got {value!r}")
    return value


def load_sweep(path: str | Path) -> Sweep:
    """Read a sweep file and expand its matrix; any unknown key or bad value is a ConfigError."""
    path = Path(path)
    where = str(path)
    data = read_toml(path, "sweep file")
    table = data.get("sweep")
    if not isinstance(table, dict):
        raise ConfigError(f"{where} has no [sweep] table")
    for key, value in table.items():
        if key not in _SWEEP_KEYS:
            raise ConfigError(f"{where}: unknown key sweep.{key}; known: {', '.join(_SWEEP_KEYS)}")
        if not isinstance(value, _SWEEP_KEYS[key]) or isinstance(value, bool) != (_SWEEP_KEYS[key] == (bool,)):
            raise ConfigError(f"{where}: sweep.{key} has the wrong type ({type(value).__name__})")
    kernels = []
    for item in _as_list(table, "kernels", [], where):
        if isinstance(item, str) and item:
            kernels.append((item, None))
        elif isinstance(item, dict) and isinstance(item.get("spec"), str) and item["spec"]:
            unknown = set(item) - {"spec", "recipe"}
            if unknown or not isinstance(item.get("recipe", ""), str):
                raise ConfigError(f"{where}: a kernel table takes spec and recipe (strings), got {item!r}")
            kernels.append((item["spec"], item.get("recipe")))
        else:
            raise ConfigError(f"{where}: each of sweep.kernels is a kernel spec or {{spec, recipe}}, got {item!r}")
    from flamia_verify.kernels.loader import unknown_kernel_name

    for spec, _ in kernels:  # a typo is the file's error, before anything runs
        problem = unknown_kernel_name(spec)
        if problem:
            raise ConfigError(f"{where}: sweep.kernels: {problem}")
    suites = _as_list(table, "suites", ["quick"], where)
    for suite in suites:
        if suite not in SUITES:
            raise ConfigError(f"{where}: unknown suite {suite!r}; choose from {', '.join(SUITES)}")
    onlys = _as_list(table, "only", [[]], where)
    for only in onlys:
        if not isinstance(only, list) or not all(isinstance(o, str) and o for o in only):
            raise ConfigError(f"{where}: each of sweep.only is a list of families or check names, got {only!r}")
    dtypes = _as_list(table, "dtypes", ["bf16"], where)
    for dtype in dtypes:
        if dtype not in CLI_DTYPES:
            raise ConfigError(f"{where}: unknown dtype {dtype!r}; choose from {', '.join(CLI_DTYPES)}")
    seeds = _as_list(table, "seeds", [0], where)
    if not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in seeds):
        raise ConfigError(f"{where}: sweep.seeds must be non-negative integers, got {seeds!r}")
    settings = _as_list(table, "settings", [{}], where)
    if not all(isinstance(s, dict) for s in settings):
        raise ConfigError(f"{where}: each of sweep.settings is a table of suite settings, got {settings!r}")
    device = check_device(table.get("device", "auto"))
    if device not in ("auto", "cpu", "cuda"):
        raise ConfigError(f"{where}: sweep.device is auto, cpu or cuda (each worker gets its own GPU), not {device!r}")
    thresholds = table.get("thresholds", {})
    _validate_thresholds(thresholds, settings, where)
    _validate_only(suites, onlys, where)
    speed = speed_shape(table["speed"], where) if "speed" in table else None
    timeout = table.get("timeout_s")
    if timeout is not None and not timeout > 0:
        raise ConfigError(f"{where}: sweep.timeout_s must be positive, got {timeout!r}")
    cases = tuple(
        SweepCase(
            kernel=spec,
            recipe=recipe,
            suite=suite,
            only=tuple(only),
            dtype=dtype,
            seed=seed,
            settings=dict(setting),
            thresholds=thresholds,
            device=device,
            forward_only=bool(table.get("forward_only", False)),
            speed=speed,
        )
        for (spec, recipe), suite, only, dtype, setting, seed in itertools.product(
            kernels, suites, onlys, dtypes, settings, seeds
        )
    )
    keys = [case_key(c) for c in cases]
    seen: dict[str, int] = {}
    for n, key in enumerate(keys):
        if key in seen:
            raise ConfigError(
                f"{where}: the matrix lists the same case twice: {cases[n].label()} (cases {seen[key] + 1} and "
                f"{n + 1} of {len(cases)}; a kernel, suite, only list, dtype, setting or seed given twice)"
            )
        seen[key] = n
    return Sweep(cases=cases, timeout_s=float(timeout) if timeout is not None else None, source=where)


def speed_shape(table: dict[str, Any], where: str) -> dict[str, Any]:
    """A speed table's fields, checked and completed with the defaults of
    :class:`flamia_verify.bench.SpeedShape` (a plain dict: it is part of the case)."""
    from dataclasses import fields

    from flamia_verify.bench import SpeedShape

    known = [f.name for f in fields(SpeedShape)]
    unknown = sorted(set(table) - set(known))
    if unknown:
        raise ConfigError(f"{where}: unknown speed field(s) {', '.join(unknown)}; known: {', '.join(known)}")
    try:
        return asdict(SpeedShape(**table))
    except ValueError as exc:
        raise ConfigError(f"{where}: {exc}") from None


def _validate_thresholds(thresholds: dict, settings: list[dict], where: str) -> None:
    """The overrides and every settings table, by the rules `check --config` applies."""
    from flamia_verify.properties.thresholds import validate_overrides

    for setting in settings:
        merged = {k: dict(v) if isinstance(v, dict) else v for k, v in thresholds.items()}
        if setting:
            merged["suite"] = {**merged.get("suite", {}), **setting}
        if merged:
            validate_overrides(merged, where)


def _validate_only(suites: list[str], onlys: list[list[str]], where: str) -> None:
    """Every --only list names checks or families of every suite it runs with."""
    from flamia_verify.properties.engine import list_checks, select_checks

    for suite in suites:
        for only in onlys:
            try:
                select_checks(list_checks(suite), only)
            except ConfigError as exc:
                raise ConfigError(f"{where}: sweep.only {only!r} with suite {suite!r}: {exc}") from None


def _digest(*parts: bytes) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    return h.hexdigest()


@cache
def tool_identity() -> str:
    """A digest of flamia-verify's own source and of the versions of torch and Triton: a change to a
    check, or a new torch (whose kernels the built-ins, the emulation and the adapters call), reruns
    every case."""
    root = Path(__file__).resolve().parents[1]
    files = sorted(p for p in root.rglob("*.py") if "__pycache__" not in p.parts)
    versions = []
    for dist in ("torch", "triton"):
        try:
            versions.append(f"{dist}={importlib.metadata.version(dist)}".encode())
        except importlib.metadata.PackageNotFoundError:
            versions.append(f"{dist}=none".encode())
    return _digest(*versions, *(str(p.relative_to(root)).encode() + b"\0" + p.read_bytes() for p in files))


def kernel_identity(spec: str) -> str:
    """What a kernel's result depends on besides the case: its source bytes where they can be found
    without running it (a file, a module's file), a distribution's version for an entry point, the
    versions of the libraries an adapter wraps, and the checks' own source for a built-in kernel
    (which lives in flamia-verify)."""
    head, sep, _ = spec.rpartition(":")
    if sep and (head.endswith(".py") or "/" in head):
        path = Path(head)
        try:
            return "file:" + _digest(path.read_bytes())
        except OSError:
            return "file-unreadable:" + head
    if sep and head:
        try:
            found = importlib.util.find_spec(head)
        except (ImportError, ValueError):
            found = None
        origin = getattr(found, "origin", None)
        if origin and Path(origin).is_file():
            top = head.split(".")[0]
            try:
                version = importlib.metadata.version(top)
            except importlib.metadata.PackageNotFoundError:
                version = ""
            return f"module:{version}:" + _digest(Path(origin).read_bytes())
        return "module-unfound:" + head
    for ep in importlib.metadata.entry_points(group="flamia_verify.kernels"):
        if ep.name == spec:
            dist = ep.dist
            return f"entry-point:{dist.name if dist else ''}:{dist.version if dist else ''}"
    if spec in ADAPTERS:  # the library it wraps: a new flash-attn or cuDNN reruns its cases
        versions = ADAPTERS[spec].library_versions()
        return f"adapter:{spec}:" + ",".join(f"{k}={v}" for k, v in sorted(versions.items()))
    return "builtin:" + spec


def case_key(case: SweepCase) -> str:
    """The store key of ``case``: its description, its kernel's identity and flamia-verify's source."""
    description = json.dumps(case.to_dict(), sort_keys=True, separators=(",", ":")).encode()
    return _digest(description, kernel_identity(case.kernel).encode(), tool_identity().encode())[:32]


def parse_shard(text: str) -> tuple[int, int]:
    """``i/n`` (1 <= i <= n) from ``--shard``."""
    index, sep, count = text.partition("/")
    try:
        i, n = int(index), int(count)
    except ValueError:
        i = n = 0
    if not sep or not (1 <= i <= n):
        raise ConfigError(f"--shard takes i/n with 1 <= i <= n (e.g. 2/4), got {text!r}")
    return i, n


def shard_of(key: str, count: int) -> int:
    """The shard (1..count) a case belongs to: from its key alone, so adding cases moves no others."""
    return int(key, 16) % count + 1
