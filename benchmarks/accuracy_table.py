"""Accuracy of every built-in kernel against the float64 reference, per tensor, on fixed seeds.

    python benchmarks/accuracy_table.py [--device cpu|cuda] [--seeds 3]

Inputs: q, k, v, dO ~ N(0, 1) in bf16, a causal pack of documents of 200, 256 and 57 tokens,
4 query heads over 2 kv heads, head dim 128. Prints a Markdown table of the relative RMSE
(||x - x_ref|| / ||x_ref||, worst over seeds) and its ratio to the bf16 kernel's on the same inputs.
"""

from __future__ import annotations

import argparse

import torch

from flamia_verify.kernels import builtin_kernels
from flamia_verify.reference import attention_backward, attention_forward

LENS = [200, 256, 57]


def case(seed: int, device: str):
    g = torch.Generator().manual_seed(seed)
    t = sum(LENS)
    mk = lambda h: torch.randn(t, h, 128, generator=g).to(torch.bfloat16).to(device)  # noqa: E731
    q, k, v, do = mk(4), mk(2), mk(2), mk(4)
    cu = torch.tensor([0] + torch.tensor(LENS).cumsum(0).tolist(), dtype=torch.int32, device=device)
    return q, k, v, do, cu


def errors(kernel, seed: int, device: str) -> dict[str, float]:
    q, k, v, do, cu = case(seed, device)
    scale = 128**-0.5
    o_ref, lse = attention_forward(q, k, v, cu, cu, softmax_scale=scale, causal=True)
    refs = (o_ref, *attention_backward(do, q, k, v, o_ref, lse, cu, cu, softmax_scale=scale, causal=True))
    qq, kk, vv = (x.clone().requires_grad_(True) for x in (q, k, v))
    out = kernel(qq, kk, vv, cu, cu, max(LENS), max(LENS), softmax_scale=scale, causal=True)
    out.backward(do)
    got = (out, qq.grad, kk.grad, vv.grad)
    return {
        name: (torch.linalg.vector_norm(g.double() - r) / torch.linalg.vector_norm(r)).item()
        for name, g, r in zip(("O", "dQ", "dK", "dV"), got, refs)
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--seeds", type=int, default=3)
    args = ap.parse_args()
    kernels = builtin_kernels()
    table = {}
    for name, kernel in kernels.items():
        worst: dict[str, float] = {}
        for seed in range(args.seeds):
            for key, val in errors(kernel, seed, args.device).items():
                worst[key] = max(worst.get(key, 0.0), val)
        table[name] = worst
    base = table["bf16"]
    print("| kernel | O | dQ | dK | dV |")
    print("|---|---|---|---|---|")
    for name, errs in table.items():
        cells = [f"{errs[t]:.2e} ({errs[t] / base[t]:.1f}x)" for t in ("O", "dQ", "dK", "dV")]
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
