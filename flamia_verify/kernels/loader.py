"""The kernel loader: built-in kernels, user kernels by module or file, entry-point kernels.

A kernel spec on the command line is one of:
  * a built-in name (``flamia-verify list`` shows them),
  * an adapter name (``sdpa-math``, ``flex``, ...: :mod:`flamia_verify.kernels.adapters`),
  * ``package.module:function``,
  * ``path/to/file.py:function``,
  * a name registered by a third-party package in the entry-point group ``flamia_verify.kernels``.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import sys
from collections.abc import Callable
from dataclasses import dataclass
from importlib.metadata import entry_points
from pathlib import Path

from flamia_verify.errors import KernelLoadError
from flamia_verify.kernels.metadata import kernel_recipe

__all__ = [
    "LoadedKernel",
    "load_kernel",
    "builtin_kernels",
    "entry_point_kernels",
    "unknown_kernel_name",
    "ENTRY_POINT_GROUP",
]

ENTRY_POINT_GROUP = "flamia_verify.kernels"


@dataclass(frozen=True)
class LoadedKernel:
    """A callable in the calling convention plus what is known about it."""

    name: str
    fn: Callable
    recipe: str | None  # the recipe the kernel claims; None when the user must say
    source: str  # "builtin", "adapter", "module", "file" or "entry-point"
    description: str = ""

    def __call__(self, *args, **kwargs):
        return self.fn(*args, **kwargs)


def builtin_kernels() -> dict[str, LoadedKernel]:
    from flamia_verify.kernels.delayed import DelayedScalingAttention  # stateful: a new instance per load
    from flamia_verify.kernels.designs import DESIGNS
    from flamia_verify.kernels.emulation import make_kernel
    from flamia_verify.kernels.triton import with_fused_dispatch  # fused Triton for CUDA inputs; imports no Triton

    kernels = {
        name: LoadedKernel(name, with_fused_dispatch(make_kernel(d)), d.recipe.name, "builtin", d.description)
        for name, d in DESIGNS.items()
    }
    delayed = DelayedScalingAttention()
    kernels["fp8-delayed"] = LoadedKernel(
        "fp8-delayed",
        delayed,
        delayed.recipe,
        "builtin",
        "per-tensor E4M3 with TransformerEngine-style delayed scaling (amax history of 16 calls per instance, "
        "margin 1, updated every call); a factory of stateful instances, one per layer (PyTorch, any device)",
    )
    return kernels


def _from_module(spec: str) -> LoadedKernel:
    mod_name, _, attr = spec.partition(":")
    if not mod_name:
        raise KernelLoadError(f"kernel spec {spec!r} names no module; write module:function or file.py:function")
    try:
        module = importlib.import_module(mod_name)
    except (Exception, SystemExit) as exc:  # an import error (or sys.exit) inside the user's module is a load failure
        raise KernelLoadError(
            f"cannot import module {mod_name!r} for kernel {spec!r}: {type(exc).__name__}: {exc}"
            f"{_file_here_hint(mod_name, attr, exc)}"
        ) from exc
    return _attr(module, attr, spec, "module")


def _file_here_hint(mod_name: str, attr: str, exc: BaseException) -> str:
    """When the module that was not found is a file (or package) in the current directory: the
    console script does not put the current directory on ``sys.path`` (``python -m`` does), so say
    so, and name the ``file.py:function`` spec that loads it."""
    missing = getattr(exc, "name", None) if isinstance(exc, ModuleNotFoundError) else None
    if not missing or not (mod_name == missing or mod_name.startswith(missing + ".")):
        return ""
    parts = mod_name.split(".")
    here = Path.cwd()
    file = Path(*parts).with_suffix(".py")
    if (here / file).is_file():
        return (
            f"; {file.as_posix()} is in the current directory, which is not on sys.path: "
            f"use --kernel {file.as_posix()}:{attr} (or run with PYTHONPATH=.)"
        )
    if (here / parts[0] / "__init__.py").is_file():
        return f"; the package {parts[0]}/ is in the current directory, which is not on sys.path: run with PYTHONPATH=."
    return ""


def _from_file(spec: str) -> LoadedKernel:
    path_s, _, attr = spec.rpartition(":")
    path = Path(path_s)
    if not path.is_file():
        raise KernelLoadError(f"kernel file {path_s!r} does not exist")
    mod_name = f"flamia_verify_user_{abs(hash(str(path.resolve())))}"
    try:
        loader_spec = importlib.util.spec_from_file_location(mod_name, path)
        # a path without a loader (None) fails here, and the except below reports it
        module = importlib.util.module_from_spec(loader_spec)  # type: ignore[arg-type]
        sys.modules[mod_name] = module
        with _siblings_importable(path.resolve().parent):
            loader_spec.loader.exec_module(module)  # type: ignore[union-attr]
    except (Exception, SystemExit) as exc:  # sys.exit() at import must not end the command with its code
        sys.modules.pop(mod_name, None)
        raise KernelLoadError(f"cannot load {path_s!r} for kernel {spec!r}: {type(exc).__name__}: {exc}") from exc
    return _attr(module, attr, spec, "file")


def _beside(directory: Path, module) -> bool:
    """Whether `module` is a module or package found directly in `directory` (``directory/name.py``,
    ``directory/name/``), not one found elsewhere below it (a virtual environment inside a project)."""
    places = [getattr(module, "__file__", None), *(getattr(module, "__path__", None) or [])]
    for place in places:
        if isinstance(place, str) and place:
            try:
                where = Path(place).resolve()
            except (OSError, ValueError):
                continue
            if where.parent == directory or (where.name == "__init__.py" and where.parent.parent == directory):
                return True
    return False


@contextlib.contextmanager
def _siblings_importable(directory: Path):
    """While a kernel file runs its imports: its directory first on ``sys.path``, as for
    ``python file.py``, so ``import helper`` finds the helper.py beside it. Afterwards ``sys.path`` is
    as before, and the modules and packages first imported from that directory (with their submodules)
    leave ``sys.modules`` (the kernel keeps its references to them), so a second kernel file with its
    own helper.py gets its own, not the first's. A sibling that the kernel imports only when called is
    therefore not found: import siblings at the top of the file."""
    before = set(sys.modules)
    entry = str(directory)
    sys.path.insert(0, entry)
    try:
        yield
    finally:
        try:
            sys.path.remove(entry)
        except ValueError:  # the kernel removed it itself
            pass
        importlib.invalidate_caches()
        new = [n for n in sys.modules if n not in before and not n.startswith("flamia_verify_user_")]
        tops = {n for n in new if "." not in n and _beside(directory, sys.modules[n])}
        for name in new:
            if name.partition(".")[0] in tops:
                del sys.modules[name]


def _attr(module, attr: str, spec: str, source: str) -> LoadedKernel:
    if not attr:
        raise KernelLoadError(f"kernel spec {spec!r} names no function; write module:function or file.py:function")
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise KernelLoadError(
                f"{module.__name__ if source == 'module' else spec.rpartition(':')[0]!r} has no attribute {attr!r}"
            )
        obj = getattr(obj, part)
    if isinstance(obj, LoadedKernel):
        return obj
    if not callable(obj):
        raise KernelLoadError(f"{spec!r} is not callable ({type(obj).__name__})")
    return LoadedKernel(spec, obj, kernel_recipe(obj), source, (obj.__doc__ or "").strip().split("\n")[0])


def entry_point_kernels() -> dict:
    """The kernels third-party packages register in the entry-point group ``flamia_verify.kernels``, by name."""
    return {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}


def load_kernel(spec) -> LoadedKernel:
    """Resolve a kernel spec (or pass a callable through) to a :class:`LoadedKernel`."""
    if isinstance(spec, LoadedKernel):
        return spec
    if callable(spec):
        name = getattr(spec, "__qualname__", None) or type(spec).__name__
        return LoadedKernel(name, spec, kernel_recipe(spec), "callable")
    if not isinstance(spec, str) or not spec:
        raise KernelLoadError(f"kernel spec must be a non-empty string or a callable, got {spec!r}")
    builtins = builtin_kernels()
    if spec in builtins:
        return builtins[spec]
    from flamia_verify.kernels.adapters import ADAPTERS  # library kernels wrapped into the convention

    if spec in ADAPTERS:
        adapter = ADAPTERS[spec]
        return LoadedKernel(spec, adapter.load(), adapter.recipe, "adapter", adapter.description)
    if ":" in spec:
        path_part = spec.rpartition(":")[0]
        if path_part.endswith(".py") or "/" in path_part or "\\" in path_part:
            return _from_file(spec)
        return _from_module(spec)
    eps = entry_point_kernels()
    if spec in eps:
        try:
            obj = eps[spec].load()
        except (Exception, SystemExit) as exc:
            raise KernelLoadError(f"entry point {spec!r} failed to load: {type(exc).__name__}: {exc}") from exc
        loaded = load_kernel(obj)
        return LoadedKernel(spec, loaded.fn, loaded.recipe, "entry-point", loaded.description)
    raise KernelLoadError(_unknown(spec, _known_names()))


def _known_names() -> list[str]:
    from flamia_verify.kernels.adapters import ADAPTERS

    return sorted(builtin_kernels()) + sorted(ADAPTERS) + sorted(entry_point_kernels())


def _unknown(spec: str, known: list[str]) -> str:
    import difflib

    close = difflib.get_close_matches(spec, known, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return (
        f"unknown kernel {spec!r}{hint}; built-in, adapter and registered kernels: {', '.join(known)}; "
        "or use module:function or file.py:function"
    )


def unknown_kernel_name(spec: str) -> str | None:
    """The message for a kernel name that names no built-in, adapter or registered kernel (None when it
    names one, or is a ``module:function`` / ``file.py:function`` spec, whose loading is the run's
    business): what a command that runs many kernels checks up front, before any of them runs."""
    if not isinstance(spec, str) or ":" in spec:
        return None
    known = _known_names()
    return None if spec in known else _unknown(spec, known)
