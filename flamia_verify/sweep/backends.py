"""The backends that run a sweep's cases: a local pool of worker processes (one per visible GPU, or
per CPU core) and Ray (one task per case, on an existing cluster or a local one). Neither schedules
anything itself beyond handing the next case to a free worker: the local pool is a
``concurrent.futures`` thread pool whose threads each take a free worker process pinned to one device
slot and hand it the case (a crash or hang there costs that case and a fresh worker, never the
sweep); Ray's own scheduler places its tasks.

Every backend calls ``on_result(result)`` once per case, in completion order, with the worker's
result or an ``error`` result naming what went wrong (crash with its exit code and last stderr
line, timeout, lost node).
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from typing import Any

from flamia_verify.errors import ConfigError
from flamia_verify.results import SweepResult
from flamia_verify.sweep.matrix import SweepCase
from flamia_verify.sweep.worker import RECIPE_MARK, RESULT_MARK, error_result, run_case

__all__ = ["BACKENDS", "local_slots", "run_local", "run_ray"]

BACKENDS = ("local", "ray")
OnResult = Callable[[SweepResult], None]


def local_slots(device: str, workers: int | None = None, per_gpu: int = 1) -> list[dict[str, str]]:
    """The environment of each local worker: one visible GPU each (``CUDA_VISIBLE_DEVICES``, read
    through the parent's own mask; ``per_gpu`` workers share each GPU, for cases that leave it idle
    most of the time), or, for a CPU sweep, one CPU core's share of threads each."""
    if per_gpu < 1:
        raise ConfigError(f"--workers-per-gpu must be at least 1, got {per_gpu}")
    gpus: list[str] = []
    if device in ("auto", "cuda"):
        import torch

        count = torch.cuda.device_count()
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        names = [v.strip() for v in visible.split(",") if v.strip()] if visible else [str(i) for i in range(count)]
        gpus = names[:count]
        if device == "cuda" and not gpus:
            raise ConfigError("the sweep asks for cuda but no CUDA device is visible; use device = cpu or auto")
    if gpus:
        if workers is not None:
            if workers > len(gpus):
                raise ConfigError(f"--workers {workers} is more than the {len(gpus)} visible GPU(s)")
            gpus = gpus[:workers]
        return [{"CUDA_VISIBLE_DEVICES": g} for _ in range(per_gpu) for g in gpus]
    cores = os.cpu_count() or 1
    count = workers or cores
    threads = max(1, cores // count)
    return [{"CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": str(threads)} for _ in range(count)]


class _Worker:
    """One long-lived worker process (:func:`flamia_verify.sweep.worker.main`) on one device slot: it serves
    case after case (the imports, the CUDA context and the compiled kernels are paid once), and is
    killed and replaced when a case crashes it or runs past the timeout."""

    def __init__(self, env_overlay: dict[str, str]) -> None:
        self.env = {**os.environ, **env_overlay}
        self.proc: subprocess.Popen | None = None
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.stderr_tail: deque[str] = deque(maxlen=50)
        self.stderr_reader: threading.Thread | None = None
        self.lock = threading.Lock()

    def _start(self) -> subprocess.Popen:
        proc = subprocess.Popen(
            [sys.executable, "-c", "import sys; from flamia_verify.sweep.worker import main; sys.exit(main())"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=self.env,
            text=True,
            bufsize=1,
            start_new_session=True,  # its own process group: a kill takes its children too
        )
        self.lines = queue.Queue()
        self.stderr_tail.clear()
        threading.Thread(target=_pump, args=(proc.stdout, self.lines.put), daemon=True).start()
        self.stderr_reader = threading.Thread(target=_pump, args=(proc.stderr, self._keep_stderr), daemon=True)
        self.stderr_reader.start()
        return proc

    def _keep_stderr(self, line: str | None) -> None:
        if line is not None and line.strip():
            self.stderr_tail.append(line.rstrip())

    def run(self, case: SweepCase, key: str, timeout_s: float | None, report_dir: str | None = None) -> SweepResult:
        """The result of ``case``; with ``report_dir`` the worker also writes the case's report into
        ``report_dir/<key>/`` before it answers (in parallel with the other workers)."""
        with self.lock:
            if self.proc is None or self.proc.poll() is not None:
                self.proc = self._start()
            proc = self.proc
        start = time.perf_counter()
        try:
            assert proc.stdin is not None
            proc.stdin.write(json.dumps({"case": case.to_dict(), "key": key, "reports": report_dir}) + "\n")
            proc.stdin.flush()
        except (BrokenPipeError, OSError):
            return self._crashed(case, key, start)
        deadline = None if timeout_s is None else start + timeout_s
        recipe = None  # the case's recipe, once the worker has announced it
        while True:
            remaining = None if deadline is None else deadline - time.perf_counter()
            if remaining is not None and remaining <= 0:
                self.kill()
                return error_result(
                    case, f"timed out after {timeout_s:g} s (worker killed)", time.perf_counter() - start, key, recipe
                )
            try:
                line = self.lines.get(timeout=remaining)
            except queue.Empty:
                continue
            if line is None:  # end of its stdout: the worker died
                return self._crashed(case, key, start, recipe)
            if line.startswith(RECIPE_MARK):
                recipe = json.loads(line[len(RECIPE_MARK) :])
            if line.startswith(RESULT_MARK):
                return SweepResult.from_dict(json.loads(line[len(RESULT_MARK) :]))

    def _crashed(self, case: SweepCase, key: str, start: float, recipe: str | None = None) -> SweepResult:
        proc = self.proc
        code = proc.wait() if proc is not None else None
        if self.stderr_reader is not None:
            self.stderr_reader.join(timeout=5)
        self.proc = None
        why = self.stderr_tail[-1] if self.stderr_tail else "it wrote nothing to stderr"
        if code == 0:
            why = f"it exited without a result; {why}"
        what = f"killed by signal {-code}" if code is not None and code < 0 else f"exit code {code}"
        return error_result(case, f"worker crashed ({what}): {why}", time.perf_counter() - start, key, recipe)

    def kill(self) -> None:
        with self.lock:
            proc, self.proc = self.proc, None
        if proc is not None:
            _kill_group(proc)

    def close(self) -> None:
        """End the worker: close its stdin (it exits after its current case) and wait a little."""
        with self.lock:
            proc, self.proc = self.proc, None
        if proc is None:
            return
        try:
            assert proc.stdin is not None
            proc.stdin.close()
            proc.wait(timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            _kill_group(proc)


def _kill_group(proc: subprocess.Popen) -> None:
    """Kill a worker's process group (its children too) and reap it."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1].strip() if lines else ""


def _pump(stream, put: Callable[[str | None], None]) -> None:
    """Every line of ``stream`` to ``put``, then None at its end."""
    try:
        for line in stream:
            put(line.rstrip("\n"))
    except (OSError, ValueError):
        pass
    put(None)


def run_local(
    cases: Sequence[tuple[str, SweepCase]],
    on_result: OnResult,
    *,
    device: str,
    workers: int | None = None,
    timeout_s: float | None = None,
    per_gpu: int = 1,
    report_dir: str | os.PathLike[str] | None = None,
) -> int:
    """Run ``cases`` ((key, case) pairs) on the local pool; returns the number of workers used. With
    ``report_dir`` each worker writes the full report of each of its cases into ``report_dir/<key>/``."""
    slots = local_slots(device, workers, per_gpu)
    workers_ = [_Worker(slot) for slot in slots]
    free: queue.Queue[_Worker] = queue.Queue()
    for worker in workers_:
        free.put(worker)

    def one(key: str, case: SweepCase) -> SweepResult:
        worker = free.get()
        try:
            return worker.run(case, key, timeout_s, None if report_dir is None else os.fspath(report_dir))
        finally:
            free.put(worker)

    pool = ThreadPoolExecutor(max_workers=len(slots), thread_name_prefix="flamia-sweep")
    try:
        futures = [pool.submit(one, key, case) for key, case in cases]
        for future in as_completed(futures):
            on_result(future.result())
    except BaseException:
        for worker in workers_:
            worker.kill()
        pool.shutdown(wait=True, cancel_futures=True)
        raise
    finally:
        for worker in workers_:
            worker.close()
    pool.shutdown(wait=True)
    return len(slots)


def _ray_case(case_data: dict[str, Any], key: str) -> dict[str, Any]:
    """The body of one Ray task: the case, run in the Ray worker's process (its result as JSON data, which
    any Ray node can send back)."""
    return run_case(case_data, key).to_dict()


def run_ray(
    cases: Sequence[tuple[str, SweepCase]],
    on_result: OnResult,
    *,
    device: str,
    workers: int | None = None,
    timeout_s: float | None = None,
    address: str | None = None,
) -> int:
    """Run ``cases`` as Ray tasks (one GPU each on a GPU sweep, one CPU each otherwise), on the
    cluster at ``address`` or on a local one started here (``workers`` CPUs); returns the number of
    task slots. At most that many tasks are in flight, so a task's timeout counts from its start."""
    try:
        import ray
        from ray.exceptions import RayError
    except ImportError:
        raise ConfigError("the ray backend needs Ray: pip install 'flamia-verify[ray]'") from None
    started_here = not ray.is_initialized()
    if started_here:
        kwargs: dict[str, Any] = {"include_dashboard": False, "log_to_driver": False, "logging_level": "ERROR"}
        if address:
            kwargs["address"] = address
        elif workers:
            kwargs["num_cpus"] = workers
        ray.init(**kwargs)
    try:
        resources = ray.cluster_resources()
        use_gpu = device == "cuda" or (device == "auto" and resources.get("GPU", 0) >= 1)
        if device == "cuda" and resources.get("GPU", 0) < 1:
            raise ConfigError("the sweep asks for cuda but the Ray cluster has no GPU")
        slots = int(resources.get("GPU", 0)) if use_gpu else int(resources.get("CPU", 1))
        if workers:
            slots = min(slots, workers)
        slots = max(slots, 1)
        options: dict[str, Any] = {"num_cpus": 1, "num_gpus": 1 if use_gpu else 0, "max_retries": 0}
        if not use_gpu:
            options["runtime_env"] = {"env_vars": {"CUDA_VISIBLE_DEVICES": ""}}
        task = ray.remote(_ray_case).options(**options)
        pending = list(cases)
        running: dict[Any, tuple[str, SweepCase, float]] = {}
        while pending or running:
            while pending and len(running) < slots:
                key, case = pending.pop(0)
                running[task.remote(case.to_dict(), key)] = (key, case, time.perf_counter())
            done, _ = ray.wait(list(running), num_returns=1, timeout=1.0)
            for ref in done:
                key, case, start = running.pop(ref)
                try:
                    on_result(SweepResult.from_dict(ray.get(ref)))
                except RayError as exc:
                    reason = f"Ray task failed ({type(exc).__name__}): {_last_line(str(exc)) or exc}"
                    on_result(error_result(case, reason, time.perf_counter() - start, key))
            if timeout_s is not None:
                now = time.perf_counter()
                for ref, (key, case, start) in list(running.items()):
                    if now - start > timeout_s:
                        ray.cancel(ref, force=True)
                        running.pop(ref)
                        on_result(
                            error_result(
                                case, f"timed out after {timeout_s:g} s (Ray task cancelled)", now - start, key
                            )
                        )
        return slots
    finally:
        if started_here:
            ray.shutdown()
