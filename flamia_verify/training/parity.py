"""Train one small model per kernel from one seed and compare the final validation losses with BF16's
seed-to-seed spread.

For every kernel: the same initial weights (``seed``), the same batches (drawn once from the corpus
with ``seed``), AdamW with linear warm-up and cosine decay, gradient clipping at 1. The BF16 kernel
also runs with ``bf16_seeds - 1`` further seeds (other weights and other batches): the sample
standard deviation of its final validation losses is the noise floor sigma. Each kernel's *gap* is
(its final validation loss - BF16's at ``seed``) / sigma, measured twice: with the kernel itself
(what training saw) and with the float64 reference attention in every layer (the *exact
evaluation*: a kernel that leaks the future looks good on its own and fails here). A kernel fails
when either |gap| exceeds ``max_gap`` (default 3). Also recorded per kernel: train loss per step,
validation loss every ``eval_every`` steps (both ways), the gradient norm per step, and the
attention output's relative RMSE against the exact kernel on the same q, k, v during evaluation.

A kernel that is a factory of stateful instances (``new_instance()``: ``cudnn-fp8``, ``fp8-delayed``)
gets one instance per attention layer, as a model builds them (:func:`~flamia_verify.kernels.state.
layer_kernels`), used for training and for its own evaluation; any other kernel is the one function
in every layer. Each kernel's row says which (``state``).
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace

import torch
import torch.nn.functional as F

from flamia_verify.errors import ConfigError
from flamia_verify.kernels.state import declared_state, is_factory, layer_kernels
from flamia_verify.training.corpus import Corpus, build_corpus, make_batches
from flamia_verify.training.model import AttentionProbe, ModelConfig, TinyLM

__all__ = [
    "ParityConfig",
    "PRESETS",
    "TrainResult",
    "make_optimizer",
    "train_step",
    "train_one",
    "run_parity",
    "SCHEMA",
]

SCHEMA = "flamia-verify/train-parity/v1"


@dataclass(frozen=True)
class ParityConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    steps: int = 300
    tokens: int = 8192  # tokens per step (one packed varlen batch)
    max_len: int = 512  # longest window (document) of a batch
    lr: float = 2e-3
    warmup: int = 30
    weight_decay: float = 0.1
    eval_every: int = 50
    val_batches: int = 8
    bf16_seeds: int = 3
    seed: int = 0
    max_gap: float = 3.0  # |gap| in units of the BF16 spread above which a kernel fails
    corpus_max_bytes: int | None = None

    def to_dict(self) -> dict:
        d = asdict(self)
        d["model"] = self.model.to_dict()
        return d


PRESETS: dict[str, ParityConfig] = {
    # CPU tests and a first look: seconds per kernel with an emulated kernel
    "tiny": ParityConfig(
        model=ModelConfig(layers=2, d_model=64, heads=2),
        steps=30,
        tokens=1024,
        max_len=128,
        lr=3e-3,
        warmup=5,
        eval_every=10,
        val_batches=2,
        corpus_max_bytes=3_000_000,
    ),
    # the GPU run of docs/training.md: 6 layers, d_model 512, 8 heads of 64
    "small": ParityConfig(model=ModelConfig(layers=6, d_model=512, heads=8), steps=300, tokens=8192, max_len=512),
}


@dataclass
class TrainResult:
    kernel: str
    seed: int
    steps: list[int]
    train_loss: list[float]
    grad_norm: list[float]
    eval_steps: list[int]
    val_loss: list[float]
    val_loss_exact: list[float]
    attn_rel_rmse: list[float]
    tokens_seen: int
    seconds: float
    diverged_at: int | None = None  # the step whose loss or gradient norm was not finite

    @property
    def final_val(self) -> float:
        return self.val_loss[-1]

    @property
    def final_val_exact(self) -> float:
        return self.val_loss_exact[-1]


def _lr(cfg: ParityConfig, step: int) -> float:
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    t = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))


def _autocast(device: str):
    return torch.autocast(device_type="cuda" if device.startswith("cuda") else "cpu", dtype=torch.bfloat16)


def _loss(model, batch, kernel, device, probe=None) -> torch.Tensor:
    with _autocast(device):
        logits = model(batch.tokens, batch.cu_seqlens, batch.max_seqlen, kernel, probe)
    return F.cross_entropy(logits.float(), batch.targets)


@torch.no_grad()
def _evaluate(model, batches, kernel, device, probe=None) -> float:
    total, n = 0.0, 0
    for b in batches:
        t = int(b.tokens.numel())
        total += float(_loss(model, b, kernel, device, probe)) * t
        n += t
    return total / n


def make_optimizer(model: torch.nn.Module, cfg: ParityConfig) -> torch.optim.AdamW:
    """AdamW (beta 0.9, 0.95) with weight decay on the matrices only."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": rest, "weight_decay": 0.0}],
        lr=cfg.lr,
        betas=(0.9, 0.95),
    )


def train_step(
    model: TinyLM, opt: torch.optim.Optimizer, cfg: ParityConfig, step: int, batch, kernel, device
) -> tuple[float, float]:
    """One optimizer step on ``batch`` with ``kernel`` in every attention layer: the learning rate of
    ``step``, forward, backward, gradient clipping at 1, AdamW. Returns (loss, gradient norm); a
    non-finite loss or norm skips the update (and its backward, for the loss)."""
    for group in opt.param_groups:
        group["lr"] = _lr(cfg, step)
    loss = _loss(model, batch, kernel, device)
    opt.zero_grad(set_to_none=True)
    gn = float("nan")
    if torch.isfinite(loss):
        loss.backward()
        gn = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
    if math.isfinite(gn):
        opt.step()
    return float(loss.detach()), gn


def train_one(
    kernel: Callable,
    name: str,
    cfg: ParityConfig,
    corpus: Corpus,
    *,
    seed: int,
    device: str,
    exact: Callable,
    val,
    on_step: Callable[[str, int, float], None] | None = None,
) -> TrainResult:
    """Train one model with ``kernel`` in every attention layer (one instance per layer when the kernel
    is a factory of stateful instances: ``new_instance()``, as a model builds them); ``exact`` evaluates
    it as well."""
    torch.manual_seed(seed)
    model = TinyLM(cfg.model).to(device)
    kernels = layer_kernels(kernel, cfg.model.layers)
    batches = [
        b.to(device) for b in make_batches(corpus.train, n=cfg.steps, tokens=cfg.tokens, max_len=cfg.max_len, seed=seed)
    ]
    opt = make_optimizer(model, cfg)
    res = TrainResult(name, seed, [], [], [], [], [], [], [], 0, 0.0)
    t0 = time.perf_counter()

    def evaluate(step: int) -> None:
        model.eval()
        probe = AttentionProbe(exact)
        res.eval_steps.append(step)
        res.val_loss.append(_evaluate(model, val, kernels, device, probe))
        res.attn_rel_rmse.append(probe.rel_rmse)
        res.val_loss_exact.append(_evaluate(model, val, exact, device))
        model.train()

    for step, batch in enumerate(batches):
        loss, gn = train_step(model, opt, cfg, step, batch, kernels, device)
        res.steps.append(step)
        res.train_loss.append(loss)
        res.grad_norm.append(gn)
        if not math.isfinite(gn):
            # the run diverged: a finding about the kernel, not a crash of the tool; its row fails
            res.diverged_at = step
            for series in (res.val_loss, res.val_loss_exact, res.attn_rel_rmse):
                series.append(float("nan"))
            res.eval_steps.append(step)
            break
        res.tokens_seen += int(batch.tokens.numel())
        if on_step is not None:
            on_step(name, step, loss)
        if (step + 1) % cfg.eval_every == 0 or step + 1 == cfg.steps:
            evaluate(step + 1)
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)
    res.seconds = time.perf_counter() - t0
    return res


def run_parity(
    kernels: dict[str, Callable],
    cfg: ParityConfig,
    *,
    device: str = "cpu",
    baseline: Callable,
    exact: Callable,
    corpus: Corpus | None = None,
    on_step: Callable[[str, int, float], None] | None = None,
    on_run: Callable[[TrainResult], None] | None = None,
) -> dict:
    """Train BF16 (``baseline``) over ``cfg.bf16_seeds`` seeds and every kernel of ``kernels`` (name ->
    callable) at ``cfg.seed``; return the result document (schema ``flamia-verify/train-parity/v1``)."""
    if cfg.bf16_seeds < 2:
        raise ConfigError(f"the noise floor needs at least 2 BF16 seeds, got {cfg.bf16_seeds}")
    if cfg.steps < 1 or cfg.eval_every < 1:
        raise ConfigError("steps and eval_every must be >= 1")
    corpus = corpus or build_corpus(max_bytes=cfg.corpus_max_bytes)
    val = [
        b.to(device)
        for b in make_batches(
            corpus.val, n=cfg.val_batches, tokens=cfg.tokens, max_len=cfg.max_len, seed=10_000 + cfg.seed
        )
    ]
    runs: list[TrainResult] = []

    def go(fn, name, seed):
        r = train_one(fn, name, cfg, corpus, seed=seed, device=device, exact=exact, val=val, on_step=on_step)
        runs.append(r)
        if on_run is not None:
            on_run(r)
        return r

    base = [go(baseline, "bf16", cfg.seed + i) for i in range(cfg.bf16_seeds)]
    bad = [r.seed for r in base if r.diverged_at is not None]
    if bad:
        raise FloatingPointError(f"the BF16 baseline diverged (seeds {bad}): no noise floor; lower the learning rate")
    ref = base[0]
    sigma = statistics.stdev([r.final_val for r in base])
    sigma_exact = statistics.stdev([r.final_val_exact for r in base])
    rows = []
    for name, fn in kernels.items():
        r = ref if name == "bf16" else go(fn, name, cfg.seed)
        gap = _in_sigmas(r.final_val - ref.final_val, sigma)
        gap_exact = _in_sigmas(r.final_val_exact - ref.final_val_exact, sigma_exact)
        gn_ratio = _tail_mean(r.grad_norm) / _tail_mean(ref.grad_norm)
        passed = r.diverged_at is None and abs(gap) <= cfg.max_gap and abs(gap_exact) <= cfg.max_gap
        if r.diverged_at is not None:
            gap = gap_exact = math.inf
        rows.append(
            {
                "diverged_at": r.diverged_at,
                "kernel": name,
                "final_val_loss": r.final_val,
                "final_val_loss_exact": r.final_val_exact,
                "gap_sigmas": gap,
                "gap_sigmas_exact": gap_exact,
                "delta_val_loss": r.final_val - ref.final_val,
                "delta_val_loss_exact": r.final_val_exact - ref.final_val_exact,
                "grad_norm_ratio": gn_ratio,
                "attn_rel_rmse_final": r.attn_rel_rmse[-1],
                "status": "pass" if passed else "fail",
                "seconds": r.seconds,
                "tokens_seen": r.tokens_seen,
                "state": _state_words(fn),
            }
        )
    return _finite_json(
        {
            "schema": SCHEMA,
            "config": cfg.to_dict(),
            "device": device,
            "corpus": {
                "root": corpus.root,
                "fingerprint": corpus.fingerprint,
                "train_documents": len(corpus.train),
                "val_documents": len(corpus.val),
                "train_bytes": corpus.train_bytes,
                "val_bytes": corpus.val_bytes,
            },
            "noise": {
                "bf16_final_val": [r.final_val for r in base],
                "sigma": sigma,
                "bf16_final_val_exact": [r.final_val_exact for r in base],
                "sigma_exact": sigma_exact,
            },
            "kernels": rows,
            "runs": [asdict(r) for r in runs],
            "passed": all(row["status"] == "pass" for row in rows),
        }
    )


def _state_words(fn: Callable) -> str:
    """How the kernel's state was used: one instance per layer (a factory) or one function everywhere."""
    try:
        policy = declared_state(fn)
    except ValueError:
        policy = None
    said = "no state declared" if policy is None else policy.describe()
    return f"{said}; {'one instance per layer' if is_factory(fn) else 'one function in every layer'}"


def _finite_json(x):
    """NaN and infinities as strings (report.json's convention: strict JSON readers refuse NaN)."""
    if isinstance(x, float) and not math.isfinite(x):
        return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")
    if isinstance(x, dict):
        return {k: _finite_json(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_finite_json(v) for v in x]
    return x


def _in_sigmas(delta: float, sigma: float) -> float:
    """delta / sigma; with no spread (sigma 0 or not finite) only an exact tie is 0, anything else inf."""
    if sigma > 0 and math.isfinite(sigma):
        return delta / sigma
    return 0.0 if delta == 0 else math.inf


def _tail_mean(xs: list[float], frac: float = 0.2) -> float:
    n = max(1, int(len(xs) * frac))
    return sum(xs[-n:]) / n


def with_overrides(cfg: ParityConfig, **kw) -> ParityConfig:
    """``cfg`` with the non-None keyword values replaced (command-line flags)."""
    return replace(cfg, **{k: v for k, v in kw.items() if v is not None})
