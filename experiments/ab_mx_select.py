"""Same-run A/B of the MX quantizer's NaN select: per element (before commit 190641b) or per block.

    python experiments/ab_mx_select.py {element|block} [benchmarks/bench_attention.py arguments]

``block`` runs ``benchmarks/bench_attention.py`` as it is; ``element`` first puts back the former
``quant._mx_apply``, which selected NaN for every element of a block whose amax is not finite. Both
give the same bits (tests/test_triton_quant.py holds the current one to the formats); the fused
kernels compile from whichever ``_mx_apply`` the quant module holds when they first run.
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

import triton
import triton.language as tl

from flamia_verify.kernels.triton import quant

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_attention.py"


@triton.jit
def _mx_apply_per_element(x, amax, RCEIL: tl.constexpr, AXIS: tl.constexpr):
    e = quant.mx_exponent(amax, RCEIL)
    data = quant.round_e4m3(x * tl.expand_dims(quant.exp2i(-e), AXIS))
    q = data * tl.expand_dims(quant.exp2i(e), AXIS)
    return tl.where(tl.expand_dims(amax < float("inf"), AXIS), q, float("nan"))


def main() -> int:
    variant, rest = (sys.argv[1] if len(sys.argv) > 1 else ""), sys.argv[2:]
    if variant not in ("element", "block"):
        raise SystemExit("usage: ab_mx_select.py {element|block} [bench_attention.py arguments]")
    if variant == "element":
        quant._mx_apply = _mx_apply_per_element
    bench = runpy.run_path(str(BENCH))  # its main(), not run as __main__
    return bench["main"](rest)


if __name__ == "__main__":
    raise SystemExit(main())
