"""Kernels that do not repeat themselves bitwise in the backward, as atomics-based kernels
(FlashAttention-2's dQ, cuDNN, split-K) do not: a correct one, and leaking ones with the same noise.

``with_atomics_noise(kernel)`` runs ``kernel`` and moves a random 1 in 2^10 of the gradients'
elements by one unit in the last place, from a generator seeded by the clock: an fp32 sum taken in
another order and rounded to bf16 the other way. The information-flow checks must pass the correct
one (its differences are reported under reproducibility) and still fail the leaking ones.

Test fixtures, not known-bad records: the noise is a correct kernel's, and the leaking base is the
built-in known-bad design ``mxfp8-naive`` itself. The noise goes around the base through the known-bad
registry's forwarding wrapper.
"""

from __future__ import annotations

import time

import torch

from flamia_verify.kernels.designs import DESIGNS
from flamia_verify.kernels.emulation import make_kernel
from flamia_verify.known_bad import around

__all__ = ["NONDETERMINISTIC", "with_atomics_noise"]

#: the share of gradient elements a call rounds the other way
FLIP_SHARE = 2.0**-10


def _flip(x: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """``x`` with a random FLIP_SHARE of its nonzero elements moved one unit in the last place up or
    down (exact zeros, the masked positions' sums, stay zero in any order)."""
    pick = (torch.rand(x.shape, generator=g) < FLIP_SHARE).to(x.device) & (x != 0)
    up = (torch.rand(x.shape, generator=g) < 0.5).to(x.device)
    towards = torch.where(up, torch.full_like(x, float("inf")), torch.full_like(x, float("-inf")))
    return torch.where(pick, torch.nextafter(x, towards), x)


class _NoisyGrad(torch.autograd.Function):
    """The identity forward; the backward rounds a random share of the incoming gradient the other way."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return _flip(grad, torch.Generator().manual_seed(time.time_ns() & 0x7FFFFFFF))


def _noisy(fn, q, k, v, cq, ck, mq, mk, scale, causal):
    q, k, v = (_NoisyGrad.apply(x) if x.requires_grad else x for x in (q, k, v))
    return fn(q, k, v, cq, ck, mq, mk, softmax_scale=scale, causal=causal)


def with_atomics_noise(kernel, name: str):
    return around(kernel, _noisy, name=name)


#: name -> (kernel, the gating checks it must fail: none for the correct one)
NONDETERMINISTIC = {
    "bf16_atomics": (with_atomics_noise(make_kernel(DESIGNS["bf16"]), "bf16_atomics"), ()),
    "mxfp8_naive_atomics": (
        with_atomics_noise(make_kernel(DESIGNS["mxfp8-naive"]), "mxfp8_naive_atomics"),
        ("causal.forward", "causal.dq", "isolation.neighbours"),
    ),
}
