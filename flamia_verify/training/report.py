"""train-parity's reports: train-parity.json (the result document), train-parity.md (the table a
pull request shows) and train-parity.html (one page with the loss, gradient-norm and drift plots)."""

from __future__ import annotations

import base64
import html
import io
import json
from pathlib import Path

__all__ = ["fmt_number", "render_markdown", "render_html", "write_parity_reports", "PARITY_FILES"]

PARITY_FILES = ("train-parity.json", "train-parity.md", "train-parity.html")


def _fmt(x, spec: str = ".4f") -> str:
    """A number of the result document (non-finite ones are the strings "nan", "inf", "-inf")."""
    return x if isinstance(x, str) else format(x, spec)


_HEADER = (
    "kernel",
    "mean gap (nats)",
    "interval",
    "gap, exact eval",
    "interval, exact eval",
    "val loss",
    "grad-norm ratio",
    "attention rel. RMSE",
    "s",
    "status",
)


def _legend(doc: dict) -> str:
    level = 100 * doc["config"]["level"]
    return (
        f"Gap: final validation loss minus BF16's at the same seed (nats/byte), mean over the seeds; interval: "
        f"its {level:g} % Student t confidence interval. Exact evaluation: the same trained model with the "
        "float64 reference attention in every layer. Grad-norm ratio: mean gradient norm over the last 20 % "
        "of steps against BF16's. Attention rel. RMSE: the kernel's attention outputs against the exact "
        "kernel's on the same q, k, v during the last evaluation."
    )


def _interval(ci) -> str:
    return f"[{_fmt(ci[0], '+.4f')}, {_fmt(ci[1], '+.4f')}]"


def _row(r: dict) -> list[str]:
    status = r["status"].upper() + ("" if not r.get("diverged_at") else f" (diverged: {r['diverged_at']})")
    if "flagged" in r:
        status += "" if r["consistent"] else " (MISSED: at or above the minimum detectable gap)"
    return [
        r["kernel"],
        _fmt(r["mean"], "+.4f"),
        _interval(r["ci"]),
        _fmt(r["mean_exact"], "+.4f"),
        _interval(r["ci_exact"]),
        _fmt(r["final_val_loss"]),
        _fmt(r["grad_norm_ratio"], ".3f") if "grad_norm_ratio" in r else "",
        _fmt(r["attn_rel_rmse_final"], ".3g"),
        f"{r['seconds']:.0f}",
        status,
    ]


def _parts(doc: dict) -> tuple[str, list[str], list[list[str]], list[list[str]]]:
    """(title, the paragraphs before the tables, the kernels' rows, the floors' and ladder's rows):
    what both renderers show."""
    cfg, m, res = doc["config"], doc["config"]["model"], doc["resolution"]
    title = f"Training parity: {'PASS' if doc['passed'] else 'FAIL'}"
    floors = doc["floors"]
    paragraphs = [
        f"{m['layers']} layers, d_model {m['d_model']}, {m['heads']} heads of {m['d_model'] // m['heads']}, byte-level; "
        f"{cfg['steps']} steps of {cfg['tokens']} tokens (windows up to {cfg['max_len']}), seeds {cfg['seed']} to "
        f"{cfg['seed'] + cfg['seeds'] - 1}, device {doc['device']}. Corpus: {doc['corpus']['train_documents']} / "
        f"{doc['corpus']['val_documents']} train / validation files of {doc['corpus']['root']} (fingerprint "
        f"{doc['corpus']['fingerprint'][:12]}); validation on {doc['evaluation']['val_tokens']} fixed held-out "
        f"tokens (one run's sampling error {_fmt(doc['evaluation']['standard_error'], '.2g')} nats; a paired "
        "difference on the same tokens does not carry it).",
        f"Minimum detectable gap: {_fmt(res['minimum_detectable_gap'], '.4f')} nats/byte "
        f"({_fmt(res['minimum_detectable_gap_percent'], '.2f')} % of BF16's loss {_fmt(res['bf16_mean_val_loss'])}): "
        f"tolerance {cfg['tolerance']:g} + t {_fmt(res['t_quantile'], '.3g')} x sd {_fmt(res['null_sd'], '.3g')} / "
        f"sqrt({cfg['seeds']}), sd from {res['null_from']}. A kernel fails when its gap's interval lies wholly "
        f"beyond +-{cfg['tolerance']:g} nats, with its own attention or with the exact one.",
    ]
    if not floors:
        paragraphs.append("Floors not measured (--no-floors).")
    if doc["determinism"]["notes"]:
        paragraphs.append("Determinism: " + " ".join(doc["determinism"]["notes"]))
    if doc["ladder"] and not doc["ladder_consistent"]:
        paragraphs.append(
            "The run missed ladder rungs at or above its minimum detectable gap: its verdicts are not trustworthy."
        )
    rows = [_row(r) for r in doc["kernels"]]
    extra = [_row({**r, "kernel": f"floor: {name} ({r['kernel']})"}) for name, r in floors.items()]
    extra += [_row({**r, "kernel": f"ladder: {r['kernel']}"}) for r in doc["ladder"]]
    return title, paragraphs, rows, extra


def render_markdown(doc: dict) -> str:
    title, paragraphs, rows, extra = _parts(doc)
    lines = [f"# {title}", ""]
    for p in paragraphs:
        lines += [p, ""]
    lines += ["| " + " | ".join(_HEADER) + " |", "|---|" + "---:|" * (len(_HEADER) - 2) + "---|"]
    lines += ["| " + " | ".join([f"`{row[0]}`", *row[1:]]) + " |" for row in rows + extra]
    lines += ["", _legend(doc), ""]
    return "\n".join(lines)


def _plot_png(doc: dict) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5))
    (a_tr, a_val), (a_gn, a_dr) = axes
    for raw in doc["runs"]:
        run = {k: ([float(x) for x in v] if isinstance(v, list) else v) for k, v in raw.items()}
        label = f"{run['kernel']} (seed {run['seed']})"
        k = max(1, len(run["train_loss"]) // 50)
        smooth = [
            sum(run["train_loss"][max(0, i - k + 1) : i + 1]) / len(run["train_loss"][max(0, i - k + 1) : i + 1])
            for i in range(len(run["train_loss"]))
        ]
        a_tr.plot(run["steps"], smooth, label=label, lw=1)
        (line,) = a_val.plot(run["eval_steps"], run["val_loss"], marker="o", ms=3, label=label)
        a_val.plot(run["eval_steps"], run["val_loss_exact"], ls="--", color=line.get_color(), lw=1)
        a_gn.plot(run["steps"], run["grad_norm"], lw=0.7, label=label)
        a_dr.plot(run["eval_steps"], run["attn_rel_rmse"], marker="o", ms=3, label=label)
    a_tr.set(title="train loss (moving mean)", xlabel="step", ylabel="loss (nats / byte)")
    a_val.set(title="validation loss (solid: own kernel, dashed: exact evaluation)", xlabel="step", ylabel="loss")
    a_gn.set(title="gradient norm (before clipping)", xlabel="step", yscale="log")
    a_dr.set(title="attention output vs exact kernel (rel. RMSE)", xlabel="step", yscale="log")
    for ax in axes.flat:
        ax.grid(alpha=0.3)
    # one legend under the four panels: inside a panel it hides curves (a leak's exact evaluation
    # runs along the top of the validation panel)
    handles, labels = a_val.get_legend_handles_labels()
    ncol = min(3, max(1, len(labels)))
    rows = -(-len(labels) // ncol)
    fig.legend(handles, labels, loc="lower center", ncol=ncol, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.03 * rows, 1, 1))
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    return base64.b64encode(buf.getvalue()).decode()


def render_html(doc: dict) -> str:
    title, paragraphs, rows, extra = _parts(doc)
    rows = rows + extra
    esc = html.escape
    table = (
        "<table><tr>"
        + "".join(f"<th>{esc(h)}</th>" for h in _HEADER)
        + "</tr>"
        + "".join("<tr>" + "".join(f"<td>{esc(c)}</td>" for c in row) + "</tr>" for row in rows)
        + "</table>"
    )
    img = f'<img alt="loss curves, gradient norms and attention drift per kernel" src="data:image/png;base64,{_plot_png(doc)}">'
    style = (
        "body{font-family:system-ui,sans-serif;max-width:1150px;margin:2em auto;color:#222}"
        "table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:3px 8px;text-align:right}"
        "th{background:#f2f2f2}img{max-width:100%}"
    )
    return (
        f"<!doctype html><html><head><meta charset='utf-8'><title>Training parity</title><style>{style}</style>"
        f"</head><body><h1>{esc(title)}</h1>{''.join(f'<p>{esc(p)}</p>' for p in paragraphs)}{table}"
        f"<p>{esc(_legend(doc))}</p>{img}</body></html>"
    )


def write_parity_reports(doc: dict, out: Path) -> dict[str, Path]:
    from flamia_verify.reports.store import atomic_write_text

    out.mkdir(parents=True, exist_ok=True)
    paths = {name: out / name for name in PARITY_FILES}
    atomic_write_text(paths["train-parity.json"], json.dumps(doc, indent=1, allow_nan=True) + "\n")
    atomic_write_text(paths["train-parity.md"], render_markdown(doc))
    atomic_write_text(paths["train-parity.html"], render_html(doc))
    return paths


fmt_number = _fmt
