"""flamia-verify: may we train with this low-precision attention kernel?

Runs a candidate attention kernel (FlashAttention varlen calling convention) beside a float64
reference and checks the properties low precision breaks: causal and cross-document leakage,
forward/backward consistency, error bounds, special values, determinism.

The public API: ``check`` and ``fuzz`` (the command line's ``check`` and ``fuzz``, from Python),
``load_kernel`` (a kernel spec to a callable) and ``Report`` (what ``check`` returns).
"""

import importlib as _importlib

from flamia_verify._version import __version__

__all__ = ["__version__", "check", "fuzz", "load_kernel", "Report"]

#: the public names loaded on first use, and the module each comes from: `import flamia_verify`
#: stays cheap and imports neither torch nor Triton
_LAZY = {
    "check": "flamia_verify.api",
    "fuzz": "flamia_verify.api",
    "load_kernel": "flamia_verify.kernels.loader",
    "Report": "flamia_verify.results",
}


def __getattr__(name: str) -> object:
    if name in _LAZY:
        return getattr(_importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'flamia_verify' has no attribute {name!r}")


def __dir__() -> list[str]:
    # the public names, the lazy ones without loading them (tab completion, help(), dir()); not the
    # module's own machinery
    return sorted(set(__all__) | {n for n in globals() if n.startswith("__") and n.endswith("__")})
