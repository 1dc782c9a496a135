"""The ways a call may hand its inputs to a kernel, one object per way (a ``CallOption``).

A case's ``call`` (``Case.call``) is a tuple of (key, value) pairs; each key is one option below and an
empty ``call`` is the plain call (every option at its first value: contiguous tensors, the scale
passed, the true maxima, a training call with one backward from the output). Each option says, in one
place, everything the rest of the package needs of it:

- its values, the first the plain call's, each with its row in the coverage model (``dimension=value``);
- which of them a case may combine with (``contiguous_only``: its gradients are read from q, k, v as
  leaves), and how a value is checked (``validate``);
- how ``interface.arguments`` calls it: the values it tries (``probe``), on how many of its packings
  (``bases``), only on a kernel with a backward (``needs_backward``), and how its result is judged
  (``judged``: the recipe's bound like any call, the plain call's bits as reproducibility, or the
  plain call's bits as an information flow that gates), with the metric and the words of a mismatch;
  an exception that is an allowed refusal rather than a failure (``refused``);
- how the harness applies it: contexts around the forward and the backward, and a step between them.

A new way of calling is one ``CallOption`` in :data:`OPTIONS`; the harness, ``interface.arguments``,
the coverage model and the case validation read it from here.
"""

from __future__ import annotations

import contextlib
import enum
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from flamia_verify.errors import ConfigError


class Case(Protocol):  # properties.cases.Case, which imports this module
    def call_option(self, key: str) -> Any: ...


class Inputs(Protocol):  # properties.cases.Inputs
    case: Any
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor


__all__ = [
    "CallOption",
    "Stage",
    "GRADS_OF",
    "Judged",
    "MAX_SEQLEN_PADS",
    "OPTIONS",
    "OptionValue",
    "check_call",
    "cu_laid_out",
    "laid_out_like",
    "lay_out",
    "max_seqlen_pads",
    "option",
    "option_value",
]


class Judged(enum.Enum):
    """How ``interface.arguments`` judges a call made with an option's other values."""

    BOUND = "bound"  # like any call: the recipe's bound, and the error rule where the bits differ
    BITWISE = "bitwise"  # the plain call's numbers handed over: its bits (reproducibility, reported)
    FLOW = "flow"  # bits that move are another call's values reaching this one (gating)


class Stage(enum.Enum):
    """How far a kernel call got: its forward, its backward, or a call a check made itself (the state
    family's sequences). A plain enum: a string is no stage, and comparing one with a string is a type
    error (mypy's strict equality). ``str()`` is the word the reports write."""

    FORWARD = "forward"
    BACKWARD = "backward"
    CALL = "call"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class OptionValue:
    """One value of an option: what a case stores, and its row of the coverage model (``checks``: the
    checks of the standard suite that make calls with it; empty: the plain call's checks for the first
    value, interface.arguments for the others)."""

    value: Any
    coverage: str
    doc: str
    checks: tuple[str, ...] = ()


def _context_none(value: Any, q: torch.Tensor) -> contextlib.AbstractContextManager:
    return contextlib.nullcontext()


@dataclass(frozen=True)
class CallOption:
    key: str  # the key in Case.call
    dimension: str  # the coverage model's dimension
    doc: str
    values: tuple[OptionValue, ...]  # the first is the plain call's
    judged: Judged = Judged.BOUND
    metric: str = ""  # BITWISE and FLOW: the metric that counts mismatched elements
    words: str = ""  # how a mismatch record names the call ("{value}" is the value)
    contiguous_only: bool = False  # other values need the contiguous layout
    needs_backward: bool = False  # interface.arguments tries it only on a kernel with a backward
    bases: int | None = None  # interface.arguments tries it on this many of its packings (None: all)
    probe: tuple[Any, ...] | None = None  # the values interface.arguments tries (None: every other value)
    refused: Callable[[Any], bool] | None = None  # a KernelCallError that is an allowed refusal
    refused_metric: str = ""
    #: whether the coverage model has the option's rows (it is observed on the built-in bf16 kernel: an
    #: option only some kernels get called with cannot be shown exercised there)
    in_coverage: bool = True
    # the harness: contexts around the forward and around the backward (value, q) -> context manager
    around_forward: Callable[[Any, torch.Tensor], contextlib.AbstractContextManager] = _context_none
    around_backward: Callable[[Any, torch.Tensor], contextlib.AbstractContextManager] = _context_none

    @property
    def default(self) -> Any:
        return self.values[0].value

    @property
    def names(self) -> tuple[Any, ...]:
        return tuple(v.value for v in self.values)

    def validate(self, value: Any) -> None:
        if value not in self.names:
            raise ConfigError(f"call option {self.key} must be one of {', '.join(map(str, self.names))}, got {value!r}")

    def coverage_value(self, value: Any) -> str:
        """The coverage model's value of a call made with ``value``."""
        return next(v.coverage for v in self.values if v.value == value)

    def probe_values(self) -> tuple[Any, ...]:
        return self.probe if self.probe is not None else self.names[1:]

    def value_words(self, value: Any) -> str:
        """A value as the reports write it."""
        return str(value)

    def mismatch_words(self, value: Any) -> str:
        return self.words.format(value=self.value_words(value))


class _MaxSeqlenPad(CallOption):
    """Integers (or a pair of them), not a closed set: checked by form; coverage "exact" or "above"."""

    def validate(self, value: Any) -> None:
        pads = value if isinstance(value, tuple) and len(value) == 2 else (value,)
        if any(isinstance(x, bool) or not isinstance(x, int) or x < 0 for x in pads):
            raise ConfigError(
                f"call option max_seqlen_pad must be a non-negative integer or a pair of them (q, k), got {value!r}"
            )

    def coverage_value(self, value: Any) -> str:
        return "above" if value else "exact"

    def value_words(self, value: Any) -> str:
        return f"{value[0]}/{value[1]}" if isinstance(value, tuple) else str(value)


@contextlib.contextmanager
def _default_dtype(value: Any, q: torch.Tensor) -> Iterator[None]:
    """torch's default dtype set to q's dtype around the call (``default_dtype=input``)."""
    if value != "input":
        yield
        return
    saved = torch.get_default_dtype()
    torch.set_default_dtype(q.dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(saved)


def _autocast(value: Any, q: torch.Tensor) -> contextlib.AbstractContextManager:
    """torch.autocast of q's device and dtype around the forward alone (``autocast=on``): the backward
    runs outside it, as PyTorch recommends."""
    if value == "on":
        return torch.autocast(device_type=q.device.type, dtype=q.dtype)
    return contextlib.nullcontext()


def _autograd_refused(err: Any) -> bool:
    """Autograd refused the backward after an in-place edit of the output (what a kernel that saves its
    output for the backward gets; never a wrong gradient)."""
    text = str(err.exc).lower()
    return isinstance(err.exc, RuntimeError) and ("inplace" in text or "in-place" in text)


def _second_backward_refused(err: Any) -> bool:
    """The kernel (or autograd) refused a second backward through one graph in words that say so
    (saved state freed after the first): a loud limit. Any other exception there is a failure."""
    text = str(err.exc).lower()
    return err.stage is Stage.BACKWARD and any(w in text for w in ("second time", "retain_graph", "already been freed"))


def _any_refusal(err: Any) -> bool:
    """A backward that cannot build a graph of itself may refuse create_graph=True in any words."""
    return True


#: added to (max_seqlen_q, max_seqlen_k) by interface.arguments: a little, and past every tile or split
#: threshold; by different amounts, so that max_seqlen_k - max_seqlen_q moves both ways (a kernel that
#: takes its causal offset from it instead of each document's Lk - Lq moves its diagonal)
MAX_SEQLEN_PADS = ((5, 12), (3000, 2950))

#: Every option, in the order interface.arguments makes its calls (its first finding is the first
#: call that fails).
OPTIONS: tuple[CallOption, ...] = (
    CallOption(
        "layout",
        "layout",
        "how q, k, v are laid out: contiguous; views into one fused (T, H + 2 Hk, D) QKV buffer, as split "
        "from a fused projection (k and v from one (T, 2 Hk, D) KV buffer when the query and key lengths "
        "differ); views of (H, T, D) storage (stride (D, T D, 1)); or each starting 7 rows into a larger "
        "buffer (a nonzero storage offset). dO arrives in the same layout",
        (
            OptionValue("contiguous", "contiguous", "contiguous q, k, v"),
            OptionValue("fused", "fused", "views into one fused QKV (or KV) buffer"),
            OptionValue("transposed", "transposed", "views of (H, T, D) storage"),
            OptionValue("offset", "offset", "views at a nonzero storage offset"),
        ),
    ),
    CallOption(
        "scale_arg",
        "softmax_scale",
        "softmax_scale passed as its value, or None (which means headdim^-0.5; allowed only when the "
        "case's scale is that default)",
        (
            OptionValue("value", "default", "the default headdim^-0.5, passed"),
            OptionValue("none", "none", "softmax_scale=None (the kernel must use headdim^-0.5)"),
        ),
    ),
    _MaxSeqlenPad(
        "max_seqlen_pad",
        "max_seqlen",
        "added to the true max_seqlen_q and max_seqlen_k (the convention allows any upper bound): one "
        "integer for both, or a pair (q, k) that raises them by different amounts (a kernel that derives "
        "a causal offset from max_seqlen_k - max_seqlen_q then moves its diagonal)",
        (
            OptionValue(0, "exact", "max_seqlen_q/k the true maxima"),
            OptionValue(
                None, "above", "max_seqlen_q/k above the true maxima", ("interface.arguments", "isolation.layout")
            ),
        ),
        judged=Judged.BITWISE,
        metric="max_seqlen_mismatches",
        words="with max_seqlen_q, max_seqlen_k + {value}",
        probe=MAX_SEQLEN_PADS,
    ),
    CallOption(
        "cu_layout",
        "cu_seqlens",
        "cu_seqlens_q and cu_seqlens_k contiguous, or as views with stride 2 and a storage offset of one "
        "element into int32 buffers whose other elements are -1 (a slice of larger metadata): the same "
        "values, so the same bits out",
        (
            OptionValue("contiguous", "contiguous", "contiguous cu_seqlens_q and cu_seqlens_k"),
            OptionValue(
                "strided", "strided", "cu_seqlens as strided views at a storage offset (slices of larger metadata)"
            ),
        ),
        judged=Judged.BITWISE,
        metric="cu_seqlens_mismatches",
        words="with strided cu_seqlens views",
    ),
    CallOption(
        "autocast",
        "autocast",
        "the forward outside, or inside torch.autocast of the inputs' device and dtype, as a mixed-precision "
        "training step calls it, the backward outside: the same tensors arrive, so the same bits must come "
        "out (autocast rewrites the caller's ops, not the kernel's)",
        (
            OptionValue("off", "off", "the forward outside torch.autocast"),
            OptionValue("on", "on", "the forward inside torch.autocast of the inputs' dtype (a mixed-precision step)"),
        ),
        judged=Judged.BITWISE,
        metric="autocast_mismatches",
        words="with the forward inside torch.autocast",
        bases=2,
        around_forward=_autocast,
    ),
    CallOption(
        "default_dtype",
        "default_dtype",
        "torch's default dtype float32, or set to the inputs' dtype around the forward and the backward, "
        "as a model built in bf16 leaves the process: a kernel's own allocations must name their dtype",
        (
            OptionValue("float32", "float32", "torch's default dtype float32"),
            OptionValue("input", "input", "torch's default dtype set to the inputs' dtype (a model built in bf16)"),
        ),
        judged=Judged.BITWISE,
        metric="default_dtype_mismatches",
        words="with torch's default dtype set to the inputs' dtype",
        bases=2,
        around_forward=_default_dtype,
        around_backward=_default_dtype,
    ),
    CallOption(
        "grad",
        "requires_grad",
        "which inputs require grad in a call with a backward: all, only q (frozen keys and values, as a "
        "cache of them is) or only k and v (frozen queries); every gradient asked for must arrive",
        (
            OptionValue("all", "all", "q, k and v all require grad"),
            OptionValue("q", "q", "only q requires grad (frozen keys and values, a cache of them)"),
            OptionValue("kv", "kv", "only k and v require grad (frozen queries)"),
        ),
        contiguous_only=True,
        needs_backward=True,
        bases=2,
    ),
    CallOption(
        "out_edit",
        "output",
        "the output handed to the backward as returned, or with 1 added in place by the caller before the "
        "backward: autograd must either refuse or give the gradients of the unedited call",
        (
            OptionValue("none", "returned", "the output handed to the backward as returned"),
            OptionValue("add", "edited_in_place", "the output edited in place before the backward"),
        ),
        needs_backward=True,
        bases=2,
        refused=_autograd_refused,
        refused_metric="refused_output_edits",
    ),
    CallOption(
        "backward",
        "backward",
        "one backward, or the backward run with retain_graph=True, the gradients cleared and run again on "
        "the same graph (gradient penalties, some accumulation loops): the second gradients are the result",
        (
            OptionValue("once", "once", "one backward per forward"),
            OptionValue("twice", "twice", "a second backward through the same graph (retain_graph=True)"),
        ),
        contiguous_only=True,
        needs_backward=True,
        bases=2,
        refused=_second_backward_refused,
        refused_metric="refused_second_backwards",
    ),
    CallOption(
        "upstream",
        "upstream",
        "dO a tensor of its own in the case's layout, or one row expanded over every token (stride 0 along "
        "the sequence), as (out * w).sum() hands it to the backward: the case's dO must have equal rows "
        "(the const_do override)",
        (
            OptionValue("fresh", "fresh", "dO a tensor of its own (in the layout of q, k, v)"),
            OptionValue(
                "broadcast",
                "broadcast",
                "dO one row expanded over every token (stride 0), as (out * w).sum() gives it",
            ),
        ),
        needs_backward=True,
        bases=1,
    ),
    CallOption(
        "interleave",
        "interleave",
        "the forward and its backward back to back, or, between them, the kernel's forward and backward "
        "on another pack (the same token counts in other documents, the other causal flag, half the scale), "
        "as the layers of a model interleave: a kernel's state between its forward and backward must be "
        "per call",
        (
            OptionValue("none", "none", "the forward and its backward back to back"),
            OptionValue(
                "other_call",
                "other_call",
                "another pack's forward and backward between a call's forward and its backward (a model's layers)",
            ),
        ),
        judged=Judged.FLOW,
        metric="interleave_mismatches",
        words="with another pack's call between the forward and the backward",
        needs_backward=True,
        bases=2,
    ),
    CallOption(
        "create_graph",
        "create_graph",
        "a first-order backward, or the backward with create_graph=True, as a gradient penalty runs it: "
        "every gradient must stay in the graph, differentiable or refusing a double backward when asked",
        (
            OptionValue("no", "no", "a first-order backward"),
            OptionValue("yes", "yes", "the backward with create_graph=True (a gradient penalty)"),
        ),
        judged=Judged.BITWISE,
        metric="create_graph_mismatches",
        words="with the backward run with create_graph=True",
        contiguous_only=True,
        needs_backward=True,
        bases=2,
        refused=_any_refusal,
        refused_metric="refused_create_graph",
    ),
    CallOption(
        "grad_mode",
        "grad_mode",
        "a training call (with its backward when the check asks for one), or a forward only under "
        "torch.no_grad() or torch.inference_mode(), where kernels take their inference paths",
        (
            OptionValue("enabled", "enabled", "a training call (forward, and backward when the check asks)"),
            OptionValue("no_grad", "no_grad", "a forward under torch.no_grad() (inference paths)"),
            OptionValue("inference", "inference", "a forward under torch.inference_mode()"),
        ),
    ),
    CallOption(
        "loss",
        "loss",
        "the backward from the output, or from a returned log-sum-exp alone, as merging partial attention "
        "results does (the first channel of dO, transposed, as its gradient); a kernel whose log-sum-exp "
        "is not in the graph gives no gradient, which is allowed. interface.lse makes these calls",
        (
            OptionValue("out", "out", "the backward from the output"),
            OptionValue("lse", "lse", "the backward from a returned log-sum-exp alone"),
        ),
        probe=(),
        in_coverage=False,  # interface.lse makes these calls only for a kernel that returns a log-sum-exp
    ),
)

_BY_KEY = {o.key: o for o in OPTIONS}

#: the gradients a call with a backward asks for, by its ``grad`` option
GRADS_OF = {"all": ("dq", "dk", "dv"), "q": ("dq",), "kv": ("dk", "dv")}


def option(key: str) -> CallOption:
    """The option named ``key``; a ConfigError naming the known ones for any other."""
    try:
        return _BY_KEY[key]
    except KeyError:
        raise ConfigError(f"unknown call option {key!r}; known: {', '.join(_BY_KEY)}") from None


def option_value(call: tuple, key: str) -> Any:
    """The value of option ``key`` in a case's ``call`` (its default when the call leaves it out)."""
    for k, v in call:
        if k == key:
            return v
    return option(key).default


def check_call(call: tuple) -> tuple:
    """``call`` unchanged when every (key, value) is a known option with an allowed value, and the
    values combine (those needing contiguous tensors have them); else a ConfigError."""
    for key, value in call:
        option(key).validate(value)
    layout = option_value(call, "layout")
    for opt in OPTIONS:  # the harness reads their gradients from q, k and v as leaves
        value = option_value(call, opt.key)
        if opt.contiguous_only and value != opt.default and layout != "contiguous":
            raise ConfigError(f"call option {opt.key}={value} needs the contiguous layout, not {layout}")
    return call


def max_seqlen_pads(case: Case) -> tuple[int, int]:
    """What the call adds to the true max_seqlen_q and max_seqlen_k (the ``max_seqlen_pad`` option)."""
    pad = case.call_option("max_seqlen_pad")
    return (int(pad[0]), int(pad[1])) if isinstance(pad, tuple) else (int(pad), int(pad))


# ----------------------------------------------------------------------------------------------
# how the tensors are handed over
# ----------------------------------------------------------------------------------------------

#: rows of zeros before q, k, v (and dO) in the ``offset`` layout
OFFSET_ROWS = 7


def _grad_of(x: torch.Tensor) -> torch.Tensor | None:
    return x.grad


def lay_out(inputs: Inputs, backward: bool):
    """Fresh copies of q, k, v in the layout the case's ``layout`` option names: leaves that require
    grad when ``backward``, or views into such leaves. Returns (q, k, v, grads_of), where
    ``grads_of()`` reads the gradients of q, k, v after the backward (None where none arrived)."""
    layout = inputs.case.call_option("layout")
    q0, k0, v0 = (x.detach() for x in (inputs.q, inputs.k, inputs.v))
    if layout == "contiguous":  # with the inputs the case's ``grad`` option names requiring grad
        wanted = GRADS_OF[inputs.case.call_option("grad")]
        q, k, v = (x.clone().requires_grad_(backward and g in wanted) for x, g in zip((q0, k0, v0), ("dq", "dk", "dv")))
        return q, k, v, lambda: (_grad_of(q), _grad_of(k), _grad_of(v))
    if layout == "fused":
        hq, hk = q0.shape[1], k0.shape[1]
        if q0.shape[0] == k0.shape[0]:  # one (T, H + 2 Hk, D) buffer, as split from a fused QKV projection
            qkv = torch.cat([q0, k0, v0], dim=1).requires_grad_(backward)
            views = (qkv[:, :hq], qkv[:, hq : hq + hk], qkv[:, hq + hk :])

            def fused_grads():
                g = _grad_of(qkv)
                return (None, None, None) if g is None else (g[:, :hq], g[:, hq : hq + hk], g[:, hq + hk :])

            return (*views, fused_grads)
        q = q0.clone().requires_grad_(backward)
        kv = torch.cat([k0, v0], dim=1).requires_grad_(backward)

        def kv_grads():
            g = _grad_of(kv)
            return (_grad_of(q), None, None) if g is None else (_grad_of(q), g[:, :hk], g[:, hk:])

        return q, kv[:, :hk], kv[:, hk:], kv_grads
    if layout == "transposed":  # (H, T, D) storage seen as (T, H, D)
        bufs = [x.transpose(0, 1).contiguous().requires_grad_(backward) for x in (q0, k0, v0)]

        def t_grads():
            gs = [_grad_of(b) for b in bufs]
            return tuple(None if g is None else g.transpose(0, 1) for g in gs)

        return (*(b.transpose(0, 1) for b in bufs), t_grads)
    # "offset": each tensor starts OFFSET_ROWS rows into a larger buffer
    bufs = []
    for x in (q0, k0, v0):
        pad = torch.zeros((OFFSET_ROWS,) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
        bufs.append(torch.cat([pad, x, pad[:5]]).requires_grad_(backward))
    lens = (q0.shape[0], k0.shape[0], v0.shape[0])

    def o_grads():
        gs = [_grad_of(b) for b in bufs]
        return tuple(None if g is None else g[OFFSET_ROWS : OFFSET_ROWS + n] for g, n in zip(gs, lens))

    return (*(b[OFFSET_ROWS : OFFSET_ROWS + n] for b, n in zip(bufs, lens)), o_grads)


def laid_out_like(x: torch.Tensor, layout: str) -> torch.Tensor:
    """A fresh copy of the upstream gradient in the case's layout: contiguous, a view into a buffer
    twice as wide (as dO arrives from a fused output projection), of transposed storage, or offset."""
    if layout == "contiguous":
        return x.clone()
    if layout == "fused":
        return torch.cat([x, torch.zeros_like(x)], dim=1)[:, : x.shape[1]]
    if layout == "transposed":
        return x.transpose(0, 1).contiguous().transpose(0, 1)
    pad = torch.zeros((OFFSET_ROWS,) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    return torch.cat([pad, x])[OFFSET_ROWS:]


def cu_laid_out(cu: torch.Tensor, cu_layout: str) -> torch.Tensor:
    """A fresh copy of cu_seqlens in the case's ``cu_layout``: contiguous, or every other element of an
    int32 buffer of -1s starting one element in (stride 2, storage offset 1)."""
    if cu_layout == "contiguous":
        return cu.clone()
    buf = torch.full((2 * cu.numel() + 1,), -1, dtype=cu.dtype, device=cu.device)
    buf[1::2] = cu
    return buf[1::2]


@contextlib.contextmanager
def around(case: Case, q: torch.Tensor, part: Stage) -> Iterator[None]:
    """Every option's context around the ``part`` (its forward or its backward) of a call of ``case``."""
    with contextlib.ExitStack() as stack:
        for opt in OPTIONS:
            hook = opt.around_forward if part is Stage.FORWARD else opt.around_backward
            stack.enter_context(hook(case.call_option(opt.key), q))
        yield
