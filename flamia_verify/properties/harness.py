"""Calling a kernel under test: the calling convention, gradients, timeouts, and what went wrong.

``KernelHarness.call(inputs)`` runs the forward (and, when asked, the backward with the case's
upstream gradient) and returns detached :class:`KernelOutputs`. Every failure of the kernel itself
becomes a :class:`KernelCallError` that carries the case, so a check can report it as ``error``
with what reproduces it.

Timeouts: with ``timeout_s`` set, each call runs in a fresh daemon thread and the caller waits at
most that long. Python cannot kill a thread: a kernel that hangs keeps its thread (and whatever
it holds: GPU stream, its own locks) until it returns or the process exits. The check reports
``error`` naming the time limit and the run continues: the harness holds no lock across a call, puts
back the caller's default dtype and random generators the abandoned call may have left changed, and
ignores whatever the thread does if it finishes late (no audit, no process-state record).
:func:`calls_left_running` counts the abandoned calls still running in the process. Such a thread
must not meet interpreter finalization: a thread that returns from C++ (a torch op) while Python
shuts down aborts the process ("terminate called without an active exception", exit 134) after the
reports are written. The command line therefore ends a process that has one with ``os._exit`` and
its documented exit code, once the reports are written (``commands.common.interrupted``); the
Python API (``flamia_verify.check``) returns its report and leaves the daemon thread running, as it
must not end its caller's process.

A kernel that blocks in C while holding the GIL (an extension that never releases it) stops the
whole process: the caller cannot even get back from its timed wait. The command line opts in to a
last resort (:func:`exit_when_stuck`): a faulthandler watchdog, which needs no GIL, that dumps every
thread's traceback to stderr and ends the process with exit code 1 (the run did not complete) when
the caller is not back ``grace`` seconds after the time limit. :func:`on_stuck_watchdog` tells a
listener when the watchdog is armed and cancelled (the command line's supervising process tells its
exit from a kernel's own exit with code 1 that way).

In-place writes: the kernel gets fresh copies of the case's tensors, and after the forward and again
after the backward of every call the harness compares each copy bitwise with the case's original. A
change is recorded in ``KernelHarness.modifications`` (case, stage, tensor, mismatch), whatever check
made the call; ``interface.inputs_unmodified`` reports them all. A forward that autograd stops because
it writes into a leaf input that requires grad is run once more on detached inputs, so that the write
is recorded with the tensor it hit.
"""

from __future__ import annotations

import contextlib
import faulthandler
import sys
import threading
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch

from flamia_verify.errors import KernelCrashError, KernelTimeoutError
from flamia_verify.kernels.state import restore_state, snapshot_state
from flamia_verify.properties.call_options import Stage, around, cu_laid_out, laid_out_like, lay_out
from flamia_verify.properties.cases import Case, Inputs, make_inputs
from flamia_verify.properties.compare import Mismatch, _bits, compare_bitwise
from flamia_verify.properties.process_state import StateChange, StateProbe

__all__ = [
    "KernelOutputs",
    "KernelCallError",
    "KernelHarness",
    "BackwardSupport",
    "calls_left_running",
    "KernelHungError",
    "exit_when_stuck",
    "on_stuck_watchdog",
    "Modification",
    "StatePin",
    "StateRecord",
    "is_leaf_inplace_error",
    "kernel_traceback",
    "same_bits",
]

#: torch's message when an in-place operation hits a leaf tensor that requires grad
_LEAF_INPLACE = "a leaf Variable that requires grad is being used in an in-place operation"


def is_leaf_inplace_error(exc: BaseException) -> bool:
    """The kernel wrote into an input in place and autograd refused it (leaf inputs that require grad)."""
    return _LEAF_INPLACE in str(exc)


@dataclass
class KernelOutputs:
    """Detached results of one call. Gradients are None when not requested or not available."""

    out: torch.Tensor
    dq: torch.Tensor | None = None
    dk: torch.Tensor | None = None
    dv: torch.Tensor | None = None
    tuple_output: bool = False
    seconds: float = 0.0
    #: the second item of a tuple output when it has the shape of FlashAttention's log-sum-exp,
    #: (nheads, total_q); None otherwise. ``second_item`` describes what the second item was.
    lse: torch.Tensor | None = None
    second_item: str = ""
    # the tensors the kernel received (fresh copies of the inputs), to detect in-place writes
    passed: dict | None = None
    #: with ``loss=lse``: whether the returned log-sum-exp was in the graph (None for other calls)
    lse_differentiable: bool | None = None
    #: with ``create_graph=yes``: the gradients that arrived outside the graph (detached: a gradient
    #: penalty on them is silently a constant); empty otherwise
    detached_grads: tuple[str, ...] = ()

    def tensors(self) -> dict[str, torch.Tensor]:
        d = {"out": self.out}
        for name in ("dq", "dk", "dv"):
            t = getattr(self, name)
            if t is not None:
                d[name] = t
        return d


def kernel_traceback(exc: BaseException) -> str:
    """The full traceback text of an exception the kernel raised, from the first frame outside this
    module (the kernel's call, or autograd's backward) down, with its chained causes."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None and tb.tb_frame.f_globals.get("__name__") == __name__:
        tb = tb.tb_next
    return "".join(traceback.format_exception(type(exc), exc, tb))


class KernelCallError(Exception):
    """The kernel raised (or hung) on one case; the check that called it reports ``error``.

    stage: how far the call got; where: the same in words (a check's own calls say which step and
    layer). summary: the exception's type and first line; traceback: its full traceback text."""

    def __init__(self, case: Case, exc: BaseException, stage: Stage, where: str | None = None):
        self.case = case
        self.exc = exc
        self.stage = stage
        self.where = str(stage) if where is None else where
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        self.summary = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
        self.traceback = kernel_traceback(exc)
        super().__init__(f"kernel {self.where} failed on {case.describe()}: {self.summary}")


@dataclass(frozen=True)
class BackwardSupport:
    """Whether the run checks gradients.

    available: gradients are computed and checked. reason: why not. declared: the user declared the
    kernel forward-only (its backward is never called). cause: "declared", "no_grad_fn", "raised",
    "no_gradient" (the backward gave no gradient for q, k or v) or "inplace" (the forward writes into
    an input in place, which autograd rejects on leaf inputs that require grad). case: the probe case.
    traceback: the full traceback of what the backward raised (cause "raised"; else empty).
    """

    available: bool
    reason: str = ""
    declared: bool = False
    cause: str = ""
    case: Case | None = None
    traceback: str = ""


@dataclass
class Modification:
    """One input tensor the kernel changed: on which case, in which stage, and how."""

    case: Case
    stage: Stage  # forward or backward
    tensor: str
    mismatch: Mismatch
    backward_call: bool  # the call ran (or tried) the backward too
    call: int = 0  # the harness's call number (0-based)


@dataclass
class StateRecord:
    """One process setting a call left changed (:mod:`flamia_verify.properties.process_state`)."""

    case: Case
    stage: Stage  # how far the call got: forward or backward
    change: StateChange
    call: int  # the harness's call number (0-based)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equal (-0.0 and +0.0 alike, as in compare_bitwise); the raw bytes decide the common case."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    a, b = a.contiguous(), b.contiguous()
    if a.dim() and torch.equal(a.view(torch.uint8), b.view(torch.uint8)):
        return True
    return torch.equal(_bits(a), _bits(b))


#: the threads of every kernel call abandoned after its time limit, by any harness of the process
_ABANDONED: list[threading.Thread] = []

#: seconds past a call's time limit after which a caller still not back ends the process (None: never)
_STUCK_GRACE_S: list[float | None] = [None]

#: told the seconds until the watchdog fires when it is armed, None when it is cancelled (None: nobody)
_STUCK_LISTENER: list[Callable[[float | None], None] | None] = [None]


def calls_left_running() -> int:
    """How many kernel calls of this process ran past their time limit and are still running (their
    daemon threads cannot be killed; see the module's docstring)."""
    _ABANDONED[:] = [t for t in _ABANDONED if t.is_alive()]
    return len(_ABANDONED)


def exit_when_stuck(grace_s: float | None) -> float | None:
    """For a command line only, never a library caller: while a timed call runs, arm a faulthandler
    watchdog that, when the caller is still not back ``grace_s`` seconds after the call's time limit
    (the kernel holds the GIL in C and never lets it go), writes every thread's traceback to stderr
    and ends the process with exit code 1. None disarms it. Returns the previous setting. The
    watchdog is faulthandler's one ``dump_traceback_later`` timer: a timer someone else armed is
    cancelled by the next timed call."""
    previous = _STUCK_GRACE_S[0]
    _STUCK_GRACE_S[0] = grace_s
    return previous


def on_stuck_watchdog(listener: Callable[[float | None], None] | None) -> Callable[[float | None], None] | None:
    """Tell ``listener`` when the watchdog of :func:`exit_when_stuck` is armed (the seconds until it
    ends the process) and when it is cancelled (None), so that a process supervising this one can tell
    the watchdog's exit (code 1) from a kernel's own. None stops telling. Returns the previous listener."""
    previous = _STUCK_LISTENER[0]
    _STUCK_LISTENER[0] = listener
    return previous


@contextlib.contextmanager
def _stuck_watchdog(timeout_s: float):
    grace = _STUCK_GRACE_S[0]
    stderr = sys.__stderr__  # the process's own (sys.stderr may be a capture without a file descriptor)
    armed = False
    if grace is not None and stderr is not None:
        try:
            faulthandler.dump_traceback_later(timeout_s + grace, exit=True, file=stderr)
            armed = True
        except (AttributeError, ValueError, OSError, RuntimeError):  # no stderr to write to: no watchdog
            pass
    listener = _STUCK_LISTENER[0] if armed else None
    if listener is not None and grace is not None:
        listener(timeout_s + grace)
    try:
        yield
    finally:
        if armed:
            faulthandler.cancel_dump_traceback_later()
            if listener is not None:
                listener(None)


def _caller_state(device: torch.device) -> Callable[[], None]:
    """The process state a call changes while it runs (the default dtype of a ``default_dtype`` case,
    the random generators the call's probe replaces): returns what puts the caller's back."""
    dtype = torch.get_default_dtype()
    cpu = torch.get_rng_state()
    cuda = None
    if device.type == "cuda" and torch.cuda.is_initialized():
        with contextlib.suppress(RuntimeError):
            cuda = torch.cuda.get_rng_state(device)

    def put_back() -> None:
        torch.set_default_dtype(dtype)
        torch.set_rng_state(cpu)
        if cuda is not None:
            with contextlib.suppress(RuntimeError):
                torch.cuda.set_rng_state(cuda, device)

    return put_back


class StatePin:
    """How the checks that judge one call at a time run a kernel that keeps state (delayed scaling, a
    calibrate-then-freeze rule): each call at the state that a fresh kernel has after one call
    (forward, and backward when the run has gradients) on the tensors of the call's case as
    ``make_inputs`` draws them, unperturbed. That state is built once per case (from ``fresh``, a
    snapshot of the kernel before any call of the run) and put back before every forward and every
    backward of a call of that case, so that

    * a check comparing a case with a perturbation of it (a future token, a neighbour document, NaN:
      inputs that keep the case they were made from) compares two calls at one state, whatever the
      perturbation: what differs is the kernel's own work within the call;
    * a check of accuracy judges the kernel at a state adapted to its inputs, as training's earlier
      steps adapt it, not at the state some other case left;
    * no call sees what another call of the run left: whether the state stays adapted call after
      call is the state family's question (:mod:`flamia_verify.properties.checks.state`).

    Cases of other packings (a document alone and packed) get other states: a layout's bits may differ
    through the scales (the ``*_bitwise`` reproducibility checks report it), never its accuracy."""

    def __init__(self, fn: Callable[..., Any], fresh: Any, *, backward: bool):
        self.fn = fn
        self.fresh = fresh
        self.backward = backward
        self._warm: dict[Case, Any] = {}
        self.warmups = 0

    def restore_fresh(self) -> None:
        """Put back the state of the kernel before any call of the run."""
        restore_state(self.fn, self.fresh)

    def before(self, inputs: Inputs) -> None:
        case = replace(inputs.case, call=()) if inputs.case.call else inputs.case
        snap = self._warm.get(case)
        if snap is None:
            restore_state(self.fn, self.fresh)
            self._warm_up(make_inputs(case, inputs.q.device))
            snap = self._warm[case] = snapshot_state(self.fn)
        restore_state(self.fn, snap)

    def _warm_up(self, inp: Inputs) -> None:
        """One call of the case's own tensors (a forward, and its backward when the run has one)."""
        self.warmups += 1
        with torch.inference_mode(False), torch.enable_grad():
            with torch.autocast(device_type=inp.q.device.type, enabled=False):
                q, k, v = (x.detach().clone().requires_grad_(self.backward) for x in (inp.q, inp.k, inp.v))
                result = self.fn(
                    q,
                    k,
                    v,
                    inp.cu_q.clone(),
                    inp.cu_k.clone(),
                    inp.max_q,
                    inp.max_k,
                    softmax_scale=inp.case.scale,
                    causal=inp.case.causal,
                )
            out = result[0] if isinstance(result, (tuple, list)) else result
            if self.backward and isinstance(out, torch.Tensor) and out.requires_grad:
                out.backward(inp.do.detach().to(out.dtype))


class KernelHungError(Exception):
    """The kernel hung on an earlier call (past the per-call limit): it is not called again, and every
    check that would call it is an error that says so (not a refusal, not a pass)."""


class KernelHarness:
    """Runs one kernel (a callable in the calling convention) on :class:`Inputs`."""

    def __init__(self, fn, *, timeout_s: float | None = None):
        self.fn = fn
        self.timeout_s = timeout_s
        #: the call that hung past ``timeout_s`` (its case, described); no call is made after it
        self.hung: str | None = None
        self.calls = 0
        self.seconds = 0.0
        self.audited = 0  # calls whose inputs were compared after the kernel returned or raised
        self.modifications: list[Modification] = []
        #: process settings a call left changed: (case, stage, change, call index)
        self.state_changes: list[StateRecord] = []
        self._abandoned: set[threading.Thread] = set()  # threads of calls that timed out
        #: called with the inputs of every call (the coverage model records what each check exercises)
        self.recorder: Callable[[Inputs], None] | None = None
        #: a stateful kernel's :class:`StatePin` (the engine sets it when the kernel can snapshot and
        #: restore its state): before every forward and every backward the state a fresh kernel has after
        #: one call on the same case; None for every other kernel
        self.pin: StatePin | None = None

    def _pinned(self, inputs: Inputs) -> None:
        if self.pin is not None:
            self.pin.before(inputs)

    # -- in-place writes ------------------------------------------------------------------

    def _late(self) -> bool:
        """This is the thread of a call abandoned after its time limit, finishing late: it records nothing."""
        return threading.current_thread() in self._abandoned

    def _audit(self, case: Case, stage: Stage, pairs: dict, flagged: set, backward: bool) -> None:
        """Compare the tensors handed to the kernel with the originals; record each new change."""
        if self._late():
            return
        for name, (passed, original) in pairs.items():
            if name in flagged:
                continue
            passed = passed.detach()
            if not same_bits(passed, original):
                flagged.add(name)
                cu = None
                if name in ("q", "do"):
                    cu = inputs_cu(case, "q")
                elif name in ("k", "v"):
                    cu = inputs_cu(case, "k")
                self.modifications.append(
                    Modification(
                        case,
                        stage,
                        name,
                        compare_bitwise(passed, original, what=name, cu_seqlens=cu),
                        backward,
                        self.calls,
                    )
                )

    def _record_state(self, case: Case, stage: Stage, changes: list[StateChange]) -> None:
        self.state_changes += [StateRecord(case, stage, change, self.calls) for change in changes]

    # -- the call itself ------------------------------------------------------------------

    def _invoke(self, inputs: Inputs, backward: bool, do: torch.Tensor | None):
        """One call as the case's options (call_options.OPTIONS) make it: the inputs handed over in their
        layouts, every option's context around the forward and around the backward, the kernel's
        writes into its inputs audited after each, and the process state it must leave as it found."""
        case = inputs.case
        backward = backward and case.calls("grad_mode", "enabled")  # the other modes are forwards only
        q, k, v, grads_of = lay_out(inputs, backward)
        cu_q, cu_k = (cu_laid_out(cu, case.call_option("cu_layout")) for cu in (inputs.cu_q, inputs.cu_k))
        original_do = inputs.do if do is None else do
        if case.calls("upstream", "broadcast"):  # one row of dO expanded: stride 0 over tokens
            upstream = original_do.detach()[:1].clone().expand(original_do.shape)
        else:
            upstream = laid_out_like(original_do.detach(), case.call_option("layout"))
        pairs = {
            "q": (q, inputs.q),
            "k": (k, inputs.k),
            "v": (v, inputs.v),
            "cu_seqlens_q": (cu_q, inputs.cu_q),
            "cu_seqlens_k": (cu_k, inputs.cu_k),
        }
        flagged: set = set()
        stage = Stage.FORWARD
        try:
            mode: contextlib.AbstractContextManager = (
                torch.enable_grad()
                if backward
                else torch.inference_mode()
                if case.calls("grad_mode", "inference")
                else torch.no_grad()
            )
            with mode:
                probe = StateProbe(q.device)  # the process state the call must leave as it found it
                try:
                    scale = None if case.calls("scale_arg", "none") else case.scale
                    with around(case, q, Stage.FORWARD):
                        self._pinned(inputs)
                        result = self.fn(
                            q, k, v, cu_q, cu_k, inputs.max_q, inputs.max_k, softmax_scale=scale, causal=case.causal
                        )
                    if backward:  # a forward-only call is audited once, below
                        self._audit(case, Stage.FORWARD, pairs, flagged, backward)
                    tuple_output = isinstance(result, (tuple, list))
                    out = result[0] if tuple_output and len(result) else result
                    if not isinstance(out, torch.Tensor):
                        raise TypeError(
                            f"kernel returned {type(result).__name__}; expected a tensor or a tuple starting with one"
                        )
                    back = _Backward()
                    if backward:
                        stage = Stage.BACKWARD
                        pairs["do"] = (upstream, original_do)
                        back = self._backward(inputs, result, out, (q, k, v), upstream, original_do, grads_of)
                finally:
                    if not self._late():  # a timed-out call's thread must not put back a state it no longer owns
                        self._record_state(case, stage, probe.finish())
            self._audit(case, stage, pairs, flagged, backward)
            self.audited += 1
            passed = {"q": q.detach(), "k": k.detach(), "v": v.detach(), "cu_seqlens_q": cu_q, "cu_seqlens_k": cu_k}
            if backward:
                passed["do"] = upstream
            lse, second = _second_item(result, inputs) if tuple_output else (None, "")
            res = KernelOutputs(
                out.detach(),
                *back.grads,
                tuple_output=tuple_output,
                passed=passed,
                lse=lse,
                second_item=second,
                detached_grads=back.detached,
                lse_differentiable=back.lse_differentiable,
            )
            return res, stage
        except _NoBackward:
            self.audited += 1
            raise
        except BaseException as exc:  # the kernel's own failure, whatever it is
            if isinstance(exc, Exception):  # it may have written before it raised
                self._audit(case, stage, pairs, flagged, backward)
                self.audited += 1
            exc.__flamia_stage__ = stage  # type: ignore[attr-defined]
            raise

    def _backward(self, inputs: Inputs, result, out, qkv, upstream, original_do, grads_of) -> _Backward:
        """The backward of a call as its options ask: from the output (edited in place first with
        ``out_edit=add``) or from the returned log-sum-exp (``loss=lse``), with another pack's call
        before it (``interleave``), run twice on one graph (``backward=twice``), with
        ``create_graph=True``; inside the options' backward contexts."""
        case = inputs.case
        q = qkv[0]
        back = _Backward()
        if case.calls("out_edit", "add") and out.requires_grad:
            out.add_(1.0)  # the caller's in-place edit of the result before its backward
        if case.calls("loss", "lse"):  # the backward from the log-sum-exp
            lse_t = result[1] if isinstance(result, (tuple, list)) and len(result) > 1 else None
            back.lse_differentiable = (
                isinstance(lse_t, torch.Tensor)
                and lse_t.requires_grad
                and tuple(lse_t.shape) == (q.shape[1], q.shape[0])
            )
            if back.lse_differentiable:
                assert isinstance(lse_t, torch.Tensor)
                self._pinned(inputs)
                lse_t.backward(lse_weights(original_do).to(device=lse_t.device, dtype=lse_t.dtype))
                back.grads = tuple(None if g is None else g.detach().contiguous() for g in grads_of())  # type: ignore[assignment]
            return back
        if out.grad_fn is None and not out.requires_grad:
            if out.numel():
                raise _NoBackward("the output has no grad_fn (forward-only kernel)")
            # no query: an empty output may stand outside the graph; every gradient is 0
            back.grads = tuple(torch.zeros_like(x) if x.requires_grad else None for x in qkv)  # type: ignore[assignment]
            return back
        up = upstream.to(out.dtype) if upstream.dtype != out.dtype else upstream
        create_graph = case.calls("create_graph", "yes")
        if create_graph:  # a penalty's upstream gradient depends on the graph itself
            up = up.detach().clone().requires_grad_()
        with around(case, q, Stage.BACKWARD):
            if case.calls("interleave", "other_call"):
                self._other_call(inputs)
            if case.calls("backward", "twice"):  # the same graph's backward again
                self._pinned(inputs)
                out.backward(up, retain_graph=True)
                for x in qkv:  # leaves: the layout is contiguous
                    x.grad = None
            with warnings.catch_warnings():  # .grad is reset below: the cycle is broken
                warnings.filterwarnings("ignore", message="Using backward.. with create_graph")
                self._pinned(inputs)
                out.backward(up, create_graph=create_graph)
        raw = grads_of()
        back.grads = tuple(None if g is None else g.detach().contiguous() for g in raw)  # type: ignore[assignment]
        if create_graph:
            back.detached = tuple(n for n, g in zip(("dq", "dk", "dv"), raw) if g is not None and not g.requires_grad)
            for x in qkv:  # the graph held by .grad: let it go
                x.grad = None
        return back

    def call(self, inputs: Inputs, *, backward: bool = True, do: torch.Tensor | None = None) -> KernelOutputs:
        """Run the kernel; raise :class:`KernelCallError` if it raises or exceeds the timeout."""
        t0 = time.perf_counter()
        if self.hung is not None:
            raise KernelHungError(
                f"not run: the kernel hung on an earlier call ({self.hung}) past the {self.timeout_s:g} s limit "
                "(case_timeout_s), and a hung kernel is not called again"
            )
        if self.recorder is not None:
            self.recorder(inputs)
        try:
            res = self._dispatch(inputs, backward, do)
        except KernelCallError as err:
            if backward and err.stage is Stage.FORWARD and is_leaf_inplace_error(err.exc):
                self._retry_detached(inputs, do)
            raise
        res.seconds = time.perf_counter() - t0
        self.seconds += res.seconds
        return res

    def _dispatch(self, inputs: Inputs, backward: bool, do) -> KernelOutputs:
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
            if isinstance(exc, KeyboardInterrupt):  # SIGINT, or SIGTERM turned into one: not the kernel's
                raise
            raise KernelCallError(inputs.case, exc, getattr(exc, "__flamia_stage__", Stage.CALL)) from exc
        finally:
            self.calls += 1
        return res

    def call_guarded(self, case: Case, thunk: Callable[[], Any], stage: Stage, where: str) -> Any:
        """Run ``thunk``, kernel calls a check makes itself (the state family: several instances of a
        kernel, inputs written into the same buffers call after call), under the harness's rules: within
        ``timeout_s`` (a hung call is abandoned and the kernel not called again), an exception of the
        kernel a :class:`KernelCallError` naming ``case``, ``stage`` and ``where`` (the call in words).
        Counted as one call."""
        if self.hung is not None:
            raise KernelHungError(
                f"not run: the kernel hung on an earlier call ({self.hung}) past the {self.timeout_s:g} s limit "
                "(case_timeout_s), and a hung kernel is not called again"
            )
        t0 = time.perf_counter()
        try:
            if self.timeout_s is None:
                return thunk()
            box: dict = {}

            def target():
                try:
                    box["result"] = thunk()
                except BaseException as exc:  # handed to the caller's thread
                    box["error"] = exc

            worker = threading.Thread(target=target, name="flamia-verify-kernel-call", daemon=True)
            put_back = _caller_state(torch.device("cpu"))
            with _stuck_watchdog(self.timeout_s):
                worker.start()
                worker.join(self.timeout_s)
            if worker.is_alive():
                self._abandoned.add(worker)
                _ABANDONED.append(worker)
                self.hung = f"{case.describe()}, {where}"
                put_back()
                raise KernelTimeoutError(
                    f"the kernel did not return within {self.timeout_s:g} s, the time limit of one kernel call "
                    "(case_timeout_s); its thread was left running (a hung thread cannot be killed in-process)"
                )
            if "error" in box:
                raise box["error"]
            return box["result"]
        except KeyboardInterrupt:
            raise
        except BaseException as exc:
            raise KernelCallError(case, exc, stage, where) from exc
        finally:
            self.calls += 1
            self.seconds += time.perf_counter() - t0

    def _other_call(self, inputs: Inputs) -> None:
        """Another pack's forward and backward through the kernel (``interleave=other_call``), run while
        the case's own call waits for its backward."""
        other = make_inputs(interleaved_case(inputs.case), inputs.q.device)
        q, k, v = (x.detach().clone().requires_grad_() for x in (other.q, other.k, other.v))
        self._pinned(other)
        result = self.fn(
            q,
            k,
            v,
            other.cu_q,
            other.cu_k,
            other.max_q,
            other.max_k,
            softmax_scale=other.case.scale,
            causal=other.case.causal,
        )
        out = result[0] if isinstance(result, (tuple, list)) else result
        if isinstance(out, torch.Tensor) and out.requires_grad:
            self._pinned(other)
            out.backward(other.do.to(out.dtype))

    def _retry_detached(self, inputs: Inputs, do) -> None:
        """The forward wrote into a leaf input that requires grad and autograd stopped it: run the
        forward again on detached inputs so that the write is recorded with the tensor it hit."""
        try:
            self._dispatch(inputs, False, do)
        except KernelCallError:
            pass

    def _threaded(self, inputs: Inputs, backward: bool, do):
        box: dict = {}

        def target():
            try:
                box["result"] = self._invoke(inputs, backward, do)[0]
            except BaseException as exc:  # handed to the caller's thread
                box["error"] = exc
                box["trace"] = traceback.format_exc()

        assert self.timeout_s is not None
        worker = threading.Thread(target=target, name="flamia-verify-kernel-call", daemon=True)
        put_back = _caller_state(inputs.q.device)
        with _stuck_watchdog(self.timeout_s):
            worker.start()
            worker.join(self.timeout_s)
        if worker.is_alive():
            self._abandoned.add(worker)  # what it does if it ever finishes is not this run's any more
            _ABANDONED.append(worker)
            self.hung = inputs.case.describe()
            put_back()  # the call's default dtype and the probe's random generators are not the caller's
            exc = KernelTimeoutError(
                f"the kernel did not return within {self.timeout_s:g} s, the time limit of one kernel call "
                "(case_timeout_s); its thread was left running (a hung thread cannot be killed in-process)"
            )
            raise KernelCallError(inputs.case, exc, Stage.CALL)
        if "error" in box:
            raise box["error"]
        return box["result"]

    # -- forward-only detection -----------------------------------------------------------

    def probe(self, inputs: Inputs, *, forward_only: bool = False) -> tuple[KernelOutputs, BackwardSupport]:
        """Run the smallest case: forward must work (else KernelCrashError); what the backward does is
        returned as :class:`BackwardSupport` (never called when ``forward_only`` is declared)."""
        case = inputs.case
        try:
            fwd = self.call(inputs, backward=False)
        except KernelCallError as err:
            raise KernelCrashError(
                f"the kernel cannot run the smallest case ({case.describe()}): {err.summary}"
            ) from err
        if forward_only:
            return fwd, BackwardSupport(
                False, "the kernel is declared forward-only", declared=True, cause="declared", case=case
            )
        want = (inputs.q.shape[0], inputs.q.shape[1], inputs.v.shape[-1])
        if fwd.out is not None and tuple(fwd.out.shape) != want:
            # the backward of a wrongly shaped output cannot take dO: say what is wrong, not "forward-only"
            return fwd, BackwardSupport(
                False,
                f"the output has shape {tuple(fwd.out.shape)}, not (total_q, nheads, head_dim) = {want}, so its "
                "backward cannot take dO (interface.output reports the shape)",
                cause="bad_output",
                case=case,
            )
        try:
            both = self.call(inputs, backward=True)
        except _NoBackward as nb:
            return fwd, BackwardSupport(False, str(nb), cause="no_grad_fn", case=case)
        except KernelCallError as err:
            if err.stage is Stage.BACKWARD:
                return fwd, BackwardSupport(
                    False, f"the backward raised {err.summary}", cause="raised", case=case, traceback=err.traceback
                )
            if is_leaf_inplace_error(err.exc):
                return fwd, BackwardSupport(
                    False,
                    "the forward writes into its inputs in place, which autograd rejects on leaf inputs "
                    f"that require grad ({err.summary})",
                    cause="inplace",
                    case=case,
                )
            raise KernelCrashError(
                f"the kernel cannot run the smallest case ({case.describe()}): {err.summary}"
            ) from err
        if both.dq is None and both.dk is None and both.dv is None:
            return fwd, BackwardSupport(
                False, "the backward produced no gradient for q, k or v", cause="no_gradient", case=case
            )
        return both, BackwardSupport(True, case=case)


def _second_item(result, inputs: Inputs) -> tuple[torch.Tensor | None, str]:
    """The log-sum-exp of a tuple output: its second item when that is a tensor of shape
    (nheads, total_q), FlashAttention's layout, or (batch, nheads, max_seqlen_q), the older padded
    layout (read back into the packed one); otherwise None and a description of what it was."""
    if len(result) < 2:
        return None, ""
    x = result[1]
    if not isinstance(x, torch.Tensor):
        return None, type(x).__name__
    c = inputs.case
    want = (c.heads, c.total_q)
    if tuple(x.shape) == want and x.is_floating_point():
        return x.detach(), f"log-sum-exp {tuple(x.shape)} {x.dtype}"
    padded = (len(c.lens_q), c.heads, inputs.max_q)
    if tuple(x.shape) == padded and x.is_floating_point():  # FlashAttention 2's older varlen layout
        rows = [x.detach()[b, :, :n] for b, n in enumerate(c.lens_q)]
        packed = torch.cat(rows, dim=1) if rows else x.new_zeros((c.heads, 0))
        return packed, f"log-sum-exp {tuple(x.shape)} {x.dtype} (padded: batch, nheads, max_seqlen_q)"
    return None, f"tensor {tuple(x.shape)} {x.dtype}"


def lse_weights(do: torch.Tensor) -> torch.Tensor:
    """The upstream gradient of a log-sum-exp (nheads, total_q) in a ``loss=lse`` call: the first
    channel of the case's dO, transposed (drawn like dO, so a dropped or misplaced row shows)."""
    return do.detach()[:, :, 0].T.contiguous()


def interleaved_case(case: Case) -> Case:
    """The call that ``interleave=other_call`` runs between a case's forward and backward: the same
    token counts, heads and head_dim (what a kernel's cache is likeliest keyed by), split into other
    documents (two, a third and two thirds), the other causal flag, half the scale, another seed."""

    def split(total: int, other: tuple[int, ...]) -> tuple[int, int]:
        a = total // 3
        return (total - a, a) if (total - a, a) != other else (a, total - a)

    return Case(
        split(case.total_q, case.lens_q),
        split(case.total_k, case.lens_k),
        heads=case.heads,
        heads_k=case.heads_k,
        headdim=case.headdim,
        causal=not case.causal,
        softmax_scale=case.scale / 2,
        dtype=case.dtype,
        seed=case.seed + 7919,
    )


def inputs_cu(case: Case, side: str) -> list[int]:
    """cu_seqlens of one side of a case ("q" or "k"), to name positions in mismatch records."""
    out = [0]
    for n in case.lens_q if side == "q" else case.lens_k:
        out.append(out[-1] + n)
    return out


@dataclass
class _Backward:
    """What a call's backward gave: the gradients of q, k, v (None where none arrived), those that came
    back outside the graph with create_graph=True, and whether a returned log-sum-exp was in the graph
    (``loss=lse``; None for a backward from the output)."""

    grads: tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None] = (None, None, None)
    detached: tuple[str, ...] = ()
    lse_differentiable: bool | None = None


class _NoBackward(Exception):
    """The kernel's output is not differentiable."""
