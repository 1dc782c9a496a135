"""Where a kernel's training run goes non-finite: the first attention call whose output or gradient
is NaN/Inf, saved as a replayable case, and the same call through the design's emulation.

    python experiments/diagnose_divergence.py --kernel flamia-nvfp4 --preset small --device cuda \
        --out OUTDIR [--emulated-steps 60]

Trains as ``train-parity`` does (same preset, seed, weights and batches), watching every attention
call: its output, and, through hooks, its dO and the gradients dq, dk, dv it returns. At the first
non-finite value it writes OUTDIR/divergence-case.pt (q, k, v, dO, cu_seqlens, max_seqlen,
softmax_scale, step, layer, which tensor) and runs that call again through the fused kernel and the
design's PyTorch emulation (on the CPU), printing which of out, dq, dk, dv are finite in each.
``--emulated-steps N`` also trains N steps with the emulation in every layer on the same device.
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path

import torch


class Watch:
    def __init__(self, kernel):
        self.kernel = kernel
        self.found = None
        self.step = 0
        self.layer = 0

    def __call__(self, q, k, v, cu_q, cu_k, mq, mk, *, softmax_scale, causal):
        out = self.kernel(q, k, v, cu_q, cu_k, mq, mk, softmax_scale=softmax_scale, causal=causal)
        out = out[0] if isinstance(out, tuple) else out
        rec = {
            "q": q.detach().clone(),
            "k": k.detach().clone(),
            "v": v.detach().clone(),
            "cu": cu_q.detach().clone(),
            "max_len": int(mq),
            "scale": float(softmax_scale),
            "step": self.step,
            "layer": self.layer,
        }
        self.layer += 1
        if self.found is None and not bool(torch.isfinite(out).all()):
            self.found = dict(rec, which="out")
        if out.requires_grad:
            out.register_hook(lambda g: rec.update(do=g.detach().clone()))
            for name, t in (("dq", q), ("dk", k), ("dv", v)):
                if t.requires_grad:
                    t.register_hook(lambda g, name=name: self._grad(rec, name, g))
        return out

    def _grad(self, rec, name, g):
        if self.found is None and not bool(torch.isfinite(g).all()):
            self.found = dict(rec, which=name)


def _replay(fn, case, device):
    q, k, v = (case[n].to(device).requires_grad_(True) for n in ("q", "k", "v"))
    cu = case["cu"].to(device)
    out = fn(q, k, v, cu, cu, case["max_len"], case["max_len"], softmax_scale=case["scale"], causal=True)
    out = out[0] if isinstance(out, tuple) else out
    res = {"out": bool(torch.isfinite(out).all())}
    if "do" in case:
        out.backward(case["do"].to(device))
        res.update({n: bool(torch.isfinite(t.grad).all()) for n, t in (("dq", q), ("dk", k), ("dv", v))})
    return res


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--kernel", default="flamia-nvfp4")
    p.add_argument("--preset", default="small")
    p.add_argument("--device", default="cuda")
    p.add_argument("--steps", type=int)
    p.add_argument("--out", default=".")
    p.add_argument("--emulated-steps", type=int, default=0)
    args = p.parse_args()
    from flamia_verify.kernels import load_kernel
    from flamia_verify.kernels.designs import DESIGNS
    from flamia_verify.kernels.emulation import make_kernel
    from flamia_verify.reference import reference_attention
    from flamia_verify.training.corpus import build_corpus, make_batches
    from flamia_verify.training.parity import PRESETS, train_one

    cfg = PRESETS[args.preset]
    if args.steps:
        cfg = replace(cfg, steps=args.steps)
    corpus = build_corpus(max_bytes=cfg.corpus_max_bytes)
    val = [
        b.to(args.device)
        for b in make_batches(
            corpus.val, n=cfg.val_batches, tokens=cfg.tokens, max_len=cfg.max_len, seed=10_000 + cfg.seed
        )
    ]
    watch = Watch(load_kernel(args.kernel).fn)

    def on_step(name, step, loss):
        watch.step, watch.layer = step + 1, 0

    r = train_one(
        watch,
        args.kernel,
        cfg,
        corpus,
        seed=cfg.seed,
        device=args.device,
        exact=reference_attention,
        val=val,
        on_step=on_step,
    )
    print(f"{args.kernel}: diverged at step {r.diverged_at}; last losses {[round(x, 3) for x in r.train_loss[-5:]]}")
    if watch.found is not None:
        f = watch.found
        print(
            f"first non-finite: {f['which']} at step {f['step']}, layer {f['layer']}; "
            f"|q| max {float(f['q'].abs().max()):.3g}, |k| max {float(f['k'].abs().max()):.3g}, "
            f"|v| max {float(f['v'].abs().max()):.3g}, |dO| max "
            f"{float(f['do'].abs().max()) if 'do' in f else float('nan'):.3g}, documents {f['cu'].numel() - 1}"
        )
        path = Path(args.out) / "divergence-case.pt"
        torch.save({k: (v.cpu() if torch.is_tensor(v) else v) for k, v in f.items()}, path)
        print(f"saved {path}")
        print("fused kernel again:", _replay(load_kernel(args.kernel).fn, f, args.device))
        if args.kernel in DESIGNS:
            print("emulation (cpu):   ", _replay(make_kernel(DESIGNS[args.kernel]), f, "cpu"))
        print("float64 reference: ", _replay(reference_attention, f, args.device))
    if args.emulated_steps and args.kernel in DESIGNS:
        emu = make_kernel(DESIGNS[args.kernel])
        r2 = train_one(
            emu,
            args.kernel + " (emulation)",
            replace(cfg, steps=args.emulated_steps),
            corpus,
            seed=cfg.seed,
            device=args.device,
            exact=reference_attention,
            val=val[:1],
        )
        print(
            f"{args.kernel} emulation, {args.emulated_steps} steps: diverged at {r2.diverged_at}, last losses "
            f"{[round(x, 3) for x in r2.train_loss[-3:]]}"
        )


if __name__ == "__main__":
    main()
