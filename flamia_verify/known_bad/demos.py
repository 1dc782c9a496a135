"""train-parity's planted kernels: what a kernel that breaks causality does to training, and the
calibrated ladder of rungs of known size. Each is a record of the known-bad registry (tag
``train-demo``); the functions below build them for ``--kernel`` and for ``--ladder``.

``future_leak`` (record ``demo.future-leak``): the FLAMIA MXFP8 emulation with the causal diagonal
moved one key to the right in the forward and the backward (query i also sees key i + 1, the byte it
must predict). Built from the source-edit family's edits (``mask.forward+1`` and ``mask.backward+1``),
so the emulation itself stays unpatched. Use it as ``--kernel flamia_verify.known_bad.demos:future_leak``
(or the older ``flamia_verify.training.demo_kernels:future_leak``). It runs the emulation on every
device, which makes it far slower than a fused kernel on a GPU.

``next_token_leak`` (record ``demo.next-token-leak``): the built-in ``flamia-mxfp8`` kernel (fused
Triton on CUDA, the emulation on the CPU) called on keys and values shifted one position left inside
every document, so that the causal query i attends to the keys and values of positions 1 .. i + 1:
the byte it must predict included. As fast as the fused kernel; the gradient flows back through the
shift.

The ladder (records ``ladder.*``, tag ``ladder``): the BF16 baseline with unbiased noise of relative
RMSE 0.01, 0.03 and 0.1 added to O, and with a 1 % softmax temperature error. ``ladder(baseline)``
builds every rung on the run's baseline.
"""

from __future__ import annotations

import functools

from flamia_verify.known_bad.edits import Mutant, SourceEdit
from flamia_verify.known_bad.forwarding import Forwarding, scale_of
from flamia_verify.known_bad.record import KNOWN_BAD, KnownBad
from flamia_verify.known_bad.table import by_name

__all__ = [
    "future_leak",
    "next_token_leak",
    "ladder",
    "LADDER_NOISE",
    "LADDER_TEMPERATURE",
    "DEMOS",
]

#: the rungs of the sensitivity ladder: relative RMSE of the noise added to O (the quantized designs
#: sit near 0.05 per call), and the relative error of the softmax temperature of the biased rung
LADDER_NOISE = (0.01, 0.03, 0.1)
LADDER_TEMPERATURE = 0.01

_CAUSAL = ("causal.forward", "causal.dq", "causal.dk_dv")


def _shift_left(x, cu):
    """x (total, heads, dim) with every document's rows moved one up (its last row repeated)."""
    import torch

    total = x.shape[0]
    idx = torch.arange(total, device=x.device) + 1
    ends = cu[1:].to(torch.long)
    lens = (cu[1:] - cu[:-1]).to(torch.long)
    last = torch.repeat_interleave(ends - 1, lens)
    return x.index_select(0, torch.minimum(idx, last))


def _next_token(fn, q, k, v, cq, ck, mq, mk, scale, causal):
    return fn(q, _shift_left(k, ck), _shift_left(v, ck), cq, ck, mq, mk, softmax_scale=scale, causal=causal)


def _noise(r: float):
    def body(fn, q, k, v, cq, ck, mq, mk, scale, causal):
        import torch

        out = fn(q, k, v, cq, ck, mq, mk, softmax_scale=scale, causal=causal)
        rms = out.detach().float().pow(2).mean().sqrt()
        return out + (r * rms * torch.randn(out.shape, device=out.device)).to(out.dtype)

    return body


def _temperature(error: float):
    def body(fn, q, k, v, cq, ck, mq, mk, scale, causal):
        return fn(q, k, v, cq, ck, mq, mk, softmax_scale=scale_of(q, scale) * (1 + error), causal=causal)

    return body


def _rung(name: str, label: str, why: str, body) -> KnownBad:
    return KnownBad(
        f"ladder.{name}",
        "ladder",
        why,
        Forwarding(body, f"ladder.{name}"),
        base="bf16",
        recipe="bf16",
        tags=("train-demo", "ladder"),
        attrs=(("rung", label),),
    )


DEMOS: tuple[KnownBad, ...] = KNOWN_BAD.register(
    KnownBad(
        "demo.future-leak",
        "mask",
        "the causal diagonal one key to the right in the forward and the backward: query i also sees key i + 1",
        SourceEdit(
            Mutant(
                "demo.future-leak",
                "mask",
                "forward and backward see one key past the diagonal",
                by_name("mask.forward+1").edits + by_name("mask.backward+1").edits,
            )
        ),
        catches=_CAUSAL,
        where="causal calls",
        tags=("train-demo",),
    ),
    KnownBad(
        "demo.next-token-leak",
        "causal",
        "keys and values shifted one position left inside every document: causal query i sees position i + 1",
        Forwarding(_next_token, "next_token_leak"),
        catches=_CAUSAL,
        where="causal calls",
        tags=("train-demo",),
    ),
    *(
        _rung(f"noise-{r:g}", f"noise {r:g}", f"unbiased noise of relative RMSE {r:g} added to O", _noise(r))
        for r in LADDER_NOISE
    ),
    _rung(
        f"temperature{100 * LADDER_TEMPERATURE:+g}%",
        f"temperature {100 * LADDER_TEMPERATURE:+g} %",
        f"the softmax scale off by {100 * LADDER_TEMPERATURE:+g} % (every row's weights a little too peaked)",
        _temperature(LADDER_TEMPERATURE),
    ),
    origin=__name__,
)


@functools.lru_cache(maxsize=1)
def _future_leak_kernel():
    return KNOWN_BAD.kernel("demo.future-leak")


def future_leak(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, softmax_scale=None, causal=False):
    """FLAMIA MXFP8 (emulation, any device) whose causal mask lets query i see key i + 1."""
    return _future_leak_kernel()(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale=softmax_scale, causal=causal
    )


future_leak.recipe = "mxfp8"  # type: ignore[attr-defined]


@functools.lru_cache(maxsize=1)
def _next_token_leak_kernel():
    """The record built on the built-in flamia-mxfp8 (fused on CUDA), loaded once (loading builds every built-in)."""
    from flamia_verify.kernels import load_kernel

    return KNOWN_BAD.kernel("demo.next-token-leak", base=load_kernel("flamia-mxfp8").fn)


def next_token_leak(
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, softmax_scale=None, causal=False
):
    """flamia-mxfp8 on keys and values shifted one position left: causal query i sees position i + 1."""
    return _next_token_leak_kernel()(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale=softmax_scale, causal=causal
    )


next_token_leak.recipe = "mxfp8"  # type: ignore[attr-defined]


def ladder(baseline) -> dict:
    """The rungs of known size, by name, each built on ``baseline``: noise of each of LADDER_NOISE,
    then the temperature error (the registry's ``ladder`` records, in order)."""
    return {dict(r.attrs)["rung"]: r.kernel(base=baseline) for r in KNOWN_BAD.select(tag="ladder")}
