"""Error on Gaussian inputs beside the error on each realistic family and on a model's captured
attention calls: per built-in design and per adapter that runs on the CPU.

    OMP_NUM_THREADS=1 python benchmarks/realistic_table.py                # ~20 s on a 2-core CPU
    python benchmarks/realistic_table.py --capture tests/data/capture_tiny DIR --kernels bf16 fp8-tensor
    OMP_NUM_THREADS=1 python benchmarks/realistic_table.py --outlier-scan # where per-tensor scaling breaks

Every cell is the relative RMSE (||x - x_ref|| / ||x_ref||) of O or dQ against the float64
reference, the root mean square over ``--seeds`` seeds, and in brackets its ratio to the same
kernel's on Gaussian inputs of the same shapes. The synthetic families are drawn on one causal pack
of documents of 200, 128, 96 and 88 tokens, 4 query heads over 2 kv heads, head_dim 64, bf16
(``flamia_verify.properties.cases``); the calls of each capture (default: tests/data/capture_tiny, two
optimizer steps of train-parity's tiny model from its initialization: 512 tokens, 2 heads of 32; a
partly trained one: ``benchmarks/realistic_stats.py --keep DIR``) are compared with Gaussian inputs
on their own shapes (the column "gaussian (NAME shapes)") and use the recorded dO.

``--outlier-scan``: Gaussian inputs with two channels of V alone (no K outliers, whose scores change
the attention itself) scaled by 10^2, 10^3 and 10^4; the relative RMSE of O over the other channels
(what a scale shared with the outlier channels costs them), of O and of dQ, for the FP8 designs.
"""

from __future__ import annotations

import argparse
import datetime
import math
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script from anywhere: the package of this checkout
    sys.path.insert(0, str(ROOT))

from flamia_verify.kernels import load_kernel  # noqa: E402
from flamia_verify.properties.cases import Case, captured_cases, make_inputs  # noqa: E402
from flamia_verify.properties.metrics import rel_rmse  # noqa: E402
from flamia_verify.reference import reference_attention  # noqa: E402

#: the built-in designs and the adapters that run on the CPU
KERNELS = ("bf16", "fp8", "fp8-tensor", "flamia-mxfp8", "flamia-nvfp4", "sdpa-math", "sdpa-flash")
FAMILIES = ("gaussian", "outliers", "sink", "rotary", "massive", "heavy_do", "realistic")
LENS = (200, 128, 96, 88)
CAPTURE = ROOT / "tests" / "data" / "capture_tiny"
TENSORS = ("out", "dq", "dk", "dv")


def _run(fn, inp, dtype=None):
    """(out, dq, dk, dv) of ``fn`` on ``inp``, the inputs in ``dtype`` (default: the case's) as leaves
    (float64 for the reference, so that its gradients are not rounded to the inputs' dtype)."""
    q, k, v = (x.detach().to(dtype or x.dtype).requires_grad_(True) for x in (inp.q, inp.k, inp.v))
    c = inp.case
    out = fn(q, k, v, inp.cu_q, inp.cu_k, inp.max_q, inp.max_k, softmax_scale=c.scale, causal=c.causal)
    out = out[0] if isinstance(out, tuple) else out
    out.backward(inp.do.to(out.dtype))
    return out.detach(), q.grad, k.grad, v.grad


def errors(fn, cases: list[Case]) -> dict[str, float]:
    """Relative RMSE of each tensor, the root mean square over ``cases``."""
    acc = {t: 0.0 for t in TENSORS}
    for case in cases:
        inp = make_inputs(case)
        ref = _run(reference_attention, inp, torch.float64)
        got = _run(fn, inp)
        for t, x, r in zip(TENSORS, got, ref):
            acc[t] += rel_rmse(x, r) ** 2
    return {t: math.sqrt(a / len(cases)) for t, a in acc.items()}


def columns(seeds: int, captures: list[Path]) -> dict[str, list[Case]]:
    """The cases of every column: the families, then per capture its calls and Gaussian values of
    their shapes (seeds 0, 1, ... of the calls' indices)."""
    cols = {
        dist: [Case(LENS, heads=4, heads_k=2, headdim=64, distribution=dist, seed=s) for s in range(seeds)]
        for dist in FAMILIES
    }
    for capture in captures:
        captured = captured_cases(capture)
        cols[f"gaussian ({capture.name} shapes)"] = [
            Case(c.lens_q, c.lens_k, heads=c.heads, heads_k=c.heads_k, headdim=c.headdim, seed=c.seed) for c in captured
        ]
        cols[f"captured {capture.name}"] = captured
    return cols


def _baseline(col: str) -> str:
    """The Gaussian column a column's ratio is taken to."""
    return f"gaussian ({col.removeprefix('captured ')} shapes)" if col.startswith("captured ") else "gaussian"


#: the channels of V the outlier scan scales, and its factors
SCAN_CHANNELS = (5, 40)
SCAN_FACTORS = (1e2, 1e3, 1e4)


def outlier_scan(kernels: list[str], seeds: int) -> None:
    print("V-only outlier channels: relative RMSE of O over the other channels / of O / of dQ\n")
    print("| factor | " + " | ".join(kernels) + " |")
    print("|---" * (len(kernels) + 1) + "|")
    rest = torch.ones(64, dtype=torch.bool)
    rest[list(SCAN_CHANNELS)] = False
    for factor in SCAN_FACTORS:
        cells = []
        for name in kernels:
            fn, acc = load_kernel(name).fn, [0.0, 0.0, 0.0]
            for seed in range(seeds):
                inp = make_inputs(Case(LENS, heads=4, heads_k=2, headdim=64, seed=seed))
                v = inp.v.float()
                v[:, :, list(SCAN_CHANNELS)] *= factor
                inp = inp.replace(v=v.to(inp.v.dtype))
                ref, got = _run(reference_attention, inp, torch.float64), _run(fn, inp)
                errs = (
                    rel_rmse(got[0][..., rest], ref[0][..., rest]),
                    rel_rmse(got[0], ref[0]),
                    rel_rmse(got[1], ref[1]),
                )
                acc = [a + e**2 for a, e in zip(acc, errs)]
            cells.append(" / ".join(f"{math.sqrt(a / seeds):.3f}" for a in acc))
        print(f"| {factor:g} | " + " | ".join(cells) + " |")
    print()


def compact(table: dict[str, dict[str, dict[str, float]]], cols: dict[str, list[Case]]) -> None:
    """One table of O and dQ: the Gaussian error, then every other column's ratio to its Gaussian one."""
    shown = [c for c in cols if c != "gaussian" and not c.startswith("gaussian (")]
    print(
        "relative RMSE of O / dQ on Gaussian inputs; elsewhere its ratio to that on Gaussian inputs of the same shapes\n"
    )
    print("| kernel | gaussian | " + " | ".join(shown) + " |")
    print("|---" * (len(shown) + 2) + "|")
    for name, row in table.items():
        cells = [f"{row['gaussian']['out']:.2g} / {row['gaussian']['dq']:.2g}"]
        for col in shown:
            base = row[_baseline(col)]
            cells.append(" / ".join(f"{row[col][t] / base[t]:.2g}" if base[t] > 0 else "-" for t in ("out", "dq")))
        print(f"| {name} | " + " | ".join(cells) + " |")
    print()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kernels", nargs="+", default=list(KERNELS))
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--capture", nargs="+", default=[str(CAPTURE)], help="capture directories (each two columns)")
    ap.add_argument("--outlier-scan", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.outlier_scan:
        outlier_scan(
            [k for k in args.kernels if k in ("fp8", "fp8-tensor", "flamia-mxfp8")] or args.kernels, args.seeds
        )
        return
    t0 = time.perf_counter()
    cols = columns(args.seeds, [Path(c) for c in args.capture])
    table = {name: {col: errors(load_kernel(name).fn, cases) for col, cases in cols.items()} for name in args.kernels}
    print(f"{datetime.date.today()}, {time.perf_counter() - t0:.0f} s; captures {', '.join(args.capture)}\n")
    compact(table, cols)
    for tensor, label in (("out", "O"), ("dq", "dQ"), ("dv", "dV")):
        print(f"relative RMSE of {label} (ratio to the kernel's Gaussian error of the same shapes)\n")
        print("| kernel | " + " | ".join(cols) + " |")
        print("|---" * (len(cols) + 1) + "|")
        for name, row in table.items():
            cells = []
            for col in cols:
                base = row[_baseline(col)][tensor]
                val = row[col][tensor]
                ratio = "" if col.startswith("gaussian") else f" ({val / base:.2g}x)" if base > 0 else ""
                cells.append(f"{val:.2g}{ratio}")
            print(f"| {name} | " + " | ".join(cells) + " |")
        print()


if __name__ == "__main__":
    main()
