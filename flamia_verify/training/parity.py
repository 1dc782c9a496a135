"""Train one small model per kernel and seed, and judge each kernel by its paired gap to BF16.

For every seed s and every kernel: the same initial weights (``s``), the same batches (drawn from the
corpus with ``s``), AdamW with linear warm-up and cosine decay, gradient clipping at 1; BF16 trains at
every seed too. The quantity judged is the *paired difference* d_s = L(kernel, s) - L(BF16, s) of the
final validation loss (one fixed held-out token set for every run): its mean over the seeds with a
Student t confidence interval (``level``, 95 % by default). A kernel fails when the interval lies
wholly above ``tolerance`` or wholly below ``-tolerance`` (default 0: any difference the run resolves),
with its own attention or with the float64 reference attention in every layer (the *exact
evaluation*: a kernel that leaks the future looks good on its own and fails there).

What the run can resolve is measured, not assumed. Two floors (``floors``): BF16 against itself
(each seed run twice: run-to-run non-determinism) and BF16 against an equivalent BF16 kernel that
rounds differently (``floor_kernel``: the chaos a last-bit difference grows into). The *minimum
detectable gap* is tolerance + t(level, n - 1) x sd / sqrt(n), sd the standard deviation of the
second floor's paired differences (of the kernels' own where no floor ran): the smallest |mean gap|
the gate calls significant. A ladder of planted kernels of known size (``ladder``: BF16 with relative
noise of RMSE 0.01, 0.03, 0.1 on O, and a 1 % softmax temperature error) shows where known gaps land;
a rung whose gap is at least the minimum detectable gap and that the gate does not flag makes the run
invalid (the tool failed, not a kernel). Also recorded per run: train loss per step, validation loss
every ``eval_every`` steps (both ways), the gradient norm per step, and the attention output's
relative RMSE against the exact kernel on the same q, k, v during evaluation.

A kernel that is a factory of stateful instances (``new_instance()``: ``cudnn-fp8``, ``fp8-delayed``)
gets one instance per attention layer at every seed, as a model builds them
(:func:`~flamia_verify.kernels.state.layer_kernels`), used for training and for its own evaluation;
any other kernel is the one function in every layer. Each kernel's row says which (``state``).

A run can be continued: every finished training carries the fingerprint of what it depends on
(:func:`run_fingerprint`: the configuration, the corpus, the device, torch and this package), and
``finished`` hands :func:`run_parity` the records of an earlier, interrupted run (``asdict`` of its
:class:`TrainResult` records); a record whose fingerprint, name and seed match is taken as it is
instead of training again. ``flamia-verify train-parity --resume`` keeps them in a journal beside
the reports.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import statistics
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field, fields, replace

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
    "judge_rung",
    "run_fingerprint",
    "SCHEMA",
]

SCHEMA = "flamia-verify/train-parity/v2"


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
    seeds: int = 3  # paired seeds: BF16 and every kernel train at seed, seed + 1, ...
    seed: int = 0
    tolerance: float = 0.0  # nats: an interval wholly beyond +-tolerance fails
    level: float = 0.95  # confidence level of the paired gap's interval
    floors: bool = True  # measure the two noise floors (BF16 twice; BF16 against floor_kernel)
    floor_kernel: str = "sdpa-math"  # an equivalent BF16 kernel that rounds differently
    ladder: bool = False  # train the planted rungs of known size too
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
        seeds=2,
        corpus_max_bytes=3_000_000,
    ),
    # the GPU run of docs/training.md: 6 layers, d_model 512, 8 heads of 64
    "small": ParityConfig(model=ModelConfig(layers=6, d_model=512, heads=8), steps=300, tokens=8192, max_len=512),
    # sized for resolution on one GPU (docs/training.md "Resolution"): a smaller model, more seeds and a
    # larger held-out set; a paired gap's spread shrinks with the chaos of the run, which a short run
    # at a moderate learning rate keeps small
    "resolution": ParityConfig(
        model=ModelConfig(layers=4, d_model=256, heads=4),
        steps=200,
        tokens=8192,
        max_len=512,
        lr=1e-3,
        warmup=20,
        eval_every=50,
        val_batches=32,
        seeds=5,
    ),
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
    val_token_sd: float = float("nan")  # the spread of the per-token losses at the last evaluation
    val_tokens: int = 0
    fingerprint: str = ""  # what the run depends on (run_fingerprint); "" for a run outside run_parity
    resumed: bool = False  # taken from an earlier run's journal, not trained in this one

    @classmethod
    def from_dict(cls, record: dict) -> TrainResult:
        """A result from ``asdict`` of one (a journal line); unknown keys are ignored."""
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in record.items() if k in names})

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
def _evaluate(model, batches, kernel, device, probe=None) -> tuple[float, float, int]:
    """(mean, sd, count) of the per-token validation losses."""
    losses = []
    for b in batches:
        with _autocast(device):
            logits = model(b.tokens, b.cu_seqlens, b.max_seqlen, kernel, probe)
        losses.append(F.cross_entropy(logits.float(), b.targets, reduction="none").double())
    every = torch.cat(losses)
    return float(every.mean()), float(every.std()) if every.numel() > 1 else 0.0, int(every.numel())


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
        mean, sd, n = _evaluate(model, val, kernels, device, probe)
        res.val_loss.append(mean)
        res.val_token_sd, res.val_tokens = sd, n
        res.attn_rel_rmse.append(probe.rel_rmse)
        res.val_loss_exact.append(_evaluate(model, val, exact, device)[0])
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


def run_fingerprint(cfg: ParityConfig, corpus: Corpus, device: str) -> str:
    """What a trained run depends on besides its kernel, name and seed, as a short hash: the
    configuration, the corpus, the device (its GPU model on CUDA), torch's version and this package's.
    A journal's run is reused only under the same fingerprint."""
    from flamia_verify._version import __version__

    where = torch.cuda.get_device_name(torch.device(device)) if device.startswith("cuda") else "cpu"
    text = json.dumps(
        {"config": cfg.to_dict(), "corpus": corpus.fingerprint, "device": where, "torch": torch.__version__,
         "flamia_verify": __version__},
        sort_keys=True,
        default=str,
    )  # fmt: skip
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def run_parity(
    kernels: dict[str, Callable],
    cfg: ParityConfig,
    *,
    device: str = "cpu",
    baseline: Callable,
    exact: Callable,
    corpus: Corpus | None = None,
    floor_kernel: Callable | None = None,
    ladder: dict[str, Callable] | None = None,
    on_step: Callable[[str, int, float], None] | None = None,
    on_run: Callable[[TrainResult], None] | None = None,
    finished: Iterable[dict] = (),
) -> dict:
    """Train BF16 (``baseline``) and every kernel of ``kernels`` (name -> callable) at each of
    ``cfg.seeds`` seeds, the floors (BF16 again; ``floor_kernel``) when ``cfg.floors``, and the rungs
    of ``ladder`` (name -> callable) when given; return the result document (schema ``SCHEMA``).
    ``finished``: records of runs made earlier (a journal); one with this run's fingerprint, name and
    seed stands for that training, marked ``resumed``. on_run receives every run, resumed ones too."""
    if cfg.seeds < 2:
        raise ConfigError(f"a paired interval needs at least 2 seeds, got {cfg.seeds}")
    if cfg.steps < 1 or cfg.eval_every < 1:
        raise ConfigError("steps and eval_every must be >= 1")
    if cfg.floors and floor_kernel is None:
        raise ConfigError("floors need the floor kernel (an equivalent BF16 kernel that rounds differently)")
    with _deterministic(device) as determinism:
        return _run_parity(
            kernels, cfg, device, baseline, exact, corpus, floor_kernel, ladder, on_step, on_run, determinism,
            finished,
        )  # fmt: skip


def _run_parity(
    kernels, cfg, device, baseline, exact, corpus, floor_kernel, ladder, on_step, on_run, determinism, finished
) -> dict:
    """The body of :func:`run_parity`, under torch's deterministic settings."""
    corpus = corpus or build_corpus(max_bytes=cfg.corpus_max_bytes)
    fingerprint = run_fingerprint(cfg, corpus, device)
    earlier = {(rec.get("kernel"), rec.get("seed")): rec for rec in finished if rec.get("fingerprint") == fingerprint}
    # one held-out token set for every run and seed: a paired difference sees no sampling noise of its own
    val = [
        b.to(device)
        for b in make_batches(corpus.val, n=cfg.val_batches, tokens=cfg.tokens, max_len=cfg.max_len, seed=10_000)
    ]
    runs: list[TrainResult] = []

    def go(fn, name, seed):
        if (name, seed) in earlier:
            r = replace(TrainResult.from_dict(earlier[(name, seed)]), resumed=True)
        else:
            r = train_one(fn, name, cfg, corpus, seed=seed, device=device, exact=exact, val=val, on_step=on_step)
            r = replace(r, fingerprint=fingerprint)
        runs.append(r)
        if on_run is not None:
            on_run(r)
        return r

    seeds = [cfg.seed + i for i in range(cfg.seeds)]
    base = {s: go(baseline, "bf16", s) for s in seeds}
    bad = [s for s, r in base.items() if r.diverged_at is not None]
    if bad:
        raise FloatingPointError(f"the BF16 baseline diverged (seeds {bad}): lower the learning rate")
    trained: dict[str, dict[int, TrainResult]] = {"bf16": base}
    for name, fn in kernels.items():
        if name != "bf16":
            trained[name] = {s: go(fn, name, s) for s in seeds}
    floors: dict[str, dict] = {}
    if cfg.floors:
        again = {s: go(baseline, "bf16 (again)", s) for s in seeds}
        other = {s: go(floor_kernel, f"floor: {cfg.floor_kernel}", s) for s in seeds}
        floors["bf16_vs_itself"] = _paired("bf16 (again)", again, base, cfg)
        floors["bf16_vs_other_rounding"] = _paired(cfg.floor_kernel, other, base, cfg)
    rungs = {name: {s: go(fn, f"ladder: {name}", s) for s in seeds} for name, fn in (ladder or {}).items()}
    fns = {"bf16": baseline, **kernels}
    rows = [
        dict(_paired(name, by_seed, base, cfg, grads=True), state=_state_words(fns[name]))
        for name, by_seed in trained.items()
    ]
    # what the run resolves: the spread of a pair that differs by rounding alone, else the kernels' own
    null_sd = (
        floors["bf16_vs_other_rounding"]["sd"]
        if floors
        else statistics.median([r["sd"] for r in rows if r["kernel"] != "bf16" and math.isfinite(r["sd"])] or [0.0])
    )
    t = _t_quantile(cfg.level, cfg.seeds)
    mdg = cfg.tolerance + t * null_sd / math.sqrt(cfg.seeds)
    mean_loss = statistics.fmean(r.final_val for r in base.values())
    ladder_rows = [_paired(name, by_seed, base, cfg) for name, by_seed in rungs.items()]
    for row in ladder_rows:
        judge_rung(row, mdg)
    first = base[seeds[0]]
    eval_mean, eval_sd, eval_tokens = first.final_val, first.val_token_sd, first.val_tokens
    return _finite_json(
        {
            "schema": SCHEMA,
            "config": cfg.to_dict(),
            "device": device,
            "determinism": determinism,
            "corpus": {
                "root": corpus.root,
                "fingerprint": corpus.fingerprint,
                "train_documents": len(corpus.train),
                "val_documents": len(corpus.val),
                "train_bytes": corpus.train_bytes,
                "val_bytes": corpus.val_bytes,
            },
            "evaluation": {
                "val_tokens": eval_tokens,
                "val_loss": eval_mean,
                # the sampling noise of one run's validation loss (per-token losses' sd / sqrt(tokens));
                # a paired difference on the same tokens does not carry it
                "standard_error": eval_sd / math.sqrt(eval_tokens) if eval_tokens else float("nan"),
            },
            "resolution": {
                "level": cfg.level,
                "t_quantile": t,
                "null_sd": null_sd,
                "null_from": "bf16_vs_other_rounding" if floors else "the kernels' paired differences",
                "minimum_detectable_gap": mdg,
                "minimum_detectable_gap_percent": 100 * mdg / mean_loss if mean_loss else float("nan"),
                "bf16_mean_val_loss": mean_loss,
            },
            "floors": floors,
            "kernels": rows,
            "ladder": ladder_rows,
            "ladder_consistent": all(r["consistent"] for r in ladder_rows),
            "runs": [asdict(r) for r in runs],
            "passed": all(row["status"] == "pass" for row in rows) and all(r["consistent"] for r in ladder_rows),
        }
    )


def judge_rung(row: dict, mdg: float) -> dict:
    """A ladder rung's row judged against the run's minimum detectable gap: it should be flagged when
    its |mean gap| is at least ``mdg``; it is consistent when flagged (failed) or not expected to be."""
    row["should_be_flagged"] = abs(row["mean"]) >= mdg
    row["flagged"] = row["status"] == "fail"
    row["consistent"] = row["flagged"] or not row["should_be_flagged"]
    return row


def _paired(name: str, runs: dict[int, TrainResult], base: dict[int, TrainResult], cfg: ParityConfig, grads=False):
    """The paired statistics of ``runs`` against ``base`` (seed -> run), own and exact evaluation, and
    the verdict: fail when a run diverged or either interval lies wholly beyond +-tolerance."""
    seeds = sorted(runs)
    diverged = [s for s in seeds if runs[s].diverged_at is not None]
    own = [runs[s].final_val - base[s].final_val for s in seeds]
    ex = [runs[s].final_val_exact - base[s].final_val_exact for s in seeds]
    a, b = _interval(own, cfg.level), _interval(ex, cfg.level)
    beyond = any(lo > cfg.tolerance or hi < -cfg.tolerance for _, _, lo, hi in (a, b))
    row = {
        "kernel": name,
        "seeds": seeds,
        "deltas": own,
        "deltas_exact": ex,
        "mean": a[0],
        "sd": a[1],
        "ci": [a[2], a[3]],
        "mean_exact": b[0],
        "sd_exact": b[1],
        "ci_exact": [b[2], b[3]],
        "final_val_loss": statistics.fmean(runs[s].final_val for s in seeds),
        "final_val_loss_exact": statistics.fmean(runs[s].final_val_exact for s in seeds),
        "attn_rel_rmse_final": statistics.fmean(runs[s].attn_rel_rmse[-1] for s in seeds),
        "diverged_at": {str(s): runs[s].diverged_at for s in diverged} or None,
        "status": "fail" if diverged or beyond else "pass",
        "seconds": sum(runs[s].seconds for s in seeds),
        "tokens_seen": sum(runs[s].tokens_seen for s in seeds),
    }
    if grads:
        row["grad_norm_ratio"] = statistics.fmean(
            _tail_mean(runs[s].grad_norm) / _tail_mean(base[s].grad_norm) for s in seeds
        )
    if diverged:
        row["mean"] = row["mean_exact"] = math.inf
    return row


def _interval(xs: list[float], level: float) -> tuple[float, float, float, float]:
    """(mean, sample sd, low, high): the Student t interval of the mean at ``level`` (n - 1 dof)."""
    if any(not math.isfinite(x) for x in xs):
        return math.inf, math.inf, -math.inf, math.inf
    mean = statistics.fmean(xs)
    sd = statistics.stdev(xs) if len(xs) > 1 else math.inf
    half = _t_quantile(level, len(xs)) * sd / math.sqrt(len(xs))
    return mean, sd, mean - half, mean + half


def _t_quantile(level: float, n: int) -> float:
    """The two-sided Student t quantile of ``level`` with n - 1 degrees of freedom (scipy)."""
    from scipy.stats import t

    return float(t.ppf(0.5 + level / 2, n - 1))


@contextlib.contextmanager
def _deterministic(device: str) -> Iterator[dict]:
    """Make a training step as deterministic as torch allows on ``device`` for the duration, then put
    torch's settings back; yields what is still not deterministic."""
    notes = []
    cuda = device.startswith("cuda")
    previous = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        torch.backends.cudnn.deterministic,
        torch.backends.cudnn.benchmark,
    )
    if cuda:
        import os

        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
        if os.environ.get("CUBLAS_WORKSPACE_CONFIG") not in (":4096:8", ":16:8"):
            notes.append("CUBLAS_WORKSPACE_CONFIG was not set before CUDA started: cuBLAS may not be deterministic")
        notes.append(
            "kernels under test may use atomics (torch warns where its own ops are non-deterministic); the "
            "floor bf16_vs_itself measures what remains"
        )
    try:
        yield {"deterministic_algorithms": cuda, "notes": notes}
    finally:
        if cuda:
            torch.use_deterministic_algorithms(previous[0], warn_only=previous[1])
            torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = previous[2], previous[3]


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


def _tail_mean(xs: list[float], frac: float = 0.2) -> float:
    n = max(1, int(len(xs) * frac))
    return sum(xs[-n:]) / n


def with_overrides(cfg: ParityConfig, **kw) -> ParityConfig:
    """``cfg`` with the non-None keyword values replaced (command-line flags)."""
    return replace(cfg, **{k: v for k, v in kw.items() if v is not None})
