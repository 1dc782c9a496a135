"""Registers, spills and shared memory of each fused kernel (GPU only): which tiles spill.

    python benchmarks/kernel_resources.py [--head-dim 128] [--designs bf16 fp8 ...]

Runs one small causal forward+backward per design (compiling its kernels with the default tiles)
and prints, per kernel, the tile, pipeline stages, registers per thread, spilled registers and
shared memory, as Triton's compiled kernel reports them.
"""

from __future__ import annotations

import argparse

import torch
import triton

from flamia_verify.kernels.designs import DESIGNS
from flamia_verify.kernels.triton.attention import fused_attention, kernel_resources


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--designs", nargs="+", default=["bf16", "fp8", "flamia-mxfp8", "flamia-nvfp4"])
    ap.add_argument("--head-dim", type=int, default=128)
    args = ap.parse_args(argv)
    print(f"{torch.cuda.get_device_name()}, triton {triton.__version__}, head_dim {args.head_dim}\n")
    print("| design | kernel | (BM, BN, warps) | stages | registers | spilled | shared bytes |")
    print("|---|---|---|---|---|---|---|")
    seen = 0
    for name in args.designs:
        q, k, v = (
            torch.randn(1024, 4, args.head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            for _ in range(3)
        )
        cu = torch.tensor([0, 512, 1024], dtype=torch.int32, device="cuda")
        out = fused_attention(DESIGNS[name], q, k, v, cu, cu, 512, 512, causal=True)
        out.backward(torch.randn_like(out))
        torch.cuda.synchronize()
        rows = kernel_resources()
        for r in rows[seen:]:
            t = r["tile"]
            print(
                f"| {name} | {r['kernel']} | ({t.block_m}, {t.block_n}, {t.num_warps}) | {r['stages']} | "
                f"{r['n_regs']} | {r['n_spills']} | {r['shared']} |"
            )
        seen = len(rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
