"""Calibrate the realistic value distributions: statistics of the attention inputs of a partly trained
train-parity model beside the same statistics of the generated families.

    OMP_NUM_THREADS=1 python benchmarks/realistic_stats.py                       # tiny, CPU, ~1.5 min
    OMP_NUM_THREADS=1 python benchmarks/realistic_stats.py --warmup-steps 400    # later in training
    python benchmarks/realistic_stats.py --capture DIR                           # an existing capture

On a GPU, the 6-layer `small` preset (8 heads of 64, 8192 tokens a step) after its 300 steps (a few
minutes on an H100; not run yet, docs/checks.md says so):

    python benchmarks/realistic_stats.py --preset small --device cuda --warmup-steps 300 --keep captures/small

The model trains ``--warmup-steps`` optimizer steps with the built-in ``bf16`` kernel, unrecorded, then
one more step whose attention calls (every layer: q, k, v, cu_seqlens and the gradient of the output,
dO) are recorded (``flamia_verify.training.record.record_training_steps``). Each call's statistics
(``flamia_verify.capture.stats``) make one row; then each value distribution of
``flamia_verify.properties.cases`` is drawn on the packing and shapes of the first call (three seeds,
the mean) and measured the same way. Columns:

    chan q/k/v     largest channel RMS / median channel RMS (worst head)
    kurt q/k/v/dO  Pearson kurtosis of the entries (3 for a Gaussian), mean over heads
    tok k/v        largest token L2 norm / median (worst head): massive-activation tokens
    dO p90/p99/max token L2 norms of dO over their median at the 90th, 99th percentile and the largest
    rank q/k       effective rank (exp of the entropy of the singular values) / head_dim
    freq q, freq k share of the squared norm in each quarter of the rotary pairs, highest frequency first
    sink (unif.)   attention weight of each document's first key, rows of >= 32 keys (uniform: 1/n)
    relpos         share of the scores' variance explained by the distance i - j
"""

from __future__ import annotations

import argparse
import datetime
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script from anywhere: the package of this checkout
    sys.path.insert(0, str(ROOT))

from flamia_verify.capture import load_capture  # noqa: E402
from flamia_verify.capture.stats import call_statistics  # noqa: E402
from flamia_verify.properties.cases import Case, cu_from_lens, make_tensors  # noqa: E402
from flamia_verify.training.record import record_training_steps  # noqa: E402

#: the generated families measured beside the capture
FAMILIES = ("gaussian", "outliers", "sink", "rotary", "massive", "heavy_do", "realistic")
SEEDS = 3

HEADER = (
    "| row | chan q / k / v | kurt q / k / v / dO | tok k / v | dO p90 / p99 / max | rank q / k | "
    "freq q | freq k | sink (unif.) | relpos |"
)


def _row(name: str, st: dict, d: int) -> str:
    def f(*keys, fmt="{:.2f}"):
        return " / ".join(fmt.format(st[k]) for k in keys)

    freq_q = " ".join(f"{st[f'freq{i}_q']:.2f}" for i in range(4))
    freq_k = " ".join(f"{st[f'freq{i}_k']:.2f}" for i in range(4))
    return (
        f"| {name} | {f('chan_q', 'chan_k', 'chan_v', fmt='{:.1f}')} | "
        f"{f('kurt_q', 'kurt_k', 'kurt_v', 'kurt_do', fmt='{:.3g}')} | {f('tok_k', 'tok_v', fmt='{:.1f}')} | "
        f"{f('do_p90', 'do_p99', 'do_max', fmt='{:.1f}')} | {st['rank_q'] / d:.2f} / {st['rank_k'] / d:.2f} | "
        f"{freq_q} | {freq_k} | {st['sink']:.3f} ({st['sink_uniform']:.3f}) | {st['relpos_r2']:.2f} |"
    )


def _mean(rows: list[dict]) -> dict:
    return {k: sum(r[k] for r in rows) / len(rows) for k in rows[0]}


def family_statistics(dist: str, lens: tuple[int, ...], heads: int, heads_k: int, headdim: int) -> dict:
    """The statistics of ``dist`` drawn on one packing (fp32 values, SEEDS seeds, the mean)."""
    cu = cu_from_lens(lens)
    rows = []
    for seed in range(SEEDS):
        case = Case(lens, heads=heads, heads_k=heads_k, headdim=headdim, distribution=dist, seed=seed, dtype="fp32")
        q, k, v, do = make_tensors(case)
        rows.append(call_statistics(q, k, v, do, cu, cu, case.scale))
    return _mean(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--warmup-steps", type=int, default=150)
    ap.add_argument("--tokens", type=int, default=None, help="tokens per step (default: the preset's)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--capture", help="measure this capture instead of training")
    ap.add_argument("--keep", help="write the capture here (default: a temporary directory)")
    args = ap.parse_args()
    if args.device == "cpu":
        torch.set_num_threads(1)  # the same tensors on every run of one machine

    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        if args.capture:
            where = Path(args.capture)
        else:
            where = Path(args.keep) if args.keep else Path(tmp) / "capture"
            record_training_steps(
                where,
                preset=args.preset,
                steps=1,
                warmup_steps=args.warmup_steps,
                tokens=args.tokens,
                seed=args.seed,
                device=args.device,
                max_bytes=1 << 31,
            )
        capture = load_capture(where)
        trained = time.perf_counter() - t0
        first = capture.calls[0]
        d = int(first.q.shape[-1])
        meta = capture.meta
        print(
            f"{capture.model}: {meta.get('warmup_steps', 0)} steps trained before the recorded one, "
            f"{len(capture.calls)} calls, {first.q.shape[0]} tokens, heads {first.q.shape[1]}/{first.k.shape[1]}, "
            f"head_dim {d}; {datetime.date.today()}, {trained:.0f} s\n"
        )
        print(HEADER)
        print("|" + "---|" * (HEADER.count("|") - 1))
        for call in capture.calls:
            st = call_statistics(
                call.q, call.k, call.v, call.dout, call.cu_seqlens_q, call.cu_seqlens_k, call.softmax_scale
            )
            print(_row(f"layer {call.layer}", st, d))
        lens = tuple(int(x) for x in first.cu_seqlens_q.diff().tolist())
        for dist in FAMILIES:
            st = family_statistics(dist, lens, int(first.q.shape[1]), int(first.k.shape[1]), d)
            print(_row(dist, st, d))


if __name__ == "__main__":
    main()
