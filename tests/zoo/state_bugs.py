"""Planted stateful bugs: per-tensor FP8 attention with delayed scaling (``fp8-delayed``,
flamia_verify/kernels/delayed.py) with one thing about its state wrong. Each is a pure function at
any one state, so every check that judges one call at the state the run pins passes it; only the
state family, which calls the kernel as training does, can fail it.

    frozen_shared            delayed scaling calibrated on the first call and then frozen, one state for
                             every layer that calls the function: cudnn-fp8's former default, emulated
                             (history 1024, margin 0)
    frozen_per_layer         the same freeze with one instance per layer (a factory): each layer's scales
                             fit its first call, and the drift of the later steps saturates them
    shared_history           TransformerEngine's recipe (history 16, margin 1), one history for all the
                             instances a factory gives out: a layer's scale comes from another layer's amax
    never_decays             the recipe per instance, but the history keeps the largest amax ever seen
                             (a running max instead of a window of 16 calls)
    do_scale_previous_step   the recipe per instance, but dO's scale from the previous backward's amax
                             alone, with no margin: a dO that doubles saturates
    scale_cache_by_address   the recipe per instance, but the scales of q, k, v cached by the tensor's
                             address (data_ptr): the allocator hands each step's activations the same
                             address, and the scale of the layer's first call is used for ever
    do_never_decays_hidden   the recipe per instance, but dO's history keeps the largest amax ever seen,
                             and the kernel describes no state: only the gradients' bits can show that a
                             spike is never forgotten (a backward history left behind by a reallocation)

Each is a record of the known-bad registry (tags ``zoo``, ``state``) built from the ``fp8-delayed``
kernel (a variation of its class), and carries ``recipe`` (fp8), ``catches`` (the checks that must
fail) and ``quiet`` (checks its bug cannot reach at the pinned state, which must pass). Command-line specs:
``flamia-verify check --kernel tests/zoo/state_bugs.py:frozen_shared --only state``.
"""

from __future__ import annotations

import math

import torch

from flamia_verify.kernels.cudnn_fp8.scaling import ROLE_INDEX, ScalingState, pow2_scale
from flamia_verify.kernels.delayed import DelayedScalingAttention, _amax
from flamia_verify.kernels.state import StateKind, StatePolicy, StateSharing
from flamia_verify.known_bad import KNOWN_BAD, KnownBad

__all__ = [
    "STATE_BUGS",
    "RECORDS",
    "fresh",
    "do_never_decays_hidden",
    "do_scale_previous_step",
    "frozen_per_layer",
    "frozen_shared",
    "never_decays",
    "scale_cache_by_address",
    "shared_history",
]


class _FrozenShared(DelayedScalingAttention):
    """One function for every layer: no factory; the state declared as what it is."""

    new_instance = None  # type: ignore[assignment]

    @property
    def state_policy(self) -> StatePolicy:
        return StatePolicy(StateKind.FROZEN, margin=self.scaling.margin, sharing=StateSharing.SHARED)


class _SharedHistory(DelayedScalingAttention):
    """A factory whose instances all write into the prototype's one state."""

    def new_instance(self) -> DelayedScalingAttention:
        twin = _SharedHistory(history_len=self.scaling.history_len, margin=self.scaling.margin, state=self.state)
        return twin

    @property
    def state_policy(self) -> StatePolicy:
        return StatePolicy(StateKind.DELAYED, self.scaling.history_len, self.scaling.margin, StateSharing.SHARED)


class _RunningMax(ScalingState):
    """Every record is the largest amax the role has ever had: the window's maximum never comes down."""

    def _write(self, roles, amax):
        history, _ = self._ensure(amax.device)
        idx = [ROLE_INDEX[r] for r in roles]
        running = torch.maximum(history[:, idx].amax(dim=0), amax.detach().to(torch.float32).reshape(-1))
        super()._write(roles, running)


class _NeverDecays(DelayedScalingAttention):
    def _new_state(self) -> ScalingState:
        return _RunningMax(self.scaling)


class _DoFromPreviousStep(DelayedScalingAttention):
    """dO's scale from the last backward's dO amax alone (margin 0); everything else the recipe."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self._last_do: torch.Tensor | None = None

    def do_scale(self, dout: torch.Tensor) -> torch.Tensor:
        amax = _amax(dout)
        source = amax if self._last_do is None else self._last_do
        self._last_do = amax
        scale = pow2_scale(source, 0)
        return torch.where(torch.isfinite(scale), scale, torch.ones_like(scale))

    def state_describe(self):
        out = super().state_describe()
        if self._last_do is not None:
            scale = float(pow2_scale(self._last_do, 0))
            out["do"] = dict(out["do"], scale=scale, scale_log2=int(round(math.log2(scale))))
            out["do"]["window_amax"] = float(self._last_do)
        return out


class _RunningMaxDo(ScalingState):
    """dO's records are the largest dO amax ever seen; every other role keeps the recipe's window."""

    def _write(self, roles, amax):
        amax = amax.detach().to(torch.float32).reshape(-1).clone()
        if "do" in roles:
            history, _ = self._ensure(amax.device)
            i = list(roles).index("do")
            amax[i] = torch.maximum(history[:, ROLE_INDEX["do"]].amax(), amax[i])
        super()._write(roles, amax)


class _DoNeverDecaysHidden(DelayedScalingAttention):
    """dO's history a running maximum, and no ``state_describe``: the scales cannot be read from outside."""

    state_describe = None  # type: ignore[assignment]

    def _new_state(self) -> ScalingState:
        return _RunningMaxDo(self.scaling)


class _ScaleCacheByAddress(DelayedScalingAttention):
    """The scales of q, k and v kept in a cache keyed by the tensors' data_ptr (shared by the instances
    of one factory): a new tensor at a known address gets the old tensor's scale."""

    def __init__(self, cache: dict | None = None, **kw):
        super().__init__(**kw)
        self._cache: dict = {} if cache is None else cache
        self._last_key: dict[str, tuple] = {}

    def new_instance(self) -> DelayedScalingAttention:
        return _ScaleCacheByAddress(cache=self._cache, history_len=self.scaling.history_len, margin=self.scaling.margin)

    def forward_scales(self, q, k, v):
        scales = super().forward_scales(q, k, v).clone()
        for i, role, t in ((0, "q", q), (1, "k", k), (2, "v", v)):
            key = (t.data_ptr(), tuple(t.shape), t.dtype)
            self._last_key[role] = key
            if key in self._cache:
                scales[i] = self._cache[key]
            else:
                self._cache[key] = scales[i].clone()
        return scales

    def state_describe(self):
        out = super().state_describe()
        for role, key in self._last_key.items():  # what the next call at the same address uses
            scale = float(self._cache[key])
            out[role] = dict(out[role], scale=scale, scale_log2=int(round(math.log2(scale))), cached=True)
        return out


_STATE = ("state.training",)
#: checks that judge one call at the state the run pins (after the probe): a stateful bug passes them
_PURE = ("causal.forward", "causal.dq", "error.out")


class _Make:
    """A build: a kernel of the base's kind (``fp8-delayed``'s class, or a variation of it) with a state of
    its own, made by ``make()``."""

    def __init__(self, make):
        self.make = make

    def __call__(self, base):
        return self.make()


def _bug(name: str, make, catches, why: str) -> KnownBad:
    return KnownBad(
        name, "state", why, _Make(make), base="fp8-delayed", catches=catches, quiet=_PURE, tags=("zoo", "state")
    )


RECORDS = KNOWN_BAD.register(
    _bug(
        "frozen_shared",
        lambda: _FrozenShared(history_len=1024, margin=0, freeze_after_calibration=True, name="frozen-shared"),
        _STATE,
        "delayed scaling calibrated on the first call, then frozen; one state for every layer "
        "(cudnn-fp8's former default)",
    ),
    _bug(
        "frozen_per_layer",
        lambda: DelayedScalingAttention(freeze_after_calibration=True, name="frozen-per-layer"),
        _STATE,
        "delayed scaling calibrated on each instance's first call, then frozen (one instance per layer)",
    ),
    _bug(
        "shared_history",
        lambda: _SharedHistory(name="shared-history"),
        _STATE,
        "TransformerEngine's recipe (history 16, margin 1) with one history shared by every layer's instance",
    ),
    _bug(
        "never_decays",
        lambda: _NeverDecays(name="never-decays"),
        ("state.history",),
        "TransformerEngine's recipe per instance, but the history keeps the largest amax ever seen",
    ),
    _bug(
        "do_scale_previous_step",
        lambda: _DoFromPreviousStep(name="do-scale-previous-step"),
        _STATE,
        "TransformerEngine's recipe per instance, but dO scaled by the previous backward's amax alone, margin 0",
    ),
    _bug(
        "scale_cache_by_address",
        lambda: _ScaleCacheByAddress(name="scale-cache-by-address"),
        _STATE,
        "TransformerEngine's recipe per instance, but the scales of q, k and v cached by the tensor's address",
    ),
    _bug(
        "do_never_decays_hidden",
        lambda: _DoNeverDecaysHidden(name="do-never-decays-hidden"),
        ("state.history",),
        "TransformerEngine's recipe per instance, but dO's history keeps its largest amax for ever, and the "
        "kernel describes no state",
    ),
    origin=__file__,
)

#: the correct kernel every record is a variation of (its recipe is what they claim)
_BASE = DelayedScalingAttention()


def fresh(name: str):
    """A new kernel of the planted bug ``name`` (its own state), tagged with catches and quiet."""
    return KNOWN_BAD.kernel(name, base=_BASE)


frozen_shared = fresh("frozen_shared")
frozen_per_layer = fresh("frozen_per_layer")
shared_history = fresh("shared_history")
never_decays = fresh("never_decays")
do_scale_previous_step = fresh("do_scale_previous_step")
scale_cache_by_address = fresh("scale_cache_by_address")
do_never_decays_hidden = fresh("do_never_decays_hidden")

STATE_BUGS = {r.name: globals()[r.name] for r in RECORDS}
