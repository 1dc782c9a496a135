"""Record the attention calls of a few train-parity training steps into a capture.

    from flamia_verify.training.record import record_training_steps
    record_training_steps("captures/tiny", preset="tiny", steps=2)    # seconds on a CPU

Each step is one optimizer step of train-parity (``train_step``: the preset's model, forward,
backward, AdamW) on a packed batch of the standard-library corpus, with the kernel of every attention
layer wrapped by :func:`flamia_verify.capture.recording`: the capture holds each layer's q, k, v,
cu_seqlens, max_seqlen, softmax_scale and causal, and the gradient of its output (dout). Layer i of
the model is layer i of the capture; step s is the s-th optimizer step. The same seed, preset,
kernel and corpus give the same tensors (on one machine and thread count), so the same hashes.
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
    **options: Any,
) -> Path:
    """Train ``steps`` optimizer steps of the ``preset`` model (``tokens`` per step: default the
    preset's) with ``kernel`` (a kernel spec or a function in the varlen convention; default the
    built-in ``bf16``) in every attention layer, recording its calls into ``out_dir``; return
    ``out_dir``. ``options`` go to :class:`flamia_verify.capture.Recorder` (``calls``, ``every``,
    ``select``, ``max_bytes``, ``meta``)."""
    if preset not in PRESETS:
        raise ConfigError(f"unknown preset {preset!r}; choose one of: {', '.join(PRESETS)}")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ConfigError(f"steps must be an int >= 1, got {steps!r}")
    cfg = with_overrides(PRESETS[preset], tokens=tokens, steps=steps)
    if isinstance(kernel, str):
        name, fn = kernel, load_kernel(kernel).fn
    else:
        name, fn = getattr(kernel, "__name__", type(kernel).__name__), kernel
    corpus = corpus if corpus is not None else build_corpus(max_bytes=cfg.corpus_max_bytes)
    torch.manual_seed(seed)
    model = TinyLM(cfg.model).to(device)
    batches = make_batches(corpus.train, n=steps, tokens=cfg.tokens, max_len=cfg.max_len, seed=seed)
    opt = make_optimizer(model, cfg)
    meta = {
        "preset": preset,
        "model_config": cfg.model.to_dict(),
        "steps": steps,
        "tokens": cfg.tokens,
        "max_len": cfg.max_len,
        "seed": seed,
        "kernel": name,
        "device": device,
        "corpus_fingerprint": corpus.fingerprint,
        **dict(options.pop("meta", None) or {}),
    }
    with recording(fn, out_dir, model=f"train-parity {preset}", meta=meta, **options) as attn:
        for step, batch in enumerate(batches):
            train_step(model, opt, cfg, step, batch.to(device), attn, device)
            attn.next_step()
    return Path(out_dir)
