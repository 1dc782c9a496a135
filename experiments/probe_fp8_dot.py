"""Probe of Hopper's E4M3 tensor-core dot, for the fp8 design's fused kernels (GPU only).

    python experiments/probe_fp8_dot.py

The fp8 design rounds every GEMM operand to E4M3 elements with power-of-two scales that are
constant along the contraction of one tile, so a tile's GEMM could run as an E4M3 ``tl.dot`` with
the scales applied to the fp32 result. That is exact only if the tensor cores accumulate the
(exact, 8-bit) products like the BF16 dot of the dequantized values does. This probe measures,
for a 128-long contraction:

1. accumulation: E4M3 ``tl.dot`` (Triton's default ``max_num_imprecise_acc`` and 32, 64, 128)
   against the BF16 ``tl.dot`` of the same values (the fused kernels' current arithmetic) and
   against the float64 sum: how many results differ, and by how many fp32 ulps;
2. speed: a loop of dots over a long contraction with E4M3 and BF16 operands, B given K-major
   (transposed in memory) or N-major.
"""

from __future__ import annotations

import functools
import sys

import torch
import triton
import triton.language as tl


@triton.jit
def _dot_tile(A, B, C, K: tl.constexpr, M: tl.constexpr, N: tl.constexpr, FP8: tl.constexpr, IMPRECISE: tl.constexpr):
    pid = tl.program_id(0)
    m = tl.arange(0, M)
    n = tl.arange(0, N)
    k = tl.arange(0, K)
    a = tl.load(A + pid * M * K + m[:, None] * K + k[None, :])
    b = tl.load(B + pid * K * N + k[:, None] * N + n[None, :])
    if FP8:
        a = a.to(tl.float8e4nv)
        b = b.to(tl.float8e4nv)
        if IMPRECISE >= 0:
            c = tl.dot(a, b, max_num_imprecise_acc=IMPRECISE)
        else:
            c = tl.dot(a, b)
    else:
        c = tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16))
    tl.store(C + pid * M * N + m[:, None] * N + n[None, :], c)


@triton.jit
def _dot_loop(
    A, B, C, KTOT, stride_bk, stride_bn, M: tl.constexpr, N: tl.constexpr, BK: tl.constexpr, FP8: tl.constexpr
):
    pid = tl.program_id(0)
    m = tl.arange(0, M)
    n = tl.arange(0, N)
    k = tl.arange(0, BK)
    acc = tl.zeros((M, N), tl.float32)
    for k0 in range(0, KTOT, BK):
        a = tl.load(A + pid * M * KTOT + m[:, None] * KTOT + (k0 + k)[None, :])
        b = tl.load(B + (k0 + k)[:, None] * stride_bk + n[None, :] * stride_bn)
        acc = tl.dot(a, b, acc)
    tl.store(C + pid * M * N + m[:, None] * N + n[None, :], acc)


def e4m3_values(shape, gen, spread):
    x = torch.randn(shape, generator=gen, device="cuda") * torch.exp2(
        torch.randint(-spread, spread + 1, shape, generator=gen, device="cuda").float()
    )
    return x.to(torch.float8_e4m3fn).float()


def accuracy():
    """Per variant: results that differ from the BF16 dot of the same values, and the largest error
    against the float64 sum relative to the sum of |a_k b_k| (in powers of two: -13 means 2^-13)."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    tiles, M, N = 256, 128, 128
    print("| K | operands | dot | results differing from the BF16 dot | max error / sum abs (log2) |")
    print("|---|---|---|---|---|")
    for K in (32, 128):
        for spread in (0, 4):
            a = e4m3_values((tiles, M, K), gen, spread)
            b = e4m3_values((tiles, K, N), gen, spread)
            ref = torch.bmm(a.double(), b.double())
            mag = torch.bmm(a.double().abs(), b.double().abs()).clamp_min(2.0**-200)
            bf = torch.empty(tiles, M, N, device="cuda")
            _dot_tile[(tiles,)](a, b, bf, K=K, M=M, N=N, FP8=False, IMPRECISE=-1)
            variants = [("BF16 dot", bf)]
            for imprecise in sorted({-1, 32, K}):
                c = torch.empty_like(bf)
                _dot_tile[(tiles,)](a, b, c, K=K, M=M, N=N, FP8=True, IMPRECISE=imprecise)
                variants.append(
                    ("E4M3 dot, " + ("default" if imprecise < 0 else f"max_num_imprecise_acc={imprecise}"), c)
                )
            for name, c in variants:
                diff = int((c != bf).sum())
                rel = float(((c.double() - ref).abs() / mag).max())
                bits = f"{torch.log2(torch.tensor(rel)).item():.1f}" if rel > 0 else "exact"
                print(f"| {K} | E4M3 x 2^[-{spread},{spread}] | {name} | {diff} of {c.numel()} | {bits} |")


def speed():
    M, N, BK, KTOT, progs = 128, 128, 128, 8192, 1056
    a16 = torch.randn(progs, M, KTOT, device="cuda").to(torch.bfloat16)
    b16 = torch.randn(KTOT, N, device="cuda").to(torch.bfloat16)
    c = torch.empty(progs, M, N, device="cuda")
    flops = 2 * M * N * KTOT * progs
    print("| operands | B layout | TFLOP/s |")
    print("|---|---|---|")
    for fp8 in (False, True):
        a = a16.to(torch.float8_e4m3fn) if fp8 else a16
        for layout in ("N-major (K, N) row-major", "K-major (N, K) transposed"):
            b = b16.to(torch.float8_e4m3fn) if fp8 else b16
            if layout.startswith("K"):
                bt = b.t().contiguous()  # (N, K) in memory
                sk, sn = bt.stride(1), bt.stride(0)
                barg = bt
            else:
                sk, sn = b.stride(0), b.stride(1)
                barg = b
            try:
                fn = functools.partial(  # bound now: do_bench calls it in this iteration
                    _dot_loop[(progs,)], a, barg, c, KTOT, sk, sn, M=M, N=N, BK=BK, FP8=fp8, num_warps=8, num_stages=3
                )
                ms = triton.testing.do_bench(fn, warmup=10, rep=100, return_mode="median")
                print(f"| {'E4M3' if fp8 else 'BF16'} | {layout} | {flops / ms / 1e9:.0f} |")
            except Exception as exc:
                print(f"| {'E4M3' if fp8 else 'BF16'} | {layout} | error: {str(exc).splitlines()[0][:100]} |")


def main() -> int:
    print(torch.cuda.get_device_name(), "triton", triton.__version__)
    accuracy()
    speed()
    return 0


if __name__ == "__main__":
    sys.exit(main())
