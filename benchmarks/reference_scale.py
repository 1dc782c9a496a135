"""Time and peak memory of the float64 reference on one long document.

    python benchmarks/reference_scale.py                       # S = 4K..32K, H=16, D=128, causal, CPU
    python benchmarks/reference_scale.py --device cuda
    python benchmarks/reference_scale.py --seqlens 32768 --mask both --modes fwd+bwd

Every case runs in a fresh subprocess, so its peak memory is its own:
* CPU: ru_maxrss of the child (the high-water mark of its resident set, which torch's
  allocations count in; tracemalloc does not see them), and the RSS just before the timed call
  (interpreter, torch, and the bf16 inputs), so "added" is what the reference itself needed;
* CUDA: torch.cuda.max_memory_allocated, and what was allocated before the timed call.

Inputs are bf16 q, k, v, dout ~ N(0, 1), one document of S tokens, softmax_scale = D^-1/2.
"fwd" is attention_forward; "fwd+bwd" is reference_attention plus backward (autograd wrapper,
analytic backward), timed as one. FLOPs count the GEMMs only: 4 S_q S_k H D for the forward
(two GEMMs), 10 S_q S_k H D for the backward (five), halved for causal.
Prints a Markdown table (and the command line and date) on stdout. The last column is the
machine's 1-minute load average when the case finished: on a shared machine, a load above
the core count means the wall time is inflated by other work. "CPU time" is the child's user +
system time for the timed call (all threads): less sensitive to other work than the wall time,
and about threads x wall time on an idle machine.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time

GIB = 2**30


def _case(spec: dict) -> dict:
    """Run one case in this process and return its measurements."""
    import resource

    import torch

    from flamia_verify.reference import attention_forward, reference_attention

    device = torch.device(spec["device"])
    S, H, D, causal = spec["seqlen"], spec["heads"], spec["headdim"], spec["causal"]
    g = torch.Generator(device="cpu").manual_seed(0)
    q, k, v, dout = (torch.randn(S, H, D, generator=g, dtype=torch.bfloat16).to(device) for _ in range(4))
    cu = torch.tensor([0, S], dtype=torch.int32, device=device)
    scale = D**-0.5

    def run(q, k, v, dout, cu, S):
        if spec["mode"] == "fwd":
            out, _ = attention_forward(
                q, k, v, cu, cu, softmax_scale=scale, causal=causal, chunk_size=spec["chunk_size"]
            )
            return out
        q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
        out = reference_attention(q, k, v, cu, cu, S, S, softmax_scale=scale, causal=causal)
        out.backward(dout)
        return out

    # Warm-up on 64 tokens: library initialisation (CUDA context, cuBLAS, MKL threads) is not
    # the reference's cost.
    n = 64
    run(q[:n], k[:n], v[:n], dout[:n], torch.tensor([0, n], dtype=torch.int32, device=device), n)

    def rss_bytes() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    else:
        before = rss_bytes()

    def cpu_seconds() -> float:
        r = resource.getrusage(resource.RUSAGE_SELF)
        return r.ru_utime + r.ru_stime

    c0 = cpu_seconds()
    t0 = time.perf_counter()
    out = run(q, k, v, dout, cu, S)
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    cpu = cpu_seconds() - c0
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated()
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    finite = bool(torch.isfinite(out).all())
    return {
        "seconds": seconds,
        "cpu_seconds": cpu,
        "peak_bytes": peak,
        "before_bytes": before,
        "finite": finite,
        "load": os.getloadavg()[0],
    }


def _flops(S: int, H: int, D: int, causal: bool, mode: str) -> float:
    per_gemm = 2.0 * S * S * H * D * (0.5 if causal else 1.0)
    return per_gemm * (2 if mode == "fwd" else 7)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seqlens", type=int, nargs="+", default=[4096, 8192, 16384, 32768])
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--headdim", type=int, default=128)
    ap.add_argument("--mask", choices=["causal", "full", "both"], default="causal")
    ap.add_argument("--modes", nargs="+", choices=["fwd", "fwd+bwd"], default=["fwd", "fwd+bwd"])
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--chunk-size", type=int, default=None, help="query rows per chunk (fwd only; default automatic)")
    ap.add_argument("--json", metavar="FILE", help="also write the raw measurements here")
    ap.add_argument("--case", help=argparse.SUPPRESS)  # internal: run one case, print JSON
    args = ap.parse_args(argv)
    if args.chunk_size is not None and "fwd+bwd" in args.modes:
        ap.error("--chunk-size applies to --modes fwd only; reference_attention uses the automatic chunk")

    if args.case:
        print(json.dumps(_case(json.loads(args.case))))
        return 0

    import torch

    masks = {"causal": [True], "full": [False], "both": [True, False]}[args.mask]
    rows = []
    for S in args.seqlens:
        for causal in masks:
            for mode in args.modes:
                spec = dict(
                    seqlen=S,
                    heads=args.heads,
                    headdim=args.headdim,
                    causal=causal,
                    mode=mode,
                    device=args.device,
                    chunk_size=args.chunk_size,
                )
                proc = subprocess.run(
                    [sys.executable, os.path.abspath(__file__), "--case", json.dumps(spec)],
                    capture_output=True,
                    text=True,
                )
                if proc.returncode != 0:
                    print(f"case {spec} failed:\n{proc.stderr[-2000:]}", file=sys.stderr)
                    return 1
                m = json.loads(proc.stdout.strip().splitlines()[-1])
                m.update(spec)
                m["gflops"] = _flops(S, args.heads, args.headdim, causal, mode) / m["seconds"] / 1e9
                rows.append(m)
                print(
                    f"S={S} {'causal' if causal else 'full'} {mode}: {m['seconds']:.1f} s, "
                    f"peak {m['peak_bytes'] / GIB:.2f} GiB",
                    file=sys.stderr,
                    flush=True,
                )

    if args.device == "cuda":
        where = torch.cuda.get_device_name(0)
        mem_cols = ("peak allocated (GiB)", "allocated before (GiB)", "added (GiB)")
    else:
        where = f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch threads {torch.get_num_threads()}"
        mem_cols = ("peak RSS (GiB)", "RSS before (GiB)", "added (GiB)")
    print(f"`{' '.join(['python', 'benchmarks/reference_scale.py', *(argv if argv is not None else sys.argv[1:])])}`")
    print(
        f"{datetime.date.today().isoformat()}, {where}, torch {torch.__version__}, H={args.heads}, D={args.headdim}, bf16 inputs\n"
    )
    print(
        f"| S | mask | mode | time (s) | CPU time (s) | GEMM GFLOP/s | {' | '.join(mem_cols)} | load avg (1 min, at end) |"
    )
    print("|---:|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for m in rows:
        print(
            f"| {m['seqlen']} | {'causal' if m['causal'] else 'full'} | {m['mode']} | {m['seconds']:.2f} | "
            f"{m['cpu_seconds']:.1f} | "
            f"{m['gflops']:.1f} | {m['peak_bytes'] / GIB:.2f} | {m['before_bytes'] / GIB:.2f} | "
            f"{(m['peak_bytes'] - m['before_bytes']) / GIB:.2f} | {m['load']:.1f} |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
