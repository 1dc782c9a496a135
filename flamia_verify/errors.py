"""Errors raised by flamia-verify. Each maps to one exit code of the command line."""

from __future__ import annotations

__all__ = [
    "FlamiaVerifyError",
    "UsageError",
    "ConfigError",
    "InputError",
    "KernelLoadError",
    "KernelCrashError",
    "KernelTimeoutError",
    "ReportSchemaError",
    "CaptureError",
]


class FlamiaVerifyError(Exception):
    """Base class of every error flamia-verify raises on purpose."""

    exit_code = 2


class UsageError(FlamiaVerifyError):
    """Bad command-line usage (exit 2)."""


class ConfigError(FlamiaVerifyError):
    """Bad configuration: unknown key or bad value in TOML or options (exit 2)."""


class InputError(FlamiaVerifyError, ValueError):
    """Tensors that break the calling convention: shapes, dtypes, cu_seqlens (exit 2)."""


class ReportSchemaError(FlamiaVerifyError):
    """A report file that does not follow the report schema (exit 2)."""


class CaptureError(FlamiaVerifyError):
    """A capture of attention calls that cannot be written or read as complete and valid (exit 2)."""


class KernelLoadError(FlamiaVerifyError):
    """The kernel spec could not be resolved or imported (exit 3)."""

    exit_code = 3


class KernelCrashError(FlamiaVerifyError):
    """The kernel raised while being called (exit 3 when nothing else could run)."""

    exit_code = 3


class KernelTimeoutError(KernelCrashError):
    """The kernel did not return within the per-case time limit."""
