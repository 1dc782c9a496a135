"""The process state a kernel call must leave as it found it.

A kernel runs inside someone's training process. Besides its inputs (``interface.inputs_unmodified``)
it can change what every later operation of that process does: torch's default dtype, the grad mode,
the matmul precision flags, torch's deterministic mode, cuDNN's flags, the thread count, the current
CUDA device, and the global random generators. :class:`StateProbe` reads all of these before a call
and after its backward and names what changed (``interface.process_state`` judges every call of a
run).

The random generators may be drawn from (a kernel with dropout advances them), never reseeded: a
backward that calls ``torch.manual_seed`` to replay its forward's dropout makes every later draw of
the process (data order, dropout masks, sampling) repeat. A reseed to the generator's own seed leaves
``initial_seed()`` unchanged, so during the call the probe gives each global generator a state of its
own that is one draw past a fresh seed: a reseed shows as the fresh state (or another seed) after the
call. The caller's generator states are put back afterwards, so a checked call changes no random
stream of the process.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["StateChange", "StateProbe", "flags"]

#: the first seed of the probe states the global generators hold during calls (each probe the next
#: one, so that a kernel drawing random numbers draws other numbers on every call, as it would unprobed)
PROBE_SEED = 0x5EED_F1A
_probes = itertools.count()


def flags(device: torch.device) -> dict[str, Any]:
    """The process-wide settings a kernel must not change, by name."""
    f: dict[str, Any] = {
        "torch.get_default_dtype()": torch.get_default_dtype(),
        "torch.is_grad_enabled()": torch.is_grad_enabled(),
        "torch.is_inference_mode_enabled()": torch.is_inference_mode_enabled(),
        "torch.are_deterministic_algorithms_enabled()": torch.are_deterministic_algorithms_enabled(),
        "torch.get_float32_matmul_precision()": torch.get_float32_matmul_precision(),
        "torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction": (
            torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction
        ),
        "torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction": (
            torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction
        ),
        "torch.backends.cudnn.allow_tf32": torch.backends.cudnn.allow_tf32,
        "torch.backends.cudnn.deterministic": torch.backends.cudnn.deterministic,
        "torch.backends.cudnn.benchmark": torch.backends.cudnn.benchmark,
        "torch.get_num_threads()": torch.get_num_threads(),
    }
    if device.type == "cuda" and torch.cuda.is_initialized():
        f["torch.cuda.current_device()"] = torch.cuda.current_device()
    return f


@dataclass(frozen=True)
class StateChange:
    """One setting a call left changed (``what``: the expression that reads it)."""

    what: str
    before: str
    after: str


def _cpu_state_at(seed: int, *, draws: int) -> torch.Tensor:
    """A CPU (MT19937) generator state: freshly seeded, then ``draws`` single draws on."""
    g = torch.Generator()
    g.manual_seed(seed)
    for _ in range(draws):
        torch.rand(1, generator=g)
    return g.get_state()


def _reseeded(
    generator: str, seed: int, probe_seed: int, state: torch.Tensor, fresh: torch.Tensor
) -> list[StateChange]:
    """What a call did to a generator that held a probe state one draw past ``probe_seed``: reseeded
    to another seed, reset to its own seed's start, or nothing (drawn from, or left)."""
    if seed != probe_seed:
        return [StateChange(f"{generator}.initial_seed()", "unchanged", f"reseeded to {seed}")]
    if torch.equal(state, fresh):
        return [StateChange(f"{generator}.get_rng_state()", "as the call left it", "reset to its seed's start")]
    return []


class StateProbe:
    """Read the process state when made; :meth:`finish` reads it again, puts the caller's random
    generators back and returns the changes."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.before = flags(device)
        self.seed = PROBE_SEED + next(_probes)
        self.cpu_saved = torch.get_rng_state()
        torch.set_rng_state(_cpu_state_at(self.seed, draws=1))
        self.cuda_saved: torch.Tensor | None = None
        if device.type == "cuda" and torch.cuda.is_initialized():
            saved = torch.cuda.get_rng_state(device)
            try:  # a Philox state one step past a fresh seed; any other state layout: no CUDA probe
                torch.cuda.manual_seed(self.seed)
                torch.cuda.set_rng_state(_cuda_state_at(self.seed, offset=4), device)
                if not torch.equal(torch.cuda.get_rng_state(device), _cuda_state_at(self.seed, offset=4)):
                    raise ValueError("unexpected CUDA generator state layout")
                self.cuda_saved = saved
            except (RuntimeError, ValueError):
                torch.cuda.set_rng_state(saved, device)

    def finish(self) -> list[StateChange]:
        changes: list[StateChange] = []
        after = flags(self.device)
        for what, value in self.before.items():
            if after.get(what) != value:
                changes.append(StateChange(what, str(value), str(after.get(what))))
        fresh = _cpu_state_at(self.seed, draws=0)
        changes += _reseeded("torch", torch.initial_seed(), self.seed, torch.get_rng_state(), fresh)
        torch.set_rng_state(self.cpu_saved)
        if self.cuda_saved is not None:
            state = torch.cuda.get_rng_state(self.device)
            fresh = _cuda_state_at(self.seed, offset=0)
            changes += _reseeded("torch.cuda", torch.cuda.initial_seed(), self.seed, state, fresh)
            torch.cuda.set_rng_state(self.cuda_saved, self.device)
        return changes


def _cuda_state_at(seed: int, *, offset: int) -> torch.Tensor:
    """A CUDA (Philox) generator state: its seed and offset as two little-endian 64-bit integers."""
    return torch.tensor([seed, offset], dtype=torch.int64).view(torch.uint8)
