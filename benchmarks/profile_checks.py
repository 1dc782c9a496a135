"""Where a suite's time goes on a device: each check's seconds, the Triton compilations it caused, and
the functions that took the most cumulative time (cProfile), for one or more runs in one process.

    python benchmarks/profile_checks.py --kernel flamia-mxfp8 --suite standard --device cuda \
        --only isolation.fuzz --runs 2 --top 25

The second run of a process reuses the kernels compiled by the first (Triton's in-memory cache), so
the difference between the runs is the compilation and first-call cost.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time


def _compiled_counts() -> dict[str, int]:
    """Compiled specializations per fused Triton kernel in this process."""
    try:
        from flamia_verify.kernels.triton import attention as A
    except ImportError:
        return {}
    counts = {}
    for name in dir(A):
        fn = getattr(A, name)
        cache = getattr(fn, "device_caches", None) or getattr(fn, "cache", None)
        if cache is None or not hasattr(fn, "fn"):
            continue
        total = 0
        for per_device in cache.values():
            entry = per_device[0] if isinstance(per_device, tuple) else per_device
            total += len(entry) if hasattr(entry, "__len__") else 0
        counts[name] = total
    return counts


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--kernel", default="flamia-mxfp8")
    p.add_argument("--suite", default="standard")
    p.add_argument("--device", default="cuda")
    p.add_argument("--only", nargs="*")
    p.add_argument("--runs", type=int, default=2)
    p.add_argument("--top", type=int, default=25)
    args = p.parse_args()
    from flamia_verify.properties import run_checks

    for run in range(1, args.runs + 1):
        before = _compiled_counts()
        prof = cProfile.Profile()
        t0 = time.perf_counter()
        prof.enable()
        report = run_checks(args.kernel, suite=args.suite, device=args.device, only=args.only)
        prof.disable()
        wall = time.perf_counter() - t0
        after = _compiled_counts()
        new = {k: after[k] - before.get(k, 0) for k in after if after[k] - before.get(k, 0)}
        print(f"== run {run}: {wall:.1f} s, {sum(new.values())} new compilations {new}")
        for c in report.checks:
            print(f"  {c.status:5s} {c.name:36s} {c.duration_s:7.2f} s")
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats(args.top)
        print(s.getvalue())


if __name__ == "__main__":
    main()
