"""``flamia-verify train-parity``: train a small model with each kernel and gate on BF16's noise floor.

    flamia-verify train-parity --kernel SPEC [SPEC ...] [--preset tiny|small] [--steps N] [--tokens N]
                               [--bf16-seeds N] [--seed N] [--max-gap SIGMAS] [--device auto|cpu|cuda|cuda:N]
                               [--out DIR] [--config FILE]

Writes DIR/train-parity.json, .md and .html. Exit 0 when every kernel's gap is within --max-gap
sigmas (own and exact evaluation); 1 when one is not; 2 bad usage; 3 a kernel could not be loaded or
crashed during training.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from flamia_verify.commands.common import device_arg, device_metavar, load_config, prepare_out, remove_stale
from flamia_verify.errors import ConfigError, KernelCrashError, UsageError

__all__ = ["add_parser", "run"]

DESCRIPTION = """\
Train one small decoder-only transformer per kernel (byte-level, RoPE, packed variable-length
documents through the kernel's varlen convention, causal; BF16 everywhere else) from one seed: the
same initial weights and the same batches for every kernel. BF16 also trains with further seeds;
the spread of its final validation loss is the noise floor sigma. Each kernel's gap is its final
validation loss minus BF16's, in sigmas, with its own attention and with the exact (float64)
attention in every layer (a kernel that leaks the future looks good on its own, not there). The
corpus is this Python's standard library source (no download). Presets: tiny (2 layers, d_model 64,
30 steps of 1024 tokens: a CPU smoke run), small (6 layers, d_model 512, 300 steps of 8192 tokens:
the GPU run; docs/training.md)."""


def add_parser(sub: Any) -> None:
    t = sub.add_parser(
        "train-parity",
        help="does a model trained with the kernel end within BF16's noise?",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    t.add_argument(
        "--kernel",
        nargs="+",
        action="extend",
        metavar="SPEC",
        help="kernels to train with (built-in name, module:function, file.py:function); bf16 is the "
        "baseline and always runs",
    )
    t.add_argument("--preset", help="model and run size: tiny or small (default: small on CUDA, tiny on the CPU)")
    t.add_argument("--steps", type=int, help="optimizer steps per run (default: the preset's)")
    t.add_argument("--tokens", type=int, help="tokens per step, one packed batch (default: the preset's)")
    t.add_argument("--bf16-seeds", type=int, help="BF16 runs for the noise floor, >= 2 (default 3)")
    t.add_argument("--seed", type=int, help="seed of the weights and batches every kernel shares (default 0)")
    t.add_argument("--max-gap", type=float, help="fail a kernel whose |gap| exceeds this many sigmas (default 3)")
    t.add_argument(
        "--device",
        type=device_arg,
        metavar=device_metavar(),
        default="auto",
        help="where the model trains: cuda:N is GPU N (default auto: cuda when a GPU is present)",
    )
    t.add_argument("--out", default="flamia-report", help="directory for train-parity.json/.md/.html")
    t.add_argument("--config", help="TOML file whose [tool.flamia-verify.train_parity] table sets the defaults")


def run(args: argparse.Namespace) -> int:
    from flamia_verify.kernels import load_kernel
    from flamia_verify.reference import reference_attention
    from flamia_verify.settings import resolve_device, train_parity_limit
    from flamia_verify.training.parity import PRESETS, run_parity, with_overrides
    from flamia_verify.training.report import PARITY_FILES, write_parity_reports

    conf = load_config(args.config).train_parity
    device = resolve_device(args.device)
    preset = args.preset or conf.get("preset") or ("small" if device.startswith("cuda") else "tiny")
    if preset not in PRESETS:
        raise UsageError(f"unknown preset {preset!r}; choose one of: {', '.join(PRESETS)}")
    specs = args.kernel or conf.get("kernels")
    if not specs:
        raise UsageError("train-parity needs at least one --kernel (bf16, the baseline, always runs)")
    for flag in ("steps", "tokens", "bf16_seeds", "max_gap"):
        value = getattr(args, flag)
        if value is not None:
            try:
                train_parity_limit(flag, value, f"--{flag.replace('_', '-')}")
            except ConfigError as exc:  # a flag's value is a usage error
                raise UsageError(str(exc)) from None
    cfg = with_overrides(
        PRESETS[preset], **{k: conf.get(k) for k in ("steps", "tokens", "bf16_seeds", "seed", "max_gap")}
    )
    cfg = with_overrides(
        cfg, steps=args.steps, tokens=args.tokens, bf16_seeds=args.bf16_seeds, seed=args.seed, max_gap=args.max_gap
    )
    out = prepare_out(args.out)
    remove_stale(out, PARITY_FILES)
    kernels = {}
    for spec in dict.fromkeys(specs):
        kernels[spec] = load_kernel(spec).fn
    baseline = load_kernel("bf16").fn
    kernels.setdefault("bf16", baseline)
    kernels = {"bf16": kernels.pop("bf16"), **kernels}
    n_runs = cfg.bf16_seeds + len(kernels) - 1
    print(
        f"train-parity: preset {preset}, {cfg.steps} steps x {cfg.tokens} tokens, {n_runs} runs on {device} "
        f"(bf16 x {cfg.bf16_seeds} seeds, then {', '.join(k for k in kernels if k != 'bf16') or 'nothing else'})",
        flush=True,
    )
    t0, last = time.perf_counter(), [0.0]

    def on_step(name: str, step: int, loss: float) -> None:
        now = time.perf_counter()
        if now - last[0] > 10 or step + 1 == cfg.steps:
            last[0] = now
            print(f"  {name}: step {step + 1}/{cfg.steps} loss {loss:.3f}  ({now - t0:.0f} s)", flush=True)

    def on_run(r: Any) -> None:
        if r.diverged_at is not None:
            print(
                f"{r.kernel} (seed {r.seed}): DIVERGED at step {r.diverged_at} (loss or gradient not finite)",
                flush=True,
            )
            return
        print(
            f"{r.kernel} (seed {r.seed}): val loss {r.final_val:.4f}, exact eval {r.final_val_exact:.4f}, "
            f"{r.seconds:.1f} s",
            flush=True,
        )

    try:
        doc = run_parity(
            kernels, cfg, device=device, baseline=baseline, exact=reference_attention, on_step=on_step, on_run=on_run
        )
    except (RuntimeError, FloatingPointError, TypeError, ValueError) as exc:
        raise KernelCrashError(f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}") from exc
    doc["preset"] = preset
    paths = write_parity_reports(doc, out)
    from flamia_verify.training.report import fmt_number as f

    for r in doc["kernels"]:
        why = "" if r.get("diverged_at") is None else f"  diverged at step {r['diverged_at']}"
        print(
            f"{r['status'].upper():4s}  {r['kernel']:24s} gap {f(r['gap_sigmas'], '+.2f')} sigma (exact eval "
            f"{f(r['gap_sigmas_exact'], '+.2f')}), val loss {f(r['final_val_loss'])}{why}"
        )
    print(
        f"noise floor sigma {f(doc['noise']['sigma'], '.4g')} over {cfg.bf16_seeds} BF16 seeds; limit {cfg.max_gap} sigma"
    )
    for p in paths.values():
        print(f"  {p}")
    sys.stdout.flush()
    return 0 if doc["passed"] else 1
