"""Plot a speed table written by ``bench_attention.py --json`` or ``flamia-verify bench --json``.

    python benchmarks/plot_bench.py benchmarks/data/bench_8d58c47.json benchmarks/speed_8d58c47.png

Two panels (causal, no mask): forward+backward TFLOP/s against tokens per document for every
kernel and SDPA baseline in the table, and the fused kernels' ratio to the fastest BF16 SDPA
baseline beneath (``flamia_verify.bench.plot_table``). Rows with an error are left out.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from flamia_verify.bench import plot_table


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("table", type=Path)
    ap.add_argument("png", type=Path)
    args = ap.parse_args(argv)
    plot_table(json.loads(args.table.read_text()), args.png)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
