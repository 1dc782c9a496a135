"""Speed of the fused kernels beside torch SDPA's cuDNN and FlashAttention-2 backends.

``bench_table(kernels)`` is what ``flamia-verify bench`` prints. Shapes follow the project's
benchmark: B * S = 32K tokens, H = 16 heads, D = 128, bf16; the fused kernels run in the varlen
convention (B documents of S tokens, no padding), SDPA on the dense (B, H, S, D) layout.

FLOP counts (FlashAttention's convention): forward ``4 B H S^2 D`` (halved when causal), backward
2.5 times the forward (five GEMMs against two), forward+backward 3.5 times. Times are medians of
``triton.testing.do_bench``; ``ratio`` is the forward+backward speed over the fastest BF16 SDPA
baseline measured in the same call at the same shape, ``ratio_bf16`` over the fused ``bf16`` kernel's
(when it is among the kernels): what the quantized designs cost against the same kernel in BF16.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from flamia_verify.kernels.emulation import EmulatedDesign

__all__ = [
    "bench_table",
    "format_table",
    "add_ratios",
    "resolve_kernel",
    "kernel_runner",
    "BenchKernel",
    "BASELINES",
    "attention_flops",
    "COLUMNS",
    "SpeedShape",
    "measure_speed",
    "plot_table",
]

BASELINES = ("sdpa-cudnn", "sdpa-flash")
#: the keys of every row, in order (the CLI prints them as columns)
COLUMNS = (
    "kernel",
    "seqlen",
    "batch",
    "causal",
    "fwd_tflops",
    "bwd_tflops",
    "fwdbwd_tflops",
    "ratio",
    "ratio_bf16",
    "fwd_ms",
    "bwd_ms",
    "fwdbwd_ms",
    "peak_extra_gib",
    "error",
)


def attention_flops(batch: int, heads: int, seqlen: int, head_dim: int, causal: bool) -> dict[str, float]:
    """FLOPs of one attention call: forward, backward, forward+backward."""
    fwd = 4.0 * batch * heads * seqlen * seqlen * head_dim * (0.5 if causal else 1.0)
    return {"fwd": fwd, "bwd": 2.5 * fwd, "fwdbwd": 3.5 * fwd}


def _sdpa_runner(backend_name: str, q, k, v, causal: bool):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = {"sdpa-cudnn": SDPBackend.CUDNN_ATTENTION, "sdpa-flash": SDPBackend.FLASH_ATTENTION}[backend_name]

    # (T, H, D) packed documents of equal length -> dense (B, H, S, D)
    def forward(q, k, v):
        with sdpa_kernel([backend]):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)

    return forward


@dataclass(frozen=True)
class BenchKernel:
    """A kernel to time: a built-in design whose fused kernels run directly (``design``), or any loaded
    kernel called in the convention (``loaded``); ``label`` names its rows."""

    label: str
    design: EmulatedDesign | None = None
    loaded: Any = None  # a LoadedKernel


def resolve_kernel(spec) -> BenchKernel:
    """Resolve a kernel spec once (a file or module is imported once, not once per row).

    A built-in design with fused kernels is timed through them directly, without the per-call
    host-side checks of cu_seqlens (they synchronize with the GPU); any other spec (module:function,
    file.py:function, an entry point, a callable) is loaded like ``check`` loads it and called as it
    is; a built-in without fused kernels runs its PyTorch emulation, and its rows say so. Raises
    KernelLoadError for a spec that does not load.
    """
    from flamia_verify.kernels import load_kernel
    from flamia_verify.kernels.designs import DESIGNS
    from flamia_verify.kernels.triton import fused_supported

    if isinstance(spec, BenchKernel):
        return spec
    if isinstance(spec, str) and spec in DESIGNS and fused_supported(DESIGNS[spec]):
        return BenchKernel(spec, design=DESIGNS[spec])
    loaded = load_kernel(spec)
    label = f"{loaded.name} (emulation)" if loaded.source == "builtin" else loaded.name
    return BenchKernel(label, loaded=loaded)


def kernel_runner(spec, causal: bool, cu, seqlen: int):
    """forward(q, k, v) -> out for one kernel (a spec or a ``resolve_kernel`` result) in the varlen
    convention: documents of ``seqlen`` tokens at offsets ``cu``, softmax_scale head_dim^-0.5."""
    from flamia_verify.convention import first_output

    kernel = resolve_kernel(spec)
    design = kernel.design
    if design is not None:
        from flamia_verify.kernels.triton.attention import fused_attention

        def forward(q, k, v):
            return fused_attention(
                design,
                q,
                k,
                v,
                cu,
                cu,
                seqlen,
                seqlen,
                softmax_scale=q.shape[-1] ** -0.5,
                causal=causal,
                validate=False,
            )

        return forward

    def forward(q, k, v):  # type: ignore[no-redef]  # the other one is returned above
        out = kernel.loaded(q, k, v, cu, cu, seqlen, seqlen, softmax_scale=q.shape[-1] ** -0.5, causal=causal)
        return first_output(out)  # (out, lse) tuples and lists, as check takes them

    forward.forward_only = bool(getattr(kernel.loaded.fn, "forward_only", False))  # type: ignore[attr-defined]
    return forward


def _time(fn, rep_ms: int) -> float:
    import triton

    return float(triton.testing.do_bench(fn, warmup=max(25, rep_ms // 4), rep=rep_ms, return_mode="median"))


def _measure(forward, q, k, v, do, rep_ms: int) -> dict[str, float]:
    """Median ms of forward, backward (from a saved forward graph) and forward+backward; peak memory.
    A kernel declared forward-only (``forward.forward_only``) gets inputs that need no gradient."""
    grad = not getattr(forward, "forward_only", False)
    q, k, v = (t.detach().requires_grad_(grad) for t in (q, k, v))

    def fwd():
        with torch.no_grad():
            forward(q, k, v)

    out = forward(q, k, v)

    def bwd():
        torch.autograd.grad(out, (q, k, v), do, retain_graph=True)

    def fwdbwd():
        o = forward(q, k, v)
        torch.autograd.grad(o, (q, k, v), do)

    res = {"fwd_ms": _time(fwd, rep_ms)}
    if out.grad_fn is None:  # a forward-only kernel: its forward is timed, the rest is not there
        res.update(bwd_ms=math.nan, fwdbwd_ms=math.nan, peak_extra_gib=math.nan)
        return res
    res["bwd_ms"] = _time(bwd, rep_ms)
    out = None  # drop the saved graph before timing forward+backward (bwd is not called again)
    res["fwdbwd_ms"] = _time(fwdbwd, rep_ms)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fwdbwd()
    torch.cuda.synchronize()
    res["peak_extra_gib"] = (torch.cuda.max_memory_allocated() - base) / 2**30
    return res


def bench_table(
    kernels: list,
    device: str = "cuda",
    *,
    seqlens=(2048, 8192, 16384),
    tokens: int = 32768,
    heads: int = 16,
    head_dim: int = 128,
    causal=(True, False),
    baselines=BASELINES,
    rep_ms: int = 100,
    progress=None,
) -> list[dict]:
    """Forward, backward and forward+backward speed of ``kernels`` (specs or ``resolve_kernel``
    results: built-in names time their fused kernels, any spec ``check`` takes is called as it is)
    and of the SDPA baselines; one dict per (kernel, S, causal), B = tokens // S documents of S tokens.

    Keys: ``COLUMNS``: kernel, seqlen, batch, causal, fwd_ms, bwd_ms, fwdbwd_ms, fwd_tflops,
    bwd_tflops, fwdbwd_tflops, ratio and ratio_bf16 (``add_ratios``), peak_extra_gib (memory
    allocated by one forward+backward beyond the inputs), error (a string, when a kernel failed: the
    other rows still come back; a forward-only kernel gets its forward and NaN for the rest).
    ``progress(done, total, label)`` is called before each measurement and once at the end.
    """
    if not str(device).startswith("cuda") or not torch.cuda.is_available():
        raise RuntimeError(
            f"bench_table needs a CUDA device, got device={device!r} "
            f"(torch.cuda.is_available() = {torch.cuda.is_available()})"
        )
    return _bench_rows(
        [resolve_kernel(k) for k in kernels],
        device,
        seqlens=seqlens,
        tokens=tokens,
        heads=heads,
        head_dim=head_dim,
        causal=causal,
        baselines=baselines,
        rep_ms=rep_ms,
        progress=progress,
        measure=_measure,
    )


def _bench_rows(
    kernels: list[BenchKernel],
    device,
    *,
    seqlens,
    tokens,
    heads,
    head_dim,
    causal,
    baselines,
    rep_ms,
    progress,
    measure,
) -> list[dict]:
    """The table's loop; ``measure(forward, q, k, v, do, rep_ms)`` returns the times (``_measure``)."""
    rows: list[dict] = []
    n_measurements = len(seqlens) * len(causal) * (len(baselines) + len(kernels))
    done = 0
    gen = torch.Generator(device=device).manual_seed(0)
    for seqlen in seqlens:
        batch = max(1, tokens // seqlen)
        n_tokens = batch * seqlen
        q, k, v, do = (
            torch.randn(n_tokens, heads, head_dim, device=device, dtype=torch.bfloat16, generator=gen) for _ in range(4)
        )
        cu = torch.arange(0, n_tokens + 1, seqlen, dtype=torch.int32, device=device)
        dense = [t.view(batch, seqlen, heads, head_dim).transpose(1, 2) for t in (q, k, v, do)]
        for c in causal:
            flops = attention_flops(batch, heads, seqlen, head_dim, c)
            group: list[dict] = []
            for kernel in list(baselines) + list(kernels):
                label = kernel if isinstance(kernel, str) else kernel.label
                if progress is not None:
                    progress(done, n_measurements, f"{label}, S = {seqlen}, {'causal' if c else 'no mask'}")
                done += 1
                row = {"kernel": label, "seqlen": seqlen, "batch": batch, "causal": c}
                try:
                    if isinstance(kernel, str):  # an SDPA baseline
                        res = measure(_sdpa_runner(kernel, dense[0], dense[1], dense[2], c), *dense, rep_ms)
                    else:
                        res = measure(kernel_runner(kernel, c, cu, seqlen), q, k, v, do, rep_ms)
                    row.update(res)
                    for phase in ("fwd", "bwd", "fwdbwd"):
                        row[f"{phase}_tflops"] = flops[phase] / (res[f"{phase}_ms"] * 1e-3) / 1e12
                except Exception as exc:  # keep the rest of the table
                    row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
                group.append(row)
                if str(device).startswith("cuda"):
                    torch.cuda.empty_cache()
            rows.extend(add_ratios(group))
    if progress is not None:
        progress(n_measurements, n_measurements, "done")
    return [{key: r.get(key, "" if key == "error" else math.nan) for key in COLUMNS} for r in rows]


def add_ratios(group: list[dict]) -> list[dict]:
    """Set ``ratio`` (forward+backward TFLOP/s over the fastest SDPA baseline's) and ``ratio_bf16``
    (over the fused ``bf16`` kernel's) on the rows of one shape; NaN where a row or its reference
    has no measurement."""

    def speed(r):
        x = r.get("fwdbwd_tflops", 0.0) if not r.get("error") else 0.0
        return 0.0 if math.isnan(x) else x

    best = max((speed(r) for r in group if r["kernel"] in BASELINES), default=0.0)
    bf16 = next((speed(r) for r in group if r["kernel"] == "bf16"), 0.0)
    for r in group:
        ok = "fwdbwd_tflops" in r and not r.get("error")
        r["ratio"] = r["fwdbwd_tflops"] / best if ok and best else math.nan
        r["ratio_bf16"] = r["fwdbwd_tflops"] / bf16 if ok and bf16 else math.nan
    return group


@dataclass(frozen=True)
class SpeedShape:
    """One benchmark shape: ``tokens // seqlen`` documents of ``seqlen`` tokens, ``heads`` heads of
    ``head_dim``, BF16 inputs; ``rep_ms`` is the timing budget of each measurement."""

    seqlen: int = 8192
    tokens: int = 32768
    heads: int = 16
    head_dim: int = 128
    causal: bool = True
    rep_ms: int = 100

    def __post_init__(self):
        for name in ("seqlen", "tokens", "heads", "head_dim", "rep_ms"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"speed shape: {name} must be a positive integer, got {value!r}")
        if not isinstance(self.causal, bool):
            raise ValueError(f"speed shape: causal must be true or false, got {self.causal!r}")

    def describe(self) -> str:
        batch = max(1, self.tokens // self.seqlen)
        mask = "causal" if self.causal else "no mask"
        return f"{batch} x {self.seqlen} tokens, H = {self.heads}, D = {self.head_dim}, {mask}, bf16"


def measure_speed(spec, shape: SpeedShape, device: str = "cuda") -> dict[str, Any]:
    """One kernel's forward, backward and forward+backward speed at ``shape`` (a row of
    ``bench_table`` without the ratios): the row's keys, ``shape`` (its description) and ``error``
    ("" when measured). A kernel that raises gives its error, not an exception; a forward-only kernel
    its forward and NaN for the rest. Needs a CUDA device."""
    if not str(device).startswith("cuda") or not torch.cuda.is_available():
        raise RuntimeError("speed is measured on a CUDA device only")
    rows = _bench_rows(
        [resolve_kernel(spec)],
        device,
        seqlens=(shape.seqlen,),
        tokens=shape.tokens,
        heads=shape.heads,
        head_dim=shape.head_dim,
        causal=(shape.causal,),
        baselines=(),
        rep_ms=shape.rep_ms,
        progress=None,
        measure=_measure,
    )
    row = {k: v for k, v in rows[0].items() if k not in ("ratio", "ratio_bf16")}
    row["shape"] = shape.describe()
    return row


def _cell(x, fmt: str) -> str:
    return "" if isinstance(x, float) and math.isnan(x) else format(x, fmt)


def format_table(rows: list[dict]) -> str:
    """A Markdown table of ``bench_table``'s rows (empty cells where nothing was measured)."""
    head = (
        "| kernel | S | causal | fwd TFLOP/s | bwd TFLOP/s | fwd+bwd TFLOP/s | fwd+bwd / best BF16 SDPA "
        "| fwd+bwd / bf16 kernel | fwd ms | bwd ms | fwd+bwd ms | peak extra GiB |"
    )
    lines = [head, "|" + "---|" * 12]
    for r in rows:
        if r.get("error"):
            lines.append(f"| {r['kernel']} | {r['seqlen']} | {r['causal']} | error: {r['error']} |||||||||")
            continue
        cells = [
            _cell(r[key], fmt)
            for key, fmt in (
                ("fwd_tflops", ".0f"),
                ("bwd_tflops", ".0f"),
                ("fwdbwd_tflops", ".0f"),
                ("ratio", ".2f"),
                ("ratio_bf16", ".2f"),
                ("fwd_ms", ".2f"),
                ("bwd_ms", ".2f"),
                ("fwdbwd_ms", ".2f"),
                ("peak_extra_gib", ".2f"),
            )
        ]
        lines.append(f"| {r['kernel']} | {r['seqlen']} | {r['causal']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


#: line colour and style of each kernel in ``plot_table`` (others: matplotlib's next colour, solid)
PLOT_STYLE = {
    "sdpa-cudnn": ("black", "--"),
    "sdpa-flash": ("grey", "--"),
    "bf16": ("tab:blue", "-"),
    "fp8": ("tab:red", "-"),
    "flamia-mxfp8": ("tab:green", "-"),
    "flamia-nvfp4": ("tab:purple", "-"),
}


def _finite(x: object) -> bool:
    return isinstance(x, (int, float)) and not math.isnan(x)


def plot_table(table: dict[str, Any], path: Path) -> None:
    """A PNG of a speed table as ``flamia-verify bench --json`` (or benchmarks/bench_attention.py) writes
    it, ``{"header": ..., "rows": [...]}``: two panels (causal, no mask), forward+backward TFLOP/s
    against tokens per document for every kernel and SDPA baseline, and beneath each the kernels'
    ratio to the fastest BF16 SDPA baseline. Rows with an error or without a forward+backward time are
    left out (a "nan" ratio, as strict JSON stores it, is drawn as a gap)."""
    from matplotlib.figure import Figure

    rows = [r for r in table["rows"] if not r.get("error") and _finite(r.get("fwdbwd_tflops"))]
    kernels = list(dict.fromkeys(r["kernel"] for r in rows))
    fig = Figure(figsize=(10, 6.5))
    axes = fig.subplots(2, 2, sharex=True, gridspec_kw={"height_ratios": [2, 1]})
    for col, causal in enumerate((True, False)):
        top, bottom = axes[0][col], axes[1][col]
        for name in kernels:
            pts = sorted(
                (r["seqlen"], r["fwdbwd_tflops"], float(r["ratio"]))
                for r in rows
                if r["kernel"] == name and bool(r["causal"]) == causal
            )
            if not pts:
                continue
            color, ls = PLOT_STYLE.get(name, (None, "-"))
            xs = [p[0] for p in pts]
            top.plot(xs, [p[1] for p in pts], ls, marker="o", color=color, label=name)
            if not name.startswith("sdpa-"):
                bottom.plot(xs, [p[2] for p in pts], ls, marker="o", color=color, label=name)
        top.set_title("causal" if causal else "no mask")
        top.set_ylabel("fwd+bwd TFLOP/s")
        top.set_ylim(bottom=0)
        bottom.set_ylabel("/ best BF16 SDPA")
        top_ratio = max([r["ratio"] for r in rows if _finite(r.get("ratio"))] + [1.0])
        bottom.set_ylim(0, 1.2 * top_ratio)
        bottom.axhline(1.0, color="black", lw=0.8)
        bottom.set_xscale("log", base=2)
        bottom.set_xlabel("tokens per document (B * S = 32K)")
        for ax in (top, bottom):
            ax.grid(alpha=0.3)
    legend: dict[str, Any] = {}
    for ax in axes[0]:  # every kernel once, whichever panel it appears in
        for handle, label in zip(*ax.get_legend_handles_labels()):
            legend.setdefault(label, handle)
    fig.legend(
        list(legend.values()), list(legend), loc="lower center", ncol=max(1, len(legend)), fontsize=8, frameon=False
    )
    fig.suptitle(table.get("header", ""), fontsize=9)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    fig.savefig(path, dpi=110)
