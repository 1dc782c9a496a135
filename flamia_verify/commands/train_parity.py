"""``flamia-verify train-parity``: train a small model with each kernel and BF16 at several seeds and gate
on the paired gap's confidence interval.

    flamia-verify train-parity --kernel SPEC [SPEC ...] [--preset tiny|small|resolution] [--steps N]
                               [--tokens N] [--seeds N] [--seed N] [--tolerance NATS] [--level P]
                               [--no-floors] [--ladder] [--device auto|cpu|cuda|cuda:N] [--out DIR]
                               [--config FILE]

Writes DIR/train-parity.json, .md and .html. Exit 0 when every kernel's paired gap is within the
tolerance at the confidence level (own and exact evaluation) and every ladder rung the run should see
is flagged; 1 otherwise; 2 bad usage; 3 a kernel could not be loaded or crashed during training.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any

from flamia_verify.commands.common import device_arg, device_metavar, load_config, prepare_out, remove_stale
from flamia_verify.errors import ConfigError, KernelCrashError, UsageError

__all__ = ["add_parser", "run", "JOURNAL", "read_journal"]

#: one JSON line per finished training of a run (``--resume`` continues from it), beside the reports
JOURNAL = "train-parity-runs.jsonl"


def read_journal(path: Path) -> list[dict]:
    """The finished trainings a journal holds; a line cut short (a run killed while writing it) or not
    a JSON object is skipped: that training runs again."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        return []
    records = []
    for line in lines:
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict):
            records.append(record)
    return records


DESCRIPTION = """\
Train one small decoder-only transformer per kernel and seed (byte-level, RoPE, packed
variable-length documents through the kernel's varlen convention, causal; BF16 everywhere else);
BF16 trains at every seed too, with the same initial weights and batches. Each kernel's gap is the
paired difference of final validation losses (kernel - BF16 at the same seed, one fixed held-out
token set), its mean over the seeds with a Student t confidence interval; a kernel fails when the
interval lies wholly beyond +-tolerance, with its own attention or with the exact (float64)
attention in every layer (a kernel that leaks the future looks good on its own, not there). The
floors (BF16 twice; BF16 against sdpa-math, which rounds differently) measure what the run can
resolve: the minimum detectable gap. --ladder adds planted kernels of known size. The corpus is this
Python's standard library source (no download). Presets: tiny (a CPU smoke run), small (6 layers,
d_model 512, 300 steps of 8192 tokens), resolution (sized for a fine gap on one GPU; docs/training.md)."""


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
    t.add_argument(
        "--preset",
        help="model and run size: tiny, small or resolution (default: small on CUDA, tiny on the CPU)",
    )
    t.add_argument("--steps", type=int, help="optimizer steps per run (default: the preset's)")
    t.add_argument("--tokens", type=int, help="tokens per step, one packed batch (default: the preset's)")
    t.add_argument(
        "--seeds", type=int, help="paired seeds: BF16 and every kernel train at each, >= 2 (default: the preset's)"
    )
    t.add_argument("--seed", type=int, help="the first seed (default 0)")
    t.add_argument(
        "--tolerance",
        type=float,
        metavar="NATS",
        help="fail a kernel whose gap's interval lies wholly beyond +-NATS (default 0: any resolved gap)",
    )
    t.add_argument("--level", type=float, help="confidence level of the paired gap's interval (default 0.95)")
    t.add_argument(
        "--no-floors",
        dest="floors",
        action="store_false",
        default=None,
        help="skip the two noise floors (BF16 twice; BF16 against sdpa-math): the minimum detectable gap "
        "then comes from the kernels' own paired spread",
    )
    t.add_argument(
        "--ladder",
        action="store_true",
        default=None,
        help="also train the planted rungs of known size (noise of relative RMSE 0.01, 0.03, 0.1 on O; a "
        "1 %% softmax temperature error) and check that the gate flags those at or above the minimum "
        "detectable gap",
    )
    t.add_argument(
        "--device",
        type=device_arg,
        metavar=device_metavar(),
        default="auto",
        help="where the model trains: cuda:N is GPU N (default auto: cuda when a GPU is present)",
    )
    t.add_argument(
        "--resume",
        action="store_true",
        help=f"continue an interrupted run in the same --out: the trainings its journal ({JOURNAL}) holds "
        "for the same configuration, corpus, device and versions are taken as they are, the rest are trained "
        "(without it the journal starts empty)",
    )
    t.add_argument("--out", default="flamia-report", help="directory for train-parity.json/.md/.html")
    t.add_argument("--config", help="TOML file whose [tool.flamia-verify.train_parity] table sets the defaults")


def run(args: argparse.Namespace) -> int:
    import os

    from flamia_verify.kernels import load_kernel
    from flamia_verify.known_bad.demos import ladder
    from flamia_verify.reference import reference_attention
    from flamia_verify.settings import resolve_device, train_parity_limit
    from flamia_verify.training.parity import PRESETS, run_parity, with_overrides
    from flamia_verify.training.report import PARITY_FILES, write_parity_reports

    conf = load_config(args.config).train_parity
    # cuBLAS is deterministic only with a fixed workspace, set before CUDA starts (a paired run must
    # differ only through the kernel); a value the user set is kept
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    device = resolve_device(args.device)
    preset = args.preset or conf.get("preset") or ("small" if device.startswith("cuda") else "tiny")
    if preset not in PRESETS:
        raise UsageError(f"unknown preset {preset!r}; choose one of: {', '.join(PRESETS)}")
    specs = args.kernel or conf.get("kernels")
    if not specs:
        raise UsageError("train-parity needs at least one --kernel (bf16, the baseline, always runs)")
    for flag in ("steps", "tokens", "seeds", "tolerance", "level"):
        value = getattr(args, flag)
        if value is not None:
            try:
                train_parity_limit(flag, value, f"--{flag}")
            except ConfigError as exc:  # a flag's value is a usage error
                raise UsageError(str(exc)) from None
    keys = ("steps", "tokens", "seeds", "seed", "tolerance", "level", "floors", "ladder")
    cfg = with_overrides(PRESETS[preset], **{k: conf.get(k) for k in keys})
    cfg = with_overrides(cfg, **{k: getattr(args, k) for k in keys})
    out = prepare_out(args.out)
    remove_stale(out, PARITY_FILES)
    journal = out / JOURNAL
    if args.resume:
        finished = read_journal(journal)
    else:
        finished = []
        remove_stale(out, (JOURNAL,))
    kernels = {}
    for spec in dict.fromkeys(specs):
        kernels[spec] = load_kernel(spec).fn
    baseline = load_kernel("bf16").fn
    kernels.setdefault("bf16", baseline)
    kernels = {"bf16": kernels.pop("bf16"), **kernels}
    floor_kernel = load_kernel(cfg.floor_kernel).fn if cfg.floors else None
    rungs = ladder(baseline) if cfg.ladder else {}
    per_seed = len(kernels) + (2 if cfg.floors else 0) + len(rungs)
    print(
        f"train-parity: preset {preset}, {cfg.steps} steps x {cfg.tokens} tokens, {cfg.seeds} seeds x {per_seed} "
        f"runs on {device} (bf16, {', '.join(k for k in kernels if k != 'bf16') or 'nothing else'}"
        f"{', the floors' if cfg.floors else ''}{', the ladder' if rungs else ''})",
        flush=True,
    )
    t0, last = time.perf_counter(), [0.0]

    def on_step(name: str, step: int, loss: float) -> None:
        now = time.perf_counter()
        if now - last[0] > 10 or step + 1 == cfg.steps:
            last[0] = now
            print(f"  {name}: step {step + 1}/{cfg.steps} loss {loss:.3f}  ({now - t0:.0f} s)", flush=True)

    def on_run(r: Any) -> None:
        if not r.resumed:  # every finished training, as it finishes: an interrupted run keeps it
            with open(journal, "a", encoding="utf-8") as f:
                f.write(json.dumps(dataclasses.asdict(r)) + "\n")
        if r.diverged_at is not None:
            print(
                f"{r.kernel} (seed {r.seed}): DIVERGED at step {r.diverged_at} (loss or gradient not finite)",
                flush=True,
            )
            return
        print(
            f"{r.kernel} (seed {r.seed}): val loss {r.final_val:.4f}, exact eval {r.final_val_exact:.4f}, "
            f"{r.seconds:.1f} s{' (from the journal)' if r.resumed else ''}",
            flush=True,
        )

    try:
        doc = run_parity(
            kernels,
            cfg,
            device=device,
            baseline=baseline,
            exact=reference_attention,
            floor_kernel=floor_kernel,
            ladder=rungs,
            on_step=on_step,
            on_run=on_run,
            finished=finished,
        )
    except (RuntimeError, FloatingPointError, TypeError, ValueError) as exc:
        raise KernelCrashError(f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}") from exc
    doc["preset"] = preset
    paths = write_parity_reports(doc, out)
    from flamia_verify.training.report import fmt_number as f

    for r in doc["kernels"] + doc["ladder"]:
        why = "" if not r.get("diverged_at") else f"  diverged at step {r['diverged_at']}"
        print(
            f"{r['status'].upper():4s}  {r['kernel']:24s} gap {f(r['mean'], '+.4f')} nats "
            f"[{f(r['ci'][0], '+.4f')}, {f(r['ci'][1], '+.4f')}] (exact eval {f(r['mean_exact'], '+.4f')} "
            f"[{f(r['ci_exact'][0], '+.4f')}, {f(r['ci_exact'][1], '+.4f')}]){why}"
        )
    res = doc["resolution"]
    print(
        f"minimum detectable gap {f(res['minimum_detectable_gap'], '.4f')} nats "
        f"({f(res['minimum_detectable_gap_percent'], '.2f')} % of the loss) at {100 * cfg.level:g} % over "
        f"{cfg.seeds} seeds; tolerance {cfg.tolerance:g}"
    )
    if not doc["ladder_consistent"]:
        missed = [r["kernel"] for r in doc["ladder"] if not r["consistent"]]
        print(f"the run missed ladder rungs it should resolve ({', '.join(missed)}): its verdicts are not trustworthy")
    for p in paths.values():
        print(f"  {p}")
    sys.stdout.flush()
    return 0 if doc["passed"] else 1
