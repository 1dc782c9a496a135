"""Plot a speed table written by ``bench_attention.py --json`` or ``flamia-verify bench --json``.

    python benchmarks/plot_bench.py benchmarks/data/bench_8d58c47.json benchmarks/speed_8d58c47.png

Two panels (causal, no mask): forward+backward TFLOP/s against tokens per document for every
kernel and SDPA baseline in the table, and the fused kernels' ratio to the fastest BF16 SDPA
baseline beneath. Rows with an error are left out.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

STYLE = {
    "sdpa-cudnn": ("black", "--"),
    "sdpa-flash": ("grey", "--"),
    "bf16": ("tab:blue", "-"),
    "fp8": ("tab:red", "-"),
    "flamia-mxfp8": ("tab:green", "-"),
    "flamia-nvfp4": ("tab:purple", "-"),
}


def plot(table: dict, path: Path) -> None:
    rows = [
        r
        for r in table["rows"]
        if not r.get("error")
        and isinstance(r.get("fwdbwd_tflops"), (int, float))
        and not math.isnan(r["fwdbwd_tflops"])
    ]
    kernels = list(dict.fromkeys(r["kernel"] for r in rows))
    fig, axes = plt.subplots(2, 2, figsize=(10, 6.5), sharex=True, gridspec_kw={"height_ratios": [2, 1]})
    for col, causal in enumerate((True, False)):
        top, bottom = axes[0][col], axes[1][col]
        for name in kernels:
            pts = sorted(
                (r["seqlen"], r["fwdbwd_tflops"], float(r["ratio"]))
                for r in rows  # "nan" in JSON
                if r["kernel"] == name and bool(r["causal"]) == causal
            )
            if not pts:
                continue
            color, ls = STYLE.get(name, (None, "-"))
            xs = [p[0] for p in pts]
            top.plot(xs, [p[1] for p in pts], ls, marker="o", color=color, label=name)
            if not name.startswith("sdpa-"):
                bottom.plot(xs, [p[2] for p in pts], ls, marker="o", color=color, label=name)
        top.set_title("causal" if causal else "no mask")
        top.set_ylabel("fwd+bwd TFLOP/s")
        top.set_ylim(bottom=0)
        bottom.set_ylabel("/ best BF16 SDPA")
        top_ratio = max(
            [r["ratio"] for r in rows if isinstance(r.get("ratio"), (int, float)) and not math.isnan(r["ratio"])]
            + [1.0]
        )
        bottom.set_ylim(0, 1.2 * top_ratio)
        bottom.axhline(1.0, color="black", lw=0.8)
        bottom.set_xscale("log", base=2)
        bottom.set_xlabel("tokens per document (B * S = 32K)")
        for ax in (top, bottom):
            ax.grid(alpha=0.3)
    legend = {}
    for ax in axes[0]:  # every kernel once, whichever panel it appears in
        for handle, label in zip(*ax.get_legend_handles_labels()):
            legend.setdefault(label, handle)
    fig.legend(
        list(legend.values()), list(legend), loc="lower center", ncol=max(1, len(legend)), fontsize=8, frameon=False
    )
    fig.suptitle(table.get("header", ""), fontsize=9)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("table", type=Path)
    ap.add_argument("png", type=Path)
    args = ap.parse_args(argv)
    plot(json.loads(args.table.read_text()), args.png)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
