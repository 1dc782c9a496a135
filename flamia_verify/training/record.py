"""Record the attention calls of a few train-parity training steps into a capture.

    from flamia_verify.training.record import record_training_steps
    record_training_steps("captures/tiny", preset="tiny", steps=2)    # seconds on a CPU
    record_training_steps("captures/tiny-trained", preset="tiny", steps=1, warmup_steps=400)

Each step is one optimizer step of train-parity (``train_step``: the preset's model, forward,
backward, AdamW) on a packed batch of the standard-library corpus, with the kernel of every attention
layer wrapped by :func:`flamia_verify.capture.recording`: the capture holds each layer's q, k, v,
cu_seqlens, max_seqlen, softmax_scale and causal, and the gradient of its output (dout). Layer i of
the model is layer i of the capture; step s is the s-th optimizer step. The same seed, preset,
kernel and corpus give the same tensors (on one machine and thread count), so the same hashes.

With ``warmup_steps``, that many optimizer steps run first without recording (the same kernel, the
same learning-rate schedule over ``warmup_steps + steps`` steps), so that the recorded calls are those
of a partly trained model rather than of its initialization; step 0 of the capture is then the
optimizer step ``warmup_steps`` of the run (``meta.warmup_steps`` says so).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from flamia_verify.capture import recording
from flamia_verify.errors import ConfigError
from flamia_verify.kernels import load_kernel
from flamia_verify.training.corpus import Corpus, build_corpus, make_batches
from flamia_verify.training.model import TinyLM
from flamia_verify.training.parity import PRESETS, make_optimizer, train_step, with_overrides

__all__ = ["record_training_steps"]


def record_training_steps(
    out_dir: str | Path,
    *,
    preset: str = "tiny",
    steps: int = 2,
    tokens: int | None = None,
    kernel: str | Callable[..., Any] = "bf16",
    seed: int = 0,
    device: str = "cpu",
    corpus: Corpus | None = None,
    warmup_steps: int = 0,
    **options: Any,
) -> Path:
    """Train ``steps`` optimizer steps of the ``preset`` model (``tokens`` per step: default the
    preset's) with ``kernel`` (a kernel spec or a function in the varlen convention; default the
    built-in ``bf16``) in every attention layer, recording its calls into ``out_dir``; return
    ``out_dir``. ``options`` go to :class:`flamia_verify.capture.Recorder` (``calls``, ``every``,
    ``select``, ``max_bytes``, ``meta``). ``warmup_steps``: optimizer steps trained before the
    recorded ones, unrecorded (the learning-rate schedule spans both)."""
    if preset not in PRESETS:
        raise ConfigError(f"unknown preset {preset!r}; choose one of: {', '.join(PRESETS)}")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ConfigError(f"steps must be an int >= 1, got {steps!r}")
    if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 0:
        raise ConfigError(f"warmup_steps must be an int >= 0, got {warmup_steps!r}")
    total = warmup_steps + steps
    cfg = with_overrides(PRESETS[preset], tokens=tokens, steps=total)
    if isinstance(kernel, str):
        name, fn = kernel, load_kernel(kernel).fn
    else:
        name, fn = getattr(kernel, "__name__", type(kernel).__name__), kernel
    corpus = corpus if corpus is not None else build_corpus(max_bytes=cfg.corpus_max_bytes)
    torch.manual_seed(seed)
    model = TinyLM(cfg.model).to(device)
    batches = make_batches(corpus.train, n=total, tokens=cfg.tokens, max_len=cfg.max_len, seed=seed)
    opt = make_optimizer(model, cfg)
    meta = {
        "preset": preset,
        "model_config": cfg.model.to_dict(),
        "steps": steps,
        **({"warmup_steps": warmup_steps} if warmup_steps else {}),
        "tokens": cfg.tokens,
        "max_len": cfg.max_len,
        "seed": seed,
        "kernel": name,
        "device": device,
        "corpus_fingerprint": corpus.fingerprint,
        **dict(options.pop("meta", None) or {}),
    }
    for step, batch in enumerate(batches[:warmup_steps]):
        train_step(model, opt, cfg, step, batch.to(device), fn, device)
    with recording(fn, out_dir, model=f"train-parity {preset}", meta=meta, **options) as attn:
        for step, batch in enumerate(batches[warmup_steps:], start=warmup_steps):
            train_step(model, opt, cfg, step, batch.to(device), attn, device)
            attn.next_step()
    return Path(out_dir)
