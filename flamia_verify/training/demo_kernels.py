"""Known-bad kernels for ``train-parity``: what a kernel that breaks causality does to training.

``future_leak``: the FLAMIA MXFP8 emulation with the causal diagonal moved one key to the right in
the forward and the backward (query i also sees key i + 1, the byte it must predict). Built from the
mutation table's edits (``mask.forward+1`` and ``mask.backward+1``), so the emulation itself stays
unpatched. Use it as ``--kernel flamia_verify.training.demo_kernels:future_leak``. It runs the
emulation on every device, which makes it far slower than a fused kernel on a GPU.

``next_token_leak``: the built-in ``flamia-mxfp8`` kernel (fused Triton on CUDA, the emulation on the
CPU) called on keys and values shifted one position left inside every document, so that the causal
query i attends to the keys and values of positions 1 .. i + 1: the byte it must predict included.
As fast as the fused kernel; the gradient flows back through the shift.
"""

from __future__ import annotations

import functools

__all__ = ["future_leak", "next_token_leak", "noisy", "temperature", "ladder", "LADDER_NOISE", "LADDER_TEMPERATURE"]


@functools.lru_cache(maxsize=1)
def _future_leak_kernel():
    from flamia_verify.mutation.build import Mutant, mutant_kernel
    from flamia_verify.mutation.table import by_name

    edits = by_name("mask.forward+1").edits + by_name("mask.backward+1").edits
    return mutant_kernel(
        Mutant("demo.future-leak", "mask", "forward and backward see one key past the diagonal", edits)
    )


def future_leak(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, softmax_scale=None, causal=False):
    """FLAMIA MXFP8 (emulation, any device) whose causal mask lets query i see key i + 1."""
    return _future_leak_kernel()(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale=softmax_scale, causal=causal
    )


future_leak.recipe = "mxfp8"  # type: ignore[attr-defined]


def _shift_left(x, cu):
    """x (total, heads, dim) with every document's rows moved one up (its last row repeated)."""
    import torch

    total = x.shape[0]
    idx = torch.arange(total, device=x.device) + 1
    ends = cu[1:].to(torch.long)
    lens = (cu[1:] - cu[:-1]).to(torch.long)
    last = torch.repeat_interleave(ends - 1, lens)
    return x.index_select(0, torch.minimum(idx, last))


@functools.lru_cache(maxsize=1)
def _mxfp8():
    """The built-in flamia-mxfp8 kernel, loaded once (loading builds every built-in)."""
    from flamia_verify.kernels import load_kernel

    return load_kernel("flamia-mxfp8").fn


def next_token_leak(
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, softmax_scale=None, causal=False
):
    """flamia-mxfp8 on keys and values shifted one position left: causal query i sees position i + 1."""
    return _mxfp8()(
        q,
        _shift_left(k, cu_seqlens_k),
        _shift_left(v, cu_seqlens_k),
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        softmax_scale=softmax_scale,
        causal=causal,
    )


next_token_leak.recipe = "mxfp8"  # type: ignore[attr-defined]


#: the rungs of the sensitivity ladder: relative RMSE of the noise added to O (the quantized designs
#: sit near 0.05 per call), and the relative error of the softmax temperature of the biased rung
LADDER_NOISE = (0.01, 0.03, 0.1)
LADDER_TEMPERATURE = 0.01


def noisy(baseline, r: float):
    """``baseline`` with unbiased noise of relative RMSE ``r`` added to its output: N(0, (r x the
    output's RMS)^2) per element, drawn from torch's global generator (so a seeded run repeats it);
    the gradient is the baseline's (the noise is a constant of the graph)."""
    import torch

    def kernel(q, k, v, cu_q, cu_k, mq, mk, *, softmax_scale=None, causal=False):
        out = baseline(q, k, v, cu_q, cu_k, mq, mk, softmax_scale=softmax_scale, causal=causal)
        rms = out.detach().float().pow(2).mean().sqrt()
        return out + (r * rms * torch.randn(out.shape, device=out.device)).to(out.dtype)

    kernel.recipe = "bf16"  # type: ignore[attr-defined]
    return kernel


def temperature(baseline, error: float):
    """``baseline`` with its softmax scale off by the relative ``error`` (a systematic bias: every row's
    weights a little too peaked)."""

    def kernel(q, k, v, cu_q, cu_k, mq, mk, *, softmax_scale=None, causal=False):
        scale = (softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5) * (1 + error)
        return baseline(q, k, v, cu_q, cu_k, mq, mk, softmax_scale=scale, causal=causal)

    kernel.recipe = "bf16"  # type: ignore[attr-defined]
    return kernel


def ladder(baseline) -> dict:
    """The rungs of known size, by name: noise of each of LADDER_NOISE, then the temperature error."""
    rungs = {f"noise {r:g}": noisy(baseline, r) for r in LADDER_NOISE}
    rungs[f"temperature {100 * LADDER_TEMPERATURE:+g} %"] = temperature(baseline, LADDER_TEMPERATURE)
    return rungs
