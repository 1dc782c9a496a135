"""What a kernel keeps from one call to the next: the declared policy, the factory, and the hooks the
checks use to run a stateful kernel.

A kernel with per-tensor FP8 scaling usually keeps state: TransformerEngine's delayed scaling takes
each scale from an amax history of earlier calls, a calibrated kernel freezes its scales after a first
call. The outputs of such a kernel depend on the calls before it, so the tool has to know (and run it
the way training does: :mod:`flamia_verify.properties.checks.state`). A kernel says what it keeps with
optional attributes, read through the accessors below (a missing attribute reads as "not declared"):

=====================  ==========================================================================
attribute              meaning
=====================  ==========================================================================
``state_policy``       a :class:`StatePolicy` (or a mapping of its fields, or one of the kinds as a
                       string): ``none`` (a pure function), ``current`` (every scale from the
                       call's own data: stateless), ``delayed`` (scales from an amax history of
                       earlier calls: ``history_len``, ``margin``), ``frozen`` (scales fixed after
                       a calibration); ``sharing`` says whether every layer that calls the kernel
                       shares the state (``shared``) or each instance has its own
                       (``per-instance``)
``new_instance()``     the kernel is a factory: returns a fresh kernel with its own state. A model
                       builds one instance per attention layer (:func:`layer_kernels`), and the
                       checks do the same
``state_snapshot()``   returns an opaque copy of the state; ``state_restore(snapshot)`` puts it back.
``state_restore(s)``   With both, the checks that judge a pure function run every call at one state
                       (the state after the first calls, restored before every forward and every
                       backward), and the state family starts from it
``state_describe()``   a JSON-able mapping of the state now (per tensor role: the scale the next
                       call uses, the history's amax, the number of records): the reports show it
                       at the call that broke the recipe
=====================  ==========================================================================

None of this is needed for a stateless kernel, and none of it is trusted blindly: the state family
runs every kernel over a training-like sequence of calls and judges each call, declared or not.
This module imports no tensor library.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = [
    "StateKind",
    "StatePolicy",
    "StateSharing",
    "can_snapshot",
    "declared_state",
    "describe_state",
    "is_factory",
    "layer_kernels",
    "restore_state",
    "snapshot_state",
]


class StateKind(enum.StrEnum):
    """Where a kernel's scales come from, as far as state goes."""

    NONE = "none"  # a pure function: no scale or cache outlives a call
    CURRENT = "current"  # every scale from the call's own data (stateless; not causal-safe per tensor)
    DELAYED = "delayed"  # scales from an amax history of earlier calls, updated every call
    FROZEN = "frozen"  # scales calibrated once (on a first call) and fixed after it


class StateSharing(enum.StrEnum):
    """Who shares one state."""

    PER_INSTANCE = "per-instance"  # each kernel object its own (a factory gives one per layer)
    SHARED = "shared"  # one state for every caller, whichever layer calls


@dataclass(frozen=True)
class StatePolicy:
    """A kernel's declared state: its kind, the amax history and margin of delayed scaling, and who
    shares it."""

    kind: StateKind = StateKind.NONE
    history_len: int | None = None
    margin: int | None = None
    sharing: StateSharing = StateSharing.PER_INSTANCE

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", StateKind(self.kind))
        object.__setattr__(self, "sharing", StateSharing(self.sharing))
        for name in ("history_len", "margin"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
                raise ValueError(f"{name} must be a non-negative int or None, got {value!r}")
        if self.history_len is not None and self.history_len < 1:
            raise ValueError(f"history_len must be at least 1, got {self.history_len}")

    @property
    def stateful(self) -> bool:
        """Whether a call may depend on earlier calls (delayed or frozen scales)."""
        return self.kind in (StateKind.DELAYED, StateKind.FROZEN)

    def describe(self) -> str:
        """One line, e.g. "delayed scaling, amax history of 16 calls, margin 1, one state per instance"."""
        if self.kind is StateKind.NONE:
            return "stateless"
        if self.kind is StateKind.CURRENT:
            return "current scaling (each call's own amax): stateless"
        parts = ["delayed scaling" if self.kind is StateKind.DELAYED else "scales frozen after a calibration"]
        if self.history_len is not None and self.kind is StateKind.DELAYED:
            parts.append(f"amax history of {self.history_len} call{'s' if self.history_len != 1 else ''}")
        if self.margin is not None:
            parts.append(f"margin {self.margin}")
        parts.append(
            "one state per instance"
            if self.sharing is StateSharing.PER_INSTANCE
            else "one state shared by every caller"
        )
        return ", ".join(parts)

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind.value,
            "history_len": self.history_len,
            "margin": self.margin,
            "sharing": self.sharing.value,
        }

    @classmethod
    def from_value(cls, value: object) -> StatePolicy:
        """A policy from what a kernel's ``state_policy`` attribute may hold: a StatePolicy, a mapping of
        its fields, or a kind as a string. ValueError names what is wrong."""
        if isinstance(value, StatePolicy):
            return value
        if isinstance(value, str):
            try:
                return cls(StateKind(value))
            except ValueError:
                raise ValueError(
                    f"unknown state kind {value!r}; choose one of {', '.join(k.value for k in StateKind)}"
                ) from None
        if isinstance(value, Mapping):
            unknown = sorted(set(value) - {"kind", "history_len", "margin", "sharing"})
            if unknown:
                raise ValueError(f"unknown state_policy key(s) {', '.join(map(str, unknown))}")
            try:
                return cls(**dict(value))
            except (TypeError, ValueError) as exc:
                raise ValueError(str(exc)) from None
        raise ValueError(f"state_policy must be a StatePolicy, a mapping or a kind string, got {type(value).__name__}")


def declared_state(fn: Callable[..., Any]) -> StatePolicy | None:
    """The policy a kernel declares (its ``state_policy`` attribute), or None when it declares none.
    A malformed declaration raises ValueError."""
    value = getattr(fn, "state_policy", None)
    return None if value is None else StatePolicy.from_value(value)


def is_factory(fn: Callable[..., Any]) -> bool:
    """Whether the kernel makes fresh instances of itself (``new_instance()``)."""
    return callable(getattr(fn, "new_instance", None))


def layer_kernels(fn: Callable[..., Any], layers: int) -> list[Callable[..., Any]]:
    """The kernels of ``layers`` attention layers as a model builds them: one fresh instance per layer
    from a factory, else the one function in every layer."""
    if is_factory(fn):
        make = fn.new_instance  # type: ignore[attr-defined]
        return [make() for _ in range(layers)]
    return [fn] * layers


def can_snapshot(fn: Callable[..., Any]) -> bool:
    """Whether the kernel's state can be copied and put back (``state_snapshot`` and ``state_restore``)."""
    return callable(getattr(fn, "state_snapshot", None)) and callable(getattr(fn, "state_restore", None))


def snapshot_state(fn: Callable[..., Any]) -> Any:
    """A copy of the kernel's state (``state_snapshot()``); see :func:`can_snapshot`."""
    return fn.state_snapshot()  # type: ignore[attr-defined]


def restore_state(fn: Callable[..., Any], snapshot: Any) -> None:
    """Put a copy from :func:`snapshot_state` back."""
    fn.state_restore(snapshot)  # type: ignore[attr-defined]


def describe_state(fn: Callable[..., Any]) -> dict[str, Any] | None:
    """The kernel's own account of its state now (``state_describe()``), or None when it gives none
    or the call fails (a description is never worth failing a check over)."""
    describe = getattr(fn, "state_describe", None)
    if not callable(describe):
        return None
    try:
        out = describe()
    except Exception:
        return None
    return dict(out) if isinstance(out, Mapping) else None
