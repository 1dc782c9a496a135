"""What one run of the checks is, resolved once where the run is asked for.

A command (``flamia-verify check``, ``fuzz``), the Python API (``flamia_verify.check``,
``run_checks``, ``fuzz``) and a sweep worker each take a kernel and a handful of options in the form
their users write them (``"auto"``, ``"bf16"``, a recipe's name, a list of families). They hand these
to :meth:`RunSpec.resolve` once: the kernel is loaded, the recipe chosen, the device and dtype
resolved, the checks selected, the threshold overrides validated and merged with the recipe's
defaults, and every bad value is a :class:`~flamia_verify.errors.ConfigError` naming it, before the
kernel is first called. Everything below the boundary (the engine, the run context, the fuzzer)
reads the frozen :class:`RunSpec` and resolves nothing again.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch

from flamia_verify.errors import ConfigError
from flamia_verify.kernels.loader import LoadedKernel, load_kernel
from flamia_verify.properties.cases import Case, captured_cases
from flamia_verify.properties.catalog import all_specs
from flamia_verify.properties.checks.common.captured import CAPTURED_CHECKS
from flamia_verify.properties.registry import CheckSpec
from flamia_verify.properties.thresholds import resolve_thresholds
from flamia_verify.recipes import RECIPES, Recipe, get_recipe
from flamia_verify.results import API_SOURCE, FAMILIES, OPTIONAL_VERDICTS
from flamia_verify.settings import SUITES, SuiteSettings, check_threads, resolve_device, resolve_dtype, suite_settings

__all__ = ["RunSpec", "list_checks", "resolve_kernel", "resolve_require", "select_checks"]


@dataclass(frozen=True)
class RunSpec:
    """One run of the checks, every option resolved (:meth:`resolve` builds it).

    kernel and recipe: the loaded kernel and the recipe that judges it. suite: quick, standard or
    full. device: ``cpu`` or ``cuda:N`` (never ``auto``); dtype: the torch dtype of the inputs.
    seed: the run seed. checks: the selected checks in running order. overrides: the user's threshold
    overrides as given (a private copy), from ``threshold_source``; thresholds, options and settings:
    the per-check thresholds and options and the suite's settings that the run uses, overrides merged.
    case_timeout_s: the limit of one kernel call (None: none). forward_only: declared, by the caller or
    by the kernel's ``forward_only`` attribute. require: the non-gating verdicts that gate as well.
    threads: torch's intra-op CPU threads during the run (None: torch's setting). inputs: a capture
    directory, and captured its recorded calls (empty without one).
    """

    kernel: LoadedKernel
    recipe: Recipe
    suite: str
    device: str
    dtype: torch.dtype
    seed: int
    checks: tuple[CheckSpec, ...]
    thresholds: Mapping[str, Mapping[str, Any]]
    options: Mapping[str, Mapping[str, Any]]
    settings: SuiteSettings
    overrides: Mapping[str, Any] | None = None
    threshold_source: str = API_SOURCE
    case_timeout_s: float | None = None
    forward_only: bool = False
    require: tuple[str, ...] = ()
    threads: int | None = None
    inputs: Path | None = None
    captured: tuple[Case, ...] = field(default=(), repr=False)

    @classmethod
    def resolve(
        cls,
        kernel,
        *,
        recipe: str | Recipe | None = None,
        suite: str = "quick",
        device: str = "cpu",
        dtype: torch.dtype | str = torch.bfloat16,
        seed: int = 0,
        only: Sequence[str] | None = None,
        thresholds: Mapping[str, Any] | None = None,
        threshold_source: str | None = None,
        case_timeout_s: float | None = None,
        forward_only: bool = False,
        require: Sequence[str] | str = (),
        threads: int | None = None,
        inputs: str | Path | None = None,
        captured: Sequence[Case] | None = None,
    ) -> RunSpec:
        """Resolve a run's options as a caller writes them (see :func:`flamia_verify.check`).

        ``kernel``: a spec string, a callable or a :class:`LoadedKernel`. ``captured``: the calls of
        ``inputs`` when the caller has read them already (a command validates a capture before it
        loads the kernel); else they are read here, before the kernel is loaded, so that a bad capture
        raises CaptureError without touching the kernel."""
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ConfigError(f"seed must be a non-negative integer, got {seed!r}")
        # inf is not "no limit" (None is): the timed wait overflows the platform's time_t
        if case_timeout_s is not None and not (
            isinstance(case_timeout_s, int | float) and 0 < case_timeout_s < float("inf")
        ):
            raise ConfigError(
                f"case_timeout_s must be a positive finite number of seconds (or None), got {case_timeout_s!r}"
            )
        threads = check_threads(threads)
        required = resolve_require(require)
        resolved_device, resolved_dtype = resolve_device(device), resolve_dtype(dtype)
        path = None if inputs is None else Path(inputs)
        if path is not None and captured is None:
            captured = captured_cases(path)  # a bad capture stops here, before the kernel is loaded
        loaded, chosen = resolve_kernel(kernel, recipe)
        pool = [s for s in all_specs() if s.name in CAPTURED_CHECKS] if path is not None else list_checks(suite)
        checks = select_checks(pool, only)
        own = copy.deepcopy(dict(thresholds)) if thresholds else None
        th, opts, suite_over = resolve_thresholds(chosen, resolved_dtype, own)
        return cls(
            kernel=loaded,
            recipe=chosen,
            suite=suite,
            device=resolved_device,
            dtype=resolved_dtype,
            seed=seed,
            checks=tuple(checks),
            thresholds=MappingProxyType(th),
            options=MappingProxyType(opts),
            settings=suite_settings(suite, suite_over),
            overrides=None if own is None else MappingProxyType(own),
            threshold_source=threshold_source or API_SOURCE,
            case_timeout_s=case_timeout_s,
            # a kernel may declare itself forward-only (``fn.forward_only = True``, as the sage adapter does)
            forward_only=bool(forward_only) or getattr(loaded.fn, "forward_only", False) is True,
            require=required,
            threads=threads,
            inputs=path,
            captured=tuple(captured or ()),
        )


def resolve_kernel(kernel, recipe: str | Recipe | None) -> tuple[LoadedKernel, Recipe]:
    """The kernel, and its recipe resolved once: ``recipe`` (a name or a Recipe), else the one the
    kernel declares. Everything below takes the :class:`Recipe`; the report writes its name."""
    loaded = load_kernel(kernel)
    chosen = recipe or loaded.recipe
    if chosen is None:
        raise ConfigError(f"kernel {loaded.name!r} declares no recipe; name one of: {', '.join(RECIPES)} (--recipe)")
    if recipe or isinstance(chosen, Recipe):
        return loaded, get_recipe(chosen)
    try:
        return loaded, get_recipe(chosen)
    except ConfigError as exc:  # the kernel's own attribute named it: say so, and how to override it
        raise ConfigError(
            f"kernel {loaded.name!r} declares recipe {chosen!r} (its `recipe` attribute), which is not a recipe: "
            f"{exc}; fix the attribute or give --recipe"
        ) from None


def resolve_require(require) -> tuple[str, ...]:
    """The required verdicts, validated: each one of ``results.OPTIONAL_VERDICTS`` (``gating`` always
    gates and may be named too); a ConfigError names a bad one and the choices."""
    if isinstance(require, str):
        require = [require]
    out: list[str] = []
    for name in require or ():
        if name == "gating":
            continue
        if name not in OPTIONAL_VERDICTS:
            raise ConfigError(
                f"require: unknown verdict {name!r}; choose from {', '.join(OPTIONAL_VERDICTS)} (gating always gates)"
            )
        if name not in out:
            out.append(name)
    return tuple(out)


def list_checks(suite: str = "quick") -> list[CheckSpec]:
    """The checks the suite runs, in running order."""
    if suite not in SUITES:
        raise ConfigError(f"unknown suite {suite!r}; choose one of: {', '.join(SUITES)}")
    return [s for s in all_specs() if suite in s.suites]


def select_checks(specs: list[CheckSpec], only: Sequence[str] | None) -> list[CheckSpec]:
    """Those of ``specs`` that ``only`` names (families or full check names), in running order."""
    if not only:
        return specs
    every = {s.name for s in all_specs()}
    chosen: list[CheckSpec] = []
    for item in only:
        if item in FAMILIES:
            chosen.extend(s for s in specs if s.family == item)
        elif item in every:
            chosen.extend(s for s in specs if s.name == item)
            if not any(s.name == item for s in specs):
                raise ConfigError(f"check {item!r} is not part of this suite; see `flamia-verify list`")
        else:
            raise ConfigError(
                f"unknown check or family {item!r}; families: {', '.join(FAMILIES)}; checks: {', '.join(sorted(every))}"
            )
    seen, out = set(), []
    for s in chosen:
        if s.name not in seen:
            seen.add(s.name)
            out.append(s)
    order = {s.name: i for i, s in enumerate(specs)}
    return sorted(out, key=lambda s: order[s.name])
