"""Calling a kernel under test: the calling convention, gradients, timeouts, and what went wrong.

``KernelHarness.call(inputs)`` runs the forward (and, when asked, the backward with the case's
upstream gradient) and returns detached :class:`KernelOutputs`. Every failure of the kernel itself
becomes a :class:`KernelCallError` that carries the case, so a check can report it as ``error``
with what reproduces it.

Timeouts: with ``timeout_s`` set, each call runs in a fresh daemon thread and the caller waits at
most that long. Python cannot kill a thread: a kernel that hangs keeps its thread (and whatever
it holds: GPU stream, locks) until it returns or the process exits. The check reports ``error`` and
the run continues; a kernel that hangs for good needs the process to be restarted.
"""

from __future__ import annotations

import threading
import time
import traceback
from dataclasses import dataclass

import torch

from flamia_verify.errors import KernelCrashError, KernelTimeoutError
from flamia_verify.properties.cases import Case, Inputs

__all__ = ["KernelOutputs", "KernelCallError", "KernelHarness", "BackwardSupport"]


@dataclass
class KernelOutputs:
    """Detached results of one call. Gradients are None when not requested or not available."""

    out: torch.Tensor
    dq: torch.Tensor | None = None
    dk: torch.Tensor | None = None
    dv: torch.Tensor | None = None
    tuple_output: bool = False
    seconds: float = 0.0
    # the tensors the kernel received (fresh copies of the inputs), to detect in-place writes
    passed: dict | None = None

    def tensors(self) -> dict[str, torch.Tensor]:
        d = {"out": self.out}
        for name in ("dq", "dk", "dv"):
            t = getattr(self, name)
            if t is not None:
                d[name] = t
        return d


class KernelCallError(Exception):
    """The kernel raised (or hung) on one case; the check that called it reports ``error``."""

    def __init__(self, case: Case, exc: BaseException, stage: str):
        self.case = case
        self.exc = exc
        self.stage = stage
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        self.summary = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
        super().__init__(f"kernel {stage} failed on {case.describe()}: {self.summary}")


@dataclass(frozen=True)
class BackwardSupport:
    available: bool
    reason: str = ""


def _grad_of(t: torch.Tensor) -> torch.Tensor | None:
    return None if t.grad is None else t.grad.detach()


class KernelHarness:
    """Runs one kernel (a callable in the calling convention) on :class:`Inputs`."""

    def __init__(self, fn, *, timeout_s: float | None = None):
        self.fn = fn
        self.timeout_s = timeout_s
        self.calls = 0
        self.seconds = 0.0

    # -- the call itself ------------------------------------------------------------------

    def _invoke(self, inputs: Inputs, backward: bool, do: torch.Tensor | None):
        q = inputs.q.detach().clone().requires_grad_(backward)
        k = inputs.k.detach().clone().requires_grad_(backward)
        v = inputs.v.detach().clone().requires_grad_(backward)
        cu_q, cu_k = inputs.cu_q.clone(), inputs.cu_k.clone()
        upstream = (inputs.do if do is None else do).detach().clone()
        stage = "forward"
        try:
            with torch.enable_grad() if backward else torch.no_grad():
                result = self.fn(
                    q,
                    k,
                    v,
                    cu_q,
                    cu_k,
                    inputs.max_q,
                    inputs.max_k,
                    softmax_scale=inputs.case.scale,
                    causal=inputs.case.causal,
                )
                tuple_output = isinstance(result, (tuple, list))
                out = result[0] if tuple_output and len(result) else result
                if not isinstance(out, torch.Tensor):
                    raise TypeError(
                        f"kernel returned {type(result).__name__}; expected a tensor or a tuple starting with one"
                    )
                grads = (None, None, None)
                if backward:
                    stage = "backward"
                    if out.grad_fn is None and not out.requires_grad:
                        raise _NoBackward("the output has no grad_fn (forward-only kernel)")
                    out.backward(upstream.to(out.dtype) if upstream.dtype != out.dtype else upstream)
                    grads = (_grad_of(q), _grad_of(k), _grad_of(v))
            passed = {"q": q.detach(), "k": k.detach(), "v": v.detach(), "cu_seqlens_q": cu_q, "cu_seqlens_k": cu_k}
            if backward:
                passed["do"] = upstream
            return KernelOutputs(out.detach(), *grads, tuple_output=tuple_output, passed=passed), stage
        except _NoBackward:
            raise
        except BaseException as exc:  # the kernel's own failure, whatever it is
            exc.__flamia_stage__ = stage  # type: ignore[attr-defined]
            raise

    def call(self, inputs: Inputs, *, backward: bool = True, do: torch.Tensor | None = None) -> KernelOutputs:
        """Run the kernel; raise :class:`KernelCallError` if it raises or exceeds the timeout."""
        t0 = time.perf_counter()
        try:
            if self.timeout_s is None:
                res, _ = self._invoke(inputs, backward, do)
            else:
                res = self._threaded(inputs, backward, do)
        except _NoBackward:
            raise
        except KernelCallError:
            raise
        except BaseException as exc:
            if isinstance(exc, KeyboardInterrupt):
                raise
            raise KernelCallError(inputs.case, exc, getattr(exc, "__flamia_stage__", "call")) from exc
        finally:
            self.calls += 1
        res.seconds = time.perf_counter() - t0
        self.seconds += res.seconds
        return res

    def _threaded(self, inputs: Inputs, backward: bool, do):
        box: dict = {}

        def target():
            try:
                box["result"] = self._invoke(inputs, backward, do)[0]
            except BaseException as exc:  # handed to the caller's thread
                box["error"] = exc
                box["trace"] = traceback.format_exc()

        worker = threading.Thread(target=target, name="flamia-verify-kernel-call", daemon=True)
        worker.start()
        worker.join(self.timeout_s)
        if worker.is_alive():
            exc = KernelTimeoutError(
                f"the kernel did not return within {self.timeout_s:g} s (its thread keeps running: "
                "a hung thread cannot be killed in-process)"
            )
            raise KernelCallError(inputs.case, exc, "call")
        if "error" in box:
            raise box["error"]
        return box["result"]

    # -- forward-only detection -----------------------------------------------------------

    def probe(self, inputs: Inputs) -> tuple[KernelOutputs, BackwardSupport]:
        """Run the smallest case: forward must work (else KernelCrashError); backward may be missing."""
        try:
            fwd = self.call(inputs, backward=False)
        except KernelCallError as err:
            raise KernelCrashError(
                f"the kernel cannot run the smallest case ({inputs.case.describe()}): {err.summary}"
            ) from err
        try:
            both = self.call(inputs, backward=True)
        except _NoBackward as nb:
            return fwd, BackwardSupport(False, str(nb))
        except KernelCallError as err:
            if err.stage == "backward":
                return fwd, BackwardSupport(False, f"backward raised {err.summary}")
            raise KernelCrashError(
                f"the kernel cannot run the smallest case ({inputs.case.describe()}): {err.summary}"
            ) from err
        if both.dq is None and both.dk is None and both.dv is None:
            return fwd, BackwardSupport(False, "the backward produced no gradient for q, k or v")
        return both, BackwardSupport(True)


class _NoBackward(Exception):
    """The kernel's output is not differentiable."""
