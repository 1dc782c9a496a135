"""Scaling of `flamia-verify sweep` with the number of workers, and the per-case overhead of a backend.

    python benchmarks/sweep_scaling.py --device cuda --workers 1 2 --out /tmp/scaling     # GPUs
    python benchmarks/sweep_scaling.py --device cpu --workers 2 --backends local ray --suite quick \
        --only interface.output isolation.offset --seeds 8 --out /tmp/scaling-cpu          # Ray overhead

The matrix: kernels x only-lists (one family each by default) x seeds. One case runs first to fill
the Triton cache and is not timed. For each backend and worker count the whole matrix runs into a
fresh directory; the script prints and writes (OUT/scaling.json) the wall time, the speed-up over the
first worker count, and the per-case overhead: (wall x workers - sum of the cases' own times) / cases,
i.e. the time a worker slot spends per case outside the check itself (worker process starts,
imports, Ray's task dispatch and result transfer), also as a fraction of the mean case time. A Ray
cluster is started before the clock starts (its start time is reported apart): a sweep pays it once.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

from flamia_verify.sweep import run_sweep
from flamia_verify.sweep.matrix import Sweep, SweepCase


def matrix(args) -> Sweep:
    onlys = [[o] for o in args.only] if args.one_each else [args.only]
    cases = tuple(
        SweepCase(kernel=k, suite=args.suite, only=tuple(only), seed=s, device=args.device)
        for k in args.kernels
        for only in onlys
        for s in range(args.seeds)
    )
    return Sweep(cases=cases, timeout_s=args.timeout, source="benchmarks/sweep_scaling.py")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--suite", default="standard")
    p.add_argument("--kernels", nargs="+", default=["flamia-mxfp8", "bf16"])
    p.add_argument("--only", nargs="+", default=["error", "bound", "causal", "isolation"])
    p.add_argument("--together", dest="one_each", action="store_false", help="one only-list of all --only")
    p.add_argument("--seeds", type=int, default=4)
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    p.add_argument("--backends", nargs="+", default=["local"])
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--out", default="/tmp/sweep-scaling")
    args = p.parse_args()
    out = Path(args.out)
    shutil.rmtree(out, ignore_errors=True)
    sweep = matrix(args)
    warm = Sweep(cases=sweep.cases[:1], timeout_s=args.timeout, source="warm-up")
    start = time.perf_counter()
    run_sweep(warm, out / "warm-up", workers=1)
    print(f"warm-up case: {time.perf_counter() - start:.1f} s", flush=True)
    rows = []
    for backend in args.backends:
        for run, workers in enumerate(args.workers):
            where = out / f"{backend}-{run}-{workers}"  # a fresh store each run: nothing is read back
            cluster_s = 0.0
            if backend == "ray":  # the cluster's one-time start is not a per-case cost: started untimed
                import ray

                start = time.perf_counter()
                ray.init(
                    num_cpus=workers if args.device == "cpu" else None, include_dashboard=False, log_to_driver=False
                )
                cluster_s = time.perf_counter() - start
            start = time.perf_counter()
            try:
                outcome = run_sweep(sweep, where, backend=backend, workers=workers)
            finally:
                wall = time.perf_counter() - start
                if backend == "ray":
                    ray.shutdown()
            inside = sum(r["elapsed_s"] for r in outcome.results)
            n = len(outcome.results)
            overhead = (wall * workers - inside) / n
            row = {
                "backend": backend,
                "workers": workers,
                "cases": n,
                "counts": outcome.counts(),
                "wall_s": round(wall, 2),
                "cluster_start_s": round(cluster_s, 2),
                "case_s_sum": round(inside, 2),
                "case_s_mean": round(inside / n, 3),
                "overhead_per_case_s": round(overhead, 3),
                "overhead_fraction": round(overhead / (inside / n), 4),
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
    base: dict[str, float] = {}
    for r in rows:  # against the backend's first run with the fewest workers
        least = min(x["workers"] for x in rows if x["backend"] == r["backend"])
        base.setdefault(
            r["backend"], next(x["wall_s"] for x in rows if x["backend"] == r["backend"] and x["workers"] == least)
        )
        r["speedup"] = round(base[r["backend"]] / r["wall_s"], 3)
    print(
        "\n| backend | workers | cases | wall (s) | speed-up | case time mean (s) | overhead per case (s) | overhead / case |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['backend']} | {r['workers']} | {r['cases']} | {r['wall_s']} | {r['speedup']}x | "
            f"{r['case_s_mean']} | {r['overhead_per_case_s']} | {100 * r['overhead_fraction']:.1f} % |"
        )
    out.mkdir(parents=True, exist_ok=True)
    (out / "scaling.json").write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
