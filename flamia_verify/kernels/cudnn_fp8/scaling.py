"""Per-tensor FP8 scaling for cuDNN's FP8 attention: the modes, the per-role state, and which mode is
causal-safe.

cuDNN's FP8 attention (``sdpa_fp8`` / ``sdpa_fp8_backward``) takes every operand as E4M3 codes with one
fp32 scale per tensor, and writes O, dQ, dK, dV as E4M3 codes (on Hopper; BF16 outputs are Blackwell
only) with one fp32 scale each. A value ``x`` is stored as ``E4M3(x * scale)`` and read back as
``code * descale``, ``descale = 1 / scale``. The roles and the tensors cuDNN takes for them:

====  ==========================  ============================================================
role  cuDNN tensors               where its scale comes from
====  ==========================  ============================================================
q     descale_q                   amax of q (measured by the fused quantization, or history)
k     descale_k                   amax of k
v     descale_v                   amax of v
o     scale_o, descale_o          a rule: ``scale_v / 2`` (see below); cuDNN's amax_o recorded
s     scale_s, descale_s          a constant: ``2^7`` (see below); cuDNN's amax_s recorded
do    descale_dO                  amax of dO
dp    scale_dP, descale_dP        cuDNN's amax_dP output: the amax of dS, the tensor scale_dP scales
dq    scale_dQ (+ our dequant)    amax of dQ (cuDNN's amax_dQ output)
dk    scale_dK                    amax of dK
dv    scale_dV                    amax of dV
====  ==========================  ============================================================

Scales are powers of two
------------------------
Every scale is the largest power of two ``2^k`` with ``amax * 2^k <= 448`` (E4M3's largest finite
value), times ``2^-margin`` (:func:`pow2_scale`). The choice, against TransformerEngine's default of
``448 / amax`` unrounded:

* ``scale * descale == 1`` exactly, so the dequantized value is the E4M3 code times an exact power of
  two: dequantization (and cuDNN's descales) add no rounding, and a quantized tensor's relative
  rounding is E4M3's own, independent of where the amax happens to fall;
* the results are reproducible bit for bit across implementations (the Triton kernels, their PyTorch
  twins, a re-run after a freeze), which the checks rely on;
* the price: the amax lands in (224, 448] instead of at 448, i.e. up to one binade of E4M3's range
  (about 17.5 binades, subnormals included) is left unused above the largest value.

The exponent is clamped to [-126, 126] so that both the scale and the descale are normal fp32 numbers.

The roles without their own amax
--------------------------------
* ``s`` (the probabilities P that cuDNN quantizes for P V and dV = P^T dO): P is formed against the
  running row maximum, so it is at most 1, and at most ``e^4`` if cuDNN rescales lazily with a
  threshold of 4 (which its FP8 reference models, with P then multiplied by ``2^-4``). ``2^7`` keeps
  ``e^4 * 2^7 * 2^-4 = 437 < 448`` and is the largest power of two that does. Constant, so it depends
  on no data at all.
* ``o``: O is a convex combination of rows of V (weights that sum to 1, up to E4M3's rounding of P:
  at most about 1.2 in the worst case), and the dequantized V never exceeds ``448 / scale_v`` (its
  codes saturate at 448). So ``|O| * scale_v / 2 <= 1.2 * 224 < 448``: with ``scale_o = scale_v / 2``
  O never saturates, whatever the data, and needs no history.
* ``dp``: cuDNN quantizes ``dS = P * (dP - D) * softmax_scale`` with scale_dP, and its amax_dP output
  is the amax of that tensor (measured on the H200, cuDNN 9.19: benchmarks/LOG.md), so the scale comes
  from it as from any other amax. A measuring run, which has no amax_dP yet, takes a provisional scale
  from a bound: with ``|P| <= 1`` and ``|D| = |sum_j P_ij dP_ij| <= max |dP|``, ``|dS| <= 2 *
  softmax_scale * max |dP|``, and ``max |dP| <= head_dim * amax(dO) * amax(V)``.

The modes, and which are causal-safe
------------------------------------
``current`` (:attr:`ScalingMode.CURRENT`): every scale from this call's own data. The forward reduces
the amax of q, k and v in one fused pass before quantizing them; the backward reduces dO's, then runs
cuDNN's backward twice: once to measure amax(dP), amax(dQ), amax(dK), amax(dV) (with provisional
scales), once with scales from those measurements. Stateless: every call is a pure function of its
inputs. **Not causal-safe** (and not document-safe): the amax of a tensor is taken over every token of
every document of the pack, so a token after position t (or in another document) changes the scale,
and therefore the rounding, of every output before t. Offered for comparison.

``delayed`` (:attr:`ScalingMode.DELAYED`): TransformerEngine's delayed scaling. Each role keeps a
history of its last ``history_len`` amaxes; a call's scale comes from the maximum over that window
(``amax_compute_algo = "max"``), and the amaxes this call produces are appended to the history after
it has run. **Causal-safe and document-safe within a call**: no scale of a call depends on that
call's data, so an output before t depends on the tokens after t (or in another document) only
through the E4M3 codes that the causal mask (or the document boundary) already zeroes out. A value
above the window's amax saturates at +-448 (a local error, no leak). Across calls the scales do depend
on earlier calls' data, which is what a training step may see. When the window's amax is zero or not
finite, the previous scale is kept (TransformerEngine's rule), so a NaN in one step does not turn
every later scale into NaN; the NaN itself is never hidden: the amax reductions report it, the
history holds it (:meth:`ScalingState.history`), and the NaN element quantizes to an E4M3 NaN.

A causal-safe *per-token*, *per-block* or *prefix-amax* mode (a scale for position t from the tokens
up to t only) is not offered: cuDNN's FP8 attention on Hopper takes every descale as one fp32 scalar
per tensor (``(1, 1, 1, 1)`` tensors), so a scale cannot vary along the sequence. Per-token scales of
Q, K and V would be causal-safe in principle (each row's scale sees only its own row); they need a
kernel that takes them (cuDNN's MXFP8 attention has block scales, on Blackwell only, with V blocked
along the sequence: the diagonal-block leak that docs/kernels.md describes).

Training with it, and checking it
----------------------------------
``delayed`` without a freeze is the kernel to train with (``cudnn-fp8``): every call appends its amaxes,
so the scales follow the activations one call late, with ``margin`` binades of headroom (1 by default
in :func:`~flamia_verify.kernels.cudnn_fp8.kernel.make_kernel`: a tensor may double from one call to
the next without saturating). A model builds one kernel, hence one state, per attention layer
(``new_instance()``): layers' activations differ by orders of magnitude, and one shared history would
give each layer another layer's scales.

The checks that compare calls with each other (the same pack with its future tokens changed, a
document alone and packed) need every call at one state: they take a :meth:`ScalingState.snapshot`
before the run and put back, before every forward and backward, the state one call on the case's own
tensors leaves (``properties.harness.StatePin``); the state family judges how the state moves from
call to call, layer after layer (``properties.checks.state``). ``freeze_after_calibration=True`` (each
role's history seeded once, by the first call that needs it, then never changed) remains an explicit
option, ``cudnn-fp8-frozen``, for checking a pure function; it is not for training, and the state
family fails it: a scale fitted to one layer's first call saturates the larger layers and the later
steps. :meth:`ScalingState.freeze` freezes a trained state, :meth:`ScalingState.reset` forgets
everything, :meth:`ScalingState.describe` says what the next call will use (the reports show it).
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from flamia_verify.formats.constants import E4M3_MAX

__all__ = [
    "BACKWARD_MEASURED",
    "E4M3_MAX",
    "FORWARD_MEASURED",
    "FORWARD_RECORDED",
    "P_SCALE_EXPONENT",
    "ROLES",
    "ScalingMode",
    "ScalingRecipe",
    "ScalingState",
    "pow2_scale",
    "scale_policy",
]

#: the probabilities' constant scale is 2^P_SCALE_EXPONENT (see the module docstring, role ``s``)
P_SCALE_EXPONENT = 7
#: scale exponents stay in [-SCALE_EXPONENT_LIMIT, SCALE_EXPONENT_LIMIT]: scale and descale normal fp32
SCALE_EXPONENT_LIMIT = 126

#: every role with a scale or an amax; the forward's roles first, then the backward's (each group is
#: contiguous, so that the state reads and writes it as one slice)
ROLES: tuple[str, ...] = ("q", "k", "v", "o", "s", "do", "dp", "dq", "dk", "dv")
ROLE_INDEX: dict[str, int] = {r: i for i, r in enumerate(ROLES)}
#: the forward's roles whose amax the fused quantization measures (their scales come from it)
FORWARD_MEASURED: tuple[str, ...] = ("q", "k", "v")
#: the forward's roles whose amaxes a call records (o and s from cuDNN's amax outputs, for diagnosis)
FORWARD_RECORDED: tuple[str, ...] = ("q", "k", "v", "o", "s")
#: the backward's roles: dO (fused quantization) and dP, dQ, dK, dV (cuDNN's amax outputs)
BACKWARD_MEASURED: tuple[str, ...] = ("do", "dp", "dq", "dk", "dv")
#: roles whose history follows v's freeze (their scales are rules, their amaxes only diagnostics)
_FOLLOW_V = ("o", "s")


class ScalingMode(enum.StrEnum):
    """Where a call's per-tensor scales come from (the module docstring has the details)."""

    CURRENT = "current"  # this call's amaxes: stateless, leaks across the causal mask and documents
    DELAYED = "delayed"  # an amax history of earlier calls (TransformerEngine): causal-safe within a call

    @property
    def causal_safe(self) -> bool:
        """True when no scale of a call depends on that call's data."""
        return self is ScalingMode.DELAYED


@dataclass(frozen=True)
class ScalingRecipe:
    """How a kernel scales: the mode, the history window, the margin and the freeze rule.

    history_len: amaxes kept per role (TransformerEngine's ``amax_history_len``, default 1024).
    margin: every amax-derived scale is divided by ``2^margin`` (TransformerEngine's ``margin``).
    freeze_after_calibration: delayed only: a role's history is seeded by the first call that needs it
    and then never changes (what a check run uses; see the module docstring).
    """

    mode: ScalingMode = ScalingMode.DELAYED
    history_len: int = 1024
    margin: int = 0
    freeze_after_calibration: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "mode", ScalingMode(self.mode))
        if isinstance(self.history_len, bool) or not isinstance(self.history_len, int) or self.history_len < 1:
            raise ValueError(f"history_len must be an int >= 1, got {self.history_len!r}")
        if isinstance(self.margin, bool) or not isinstance(self.margin, int) or not 0 <= self.margin <= 64:
            raise ValueError(f"margin must be an int in [0, 64], got {self.margin!r}")


def pow2_scale(amax: torch.Tensor, margin: int = 0) -> torch.Tensor:
    """The largest power of two ``2^k`` with ``amax * 2^k <= 448``, times ``2^-margin`` (fp32).

    Exact, from the binary exponent (no floating log2): with ``amax = m * 2^e``, ``m`` in [0.5, 1),
    ``k = 9 - e`` when ``m <= 0.875`` (``amax * 2^k = 2^9 m <= 448``) and ``8 - e`` above. ``k - margin``
    is clamped to [-126, 126]. Meant for finite amax > 0; zero, NaN and Inf give NaN (the caller
    decides, :func:`scale_policy`).
    """
    a = amax.detach().to(torch.float32)
    mant, exp = torch.frexp(a)
    k = (9 - exp) - (mant > 0.875).to(exp.dtype) - margin
    k = k.clamp(-SCALE_EXPONENT_LIMIT, SCALE_EXPONENT_LIMIT)
    scale = torch.ldexp(torch.ones_like(a), k)
    return torch.where(torch.isfinite(a) & (a > 0), scale, torch.full_like(a, math.nan))


def scale_policy(amax: torch.Tensor, previous: torch.Tensor, margin: int = 0) -> torch.Tensor:
    """:func:`pow2_scale` where the amax is finite and positive, else ``previous`` (TransformerEngine's
    rule for a window that saw only zeros, an Inf or a NaN: keep the scale in use)."""
    a = amax.detach().to(torch.float32)
    ok = torch.isfinite(a) & (a > 0)
    return torch.where(ok, pow2_scale(a, margin), previous.to(torch.float32))


@dataclass(frozen=True)
class _Snapshot:
    """What :meth:`ScalingState.snapshot` copies."""

    history: torch.Tensor | None
    scale: torch.Tensor | None
    recorded: tuple[int, ...]
    calibrated: tuple[bool, ...]
    frozen: tuple[bool, ...]
    seen: dict[str, torch.Tensor]


def _slice(roles: Sequence[str]) -> slice:
    """The roles as one slice of ROLES (each group the kernels use is contiguous there)."""
    idx = [ROLE_INDEX[r] for r in roles]
    if idx != list(range(idx[0], idx[0] + len(idx))):
        raise ValueError(f"roles {tuple(roles)} are not contiguous in {ROLES}")
    return slice(idx[0], idx[-1] + 1)


class ScalingState:
    """The per-role amax history and scales of one kernel (delayed), or nothing (current).

    Every tensor lives on the device of the calls (created on the first call, moved if the device
    changes); nothing here reads a device value on the host, so a call never waits for the GPU.
    """

    def __init__(self, recipe: ScalingRecipe | None = None) -> None:
        self.recipe = recipe if recipe is not None else ScalingRecipe()
        self._clear()

    def _clear(self) -> None:
        #: bumped by every change of the history or the freeze: equal generations give equal scales
        self.generation: int = getattr(self, "generation", -1) + 1
        self._history: torch.Tensor | None = None  # (history_len, len(ROLES)) fp32, zeros before any record
        self._scale: torch.Tensor | None = None  # (len(ROLES),) fp32: the delayed scales in use, 1 at first
        self._recorded = [0] * len(ROLES)  # records per role (the next row is recorded % history_len)
        self._calibrated = [False] * len(ROLES)
        self._frozen = [False] * len(ROLES)
        #: each role's amax of the last call that measured or recorded it, frozen or not (for reports)
        self._seen: dict[str, torch.Tensor] = {}

    # ------------------------------------------------------------------ state

    @property
    def mode(self) -> ScalingMode:
        return self.recipe.mode

    def _ensure(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if self._history is None or self._scale is None:
            self._history = torch.zeros(self.recipe.history_len, len(ROLES), dtype=torch.float32, device=device)
            self._scale = torch.ones(len(ROLES), dtype=torch.float32, device=device)
        elif self._history.device != device:
            self._history = self._history.to(device)
            self._scale = self._scale.to(device)
        return self._history, self._scale

    def history(self) -> torch.Tensor | None:
        """A copy of the amax history, (history_len, len(ROLES)) in ROLES order (None before any call).
        Rows are a ring buffer per role: the order of rows is not the order of calls."""
        return None if self._history is None else self._history.clone()

    def records(self, role: str) -> int:
        """How many amaxes of ``role`` have been recorded (calibration included)."""
        return self._recorded[ROLE_INDEX[role]]

    def calibrated(self, role: str) -> bool:
        return self._calibrated[ROLE_INDEX[role]]

    def frozen(self, role: str) -> bool:
        """Whether ``role``'s history no longer changes (o and s follow v)."""
        return self._frozen[ROLE_INDEX["v" if role in _FOLLOW_V else role]]

    def freeze(self) -> None:
        """Stop recording for every role: from now on every call is a pure function of its inputs
        (the roles not yet calibrated still calibrate once, then stay)."""
        self._frozen = [True] * len(ROLES)
        self.generation += 1

    def unfreeze(self) -> None:
        self._frozen = [False] * len(ROLES)
        self.generation += 1

    def reset(self) -> None:
        """Forget the history, the scales and the freeze (the recipe stays)."""
        self._clear()

    def snapshot(self) -> _Snapshot:
        """A copy of everything a later call reads (history, scales, records, calibration, freeze), for
        :meth:`restore`: the checks run every call of a pure-function check at one state."""
        return _Snapshot(
            None if self._history is None else self._history.clone(),
            None if self._scale is None else self._scale.clone(),
            tuple(self._recorded),
            tuple(self._calibrated),
            tuple(self._frozen),
            dict(self._seen),
        )

    def restore(self, snap: _Snapshot) -> None:
        """Put back a :meth:`snapshot` (copies of it: the snapshot can be restored again)."""
        self._history = None if snap.history is None else snap.history.clone()
        self._scale = None if snap.scale is None else snap.scale.clone()
        self._recorded = list(snap.recorded)
        self._calibrated = list(snap.calibrated)
        self._frozen = list(snap.frozen)
        self._seen = dict(snap.seen)
        self.generation += 1  # a new generation: no cached scalar of another state is reused

    def window_amax(self, roles: Sequence[str]) -> list[float]:
        """The amax the next call takes each role's scale from (the maximum over its history window;
        NaN where it is NaN; 0 before any record). Reads the device values on the host: for reports."""
        if self._history is None:
            return [0.0] * len(roles)
        idx = [ROLE_INDEX[r] for r in roles]
        return [float(x) for x in self._history[:, idx].amax(dim=0).tolist()]

    def last_amax(self, roles: Sequence[str]) -> list[float | None]:
        """Each role's amax in the last call that measured or recorded it, whether or not the history
        kept it (a frozen role's history does not): None before any."""
        return [float(self._seen[r]) if r in self._seen else None for r in roles]

    def next_scales(self, roles: Sequence[str]) -> list[float | None]:
        """The scale the next call gives each role (delayed, calibrated roles; None for a role that the
        next call calibrates, and in current mode), without changing the state."""
        if self.mode is ScalingMode.CURRENT or self._history is None or self._scale is None:
            return [None] * len(roles)
        window = self._history[:, [ROLE_INDEX[r] for r in roles]].amax(dim=0)
        previous = self._scale[[ROLE_INDEX[r] for r in roles]]
        scales = scale_policy(window, previous, self.recipe.margin).tolist()
        return [float(s) if self._calibrated[ROLE_INDEX[r]] else None for r, s in zip(roles, scales, strict=True)]

    def describe(self, roles: Sequence[str] = ROLES) -> dict[str, dict[str, object]]:
        """Per role: the scale the next call uses (and its log2), the window's amax it comes from, the
        last record, the number of records, calibrated and frozen; JSON-able, for reports."""
        scales = self.next_scales(roles)
        window = self.window_amax(roles)
        last = self.last_amax(roles)
        out: dict[str, dict[str, object]] = {}
        for r, s, w, a in zip(roles, scales, window, last, strict=True):
            out[r] = {
                "scale": s,
                "scale_log2": None if s is None or not math.isfinite(s) or s <= 0 else int(round(math.log2(s))),
                "window_amax": w,
                "last_amax": a,
                "records": self._recorded[ROLE_INDEX[r]],
                "calibrated": self._calibrated[ROLE_INDEX[r]],
                "frozen": self.frozen(r),
            }
        return out

    # ------------------------------------------------------------------ per call

    def needs_measurement(self, roles: Sequence[str]) -> bool:
        """Whether a call must measure these roles' amaxes itself before it can scale them:
        always in current mode, and in delayed mode until the roles have been calibrated."""
        return self.mode is ScalingMode.CURRENT or not all(self._calibrated[ROLE_INDEX[r]] for r in roles)

    def scales(
        self,
        roles: Sequence[str],
        device: torch.device,
        measured: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The scales of ``roles`` for this call, (len(roles),) fp32 on ``device``.

        measured: this call's amaxes of the roles, required when :meth:`needs_measurement` said so.
        In current mode they give the scales directly (the previous scale is 1 where an amax is zero or
        not finite). In delayed mode, roles not yet calibrated are calibrated with them: they become
        the history's first row (and the roles freeze when the recipe says so); the scales then come
        from the window as for every later call.
        """
        s = _slice(roles)
        if self.mode is ScalingMode.CURRENT:
            if measured is None:
                raise ValueError("current scaling needs this call's amaxes")
            amax = measured.detach().to(device=device, dtype=torch.float32).clone()
            previous = torch.ones(len(roles), dtype=torch.float32, device=device)
        else:
            history, scale = self._ensure(device)
            if not all(self._calibrated[ROLE_INDEX[r]] for r in roles):
                if measured is None:
                    raise ValueError(f"roles {tuple(roles)} are not calibrated: this call must measure their amaxes")
                self._write(roles, measured.to(device))
                for r in roles:
                    i = ROLE_INDEX[r]
                    self._calibrated[i] = True
                    if self.recipe.freeze_after_calibration:
                        self._frozen[i] = True
            amax = history[:, s].amax(dim=0)  # NaN in the window propagates (torch.amax)
            previous = scale[s]
        new = scale_policy(amax, previous, self.recipe.margin)
        if self.mode is ScalingMode.DELAYED:
            assert self._scale is not None
            self._scale[s] = new
        return new

    def record(self, roles: Sequence[str], amax: torch.Tensor) -> None:
        """Append this call's amaxes of ``roles`` to their histories, after the call has run (delayed,
        not frozen; a no-op in current mode). ``amax``: (len(roles),) on the state's device."""
        if self.mode is ScalingMode.CURRENT:
            return
        self._see(roles, amax)
        keep = [r for r in roles if not self.frozen(r)]
        if not keep:
            return
        self._ensure(amax.device)
        if len(keep) == len(roles):
            self._write(roles, amax)
        else:
            for r in keep:
                j = list(roles).index(r)
                self._write((r,), amax[j : j + 1])

    def _see(self, roles: Sequence[str], amax: torch.Tensor) -> None:
        values = amax.detach().to(torch.float32).reshape(-1)
        for j, r in enumerate(roles):
            self._seen[r] = values[j]

    def _write(self, roles: Sequence[str], amax: torch.Tensor) -> None:
        self._see(roles, amax)
        history, _ = self._ensure(amax.device)
        idx = [ROLE_INDEX[r] for r in roles]
        rows = [self._recorded[i] % self.recipe.history_len for i in idx]
        values = amax.detach().to(torch.float32).reshape(-1)
        if len(set(rows)) == 1:
            history[rows[0], _slice(roles)] = values
        else:
            for j, (i, row) in enumerate(zip(idx, rows, strict=True)):
                history[row, i] = values[j]
        for i in idx:
            self._recorded[i] += 1
        self.generation += 1
