"""The pieces every known-bad kernel is built from, once: the forwarding wrapper, the emulation with a
change planted in one pass, and the small autograd functions the bugs share.

*The forwarding wrapper* (:func:`around`, and :class:`Forwarding` as a record's ``build``): a kernel
in the calling convention that hands every call to ``body(base, q, k, v, cu_q, cu_k, max_q, max_k,
softmax_scale, causal)``, where ``base`` is the correct kernel and the body is the buggy code around
it (argument defaults, index arithmetic, dispatch, a guard on the output). Every wrapper bug of the
registry, whoever reads it, goes through this one function.

*The emulation with a planted change* (:func:`patched_emulation`): the emulation's forward and
backward passes (:mod:`flamia_verify.kernels.emulation`), each run inside a context of its own (a
replaced step: another mask, another quantizer), with a design of its own, and dO mapped on its way
into the backward.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from flamia_verify.known_bad.record import Kernel

__all__ = [
    "Body",
    "Forwarding",
    "PassInfo",
    "around",
    "output",
    "run",
    "scale_of",
    "EditGrad",
    "STE",
    "patched_emulation",
]

#: body(base, q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale, causal): the buggy code around base
Body = Callable[..., Any]


def _identifier(name: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in name)


def around(base: Kernel, body: Body, *, name: str = "") -> Kernel:
    """The kernel that runs ``body`` around ``base`` in the calling convention (recipe: the base's)."""

    def kernel(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, softmax_scale=None, causal=False):
        return body(base, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal)

    kernel.__name__ = kernel.__qualname__ = _identifier(name or getattr(body, "__name__", "forwarding"))
    recipe = getattr(base, "recipe", None)
    if isinstance(recipe, str):
        kernel.recipe = recipe  # type: ignore[attr-defined]  # function attribute (kernels.metadata)
    return kernel


@dataclass(frozen=True)
class Forwarding:
    """A record's ``build`` for a wrapper bug: ``Forwarding(body, name)(base)`` is :func:`around`."""

    body: Body
    name: str = ""

    def __call__(self, base: Kernel) -> Kernel:
        return around(base, self.body, name=self.name)


def output(result: Any) -> torch.Tensor:
    """out of a kernel's result: the tensor, or the first of an ``(out, lse)`` tuple."""
    return result[0] if isinstance(result, (tuple, list)) else result


def run(fn: Kernel, q, k, v, cu_q, cu_k, max_q, max_k, scale, causal) -> torch.Tensor:
    """``fn`` called in the convention; its out (a returned lse dropped)."""
    return output(fn(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=scale, causal=causal))


def scale_of(q: torch.Tensor, softmax_scale) -> float:
    """The softmax scale a call means: the one passed, or headdim^-0.5 for None."""
    return q.shape[-1] ** -0.5 if softmax_scale is None else float(softmax_scale)


class EditGrad(torch.autograd.Function):
    """The identity forward; the backward hands ``edit(grad)`` to the input (a gradient post-step)."""

    @staticmethod
    def forward(ctx, x, edit):
        ctx.edit = edit
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return ctx.edit(g.clone()), None


class STE(torch.autograd.Function):
    """Forward ``fn(x)`` (a buggy rounding); the backward the identity (straight-through)."""

    @staticmethod
    def forward(ctx, x, fn):
        return fn(x)

    @staticmethod
    def backward(ctx, g):
        return g, None


@dataclass(frozen=True)
class PassInfo:
    """What a pass's context factory is told about the call: the offsets and (total_q, total_k, head_dim)."""

    cu_q: torch.Tensor
    cu_k: torch.Tensor
    shape: tuple[int, int, int]


#: a context factory of one pass: PassInfo -> a context manager the pass runs in
Within = Callable[[PassInfo], contextlib.AbstractContextManager]


class _Patched(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cu_q, cu_k, scale, causal, fwd_design, bwd_design, fwd, bwd, dout_map):
        from flamia_verify.kernels.emulation import forward_pass

        info = PassInfo(cu_q, cu_k, (q.shape[0], k.shape[0], q.shape[-1]))
        with fwd(info) if fwd else contextlib.nullcontext():
            out, lse2 = forward_pass(fwd_design, q, k, v, cu_q, cu_k, scale, causal)
        ctx.save_for_backward(q, k, v, out, lse2, cu_q, cu_k)
        ctx.scale, ctx.causal, ctx.design, ctx.bwd, ctx.dout_map, ctx.info = (
            scale,
            causal,
            bwd_design,
            bwd,
            dout_map,
            info,
        )
        return out

    @staticmethod
    def backward(ctx, dout):
        from flamia_verify.kernels.emulation import backward_pass

        q, k, v, out, lse2, cu_q, cu_k = ctx.saved_tensors
        if ctx.dout_map is not None:
            dout = ctx.dout_map(dout)
        info = PassInfo(cu_q, cu_k, ctx.info.shape)  # the offsets the backward pass is handed
        with ctx.bwd(info) if ctx.bwd else contextlib.nullcontext():
            dq, dk, dv = backward_pass(ctx.design, q, k, v, out, lse2, dout, cu_q, cu_k, ctx.scale, ctx.causal)
        return dq, dk, dv, None, None, None, None, None, None, None, None, None


def patched_emulation(
    fwd_design,
    bwd_design=None,
    *,
    forward: Within | None = None,
    backward: Within | None = None,
    dout: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> Kernel:
    """The emulation of ``fwd_design`` forward and ``bwd_design`` (default: the same) backward, each
    pass inside its context (``forward(info)``, ``backward(info)``; None: unchanged), dO passed
    through ``dout`` before the backward. The caller's autocast is left as it is (as a kernel
    written in torch ops that does not guard against it)."""
    bwd = fwd_design if bwd_design is None else bwd_design

    def kernel(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, softmax_scale=None, causal=False):
        return _Patched.apply(
            q, k, v, cu_seqlens_q, cu_seqlens_k, scale_of(q, softmax_scale), bool(causal), fwd_design, bwd, forward,
            backward, dout,
        )  # fmt: skip

    return kernel
